"""EAGLE-1/EAGLE-2 folders: import (SafeAILab key names, size checks, EAGLE-3 refusal), export per engine,
export -> import bit-identical, and the config transformers' AutoConfig reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from taps_ray.models.drafter import DrafterLoadError, DraftHead
from taps_ray.models.eagle_format import TOKEN_MAP_NAME, EagleExportError, export_eagle
from tests.conftest import make_tiny_target

LAYER_KEYS = [
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight",
]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(0)


def eagle_config(target, **changes) -> dict:
    """A SafeAILab-style config.json for ``target`` (written out literally, not by our exporter)."""
    cfg = target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True, "hidden_act": "silu",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings, "num_attention_heads": cfg.num_attention_heads,
            "num_hidden_layers": 1, "num_key_value_heads": cfg.num_key_value_heads,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_parameters["rope_theta"], "rope_scaling": None,
            "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": cfg.vocab_size, **changes}


def eagle_weights(target, bias: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under exactly the SafeAILab key names, with the target's embedding as EAGLE stores it."""
    g = torch.Generator().manual_seed(seed)
    h, kv = target.hidden_size, target.config.num_key_value_heads * 16
    inter = target.config.intermediate_size
    shapes = dict(zip(LAYER_KEYS, [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,)]))
    tensors = {k: torch.randn(*s, generator=g) * 0.1 for k, s in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] += 1.0
    tensors["fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    if bias:
        tensors["fc.bias"] = torch.randn(h, generator=g) * 0.1
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    return tensors


def write_eagle(folder, config: dict, tensors: dict, weights: str = "model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights == "model.safetensors":
        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, str(folder / weights))
    return folder


def features(head, target, n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (1, n), generator=g)
    feats = torch.randn(1, n, target.hidden_size, generator=g)
    with torch.inference_mode():
        return head(target.embed_tokens(tokens), feats, torch.arange(n)[None])


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("bias", [True, False])
def test_eagle_checkpoint_drafts_like_our_head_with_the_same_weights(target, tmp_path, weights, bias):
    tensors = eagle_weights(target, bias=bias)
    folder = write_eagle(tmp_path / "eagle", eagle_config(target, bias=bias), tensors, weights)
    imported = DraftHead.load(folder, target.config, target.fingerprint)
    ours = DraftHead(target.config)
    state = {"layer." + k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")}
    state["fc.weight"] = tensors["fc.weight"]
    state["fc.bias"] = tensors["fc.bias"] if bias else torch.zeros(target.hidden_size)
    ours.load_state_dict(state, strict=False)
    torch.testing.assert_close(features(imported, target), features(ours.eval(), target), atol=1e-5, rtol=0)
    assert imported.draft_to_target is None and imported.metadata["format"] == "eagle"


def test_eagle3_checkpoints_are_refused_by_name(target, tmp_path):
    tensors = eagle_weights(target)
    midlayer = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    folder = write_eagle(tmp_path / "specforge", eagle_config(target, architectures=["LlamaForCausalLMEagle3"]),
                         {**midlayer, "d2t": torch.zeros(8, dtype=torch.long)})
    with pytest.raises(DrafterLoadError, match="EAGLE-3 checkpoint.*midlayer"):
        DraftHead.load(folder, target.config, target.fingerprint)
    folder = write_eagle(tmp_path / "d2t", eagle_config(target), {**tensors, "t2d": torch.ones(8, dtype=torch.bool)})
    with pytest.raises(DrafterLoadError, match="EAGLE-3 checkpoint.*t2d"):
        DraftHead.load(folder, target.config, target.fingerprint)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32}, "hidden_size is 32; target 'tiny-llama-seed0' needs 64"),
    ({"vocab_size": 128}, "vocab_size is 128; target 'tiny-llama-seed0' needs 256"),
    ({"num_attention_heads": 8}, "num_attention_heads is 8; .* needs 4"),
    ({"num_key_value_heads": 4}, "num_key_value_heads is 4; .* needs 2"),
    ({"rope_theta": 500000.0}, "rope_parameters is .*500000.*; .* needs .*10000"),
    ({"num_hidden_layers": 2}, "num_hidden_layers is 2; only one-layer"),
])
def test_size_mismatches_name_the_value_and_what_is_valid(target, tmp_path, change, message):
    folder = write_eagle(tmp_path / "eagle", eagle_config(target, **change), eagle_weights(target))
    with pytest.raises(DrafterLoadError, match=message):
        DraftHead.load(folder, target.config, target.fingerprint)


def test_bad_weights_are_named(target, tmp_path):
    tensors = eagle_weights(target)
    wrong = {**tensors, "fc.weight": torch.zeros(target.hidden_size, target.hidden_size)}
    with pytest.raises(DrafterLoadError, match=r"fc.weight has shape \[64, 64\]; target needs \[64, 128\]"):
        DraftHead.load(write_eagle(tmp_path / "a", eagle_config(target), wrong), target.config, target.fingerprint)
    normed = {**tensors, "layers.0.input_layernorm.weight": torch.ones(target.hidden_size)}
    with pytest.raises(DrafterLoadError, match="unexpected.*input_layernorm.*no input norm"):
        DraftHead.load(write_eagle(tmp_path / "b", eagle_config(target), normed), target.config, target.fingerprint)
    no_bias = {k: v for k, v in tensors.items() if k != "fc.bias"}
    with pytest.raises(DrafterLoadError, match="bias: true but the weights have no fc.bias"):
        DraftHead.load(write_eagle(tmp_path / "c", eagle_config(target), no_bias), target.config, target.fingerprint)
    with pytest.raises(DrafterLoadError, match="bias: false but fc.bias is non-zero"):
        DraftHead.load(write_eagle(tmp_path / "d", eagle_config(target, bias=False), tensors), target.config,
                       target.fingerprint)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps(eagle_config(target)))
    with pytest.raises(DrafterLoadError, match="no model.safetensors or pytorch_model.bin"):
        DraftHead.load(tmp_path / "e", target.config, target.fingerprint)


def trained_head(target, **kwargs) -> DraftHead:
    head = DraftHead(target.config, seed=5, metadata={"name": "math", "algorithm": "hass"}, **kwargs)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def assert_identical(a: DraftHead, b: DraftHead, target) -> None:
    assert a.trainable_state().keys() == b.trainable_state().keys()
    for key, value in a.trainable_state().items():
        assert torch.equal(b.trainable_state()[key], value), key
    assert (a.draft_to_target is None) == (b.draft_to_target is None)
    if a.draft_to_target is not None:
        assert torch.equal(a.draft_to_target, b.draft_to_target)
    assert torch.equal(features(a, target), features(b, target))


@pytest.mark.parametrize("reduced", [False, True])
def test_sglang_export_then_import_is_bit_identical(target, tmp_path, reduced):
    d2t = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:100] if reduced else None
    head = trained_head(target, draft_to_target=d2t)
    done = export_eagle(head, tmp_path / "eagle", target.fingerprint)
    assert done.bias and (done.token_map is not None) == reduced
    keys = set(load_file(str(done.path / "model.safetensors")))
    zero_attention_biases = {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert keys == {"fc.weight", "fc.bias", *LAYER_KEYS, *zero_attention_biases}
    if reduced:
        assert torch.equal(torch.load(str(done.path / TOKEN_MAP_NAME), weights_only=True), d2t)
    loaded = DraftHead.load(done.path, target.config, target.fingerprint)
    assert_identical(head, loaded, target)
    assert loaded.metadata == head.metadata and loaded.seed == head.seed


def test_vllm_export_refuses_what_vllm_cannot_load(target, tmp_path):
    fresh = DraftHead(target.config, seed=2).eval()  # fc.bias is initialised to zero
    done = export_eagle(fresh, tmp_path / "vllm", target.fingerprint, engine="vllm")
    assert not done.bias and set(load_file(str(done.path / "model.safetensors"))) == {"fc.weight", *LAYER_KEYS}
    assert_identical(fresh, DraftHead.load(done.path, target.config, target.fingerprint), target)
    trained = trained_head(target)
    with pytest.raises(EagleExportError, match="fc.bias is non-zero .*--engine sglang, or add --drop-fc-bias"):
        export_eagle(trained, tmp_path / "x", target.fingerprint, engine="vllm")
    reduced = DraftHead(target.config, draft_to_target=torch.arange(100))
    with pytest.raises(EagleExportError, match="reduced vocabulary of 100 tokens .*--speculative-token-map"):
        export_eagle(reduced, tmp_path / "y", target.fingerprint, engine="vllm")
    dropped = export_eagle(trained, tmp_path / "z", target.fingerprint, engine="vllm", drop_fc_bias=True)
    assert dropped.fc_bias_dropped and not dropped.bias
    loaded = DraftHead.load(dropped.path, target.config, target.fingerprint)
    assert not loaded.fc.bias.count_nonzero() and torch.equal(loaded.fc.weight, trained.fc.weight)


@pytest.mark.parametrize("engine, architecture", [("sglang", "LlamaForCausalLMEagle"), ("vllm", "EagleLlamaForCausalLM")])
def test_autoconfig_parses_the_export_as_a_one_layer_llama(target, tmp_path, engine, architecture):
    done = export_eagle(DraftHead(target.config), tmp_path / engine, target.fingerprint, engine=engine)
    cfg = AutoConfig.from_pretrained(str(done.path))
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 1 and cfg.architectures == [architecture]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 256, 4, 2)
    assert cfg.bias is False and cfg.tie_word_embeddings is False
    assert cfg.rope_parameters["rope_theta"] == json.loads((done.path / "config.json").read_text())["rope_theta"]


def test_export_replaces_only_an_earlier_export(target, tmp_path):
    head = DraftHead(target.config)
    export_eagle(head, tmp_path / "out", target.fingerprint)
    export_eagle(head, tmp_path / "out", target.fingerprint)  # an earlier export is replaced
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(EagleExportError, match=r"refusing to replace .*notes\.txt"):
        export_eagle(head, tmp_path / "out", target.fingerprint)
    other = make_tiny_target(seed=1)
    done = export_eagle(head, tmp_path / "other", target.fingerprint)
    with pytest.raises(DrafterLoadError, match="trained for another target: .*embed_hash"):
        DraftHead.load(done.path, other.config, other.fingerprint)


@pytest.mark.parametrize("token_map, message", [
    ([3, 7, 3], r"draft_to_target repeats target id 3 \(draft ids 0 and 2\)"),
    ([3, 256], r"draft_to_target\[1\] = 256 is outside the target vocabulary \[0, 256\)"),
    ([3], "it holds 1 target id; need at least 2"),
])
def test_import_refuses_a_bad_token_map(target, tmp_path, token_map, message):
    done = export_eagle(DraftHead(target.config, draft_to_target=torch.arange(10)), tmp_path / "eagle",
                        target.fingerprint)
    torch.save(torch.tensor(token_map), str(done.path / TOKEN_MAP_NAME))
    with pytest.raises(DrafterLoadError, match=f"token map {TOKEN_MAP_NAME}: {message}"):
        DraftHead.load(done.path, target.config, target.fingerprint)
