"""The target's own decoder forward over a preallocated KV cache: the "static" engine.

transformers' forward is general and pays for it on every step: a cache object per layer that
concatenates, mask construction, hooks and a dozen small ops per projection. For the families whose
layers are a plain pre-norm Llama block (Llama, Llama-3, Mistral, Qwen2/2.5, Qwen3, Phi-3) this module
runs the same arithmetic directly on the model's own weights:

- q/k/v and gate/up are fused into one matrix each (the HF modules' weights become views of them, so
  the two forwards share storage and any in-place change to a weight reaches both);
- on CPU in float32 (and in bfloat16 where oneDNN has native bf16) every product runs through oneDNN on a
  prepacked copy of its weight (:class:`Linear`); with ``weights="int4"`` the layers' products read 4-bit
  codes instead (:class:`~taps_ray.models.quant.Int4Linear`) in steps of up to ``int4_max_rows`` rows (measured per
  machine: :mod:`taps_ray.spec.calibrate`; ``INT4_MAX_ROWS`` until then), and
  wider steps of a GGUF target (whose dense weights are its codes' values within bf16 rounding) run on the
  packed dense copy, where torch's int4 kernel is slower; the LM head stays dense; with ``weights="fp16"``
  every product, the LM head included, reads half-precision weights (:class:`~taps_ray.models.quant.HalfLinear`);
- :class:`KVCache` preallocates every layer's keys and values, ``[L, kv_heads, C, d]``, with an explicit
  ``length``; a step writes its n entries at ``length .. length + n - 1``, cropping moves ``length``
  back, and compaction after tree verification gathers the accepted entries by index;
- a batch of several requests' steps runs packed: one matmul per projection over all their tokens
  ``[T = sum n_i, H]``, attention per request on that request's own cache (no padding, no copies); on CPU the
  one-token requests attend in one kernel call per layer (:mod:`~taps_ray.models.decode_attention`).

Shapes: ``n`` new tokens of one request, ``P`` its cached length, ``T`` tokens of a packed batch,
``H`` hidden, ``h``/``g`` query/kv heads, ``d`` head dim, ``L`` layers, ``C`` cache capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from taps_ray.models.compiled import CompiledSteps, compile_support
from taps_ray.models.decode_attention import DecodeAttention
from taps_ray.models.graphs import StepGraphs
from taps_ray.models.quant import (
    GROUP,
    HalfLinear,
    Int4Linear,
    Int4Weight,
    LinearForward,
    Q4Q8Linear,
    Q8Q8Linear,
    half_rows,
    install_forwards,
    quantize_rtn,
    tensor_identity,
)
from taps_ray.models.target_cache import KVCache, Segment

STATIC_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
PACK_ROWS = 16


def static_support(model) -> str | None:
    """Why the static engine cannot run ``model`` exactly as its own forward does, or None when it can."""
    config = model.config.get_text_config(decoder=True)
    family = getattr(config, "model_type", "")
    if family not in STATIC_FAMILIES:
        return f"family {family!r} is not one of {', '.join(STATIC_FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (silu only)"
    base = model.base_model
    layer = base.layers[0]
    attn = layer.self_attn
    if not hasattr(attn, "qkv_proj") and not all(hasattr(attn, f"{x}_proj") for x in "qkv"):
        return "attention without q/k/v projections"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0) and family != "phi3":
        return "partial rotary embeddings"
    if any(hasattr(attn, name) for name in ("sinks", "s_aux")):
        return "attention sinks"
    return None


def _fuse(parts: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum out, in] (and bias) from ``parts``; each part's weight becomes a view of it."""
    if len(parts) == 1:
        return parts[0].weight, parts[0].bias
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(p.out_features)
                          for p, b in zip(parts, biases)])
    else:
        bias = None
    start = 0
    for p in parts:
        stop = start + p.out_features
        p.weight.data = weight[start:stop]
        if p.bias is not None:
            p.bias.data = bias[start:stop]
        start = stop
    return weight, bias


class Linear:
    """``x [T, in] -> x @ weight.T + bias``; on CPU, through oneDNN with the weight prepacked once.

    oneDNN's prepacked float32 inner product runs every row count a decode step has (1 to 64) faster than
    MKL's sgemm on the plain layout on the CPUs measured (docs/BENCHMARKS.md, "Engine"). The packed copy is made again when
    the weight is replaced or changed in place (its ``_version``), so it never goes stale. It costs a
    second copy of the weights in memory; where oneDNN cannot pack (no mkldnn build, a half dtype
    without the CPU support it needs) the product is ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.weight, self.bias, self.pack = weight, bias, pack
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pack:
            return F.linear(x, self.weight, self.bias)
        key = (self.weight.data_ptr(), self.weight._version)
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


class PackedLinearForward(LinearForward):
    """On a CPU input of the weight's dtype where :func:`can_pack`, oneDNN's product on a prepacked copy of the
    weight (:class:`Linear`)."""

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dtype == weight.dtype and can_pack(weight.device, weight.dtype)

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight.detach(), None if bias is None else bias.detach(), pack=True)


def read_linears_packed(module: torch.nn.Module) -> None:
    """Make every ``nn.Linear`` of ``module`` (a drafter) compute, outside autograd, through oneDNN on a prepacked
    copy of its weight (:class:`PackedLinearForward`); idempotent. A bf16 ``F.linear`` on CPU reorders its weight
    on every call: packed, a drafter forward takes 11-25% less at 1-8 rows (docs/BENCHMARKS.md)."""
    install_forwards(module, PackedLinearForward)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`Linear` prepacks for oneDNN here: a CPU with torch's mkldnn, in float32, or in bfloat16
    where oneDNN has native bf16 (faster than ``F.linear`` there at every decode row count, docs/BENCHMARKS.md)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class RMSNorm:
    """``module`` (a Llama-style RMSNorm: ``weight * x / rms(x)``, the normalisation in float32) as one
    ``F.rms_norm`` call, the same arithmetic bit for bit: in float32 one op instead of eight, in a half dtype
    four (to float32, normalise, back, times the weight) instead of eight; other norms run the module itself."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module = module
        self.eps = getattr(module, "variance_epsilon", None)
        self.weight = getattr(module, "weight", None)
        self.fused = (self.eps is not None and type(module).__name__.endswith("RMSNorm")
                      and isinstance(self.weight, torch.Tensor))
        self.half = dtype != torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self.module(x)
        if not self.half:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def parameters(self):
        return self.module.parameters()


Product = Linear | Int4Linear | HalfLinear | Q4Q8Linear
"""One layer product ``x [T, K] -> [T, N]`` in the engine's weight format."""


@dataclass
class _Layer:
    norm_in: RMSNorm
    qkv: Product
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o_proj: Product
    norm_post: RMSNorm
    gate_up: Product
    down: Product
    window: int | None


class StaticEngine:
    """The decoder forward of ``model`` (a family :func:`static_support` accepts) on :class:`KVCache` caches.

    ``windows``: per layer, its sliding window (None: full attention), as the target applies them.
    ``graphs``: run steps of up to 64 tokens on one request's cache as CUDA graphs
    (:class:`~taps_ray.models.graphs.StepGraphs`; a CUDA target without sliding windows, else a ValueError).
    ``weights``: ``dense`` (the model's own weights), ``fp16`` (every product on a half-precision copy, float32
    activations) or ``int4`` (the layers' products on 4-bit codes:
    ``int4_codes`` by HF parameter name where given, such as a GGUF's own Q4_1 blocks, else round-to-nearest
    from the dense weight; given codes that do not match the dense weights within its dtype's rounding are
    a ValueError).
    ``compile``: run one request's narrow int4 steps on CPU as one inductor-compiled forward
    (:class:`~taps_ray.models.compiled.CompiledSteps`; a ValueError where :func:`compile_support` refuses).
    """

    def __init__(self, model, windows: list[int | None], weights: str = "dense",
                 int4_codes: dict[str, Int4Weight] | None = None, graphs: bool = False, compile: bool = False):
        reason = static_support(model)
        if reason is not None:
            raise ValueError(f"the static engine cannot run this target: {reason}")
        base = model.base_model
        config = model.config.get_text_config(decoder=True)
        self.base = base
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        attn0 = base.layers[0].self_attn
        self.head_dim = getattr(attn0, "head_dim", None) or config.hidden_size // self.heads
        self.scale = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.packed = can_pack(self.device, self.dtype)
        self.attention_dtype = attention_dtype(self.device, self.dtype)
        if weights not in ("dense", "int4", "fp16", "q4q8"):
            raise ValueError(f"weights must be dense, int4, fp16 or q4q8, got {weights!r}")
        self.weights = weights
        self._codes = int4_codes or {}
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.layers = [self._layer(layer, window) for layer, window in zip(base.layers, windows)]
        self._final_norm = RMSNorm(base.norm, self.dtype)
        self._codes = {}
        self._head: Linear | HalfLinear | Q8Q8Linear | None = None
        self.int4_rows_pinned = False  # int4_max_rows set by target.int4_max_rows: not calibrated
        self.int4_rows_calibrated: dict | None = None  # the key int4_max_rows was measured under (spec/calibrate.py)
        self.graphs: StepGraphs | None = None
        if graphs:
            if self.device.type != "cuda" or any(window is not None for window in windows):
                raise ValueError(f"CUDA graphs need a CUDA target without sliding-window layers (device "
                                 f"{self.device}, windows {sorted({w for w in windows if w is not None})})")
            self.graphs = StepGraphs(self)
        self.compiled: CompiledSteps | None = None
        if compile:
            reason = compile_support(self)
            if reason is not None:
                raise ValueError(f"compiled steps cannot run on this target: {reason}")
            self.compiled = CompiledSteps(self)

    def _layer(self, layer, window: int | None) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_parts = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        up_parts = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        names = lambda parts: [self._names[id(p.weight)] for p in parts]  # noqa: E731
        qkv, gate_up = (self._product(*_fuse(parts), names(parts)) for parts in (qkv_parts, up_parts))
        return _Layer(RMSNorm(layer.input_layernorm, self.dtype), qkv, getattr(attn, "q_norm", None),
                      getattr(attn, "k_norm", None),
                      self._product(attn.o_proj.weight, attn.o_proj.bias, names([attn.o_proj])),
                      RMSNorm(layer.post_attention_layernorm, self.dtype), gate_up,
                      self._product(mlp.down_proj.weight, mlp.down_proj.bias, names([mlp.down_proj])), window)

    def _product(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 names: list[str]) -> Product:
        """The product of one (fused) weight [N, K] made of the parameters ``names``, in this engine's format."""
        if self.weights == "dense":
            return Linear(weight, bias, self.packed)
        if self.weights == "fp16":
            return HalfLinear(weight, bias)
        given = [self._codes.get(name) for name in names]
        if not all(given):
            codes = quantize_rtn(weight)
            return Q4Q8Linear(codes, bias, weight) if self.weights == "q4q8" else Int4Linear(codes, bias, self.dtype, weight)
        codes = Int4Weight.cat(given)
        error = float((codes.dequantize() - weight.detach().float().cpu()).abs().max())
        bound = torch.finfo(self.dtype).eps * float(weight.detach().abs().max())
        if error > bound:
            raise ValueError(f"the int4 codes of {', '.join(names)} do not match the dense weights (largest "
                             f"difference {error:.3g} > {bound:.3g}): the file's layout is not the one this target loaded")
        if self.weights == "q4q8":
            return Q4Q8Linear(codes, bias, weight)
        return Int4Linear(codes, bias, self.dtype, weight, Linear(weight, bias, True) if self.packed else None)

    def products(self) -> list[Product]:
        """Every layer product, layer by layer: q/k/v, output, gate/up, down."""
        return [product for layer in self.layers for product in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]

    def _wide_int4(self) -> list[Int4Linear]:
        return [product for product in self.products() if isinstance(product, Int4Linear) and product.wide is not None]

    @property
    def int4_max_rows(self) -> int | None:
        """Rows up to which the int4 layer products read their codes, wider steps running on the packed dense
        copy (None: no product has both, e.g. dense weights or round-to-nearest codes)."""
        products = self._wide_int4()
        return products[0].max_rows if products else None

    def set_int4_max_rows(self, rows: int) -> None:
        """Make every int4 layer product with a packed dense copy read its codes in steps of up to ``rows`` rows."""
        if rows < 1:
            raise ValueError(f"int4_max_rows must be >= 1 (1: only one-token steps read the codes), got {rows}")
        for product in self._wide_int4():
            product.max_rows = rows

    def head(self, head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """``head(hidden)`` [.., V] for the LM head module ``head`` and ``hidden`` [.., H], as a :class:`Linear`
        (prepacked once, again whenever the head is replaced or changed; fp16 weights: a :class:`HalfLinear`; q4q8
        weights: int8 codes times int8 activations, a :class:`~taps_ray.models.quant.Q8Q8Linear`)."""
        stale = isinstance(self._head, Q8Q8Linear) and tensor_identity(head.weight) != self._head.key
        if self._head is None or self._head.weight is not head.weight or stale:
            if self.weights == "fp16":
                self._head = HalfLinear(head.weight, head.bias)
            elif self.weights == "q4q8" and head.weight.shape[0] % 16 == 0 and head.weight.shape[1] % GROUP == 0:
                self._head = Q8Q8Linear(head.weight, head.bias)
            else:
                self._head = Linear(head.weight, head.bias, self.packed)
        return self._head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)

    def step_tensors(self, head: torch.nn.Linear) -> list[torch.Tensor]:
        """Every tensor a plain step reads in full, in the format the products read them (int4: the packed
        codes and their scales; fp16: half-precision tensors of the packed copies' size), the LM head ``head``'s
        weight included: what the weight-read floor reads."""
        head_read = head.weight.detach().half() if self.weights == "fp16" else head.weight
        if self.weights == "q4q8" and isinstance(self._head, Q8Q8Linear) and self._head.weight is head.weight:
            head_read = self._head.packed
        tensors = [*self.base.norm.parameters(), head_read]
        for layer in self.layers:
            tensors += [*layer.norm_in.parameters(), *layer.norm_post.parameters()]
            for product in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                if isinstance(product, Int4Linear):
                    tensors += [product.packed, product.scale_zero]
                elif isinstance(product, Q4Q8Linear):
                    tensors.append(product.packed)
                elif isinstance(product, HalfLinear):
                    tensors.append(product.read_proxy())
                else:
                    tensors.append(product.weight)
                tensors += [] if product.bias is None else [product.bias]
        return tensors

    def _rows(self, total: int) -> int:
        """The row count a forward of ``total`` tokens runs its products on: ``total``, or for fp16 weights the
        next count whose rows round as in any other (:func:`~taps_ray.models.quant.half_row_counts`)."""
        return half_rows(total) if self.weights == "fp16" else total

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty cache of at least ``capacity`` entries (with CUDA graphs, a pooled one where it fits)."""
        if self.graphs is not None and capacity <= self.graphs.capacity:
            return self.graphs.new_cache()
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.attention_dtype, self.device, capacity)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Last hidden states [T, H] (after the final norm) of ``tokens`` [T] at ``positions`` [T], the
        segments' tokens one after another; each segment's cache is extended by its n entries."""
        return self.forward_layers(tokens, positions, segments, ())[0]

    @torch.inference_mode()
    def forward_layers(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                       layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`'s last hidden states [T, H] and the hidden states ``layers`` (HF ``hidden_states``
        indices: 0 the embeddings, i decoder layer i - 1's output, L the final norm's) concatenated
        [T, len(layers) * H] (None when ``layers`` is empty)."""
        if self.graphs is not None and self.graphs.applies(segments):
            return self.graphs.run(tokens, positions, segments[0], layers)
        if self.compiled is not None and self.compiled.applies(segments):
            return self.compiled.run(tokens, positions, segments[0], layers)
        for seg in segments:
            seg.cache.reserve(seg.n)
        x, cos, sin = self.embed(tokens, positions)
        total = x.shape[0]
        rows = self._rows(total)
        if rows > total:  # products run on rows they round alike on (fp16); the padding rows attend nowhere
            x = F.pad(x, (0, 0, 0, rows - total))
        starts = [0, *accumulate(seg.n for seg in segments)][:-1]
        masks = [self._masks(seg, positions[start:start + seg.n]) for seg, start in zip(segments, starts)]
        hd = self.heads * self.head_dim
        windowed = any(layer.window is not None for layer in self.layers)
        kernel = None if windowed else DecodeAttention.plan(segments, starts, self.heads, self.kv_heads,
                                                            self.head_dim, self.scale)
        rest = [(seg, start, mask) for seg, start, mask in zip(segments, starts, masks)
                if kernel is None or start not in kernel.taken]

        def attend(index: int, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not rest or len(segments) == 1:
                out = (kernel(index, q, k, v) if not rest
                       else self._attend(index, layer, segments[0], q, k, v, masks[0])).reshape(total, hd)
                return F.pad(out, (0, 0, 0, rows - total)) if rows > total else out
            out = q.new_zeros(rows, hd)
            if kernel is not None:
                out[kernel.rows] = kernel(index, q[kernel.rows], k[kernel.rows], v[kernel.rows]).reshape(-1, hd)
            for seg, start, mask in rest:
                part = slice(start, start + seg.n)
                out[part] = self._attend(index, layer, seg, q[part], k[part], v[part], mask).reshape(seg.n, hd)
            return out

        final, features = self.decode(x, cos, sin, total, attend, layers)
        for seg in segments:
            seg.cache.length += seg.n
        return final, features

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embeddings [T, H] of ``tokens`` [T] and the rotary ``cos``/``sin`` [T, 1, r] of ``positions`` [T]
        (``sin`` signed by :func:`_signed_sin`)."""
        x = self.base.embed_tokens(tokens)[None]
        cos, sin = self.base.rotary_emb(x, positions[None])
        return x[0], cos[0, :, None], _signed_sin(sin[0, :, None])

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, total: int, attend,
               layers: tuple[int, ...], product=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over ``x`` [R, H] (R >= ``total`` rows, the first ``total`` real): per layer the
        q/k/v product and rotary embedding, ``attend(index, layer, q [total, h, d], k, v [total, g, d])`` ->
        [R, h * d], the output product and the MLP; :meth:`forward_layers`' result. ``product(linear, x)``
        runs each layer product (None: ``linear(x)``)."""
        taps: dict[int, torch.Tensor] = {0: x[:total]} if 0 in layers else {}
        h, g, d = self.heads, self.kv_heads, self.head_dim
        run = product or _call
        for index, layer in enumerate(self.layers):
            qkv = run(layer.qkv, layer.norm_in(x))
            qk, v = qkv[:total].split(((h + g) * d, g * d), dim=-1)
            qk, v = qk.view(-1, h + g, d), v.view(-1, g, d)
            if layer.q_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :h]), layer.k_norm(qk[:, h:])], dim=1)
            qk = _rope(qk, cos, sin)  # q and k heads in one pass
            x = x + run(layer.o_proj, attend(index, layer, qk[:, :h], qk[:, h:], v))
            gate, up = run(layer.gate_up, layer.norm_post(x)).chunk(2, dim=-1)
            x = x + run(layer.down, F.silu(gate) * up)
            if index + 1 in layers:
                taps[index + 1] = x[:total]
        final = self._final_norm(x[:total])
        taps[len(self.layers)] = final
        return final, (torch.cat([taps[i] for i in layers], dim=-1) if layers else None)

    def _attend(self, index: int, layer: _Layer, seg: Segment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                masks: dict) -> torch.Tensor:
        """Write the segment's k/v [n, g, d] at its cache's end, attend its q [n, h, d] over the cache:
        [n, h, d]."""
        cache, past = seg.cache, seg.cache.length
        end = past + seg.n
        cache.keys[index, :, past:end] = k.transpose(0, 1)
        cache.values[index, :, past:end] = v.transpose(0, 1)
        mask = masks["sliding" if layer.window is not None else "full"]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(cache.keys.dtype), cache.keys[index, None, :, :end],
            cache.values[index, None, :, :end], attn_mask=mask, is_causal=masks["causal"] and layer.window is None,
            scale=self.scale, enable_gqa=self.heads != self.kv_heads)
        return out[0].transpose(0, 1).to(q.dtype)

    def _masks(self, seg: Segment, positions: torch.Tensor) -> dict:
        """The additive masks [n, P + n] of ``seg`` for full and sliding layers (None where attention
        needs none), and whether full layers may use SDPA's own causal mask (no cache yet, no mask)."""
        past, n = seg.cache.length, seg.n
        windows = {layer.window for layer in self.layers if layer.window is not None}
        dtype = self.attention_dtype
        mask = None if seg.mask is None else seg.mask.to(dtype)
        causal = mask is None and past == 0 and n > 1
        if mask is None and n > 1 and (past > 0 or windows):
            mask = _causal_mask(n, past, dtype, self.device)
        full = None if causal else mask
        if not windows:
            return {"full": full, "sliding": None, "causal": causal}
        window = windows.pop()
        base = mask if mask is not None else torch.zeros(n, past + n, dtype=dtype, device=self.device)
        keys = torch.cat([torch.arange(past, device=self.device), positions])
        outside = (positions[:, None] - keys[None, :]) >= window
        sliding = base.masked_fill(outside, torch.finfo(dtype).min)
        return {"full": full, "sliding": sliding, "causal": causal}


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache holds and attention runs in: float32 for a bfloat16 target on CPU (torch's CPU
    attention is 4-5.5x slower in bf16 than in float32 at one query and slower at every size measured; the cached bf16 keys and values are exact in
    float32, so the cache only doubles in bytes), else the target's own dtype."""
    return torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype


def _call(linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


def _causal_mask(n: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask [n, past + n] of n new tokens after ``past`` cached entries."""
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    mask[:, past:] = mask[:, past:].masked_fill(future, torch.finfo(dtype).min)
    return mask


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, heads, d] with ``cos`` [T, 1, r] and ``sin`` signed by :func:`_signed_sin` on its
    first r dims: ``x * cos + rotate_half(x) * sin`` with the same products and sums, in four ops."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, dims=-1) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + head.roll(rot // 2, dims=-1) * sin, tail], dim=-1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [.., r] with its first half negated: ``rotate_half(x) * sin == x.roll(r // 2) * _signed_sin(sin)``
    exactly (negation is exact)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
