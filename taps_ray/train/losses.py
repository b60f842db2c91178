"""EAGLE-2, HASS and EAGLE-3 drafter training objectives.

Alignment (EAGLE). A batch row holds tokens ``x_0..x_{T-1}`` and target features ``f_0..f_{T-1}``
(last hidden state after the final norm, teacher forced). The drafter has ``n = T - 1`` positions:
at position ``i`` it consumes ``embed(x_{i+1})`` and ``f_i`` and predicts ``f_{i+1}``; the target
distribution of the token ``x_{i+2}`` is ``p_i = softmax(head(f_{i+1}))``. Position ``i`` is the
draft-tree node of token ``x_{i+1}``: its output gives the distribution of the token after it.

Loss mask. Position ``i`` is scored iff ``x_{i+1}`` is a real assistant token
(``loss_mask[i+1] * attention_mask[i+1]``): at inference every node whose output is used is a
token the target produced (the bonus root or a drafted continuation of it). In HASS pass ``k`` the
position ``t`` stands for the depth-``k`` state whose chain of nodes is ``x_{t-k+2}..x_{t+1}``
(the root, whose input carries a target feature, and ``k - 1`` drafted nodes); it is scored iff all
``k`` nodes are scored positions, so ``t >= k - 1`` and the chain never starts in a prompt.

Harmonized context alignment (HASS). Pass 1 is the EAGLE-2 pass on (noised) target features.
Pass ``k`` feeds back the drafter's own pass-``(k-1)`` output: the input feature at ``t`` is
``f̂^{(k-1)}_t`` (the pass-``(k-1)`` output at ``t - 1``); the query at ``t`` attends to the
pass-1 keys/values at ``j <= t - k + 1`` and to the pass-``m`` key/value at ``j = t - k + m`` for
``m = 2..k`` (itself when ``m = k``) -- exactly the drafter's state at depth ``k`` of a draft tree.
One pass is one layer call over the whole sequence on top of a cache holding the earlier passes'
keys/values ``[pass 1 ; ... ; pass k-1]`` with the mask above. The fed-back features are detached
by default (``hass_detach``, stop-gradient): pass ``k`` learns to act in the depth-``k`` state it is
given rather than to steer earlier passes towards easier states; earlier passes' keys/values stay
in the graph through the drafter's parameters. The total is the mean over passes of each pass's loss,
so one pass equals EAGLE-2 and the loss scale does not grow with ``n``.

Training-time test (EAGLE-3, :class:`~taps_ray.models.eagle3.Eagle3Head`). A row's ``hidden`` holds the
three target layers the drafter fuses, then the last hidden state ([T, 4H]); the input feature of pass 1 is
``fc`` of the three layers (no noise), the teacher distribution that of the last hidden state. Passes
``2..ttt_steps`` are HASS's passes on the drafter's own (pre-norm) outputs, with the same masks, and the
gradient flows through the fed-back outputs (no stop-gradient). Each pass's loss is the soft CE to the target
alone (no feature regression: ``feature_weight`` and ``ce_weight`` do not apply); the total is their mean.

Every term is a mean over the scored positions of its pass; the per-position feature term is the
SmoothL1 (beta 1) averaged over the hidden dimension. Soft CE and top-K distillation share one fused
autograd function with a closed-form logits gradient (``log q`` is never materialised); the
[N, V] LM-head products dominate a training step on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from taps_ray.config import ObjectiveConfig
from taps_ray.models.drafter import DraftHead


@dataclass
class LossOutput:
    """``total`` scalar tensor (backprop this); ``parts`` floats: ``loss``, ``feature``, ``ce``,
    ``topk`` (HASS; means over passes) and ``pass{k}/{loss,feature,ce,topk}``; ``tokens`` scored
    positions of pass 1; ``top1_acc[k-1]`` drafter argmax == target argmax over the draft vocabulary
    in pass ``k`` (NaN if no position is scored; a training signal: the held-out ``acc<k>`` of
    :func:`taps_ray.train.loop.evaluate` compares with the target's argmax over its whole vocabulary)."""

    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    top1_acc: list[float] = field(default_factory=list)


@dataclass
class DraftInputs:
    """A batch aligned to drafter positions (``n = T - 1``).

    ``token_embeds`` [B, n, H] = embed(x_{i+1}); ``features`` [B, n, F] = f_i (the drafter's feature layers,
    F = len(feature_layers) * H); ``targets`` [B, n, H] = the last hidden state at i + 1; ``positions``
    [B, n]; ``scored`` Bool[B, n] = x_{i+1} is a real assistant token.
    """

    token_embeds: torch.Tensor
    features: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    scored: torch.Tensor


def unwrap(drafter: nn.Module) -> DraftHead:
    """The :class:`DraftHead` inside a DDP/FSDP-style wrapper (``.module``), else ``drafter``."""
    return getattr(drafter, "module", drafter)


def align_batch(batch: dict, embed: nn.Embedding | torch.Tensor, drafter: nn.Module) -> DraftInputs:
    """Shift a feature batch (``input_ids``, ``loss_mask``, ``attention_mask`` [B, T], ``hidden`` [B, T,
    row_layers * H], right padded) to drafter positions, on the drafter's device and dtype; the target
    embedding is used frozen. ValueError when ``hidden`` is not ``row_layers * H`` wide."""
    module = unwrap(drafter)
    weight = module.fc.weight
    size = module.config.hidden_size
    input_ids = batch["input_ids"].to(weight.device)
    hidden = batch["hidden"].to(device=weight.device, dtype=weight.dtype)
    if hidden.is_inference():
        hidden = hidden.clone()
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    if hidden.shape[-1] != module.row_layers * size:
        raise ValueError(f"a {module.algorithm} drafter trains on {module.row_layers} hidden state(s) of {size} per "
                         f"token, got hidden of width {hidden.shape[-1]}")
    attention_mask = batch.get("attention_mask")
    real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.to(weight.device).bool())
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("attention_mask must be right padded (1 ... 1 0 ... 0 per row)")
    loss_mask = batch["loss_mask"].to(weight.device) > 0
    table = embed.weight if isinstance(embed, nn.Module) else embed
    token_embeds = F.embedding(input_ids[:, 1:], table.detach()).to(weight.dtype)
    n = input_ids.shape[1] - 1
    positions = torch.arange(n, device=weight.device).expand(input_ids.shape[0], n)
    return DraftInputs(
        token_embeds=token_embeds,
        features=hidden[:, :-1, :len(module.feature_layers) * size],
        targets=hidden[:, 1:, -size:],
        positions=positions,
        scored=(loss_mask & real)[:, 1:],
    )


def feature_noise(features: torch.Tensor, cfg: ObjectiveConfig, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """``features`` plus the configured noise (one draw of ``features``' shape from ``generator``)."""
    if cfg.noise == "none" or cfg.noise_std == 0:
        return features
    kwargs = {"generator": generator, "device": features.device, "dtype": features.dtype}
    if cfg.noise == "uniform":
        return features + (torch.rand(features.shape, **kwargs) - 0.5) * cfg.noise_std
    return features + torch.randn(features.shape, **kwargs) * cfg.noise_std


def chain_scored(scored: torch.Tensor, depth: int) -> torch.Tensor:
    """Bool[B, n]: position ``t`` is scored at depth ``depth`` iff ``scored[t-depth+1 .. t]`` all hold."""
    out = scored.clone()
    for s in range(1, depth):
        out[:, s:] &= scored[:, :-s]
        out[:, :s] = False
    return out


def harmonized_mask(n: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, n, depth * n] of pass ``depth`` over keys [pass 1 ; ... ; pass depth]."""
    t = torch.arange(n, device=device).view(n, 1)
    j = torch.arange(n, device=device).view(1, n)
    blocks = [j <= t - depth + 1] + [j == t - depth + m for m in range(2, depth + 1)]
    allowed = torch.cat(blocks, dim=1)
    mask = torch.zeros(n, depth * n, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, n, depth * n)


def drafter_passes(drafter: nn.Module, token_embeds: torch.Tensor, features: torch.Tensor,
                   positions: torch.Tensor, passes: int, detach: bool = True) -> list[torch.Tensor]:
    """Outputs f̂ [B, n, H] of passes 1..``passes`` (harmonized context alignment / training-time test;
    pass 1 = EAGLE-2's) from target ``features`` [B, n, F] (the drafter's :meth:`fuse` makes them H wide).

    Pass ``k``'s input feature at ``t`` is pass ``k-1``'s output at ``t - 1`` (the fused ``features[:, 0]``
    at ``t = 0``, a position never scored at depth ``k > 1``). ``drafter`` may be a DDP wrapper.
    """
    n = features.shape[1]
    module = unwrap(drafter)
    features = module.fuse(features)
    cache = module.new_cache() if passes > 1 else None
    outputs: list[torch.Tensor] = []
    inputs = features
    for k in range(1, passes + 1):
        mask = harmonized_mask(n, k, features.dtype, features.device)
        out = drafter(token_embeds, inputs, positions, cache=cache, attention_mask=mask)
        outputs.append(out)
        if k < passes:
            fed = out.detach() if detach else out
            inputs = torch.cat([features[:, :1], fed[:, :-1]], dim=1)
    return outputs


def smooth_l1(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position SmoothL1 (beta 1) averaged over the hidden dim: [N, H] x [N, H] -> [N]."""
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=1.0).mean(-1)


class _SoftTargetCrossEntropy(torch.autograd.Function):
    """Fused soft CE and top-K distillation from draft logits; one [N, V] pass each way besides z."""

    @staticmethod
    def forward(ctx, z, p, p_mass, p_top, top_ids):
        lse = torch.logsumexp(z, dim=-1)
        ce = p_mass * lse - torch.linalg.vecdot(p, z)
        topk_mass = p_top.sum(-1)
        topk = topk_mass * lse - (p_top * z.gather(-1, top_ids)).sum(-1)
        ctx.save_for_backward(z, lse, p, p_mass, p_top, top_ids, topk_mass)
        return ce, topk

    @staticmethod
    def backward(ctx, g_ce, g_topk):
        z, lse, p, p_mass, p_top, top_ids, topk_mass = ctx.saved_tensors
        grad = (z - lse.unsqueeze(-1)).exp_()
        grad.mul_((g_ce * p_mass + g_topk * topk_mass).unsqueeze(-1))
        grad.addcmul_(p, g_ce.unsqueeze(-1), value=-1.0)
        grad.scatter_add_(-1, top_ids, -(g_topk.unsqueeze(-1) * p_top))
        return grad, None, None, None, None


@dataclass
class TargetDistribution:
    """Target probabilities ``p`` [N, V] (no gradient), their mass [N] and top-K values/ids [N, K]."""

    p: torch.Tensor
    mass: torch.Tensor
    top_p: torch.Tensor
    top_ids: torch.Tensor

    @classmethod
    def of(cls, p: torch.Tensor, topk: int = 0) -> TargetDistribution:
        p = p.detach()
        top_p, top_ids = p.topk(min(topk, p.shape[-1]), dim=-1)
        return cls(p=p, mass=p.sum(-1), top_p=top_p, top_ids=top_ids)


def distillation_terms(logits: torch.Tensor, target: TargetDistribution | torch.Tensor, topk: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position soft CE ``-sum_j p_j log q_j`` and top-K distillation ``-sum_{j in topK(p)} p_j
    log q_j`` with ``q = softmax(logits)``: logits [N, V] -> ([N], [N]); K = 0 gives zeros.

    ``target`` is ``p`` [N, V] (then ``topk`` is K) or a precomputed :class:`TargetDistribution`.
    The logits' gradient is computed in closed form (``q * (g_ce sum p + g_topk sum_topK p) - g_ce p
    - g_topk p 1_topK``) without materialising ``log q``.
    """
    if not isinstance(target, TargetDistribution):
        target = TargetDistribution.of(target, topk)
    dtype = logits.dtype
    return _SoftTargetCrossEntropy.apply(logits, target.p.to(dtype), target.mass.to(dtype),
                                         target.top_p.to(dtype), target.top_ids)


def _masked_mean(values: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
    return (values * weight).sum() / max(count, 1)


def _pass_loss(cfg: ObjectiveConfig, pred: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor,
               target: TargetDistribution, weight: torch.Tensor,
               count: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One pass's terms (``feature``, ``ce``, ``topk`` as ``cfg.algorithm`` uses them), each a mean over the
    scored rows weighted by ``weight`` [N] (``count`` its sum), and the pass's weighted loss. ``pred`` and
    ``targets`` [N, H] are the predicted and target features, ``logits`` [N, V] the prediction's."""
    ce, topk = distillation_terms(logits, target)
    if cfg.algorithm == "eagle3":
        terms = {"ce": _masked_mean(ce, weight, count)}
        loss = terms["ce"]
    else:
        terms = {
            "feature": _masked_mean(smooth_l1(pred, targets), weight, count),
            "ce": _masked_mean(ce, weight, count),
        }
        loss = cfg.feature_weight * terms["feature"] + cfg.ce_weight * terms["ce"]
    if cfg.algorithm == "hass":
        terms["topk"] = _masked_mean(topk, weight, count)
        loss = loss + cfg.topk_weight * terms["topk"]
    return terms, loss


def drafter_loss(
    drafter: nn.Module,
    batch: dict,
    embed: nn.Embedding | torch.Tensor,
    lm_head_weight: torch.Tensor,
    cfg: ObjectiveConfig,
    generator: torch.Generator | None = None,
    add_noise: bool = True,
) -> LossOutput:
    """EAGLE-2 / HASS / EAGLE-3 loss of one batch (see module docstring for alignment and masking).

    Per pass: ``feature_weight * SmoothL1 + ce_weight * softCE(p, q) [+ topk_weight * topK(p, q)]``
    with ``p = softmax(head(f_{i+1}))``, ``q = softmax(head(readout(f̂_{i+1})))`` over the draft vocabulary
    (eagle3: ``softCE(p, q)`` alone, no noise, gradient through the unroll); total = mean over passes. ``add_noise`` applies ``cfg.noise`` to the input target features
    (training); ``generator`` makes the noise reproducible. ``drafter`` is a :class:`DraftHead` or a
    DDP wrapper of one (its forward is called once per pass, through the wrapper).
    """
    inputs = align_batch(batch, embed, drafter)
    eagle3 = cfg.algorithm == "eagle3"
    features = feature_noise(inputs.features, cfg, generator) if add_noise and not eagle3 else inputs.features
    outputs = drafter_passes(drafter, inputs.token_embeds, features, inputs.positions, cfg.passes,
                             detach=cfg.hass_detach and not eagle3)
    head = lm_head_weight.detach()
    module = unwrap(drafter)
    scored = inputs.scored
    targets = inputs.targets[scored]
    use_topk = cfg.algorithm == "hass"
    with torch.no_grad():
        target_logits = module.vocab_logits(targets, head)
        target_top1 = target_logits.argmax(-1)
        target = TargetDistribution.of(torch.softmax(target_logits, dim=-1), cfg.topk if use_topk else 0)
        del target_logits

    parts: dict[str, float] = {}
    top1: list[float] = []
    pass_losses = []
    sums = {"feature": 0.0, "ce": 0.0, "topk": 0.0}
    for k, out in enumerate(outputs, start=1):
        weight = chain_scored(scored, k)[scored].float()
        count = int(weight.sum())
        pred = out[scored]
        logits = module.logits(pred, head)
        terms, loss = _pass_loss(cfg, pred, targets, logits, target, weight, count)
        pass_losses.append(loss)
        with torch.no_grad():
            hits = (logits.argmax(-1) == target_top1).float()
            top1.append(float((hits * weight).sum()) / count if count else float("nan"))
        parts[f"pass{k}/loss"] = float(loss.detach())
        for name, value in terms.items():
            parts[f"pass{k}/{name}"] = float(value.detach())
            sums[name] += parts[f"pass{k}/{name}"]
    total = torch.stack(pass_losses).mean()
    parts["loss"] = float(total.detach())
    for name in (("ce",) if eagle3 else ("feature", "ce")) + (("topk",) if use_topk else ()):
        parts[name] = sums[name] / len(outputs)
    return LossOutput(total=total, parts=parts, tokens=int(scored.sum()), top1_acc=top1)
