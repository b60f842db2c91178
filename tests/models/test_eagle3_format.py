"""EAGLE-3 folders for SGLang and vLLM: every exported tensor lands on a parameter the engine's loader declares,
with its shape (SGLang skips unknown names silently, so a wrong key would not be an error there), the aux layers
each engine captures are the ones the head reads, export -> import is bit-identical, and bad folders are named.

The loaders' parameter tables and name handling below are transcribed from their source:
SGLang ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3.load_weights``, sgl-project/sglang
at 03d5a77) and vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM.load_weights`` and
``LlamaModel.load_weights``, vllm-project/vllm at 00bd149); the capture conventions from their Llama models'
``set_eagle3_layers_to_capture`` (SGLang: layer id + 1) and ``aux_hidden_state_layers`` (vLLM: layer id).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from taps_ray.models.drafter import DrafterLoadError, DraftHead
from taps_ray.models.eagle3 import Eagle3Head
from taps_ray.models.eagle3_format import aux_from_config, export_eagle3, load_eagle3
from taps_ray.models.eagle_format import EagleExportError
from tests.conftest import make_tiny_target

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(0, layers=8)


def head_of(target, reduced: bool = True, seed: int = 3) -> Eagle3Head:
    d2t = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:96] if reduced else None
    head = Eagle3Head(target.config, draft_to_target=d2t, seed=seed, metadata={"name": "e3"})
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return head.eval()


def declared(target, head, engine: str) -> dict[str, tuple[int, ...]]:
    """The parameters each engine's EAGLE-3 model declares, with their shapes, for this drafter's config."""
    c = head.config
    h, g, d, hidden, inter = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size
    layer = "model.midlayer." if engine == "sglang" else "model.layers.0."
    params = {
        "model.embed_tokens.weight": (c.vocab_size, hidden),
        "model.fc.weight": (hidden, 3 * hidden),
        f"{layer}self_attn.qkv_proj.weight": ((h + 2 * g) * d, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": (hidden, h * d),
        f"{layer}mlp.gate_up_proj.weight": (2 * inter, hidden),
        f"{layer}mlp.down_proj.weight": (hidden, inter),
        f"{layer}input_layernorm.weight": (hidden,),
        f"{layer}hidden_norm.weight": (hidden,),
        f"{layer}post_attention_layernorm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (head.draft_vocab_size, hidden),
    }
    if engine == "vllm":
        params["draft_id_to_target_id"] = (head.draft_vocab_size,)
    return params


def shard_shape(head, shard) -> tuple[int, ...]:
    c = head.config
    rows = {"q": c.num_attention_heads * c.head_dim, "k": c.num_key_value_heads * c.head_dim,
            "v": c.num_key_value_heads * c.head_dim, 0: c.intermediate_size, 1: c.intermediate_size}[shard]
    return (rows, (2 if shard in ("q", "k", "v") else 1) * c.hidden_size)


def route(name: str, engine: str, params: dict) -> tuple[str | None, object]:
    """Where the engine's ``load_weights`` puts a file's tensor ``name``: (parameter, shard id), or (None, None)
    when it drops it on purpose (``t2d``); SGLang keeps ``d2t`` as its hot-token ids."""
    if "t2d" in name:
        return None, None
    if engine == "sglang":
        if "d2t" in name:
            return "hot_token_id", None
        for param, shard, shard_id in STACKED:
            if shard in name:
                name = name.replace(shard, param)
                return (name if name in params else f"model.{name}"), shard_id
        return (name if name in params else f"model.{name}"), None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.")
    for param, shard, shard_id in STACKED:
        if shard in name:
            return name.replace(shard, param), shard_id
    return name, None


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("reduced", [True, False])
def test_every_exported_tensor_lands_on_a_declared_parameter_of_its_shape(target, tmp_path, engine, reduced):
    head = head_of(target, reduced)
    export_eagle3(head, tmp_path / engine, target.fingerprint, target.lm_head.weight, engine=engine)
    tensors = load_file(str(tmp_path / engine / "model.safetensors"))
    params = declared(target, head, engine)
    covered, shards = set(), {}
    for name, tensor in tensors.items():
        param, shard = route(name, engine, params)
        if param is None:
            continue
        if param == "hot_token_id":
            assert torch.equal(tensor + torch.arange(tensor.numel()), head.draft_to_target)
            continue
        assert param in params, f"{engine} has no parameter for {name!r} (routed to {param!r})"
        covered.add(param)
        if shard is None:
            assert tuple(tensor.shape) == params[param], (name, tuple(tensor.shape), params[param])
        else:
            assert tuple(tensor.shape) == shard_shape(head, shard), (name, tuple(tensor.shape))
            shards.setdefault(param, 0)
            shards[param] += tensor.shape[0]
    assert all(shards[p] == params[p][0] for p in shards), "stacked shards fill their parameter"
    optional = {"model.embed_tokens.weight"} | ({"draft_id_to_target_id"} if not reduced else set())
    assert set(params) - covered <= optional, f"{engine} parameters left unloaded: {set(params) - covered - optional}"
    if engine == "vllm" and reduced:
        targets = torch.arange(head.draft_vocab_size) + tensors["d2t"]
        assert torch.equal(targets, head.draft_to_target)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_config_names_what_each_engine_needs_and_the_layers_it_captures_are_the_heads(target, tmp_path, engine):
    head = head_of(target)
    meta = json.loads((export_eagle3(head, tmp_path / engine, target.fingerprint, target.lm_head.weight,
                                     engine=engine).path / "config.json").read_text())
    assert meta["architectures"] == {"sglang": ["LlamaForCausalLMEagle3"], "vllm": ["Eagle3LlamaForCausalLM"]}[engine]
    assert meta["tie_word_embeddings"] is False and meta["draft_vocab_size"] == 96 and meta["num_hidden_layers"] == 1
    assert meta["vocab_size"] == target.vocab_size and meta["bias"] is False
    if engine == "sglang":
        captured = [i + 1 for i in meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        assert "eagle_aux_hidden_state_layer_ids" not in meta
    else:
        captured = list(meta["eagle_aux_hidden_state_layer_ids"])
        assert "eagle_config" not in meta
    assert tuple(captured) == head.feature_layers, "the engine would feed the head other layers than it trained on"
    assert aux_from_config(meta) == head.aux


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_then_import_is_bit_identical(target, tmp_path, engine):
    head = head_of(target)
    folder = export_eagle3(head, tmp_path / engine, target.fingerprint, target.lm_head.weight, engine=engine).path
    back = load_eagle3(folder, target.config, target.fingerprint)
    assert torch.equal(back.draft_to_target, head.draft_to_target) and back.aux == head.aux
    assert back.metadata == head.metadata and back.seed == head.seed
    state, again = head.trainable_state(), back.trainable_state()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)


def test_a_folder_with_an_lm_head_of_its_own_is_refused_and_the_targets_rows_are_accepted(target, tmp_path):
    head = head_of(target)
    folder = export_eagle3(head, tmp_path / "e3", target.fingerprint, target.lm_head.weight).path
    meta = json.loads((folder / "config.json").read_text())
    del meta["taps"]
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterLoadError, match="LM head of its own .*import it with the target at hand"):
        load_eagle3(folder, target.config, target.fingerprint)
    assert load_eagle3(folder, target.config, target.fingerprint, target.lm_head.weight).aux == head.aux
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.5
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="not the target's LM head .*largest difference 0.5"):
        load_eagle3(folder, target.config, target.fingerprint, target.lm_head.weight)


@pytest.mark.parametrize("change, message", [
    (lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), "bad d2t: .*repeat"),
    (lambda t: t.__setitem__("t2d", ~t["t2d"]), "t2d does not mark exactly the 96"),
    (lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :10].contiguous()), r"wrong shapes: fc.weight \[64, 10\]"),
    (lambda t: t.pop("norm.weight"), "missing: norm.weight"),
])
def test_bad_folders_name_the_value_and_what_is_valid(target, tmp_path, change, message):
    folder = export_eagle3(head_of(target), tmp_path / "e3", target.fingerprint, target.lm_head.weight).path
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match=message):
        load_eagle3(folder, target.config, target.fingerprint)


def test_export_refuses_what_the_engine_cannot_load(target, tmp_path):
    with pytest.raises(EagleExportError, match="takes an EAGLE-3 drafter, this one is eagle2: use --format eagle"):
        export_eagle3(DraftHead(target.config), tmp_path / "a", target.fingerprint, target.lm_head.weight)
    head = head_of(target)
    head.midlayer.self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(head.midlayer.self_attn.q_proj.out_features))
    with pytest.raises(EagleExportError, match="q_proj.bias; SGLang's EAGLE-3 layer has no such biases"):
        export_eagle3(head, tmp_path / "b", target.fingerprint, target.lm_head.weight, engine="sglang")
    assert export_eagle3(head, tmp_path / "c", target.fingerprint, target.lm_head.weight, engine="vllm").engine == "vllm"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(EagleExportError, match="refusing to replace .*notes.txt"):
        export_eagle3(head_of(target), tmp_path / "d", target.fingerprint, target.lm_head.weight)


def test_taps_export_writes_an_eagle3_folder_for_each_engine_from_a_saved_head(target, tmp_path, monkeypatch, capsys):
    """The CLI reads a saved EAGLE-3 head, loads its target for the LM head rows (``--target``) and writes the
    engine's folder; an EAGLE-3 head asked for ``--format eagle`` (and the reverse) is told which format fits."""
    from taps_ray.cli import main
    from taps_ray.models import target as target_module

    head = head_of(target)
    saved = head.save(tmp_path / "head", target.fingerprint)
    monkeypatch.setattr(target_module.TargetModel, "load", classmethod(lambda cls, cfg: target))
    assert main(["export", str(saved), "--format", "eagle3", "--engine", "vllm", "--out", str(tmp_path / "v")]) == 0
    assert "EAGLE-3 for vllm" in capsys.readouterr().out
    back = load_eagle3(tmp_path / "v", target.config, target.fingerprint)
    assert torch.equal(back.trainable_state()["fc.weight"], head.trainable_state()["fc.weight"])
    assert main(["export", str(saved), "--format", "eagle", "--out", str(tmp_path / "x")]) == 2
    assert "--format eagle does not fit this eagle3 drafter: use --format eagle3" in capsys.readouterr().err
    eagle2 = DraftHead(target.config).save(tmp_path / "e2", target.fingerprint)
    assert main(["export", str(eagle2), "--format", "eagle3", "--out", str(tmp_path / "y")]) == 2
    assert "--format eagle3 does not fit this eagle2 drafter: use --format eagle" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
