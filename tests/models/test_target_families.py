"""The target-family matrix: tiny random Llama-3, Qwen2.5, Qwen3, Mistral, Gemma-2, Gemma-3 and Phi-3 targets
(2 layers, vocab 256, fp32, built offline from the transformers config classes). Sliding windows of 8
(Mistral, Phi-3, Qwen2.5 with ``use_sliding_window``, Gemma-2/3 alternating sliding and full layers);
Gemma with and without attention / final logit soft-capping.

For each family: a :class:`DraftHead` sized from the target's config drafts a tree; greedy speculative
decoding equals vanilla token for token over sequences several sliding windows long; and after a tree
step plus :func:`compact_cache` the cache equals a fresh prefill of the accepted sequence.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from taps_ray.config import TreeConfig
from taps_ray.models.attention import GQA_SDPA
from taps_ray.models.drafter import DraftHead
from taps_ray.models.engine import KVCache
from taps_ray.models.target import TargetLoadError, TargetModel
from taps_ray.models.target_cache import compact_cache, crop_cache
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy
from taps_ray.spec.tree import DrafterState, build_tree, draft_tree
from taps_ray.spec.verify import compact_target, run_tree, verify_greedy
from tests.spec.spec_helpers import OracleStrategy, make_peaky, random_prompt, sharp_drafter

WINDOW = 8
VOCAB = 256
HIDDEN = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
              eos_token_id=1)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "qwen2.5": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2.5-sliding": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                            max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW, head_dim=8,
                                                        tie_word_embeddings=False)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(sliding_window=WINDOW, head_dim=32, query_pre_attn_scalar=24,
                                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        sliding_window=WINDOW, head_dim=32, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3-nocap": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        sliding_window=WINDOW, head_dim=32, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=WINDOW, pad_token_id=0, tie_word_embeddings=False)),
}
SOFTCAP = {"gemma2", "gemma3"}
STATIC = {"llama3", "qwen2.5", "qwen2.5-sliding", "qwen3", "mistral", "phi3"}
TREE = TreeConfig(depth=3, top_k=3, total_tokens=10)


def family_model(family: str, seed: int = 0):
    """A tiny random ``family`` model (fp32, eval), attention left at the model's default."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**COMMON, **extra})).eval()


def family_target(family: str, seed: int = 0) -> TargetModel:
    return TargetModel(family_model(family, seed), tokenizer=None, name=f"tiny-{family}")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def peaky_target(family) -> TargetModel:
    return make_peaky(family_target(family))


def test_attention_and_windows(family):
    """Soft-capped attention runs the model's eager attention; every other family the GQA SDPA on CPU."""
    target = family_target(family)
    expected = "eager" if family in SOFTCAP else GQA_SDPA
    assert target.model.config._attn_implementation == expected
    window = FAMILIES[family][2].get("sliding_window")
    kinds = getattr(target.config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * 2
    assert target.windows == [window if kind == "sliding_attention" else None for kind in kinds]
    cache = _filled_cache(target)
    if family in STATIC:
        assert target.engine is not None and isinstance(cache, KVCache)
        assert all(layer.keys.shape[-2] == 3 * WINDOW for layer in cache.layers)
    else:
        assert target.engine is None
        assert all(type(layer) is DynamicLayer for layer in cache.layers)


def _filled_cache(target: TargetModel) -> DynamicCache:
    return target.prefill(random_prompt(target, 3 * WINDOW, seed=0)[None]).cache


def test_drafter_sizing(family):
    target = family_target(family)
    rope = target.config.rope_parameters
    full_rope = rope.get("full_attention", rope)
    assert DraftHead(target.config).config.rope_parameters["rope_theta"] == full_rope["rope_theta"]
    text = target.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    tied = target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert tied == bool(FAMILIES[family][2].get("tie_word_embeddings", True))
    drafter = DraftHead(target.config, seed=0).eval()
    attn = drafter.layer.self_attn
    assert attn.q_proj.out_features == text.num_attention_heads * head_dim
    assert attn.k_proj.out_features == text.num_key_value_heads * head_dim
    prompt = random_prompt(target, 12, seed=1)
    out = target.prefill(prompt[None])
    state = DrafterState(drafter)
    state.add(prompt[1:], out.hidden[0, :-1])
    tree = draft_tree(drafter, target, state, TREE)
    assert tree.size == TREE.total_tokens and tree.prefix_len == prompt.numel() - 1
    assert bool((tree.tokens[1:] >= 0).all() and (tree.tokens < VOCAB).all())


def test_greedy_speculative_equals_vanilla(family, peaky_target):
    target = peaky_target
    prompt = random_prompt(target, 12, seed=2)
    vanilla = generate(target, prompt, None, max_new_tokens=40, eos_token_ids=set())
    assert len(set(vanilla.token_ids)) >= 10, f"{family}: greedy text collapsed: {vanilla.token_ids}"
    drafter = sharp_drafter(target, seed=3)
    single = generate(target, prompt, SingleStrategy(drafter, TREE), max_new_tokens=40, eos_token_ids=set())
    assert single.token_ids == vanilla.token_ids
    reference = torch.cat([prompt, torch.tensor(vanilla.token_ids)])
    oracle = OracleStrategy(reference, VOCAB, depth=5, seed=4)
    spec = generate(target, prompt, oracle, max_new_tokens=40, eos_token_ids=set())
    assert spec.token_ids == vanilla.token_ids
    assert max(spec.accept_lengths) >= 3 and len(spec.steps) < 40


def _layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("prefix", [5, 3 * WINDOW + 2])
def test_compaction_matches_fresh_prefill(family, peaky_target, prefix):
    target = peaky_target
    prompt = random_prompt(target, prefix, seed=5)
    seq = torch.cat([prompt, torch.tensor(generate(target, prompt, None, max_new_tokens=6,
                                                   eos_token_ids=set()).token_ids)])
    r = prefix - 1
    cache = target.new_cache()
    target.prefill(seq[None, :r], cache)
    nxt = [int(t) for t in seq[r:r + 5]]
    # root, a decoy chain, the true chain of 3, a decoy under the true chain, then the 4th (wrong) token
    decoy = [(t + 11) % (VOCAB - 2) + 2 for t in nxt]
    tokens = [nxt[0], decoy[1], decoy[2], nxt[1], decoy[2], nxt[2], nxt[3], (nxt[4] + 5) % (VOCAB - 2) + 2]
    parents = [-1, 0, 1, 0, 3, 3, 5, 6]
    tree = build_tree(tokens, parents, prefix_len=r)
    out = run_tree(target, tree, cache)
    verdict = verify_greedy(tree, out.logits[0])
    assert verdict.path.tolist() == [0, 3, 5, 6]
    assert verdict.tokens.tolist() == [nxt[1], nxt[2], nxt[3], nxt[4]]
    compact_target(cache, tree, verdict)
    fresh = target.prefill(seq[None, :r + 4])
    assert cache.get_seq_length() == fresh.cache.get_seq_length() == r + 4
    for (k, v), (fk, fv) in zip(_layer_kv(cache), _layer_kv(fresh.cache), strict=True):
        torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, fv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0, verdict.path], fresh.logits[0, r:], atol=1e-4, rtol=1e-4)
    after = target.forward(seq[None, r + 4:r + 5], torch.tensor([[r + 4]]), cache)
    torch.testing.assert_close(after.logits[0, -1], target.prefill(seq[None, :r + 5]).logits[0, -1],
                               atol=1e-4, rtol=1e-4)
    crop_cache(cache, r)
    for (k, v), (fk, fv) in zip(_layer_kv(cache), _layer_kv(fresh.cache), strict=True):
        torch.testing.assert_close(k, fk[..., :r, :])
        torch.testing.assert_close(v, fv[..., :r, :])


@pytest.mark.parametrize("family", sorted(STATIC))
def test_static_engine_equals_transformers_forward(family):
    """The static engine's prefill, plain steps and tree step give transformers' logits (fp32), and its
    compacted cache the same entries as the transformers cache compacted alike."""
    static = make_peaky(family_target(family))
    reference = make_peaky(TargetModel(family_model(family), None, family, engine="hf"))
    assert static.engine is not None and reference.engine is None
    prompt = random_prompt(static, 3 * WINDOW + 1, seed=6)
    ours, theirs = static.prefill(prompt[None]), reference.prefill(prompt[None])
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4)
    p = prompt.numel()
    for i in range(3):
        token, position = prompt[None, i:i + 1], torch.tensor([[p + i]])
        ours = static.forward(token, position, ours.cache)
        theirs = reference.forward(token, position, theirs.cache)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4)
    tree = build_tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3], prefix_len=p + 3)
    ours, theirs = run_tree(static, tree, ours.cache), run_tree(reference, tree, theirs.cache)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4)
    keep = torch.tensor([0, 1, 3])
    compact_cache(ours.cache, p + 3, keep)
    compact_cache(theirs.cache, p + 3, keep)
    for (k, v), (rk, rv) in zip(_layer_kv(ours.cache), _layer_kv(theirs.cache), strict=True):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)


def test_static_engine_is_refused_where_it_cannot_run():
    with pytest.raises(TargetLoadError, match=r"engine=static, but family 'gemma2'"):
        TargetModel(family_model("gemma2"), None, "gemma", engine="static")


def test_sliding_window_cache_is_refused_by_crop_and_compact():
    target = family_target("mistral")
    cache = DynamicCache(config=target.config)
    target.prefill(random_prompt(target, 3 * WINDOW, seed=0)[None], cache)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    with pytest.raises(ValueError, match="cache layer 0 is a DynamicSlidingWindowLayer"):
        compact_cache(cache, 3 * WINDOW - 4, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="full-history DynamicLayer"):
        crop_cache(cache, 5)


def test_unsupported_families_are_refused():
    model = family_model("qwen2.5")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(TargetLoadError, match=r"\(qwen2\) has 'linear_attention' layers \(layer 1\)"):
        TargetModel(model, None, "mixed-qwen")
    model = family_model("mistral")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(TargetLoadError, match=r"\(mistral\) mixes sliding and full attention layers"):
        TargetModel(model, None, "mixed-mistral")
    model = family_model("gemma3-nocap")
    model.config.use_bidirectional_attention = True
    with pytest.raises(TargetLoadError, match="bidirectional"):
        TargetModel(model, None, "bidirectional-gemma3")
    model = family_model("llama3")
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    model.config.final_logit_softcapping = 3.0
    with pytest.raises(TargetLoadError, match=r"'capped-llama' \(llama\): its logits are not lm_head\(hidden\)"):
        TargetModel(model, None, "capped-llama")
