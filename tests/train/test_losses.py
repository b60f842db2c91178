"""EAGLE-2 / HASS objectives and held-out metrics against direct computations on tiny models."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from taps_ray.models.drafter import DraftHead
from taps_ray.train.losses import (
    ObjectiveConfig,
    chain_scored,
    distillation_terms,
    drafter_loss,
    drafter_passes,
    harmonized_mask,
    smooth_l1,
)
from taps_ray.train.metrics import simulated_tau, unrolled_accuracy, unrolled_counts
from tests.conftest import make_tiny_target

T = 20
LENGTHS = (20, 15, 11)
SPANS = (((5, 17),), ((3, 8), (10, 15)), ((2, 9),))


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(3, vocab_size=128, hidden_size=32)


@pytest.fixture(scope="module")
def batch(target):
    """Right-padded rows with assistant spans (one row has two turns, one ends in non-assistant tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, target.vocab_size, (len(LENGTHS), T), generator=g)
    attn = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    loss_mask = torch.zeros(len(LENGTHS), T)
    for b, (length, spans) in enumerate(zip(LENGTHS, SPANS)):
        attn[b, :length] = 1
        ids[b, length:] = 0
        for lo, hi in spans:
            loss_mask[b, lo:hi] = 1
    hidden = target.hidden_states(ids, attn).clone()
    return {"input_ids": ids, "hidden": hidden, "loss_mask": loss_mask, "attention_mask": attn}


def head_and_embed(target):
    return target.lm_head.weight, target.embed_tokens


def drafter_for(target, seed=1):
    head = DraftHead(target.config, seed=seed)
    with torch.no_grad():
        head.fc.weight.mul_(20.0)
    return head


def scored_positions(batch):
    ids, lm, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    return [(b, i) for b in range(ids.shape[0]) for i in range(ids.shape[1] - 1)
            if am[b, i + 1] and lm[b, i + 1]]


def full_pass(drafter, batch, embed, features=None):
    ids, hidden = batch["input_ids"], batch["hidden"]
    feats = hidden[:, :-1] if features is None else features
    n = ids.shape[1] - 1
    return drafter(embed(ids[:, 1:]), feats, torch.arange(n).expand(ids.shape[0], n))


def direct_terms(out, batch, head, positions, k=10):
    """Means over ``positions`` of SmoothL1, soft CE and top-K distillation, one position at a time."""
    feats, ces, tops = [], [], []
    for b, i in positions:
        target = batch["hidden"][b, i + 1]
        d = out[b, i] - target
        feats.append(torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean())
        p = torch.softmax(head @ target, -1)
        log_q = torch.log_softmax(head @ out[b, i], -1)
        ces.append(-(p * log_q).sum())
        top = p.topk(k)
        tops.append(-(top.values * log_q[top.indices]).sum())
    mean = lambda xs: float(torch.stack(xs).mean())  # noqa: E731
    return mean(feats), mean(ces), mean(tops)


def chain_reference(drafter, embeds, feats, t, k):
    """Depth-k tree state, run position by position: target features up to t-k+1, then own features."""
    n = feats.shape[1]
    pos = torch.arange(n).view(1, n)
    r = t - k + 1
    cache = drafter.new_cache()
    f = drafter(embeds[:, : r + 1], feats[:, : r + 1], pos[:, : r + 1], cache=cache)[:, -1:]
    for s in range(r + 1, t + 1):
        f = drafter(embeds[:, s : s + 1], f, pos[:, s : s + 1], cache=cache)
    return f[0, -1]


def test_config_validation():
    assert ObjectiveConfig().passes == 1
    assert ObjectiveConfig(algorithm="hass").passes == 3
    with pytest.raises(ValidationError):
        ObjectiveConfig(unknown=1)
    with pytest.raises(ValidationError):
        ObjectiveConfig(noise="laplace")
    with pytest.raises(ValidationError):
        ObjectiveConfig(hass_passes=0)


def test_smooth_l1_matches_torch_definition():
    pred, target = torch.randn(5, 7) * 2, torch.randn(5, 7)
    d = pred - target
    expected = torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean(-1)
    torch.testing.assert_close(smooth_l1(pred, target), expected)


def test_distillation_terms_values_and_closed_form_gradient():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 11, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(6, 11, dtype=torch.float64, generator=g) * 3, -1)
    ce, topk = distillation_terms(z, p, topk=3)
    log_q = torch.log_softmax(z, -1)
    top = p.topk(3)
    torch.testing.assert_close(ce, -(p * log_q).sum(-1))
    torch.testing.assert_close(topk, -(top.values * log_q.gather(-1, top.indices)).sum(-1))
    assert torch.autograd.gradcheck(lambda x: distillation_terms(x, p, 3), (z,))
    assert torch.equal(distillation_terms(z, p, 0)[1], torch.zeros(6, dtype=torch.float64))


def test_chain_scored_and_mask_pattern():
    scored = torch.tensor([[0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert chain_scored(scored, 1).tolist() == scored.tolist()
    assert chain_scored(scored, 2).int().tolist() == [[0, 0, 1, 1, 0, 0, 1]]
    assert chain_scored(scored, 3).int().tolist() == [[0, 0, 0, 1, 0, 0, 0]]
    allowed = harmonized_mask(4, 2, torch.float32, torch.device("cpu"))[0, 0] == 0
    expected = [[0, 0, 0, 0, 1, 0, 0, 0],
                [1, 0, 0, 0, 0, 1, 0, 0],
                [1, 1, 0, 0, 0, 0, 1, 0],
                [1, 1, 1, 0, 0, 0, 0, 1]]
    assert allowed.int().tolist() == expected
    allowed3 = harmonized_mask(4, 3, torch.float32, torch.device("cpu"))[0, 0] == 0
    assert allowed3[3].int().tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_eagle2_terms_match_direct_computation(target, batch):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm="eagle2", noise="none")
    out = drafter_loss(drafter, batch, embed, head, cfg)
    positions = scored_positions(batch)
    with torch.no_grad():
        full = full_pass(drafter, batch, embed)
    feature, ce, _ = direct_terms(full, batch, head, positions)
    assert out.tokens == len(positions)
    assert out.parts["feature"] == pytest.approx(feature, rel=1e-5)
    assert out.parts["ce"] == pytest.approx(ce, rel=1e-5)
    assert float(out.total.detach()) == pytest.approx(feature + 0.1 * ce, rel=1e-5)
    assert "topk" not in out.parts
    hits = [int((head @ full[b, i]).argmax() == (head @ batch["hidden"][b, i + 1]).argmax()) for b, i in positions]
    assert out.top1_acc == [pytest.approx(sum(hits) / len(hits))]


def test_noise_applies_to_input_features_only(target, batch):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm="eagle2", noise="uniform", noise_std=0.2)
    out = drafter_loss(drafter, batch, embed, head, cfg, generator=torch.Generator().manual_seed(7))
    inputs = batch["hidden"][:, :-1]
    noise = (torch.rand(inputs.shape, generator=torch.Generator().manual_seed(7)) - 0.5) * 0.2
    assert noise.abs().max() <= 0.1
    with torch.no_grad():
        full = full_pass(drafter, batch, embed, features=inputs + noise)
    feature, ce, _ = direct_terms(full, batch, head, scored_positions(batch))
    assert out.parts["feature"] == pytest.approx(feature, rel=1e-5)
    assert out.parts["ce"] == pytest.approx(ce, rel=1e-5)
    clean = drafter_loss(drafter, batch, embed, head, cfg, add_noise=False)
    assert clean.parts["feature"] != pytest.approx(out.parts["feature"], rel=1e-6)


def test_topk_term_matches_direct_computation(target, batch):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=1, topk=10, topk_weight=0.5, noise="none")
    out = drafter_loss(drafter, batch, embed, head, cfg)
    with torch.no_grad():
        full = full_pass(drafter, batch, embed)
    feature, ce, topk = direct_terms(full, batch, head, scored_positions(batch), k=10)
    assert out.parts["topk"] == pytest.approx(topk, rel=1e-5)
    assert float(out.total.detach()) == pytest.approx(feature + 0.1 * ce + 0.5 * topk, rel=1e-5)


def test_hass_one_pass_without_topk_equals_eagle2(target, batch):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    eagle = drafter_loss(drafter, batch, embed, head, ObjectiveConfig(algorithm="eagle2"),
                         generator=torch.Generator().manual_seed(3))
    hass = drafter_loss(drafter, batch, embed, head,
                        ObjectiveConfig(algorithm="hass", hass_passes=1, topk_weight=0.0),
                        generator=torch.Generator().manual_seed(3))
    assert torch.equal(eagle.total, hass.total)
    assert eagle.top1_acc == hass.top1_acc


@pytest.mark.parametrize("depth", [2, 3])
def test_hass_pass_matches_position_by_position_tree_state(target, batch, depth):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    ids, hidden = batch["input_ids"], batch["hidden"]
    n = ids.shape[1] - 1
    embeds = embed(ids[:, 1:])
    with torch.no_grad():
        outs = drafter_passes(drafter, embeds, hidden[:, :-1], torch.arange(n).expand(ids.shape[0], n), depth)
        for b, length in enumerate(LENGTHS):
            for t in range(depth - 1, length - 1):
                ref = chain_reference(drafter, embeds[b : b + 1], hidden[b : b + 1, :-1], t, depth)
                torch.testing.assert_close(outs[depth - 1][b, t], ref, rtol=1e-4, atol=1e-5)


def test_hass_pass2_loss_scored_against_tree_state(target, batch):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=2, topk_weight=1.0, noise="none")
    out = drafter_loss(drafter, batch, embed, head, cfg)
    ids, hidden = batch["input_ids"], batch["hidden"]
    embeds = embed(ids[:, 1:])
    scored = set(scored_positions(batch))
    chain = [(b, t) for b, t in sorted(scored) if t >= 1 and (b, t - 1) in scored]
    ref = torch.zeros_like(hidden[:, :-1])
    with torch.no_grad():
        for b, t in chain:
            ref[b, t] = chain_reference(drafter, embeds[b : b + 1], hidden[b : b + 1, :-1], t, 2)
    feature, ce, topk = direct_terms(ref, batch, head, chain)
    assert out.parts["pass2/feature"] == pytest.approx(feature, rel=1e-4)
    assert out.parts["pass2/ce"] == pytest.approx(ce, rel=1e-4)
    assert out.parts["pass2/topk"] == pytest.approx(topk, rel=1e-4)
    pass1 = drafter_loss(drafter, batch, embed, head, cfg.model_copy(update={"hass_passes": 1}))
    assert out.parts["pass1/loss"] == pytest.approx(pass1.parts["loss"], rel=1e-6)
    assert float(out.total.detach()) == pytest.approx((out.parts["pass1/loss"] + out.parts["pass2/loss"]) / 2, rel=1e-6)
    assert len(out.top1_acc) == 2


@pytest.mark.parametrize("algorithm", ["eagle2", "hass"])
def test_padding_and_trailing_non_assistant_positions_do_not_matter(target, batch, algorithm):
    head, embed = head_and_embed(target)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm=algorithm, noise="none")
    base = drafter_loss(drafter, batch, embed, head, cfg)
    changed = {k: v.clone() for k, v in batch.items()}
    g = torch.Generator().manual_seed(5)
    pad = changed["attention_mask"] == 0
    changed["hidden"][pad] = torch.randn(int(pad.sum()), changed["hidden"].shape[-1], generator=g) * 5
    changed["input_ids"][pad] = 7
    changed["loss_mask"][pad] = 1.0
    changed["hidden"][0, 17:] = torch.randn(3, changed["hidden"].shape[-1], generator=g) * 5
    changed["input_ids"][0, 17:] = 9
    other = drafter_loss(drafter, changed, embed, head, cfg)
    assert other.tokens == base.tokens
    torch.testing.assert_close(other.total, base.total, rtol=0, atol=1e-6)
    unscored = {k: v.clone() for k, v in batch.items()}
    unscored["loss_mask"][0, 17] = 1.0
    assert drafter_loss(drafter, unscored, embed, head, cfg).tokens == base.tokens + 1


def test_gradients_reach_drafter_only(batch):
    target = make_tiny_target(3, vocab_size=128, hidden_size=32)
    target.embed_tokens.weight.requires_grad_(True)
    target.lm_head.weight.requires_grad_(True)
    drafter = drafter_for(target)
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=3, topk_weight=1.0)
    out = drafter_loss(drafter, batch, target.embed_tokens, target.lm_head.weight, cfg,
                       generator=torch.Generator().manual_seed(0))
    out.total.backward()
    assert target.embed_tokens.weight.grad is None
    assert target.lm_head.weight.grad is None
    for name, param in drafter.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_detach_flag_changes_the_gradient(target, batch):
    head, embed = head_and_embed(target)
    grads = []
    for detach in (True, False):
        drafter = drafter_for(target)
        cfg = ObjectiveConfig(algorithm="hass", hass_passes=2, noise="none", hass_detach=detach)
        drafter_loss(drafter, batch, embed, head, cfg).total.backward()
        grads.append(drafter.fc.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_reduced_vocab_identity_map_matches_full_vocab(target, batch):
    head, embed = head_and_embed(target)
    full = drafter_for(target)
    reduced = DraftHead(target.config, draft_to_target=torch.arange(target.vocab_size), seed=1)
    reduced.load_state_dict(full.state_dict())
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=2, noise="none")
    a = drafter_loss(full, batch, embed, head, cfg)
    b = drafter_loss(reduced, batch, embed, head, cfg)
    torch.testing.assert_close(a.total, b.total)
    assert a.top1_acc == b.top1_acc
    assert unrolled_accuracy(full, batch, embed, head, 2) == unrolled_accuracy(reduced, batch, embed, head, 2)


def test_train_accuracy_of_a_reduced_vocabulary_compares_argmaxes_over_the_draft_vocabulary(target, batch):
    """The training acc1 needs no full-vocabulary product: drafter and target argmax over the draft ids."""
    head, embed = head_and_embed(target)
    draft_ids = torch.arange(0, target.vocab_size, 2)
    drafter = DraftHead(target.config, draft_to_target=draft_ids, seed=1)
    drafter.load_state_dict(drafter_for(target).state_dict(), strict=False)
    hidden = batch["hidden"].clone()
    with torch.no_grad():
        for i in range(0, T - 1, 2):  # every other target feature is the drafter's own prediction: a hit
            hidden[:, i + 1] = full_pass(drafter, {**batch, "hidden": hidden}, embed)[:, i]
        full = full_pass(drafter, {**batch, "hidden": hidden}, embed)
    batch = {**batch, "hidden": hidden}
    out = drafter_loss(drafter, batch, embed, head, ObjectiveConfig(algorithm="eagle2", noise="none"))
    sub = head[draft_ids]
    hits = [int((sub @ full[b, i]).argmax() == (sub @ batch["hidden"][b, i + 1]).argmax())
            for b, i in scored_positions(batch)]
    assert 0 < sum(hits) < len(hits)
    assert out.top1_acc == [pytest.approx(sum(hits) / len(hits))]


def test_simulated_tau():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.4)
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.0, 1.0]) == 1.0
    assert simulated_tau([0.9, 0.8, 0.5, 0.5]) == pytest.approx(1 + 0.9 + 0.72 + 0.36 + 0.18)


def test_unrolled_accuracy_is_one_for_a_self_consistent_sequence(target):
    """Oracle: features generated by the drafter itself, so every unrolled state reproduces them."""
    head, embed = head_and_embed(target)
    drafter = drafter_for(target, seed=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, target.vocab_size, (1, 14), generator=g)
    hidden = torch.zeros(1, 14, target.hidden_size)
    hidden[0, 0] = torch.randn(target.hidden_size, generator=g)
    with torch.no_grad():
        for i in range(13):
            pos = torch.arange(i + 1).view(1, -1)
            hidden[0, i + 1] = drafter(embed(ids[:, 1 : i + 2]), hidden[:, : i + 1], pos)[0, -1]
    batch = {"input_ids": ids, "hidden": hidden, "loss_mask": torch.ones(1, 14),
             "attention_mask": torch.ones(1, 14, dtype=torch.long)}
    assert unrolled_accuracy(drafter, batch, embed, head, 4) == [1.0, 1.0, 1.0, 1.0]
    assert unrolled_counts(drafter, batch, embed, head, 4)[1] == [13, 12, 11, 10]


@pytest.fixture(scope="module")
def trained(target, batch):
    """A drafter fitted to ``batch`` with HASS (n=2), and its first and last losses."""
    head, embed = head_and_embed(target)
    drafter = drafter_for(target, seed=2)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95))
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=2, topk_weight=1.0)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        out = drafter_loss(drafter, batch, embed, head, cfg, generator=g)
        opt.zero_grad()
        out.total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        losses.append(out.parts["loss"])
    return drafter, losses


def test_training_reduces_the_loss(trained):
    _, losses = trained
    assert losses[-1] < 0.5 * losses[0]


def test_unrolled_accuracy_matches_direct_loops(target, batch, trained):
    head, embed = head_and_embed(target)
    drafter = trained[0]
    correct, total = unrolled_counts(drafter, batch, embed, head, 2)
    ids, hidden = batch["input_ids"], batch["hidden"]
    embeds = embed(ids[:, 1:])
    scored = set(scored_positions(batch))
    hits = {1: [], 2: []}
    with torch.no_grad():
        for b, i in sorted(scored):
            pos = torch.arange(i + 1).view(1, -1)
            f = drafter(embeds[b : b + 1, : i + 1], hidden[b : b + 1, : i + 1], pos)[0, -1]
            truth = (head @ hidden[b, i + 1]).argmax()
            hits[1].append(int((head @ f).argmax() == truth))
            if (b, i - 1) in scored:
                f2 = chain_reference(drafter, embeds[b : b + 1], hidden[b : b + 1, :-1], i, 2)
                hits[2].append(int((head @ f2).argmax() == truth))
    assert total == [len(hits[1]), len(hits[2])]
    assert correct == [sum(hits[1]), sum(hits[2])]
    acc = unrolled_accuracy(drafter, batch, embed, head, 2)
    assert acc == [sum(hits[1]) / len(hits[1]), sum(hits[2]) / len(hits[2])]
    assert all(0 < a < 1 for a in acc)


def test_ddp_wrapped_drafter_matches_plain(target, batch, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    head, embed = head_and_embed(target)
    cfg = ObjectiveConfig(algorithm="hass", hass_passes=3, noise="none")
    plain = drafter_for(target)
    ref = drafter_loss(plain, batch, embed, head, cfg)
    ref.total.backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(drafter_for(target))
        out = drafter_loss(ddp, batch, embed, head, cfg)
        out.total.backward()
        assert unrolled_accuracy(ddp, batch, embed, head, 2) == unrolled_accuracy(plain, batch, embed, head, 2)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(out.total, ref.total)
    for (name, a), b in zip(ddp.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.fixture(scope="module")
def deep():
    """A peaky target deep enough for an EAGLE-3 drafter (8 layers: it reads hidden states 2, 4 and 5)."""
    from tests.spec.spec_helpers import make_peaky

    return make_peaky(make_tiny_target(3, vocab_size=128, hidden_size=32, layers=8), 3)


@pytest.fixture(scope="module")
def eagle3_batch(deep, batch):
    """``batch``'s rows with EAGLE-3 features: hidden states 2, 4, 5 and the last one (8), [B, T, 4H]."""
    hidden = deep.hidden_states(batch["input_ids"], batch["attention_mask"], layers=(2, 4, 5, 8)).clone()
    return {**batch, "hidden": hidden}


def eagle3_for(target, seed=1):
    from taps_ray.models.eagle3 import Eagle3Head

    return Eagle3Head(target.config, seed=seed)


def test_eagle3_config_unrolls_ttt_steps():
    assert ObjectiveConfig(algorithm="eagle3").passes == 3
    assert ObjectiveConfig(algorithm="eagle3", ttt_steps=5).passes == 5
    assert ObjectiveConfig(algorithm="hass", ttt_steps=5).passes == 3
    with pytest.raises(ValidationError):
        ObjectiveConfig(algorithm="eagle3", ttt_steps=0)


@pytest.mark.parametrize("depth", [2, 3])
def test_eagle3_unrolled_step_matches_the_tree_state_on_fused_layers(deep, eagle3_batch, depth):
    """Step k of training-time test is the drafter at depth k of a tree: fc of the three target layers up to
    t - k + 1, then its own pre-norm outputs."""
    embed = deep.embed_tokens
    drafter = eagle3_for(deep)
    ids, hidden = eagle3_batch["input_ids"], eagle3_batch["hidden"]
    n = ids.shape[1] - 1
    embeds = embed(ids[:, 1:])
    features = hidden[:, :-1, :96]
    with torch.no_grad():
        outs = drafter_passes(drafter, embeds, features, torch.arange(n).expand(ids.shape[0], n), depth)
        fused = drafter.fuse(features)
        for b, length in enumerate(LENGTHS):
            for t in range(depth - 1, length - 1):
                ref = chain_reference(drafter, embeds[b : b + 1], fused[b : b + 1], t, depth)
                torch.testing.assert_close(outs[depth - 1][b, t], ref, rtol=1e-4, atol=1e-5)


def test_eagle3_loss_is_the_soft_ce_at_every_step_without_feature_regression_or_noise(deep, eagle3_batch):
    head, embed = deep.lm_head.weight, deep.embed_tokens
    drafter = eagle3_for(deep)
    cfg = ObjectiveConfig(algorithm="eagle3", ttt_steps=2)
    out = drafter_loss(drafter, eagle3_batch, embed, head, cfg, generator=torch.Generator().manual_seed(0))
    assert set(out.parts) == {"loss", "ce", "pass1/loss", "pass1/ce", "pass2/loss", "pass2/ce"}
    quiet = drafter_loss(drafter, eagle3_batch, embed, head, cfg.model_copy(update={"noise": "none"}))
    assert torch.equal(out.total, quiet.total), "EAGLE-3 adds no input noise"
    ids, hidden = eagle3_batch["input_ids"], eagle3_batch["hidden"]
    n = ids.shape[1] - 1
    embeds = embed(ids[:, 1:])
    scored = set(scored_positions(eagle3_batch))
    with torch.no_grad():
        outs = drafter_passes(drafter, embeds, hidden[:, :-1, :96], torch.arange(n).expand(ids.shape[0], n), 2)
    for k, positions in ((1, sorted(scored)), (2, [(b, t) for b, t in sorted(scored) if (b, t - 1) in scored])):
        ces = []
        for b, i in positions:
            p = torch.softmax(head @ hidden[b, i + 1, 96:], -1)
            ces.append(-(p * torch.log_softmax(head @ drafter.norm(outs[k - 1][b, i]), -1)).sum())
        assert out.parts[f"pass{k}/ce"] == pytest.approx(float(torch.stack(ces).mean().detach()), rel=1e-4)
        assert out.parts[f"pass{k}/loss"] == out.parts[f"pass{k}/ce"]
    assert float(out.total.detach()) == pytest.approx((out.parts["pass1/ce"] + out.parts["pass2/ce"]) / 2, rel=1e-6)


def test_eagle3_gradient_flows_through_the_unroll(deep, eagle3_batch):
    """The fed-back outputs are not detached (hass_detach does not apply): the gradient equals that of the
    mean step loss over undetached passes, and differs from the detached one."""
    head, embed = deep.lm_head.weight, deep.embed_tokens
    cfg = ObjectiveConfig(algorithm="eagle3", ttt_steps=2)
    grads = []
    for detach_flag in (True, False):
        drafter = eagle3_for(deep)
        drafter_loss(drafter, eagle3_batch, embed, head, cfg.model_copy(update={"hass_detach": detach_flag})
                     ).total.backward()
        grads.append(drafter.fc.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    ids, hidden = eagle3_batch["input_ids"], eagle3_batch["hidden"]
    n = ids.shape[1] - 1
    scored = torch.tensor([[(b, i) in set(scored_positions(eagle3_batch)) for i in range(n)] for b in range(len(ids))])
    head = head.detach()
    p = torch.softmax(hidden[:, 1:, 96:] @ head.T, -1)[scored]
    for detach, equal in ((False, True), (True, False)):
        drafter = eagle3_for(deep)
        outs = drafter_passes(drafter, embed(ids[:, 1:]), hidden[:, :-1, :96],
                              torch.arange(n).expand(len(ids), n), 2, detach=detach)
        losses = []
        for k, out in enumerate(outs, start=1):
            weight = chain_scored(scored, k)[scored].float()
            ce = -(p * torch.log_softmax(drafter.logits(out[scored], head), -1)).sum(-1)
            losses.append((ce * weight).sum() / weight.sum())
        torch.stack(losses).mean().backward()
        assert torch.allclose(drafter.fc.weight.grad, grads[0], rtol=1e-4, atol=1e-6) == equal


def test_eagle3_needs_the_three_layers_and_the_last(deep, batch):
    deep_last = {**batch, "hidden": deep.hidden_states(batch["input_ids"], batch["attention_mask"])}
    with pytest.raises(ValueError, match="a eagle3 drafter trains on 4 hidden state"):
        drafter_loss(eagle3_for(deep), deep_last, deep.embed_tokens, deep.lm_head.weight,
                     ObjectiveConfig(algorithm="eagle3"))


def test_eagle3_training_raises_held_out_accuracy(deep, eagle3_batch):
    head, embed = deep.lm_head.weight, deep.embed_tokens
    drafter = eagle3_for(deep)
    cfg = ObjectiveConfig(algorithm="eagle3")
    before = drafter_loss(drafter, eagle3_batch, embed, head, cfg).parts["loss"]
    acc_before = unrolled_accuracy(drafter, eagle3_batch, embed, head, 3)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(40):
        optimizer.zero_grad()
        drafter_loss(drafter, eagle3_batch, embed, head, cfg).total.backward()
        optimizer.step()
    assert drafter_loss(drafter, eagle3_batch, embed, head, cfg).parts["loss"] < before - 0.5
    acc = unrolled_accuracy(drafter, eagle3_batch, embed, head, 3)
    assert sum(acc) > sum(acc_before) + 0.5 and simulated_tau(acc) > 1.5
