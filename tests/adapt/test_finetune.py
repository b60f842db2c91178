"""``taps adapt`` end to end on a tiny random target: requests served with capture on become the traffic
folder; the new version starts from the source drafter's weights and vocabulary, trains on traffic and
the source's original datasets at the traffic share, and records tau before / after per domain in its
``config.json`` and model card. ``--new`` is plain ``taps train`` on a ``{kind: features, path: <capture
folder>}`` dataset: the captured folder is trained on as it is. Bad inputs are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from taps_ray import cli
from taps_ray.adapt.finetune import AdaptError, gate_domains, model_card, run_adapt
from taps_ray.config import ConfigError, load_config
from taps_ray.config_serve import CaptureConfig
from taps_ray.data.capture import TRAFFIC
from taps_ray.data.contamination import TRAINED_PROMPTS, prompt_hash
from taps_ray.models.drafter import DraftHead
from tests.data.test_capture import decode, make_verifier
from tests.spec.spec_helpers import oracle_drafter
from tests.train.train_helpers import HIDDEN, VOCAB, drafter_tensors, tiny_experiment, write_features

CAPTURED = 26  # 6 held out (train.heldout_rows), 20 in the traffic pool


def captured_prompts() -> list[list[int]]:
    return [torch.randint(2, VOCAB, (6 + i % 5,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(CAPTURED)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Config (math and chat features), target, a source drafter recording both datasets and a 48-token
    vocabulary, and a traffic folder of requests served with capture on."""
    tmp = tmp_path_factory.mktemp("adapt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAPS_CACHE", str(tmp / "cache"))
        path, target = tiny_experiment(tmp, [{"name": "unused", "mixture": "math-only"}])
        source = tmp / "source"
        d2t = torch.tensor(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:48].tolist()))
        DraftHead(target.config, draft_to_target=d2t, seed=5).save(
            source, target.fingerprint, extra={"algorithm": "eagle2", "data": {"math": {}, "chat": {}}})
        capture = CaptureConfig(enabled=True, dir=str(tmp / "traffic"), rows_per_shard=8, mode="all")
        verifier = make_verifier(target, {"a": oracle_drafter(target)}, capture)
        for prompt in captured_prompts():
            decode(verifier, prompt)
        verifier.capture.flush()
        yield path, target, source, tmp / "traffic", tmp
        verifier.pool.shutdown()


def test_adapt_fine_tunes_the_source_at_the_traffic_share_then_trains_a_new_drafter_on_the_captured_folder(
        setup, ray_session, monkeypatch):
    path, target, source, traffic, tmp = setup
    monkeypatch.setenv("TAPS_CACHE", str(tmp / "cache"))
    # a learning rate of 1e-9 keeps the weights where training started: they must be the source's
    cfg = load_config(path, ["train.lr=1e-9", "train.epochs=1"])
    # the source as a relative path: the Train worker runs in another working directory, so the driver
    # must hand it an absolute one
    monkeypatch.chdir(source.parent)
    result = run_adapt(cfg, traffic, source.name, share=0.5, out=tmp / "v1")
    assert result.version == 1 and result.out == tmp / "v1"
    folder = cfg.run_dir / "drafters" / "adapt-v1"
    meta = json.loads((folder / "config.json").read_text())
    absolute = str(source.resolve())
    assert meta["version"] == 1 and meta["parent"] == absolute and meta["init_from"] == absolute
    record = meta["adapt"]
    # pools: traffic 20, math 30, chat 30; share 0.5 -> all 20 traffic rows, 10 + 10 original rows
    assert record["rows"] == {"chat": 10, "math": 10, TRAFFIC: 20} and record["traffic_rows"] == 20
    assert record["traffic_rows_captured"] == CAPTURED and record["traffic_share"] == 0.5
    assert meta["mixture"]["counts"] == record["rows"]
    assert set(record["tau"]) == {TRAFFIC, "math", "chat"} and record["guarded"] == []
    for tau in record["tau"].values():
        assert tau["after"] == pytest.approx(tau["before"], abs=1e-3)
    new, old = drafter_tensors(folder), drafter_tensors(source)
    assert set(new) == set(old)
    for name in old:
        np.testing.assert_allclose(new[name], old[name], atol=1e-6, err_msg=name)
    loaded = DraftHead.load(result.out, target.config, target.fingerprint)
    src = DraftHead.load(source, target.config, target.fingerprint)
    assert torch.equal(loaded.draft_to_target, src.draft_to_target)
    card = (result.out / "README.md").read_text()
    assert "adapt-v1 (version 1)" in card and "traffic rows used: 20 (share 0.5)" in card
    assert "| traffic |" in card and "| math |" in card and "simulated tau" in card
    assert json.loads((result.out / "config.json").read_text())["adapt"] == record

    # the next version of the same run folder; --new: a fresh specialist on traffic only, through the CLI:
    # plain `taps train` on the dataset {kind: features, path: <capture folder>}, the folder as it is
    assert cli.main(["adapt", str(path), "--traffic", str(traffic), "--drafter", str(folder), "--new",
                     "train.epochs=1"]) == 0
    second_dir = cfg.run_dir / "drafters" / "adapt-v2"
    second = json.loads((second_dir / "config.json").read_text())
    assert second["version"] == 2 and second["parent"] == str(folder) and "init_from" not in second
    assert second["adapt"]["rows"] == {TRAFFIC: 20} and second["adapt"]["new"] is True
    assert second["mixture"]["counts"] == {TRAFFIC: 20} and second["data"][TRAFFIC]["features"] == str(traffic)
    DraftHead.load(second_dir, target.config, target.fingerprint)
    trained = json.loads((second_dir / TRAINED_PROMPTS).read_text())
    assert trained["sha256"] and set(trained["sha256"]) <= {prompt_hash(target.tokenizer.decode(p))
                                                            for p in captured_prompts()}
    assert not np.allclose(drafter_tensors(second_dir)["fc.weight"], new["fc.weight"])


def test_the_gate_guards_every_prepared_domain_not_only_the_drafters_own():
    """A chat drafter adapted beside a served math drafter: the tau record covers the traffic, chat, and
    math too (guarded), and not a dataset without prepared features."""
    prepared = {"math": object(), TRAFFIC: object(), "chat": object()}
    assert gate_domains(["chat", "code"], prepared) == [TRAFFIC, "chat", "math"]
    assert gate_domains([], {TRAFFIC: object()}) == [TRAFFIC]
    record = {"new": False, "traffic": "t", "traffic_rows_captured": 40, "heldout_rows": 8, "traffic_rows": 32,
              "traffic_share": 0.5, "rows": {TRAFFIC: 32, "chat": 32}, "guarded": ["math"], "tau_kind": "sim",
              "tau": {TRAFFIC: {"before": 1.5, "after": 1.9}, "chat": {"before": 1.6, "after": 1.6},
                      "math": {"before": 2.0, "after": 1.8}}}
    card = model_card("adapt-v1", 1, "src", record, {"algorithm": "eagle2"})
    assert "| math (guarded: not a training set) | 2.000 | 1.800 |" in card and "| chat | 1.600 | 1.600 |" in card


@pytest.mark.slow
def test_bad_inputs_are_clear_errors(setup, monkeypatch, capsys):
    path, target, source, traffic, tmp = setup
    monkeypatch.setenv("TAPS_CACHE", str(tmp / "cache"))
    cfg = load_config(path)
    with pytest.raises(AdaptError, match=r"traffic folder .*nowhere.* does not exist"):
        run_adapt(cfg, tmp / "nowhere", str(source), target=target)
    for share in (-0.1, 1.5):
        with pytest.raises(AdaptError, match=rf"traffic share must be in \[0, 1\].*got {share}"):
            run_adapt(cfg, traffic, str(source), share=share, target=target)
    with pytest.raises(AdaptError, match="--new trains on the traffic only; a traffic share of 0.5 does not apply"):
        run_adapt(cfg, traffic, str(source), share=0.5, new=True, target=target)
    with pytest.raises(ConfigError, match="adapt.traffic_share"):
        load_config(path, ["adapt.traffic_share=2"])
    from tests.conftest import make_tiny_target

    other = make_tiny_target(8, vocab_size=VOCAB, hidden_size=HIDDEN)
    other_cfg = load_config(path, ["name=other"])
    foreign = write_features(other_cfg, other, "math", 10, seed=3, token_range=(2, 70))
    with pytest.raises(AdaptError, match="computed for target"):
        run_adapt(cfg, foreign, str(source), target=target)
    with pytest.raises(AdaptError, match="has 26 row.*needs more than 40"):
        run_adapt(load_config(path, ["train.heldout_rows=40"]), traffic, str(source), target=target)
    with pytest.raises(AdaptError, match="--drafter: .*does not exist"):
        run_adapt(cfg, traffic, str(tmp / "no-drafter"), target=target)
    assert cli.main(["adapt", str(path), "--traffic", str(tmp / "nowhere"), "--drafter", str(source)]) == 2
    assert "taps adapt: error: traffic folder" in capsys.readouterr().err


def test_the_adapt_sweep_spec_varies_the_traffic_share_of_a_fine_tuning(tmp_path):
    """tune/adapt.yaml: each trial's mixture is ``ratio`` traffic to ``1 - ratio`` original rows, starting
    from the spec's drafter (what ``taps adapt --traffic-share`` trains)."""
    from taps_ray.config import ExperimentConfig
    from taps_ray.sweeps.config import load_spec
    from taps_ray.sweeps.mixture import trial_variant

    spec = load_spec("tune/adapt.yaml")
    assert spec.mixture.datasets[0] == TRAFFIC and spec.search["ratio"].probes()
    cfg = ExperimentConfig.model_validate({"data": {"datasets": {
        TRAFFIC: {"domain": TRAFFIC, "alternatives": [{"kind": "features", "path": str(tmp_path / "cap")}]},
        "math": {"domain": "math", "alternatives": [{"kind": "jsonl", "path": "/missing/math.jsonl"}]}}}})
    trial_cfg, variant = trial_variant(spec, cfg, {"ratio": 0.25})
    assert trial_cfg.mixtures[variant.mixture].ratio == {TRAFFIC: 0.25, "math": 0.75}
    assert trial_cfg.variant_train(variant).init_from == "release:math"


class InProcessDrafter:
    """A :class:`~taps_ray.adapt.watch.PromotionTarget` over the in-process verifier's drafter ``a``: a swap
    loads the checkpoint into its drafting sessions, as a Drafter replica's ``reconfigure`` does."""

    def __init__(self, verifier, target, checkpoint: str):
        self.sessions, self.target = verifier.clients["a"].replicas[0], target
        self.checkpoint, self.promoted, self.swaps = checkpoint, None, []

    def serving(self) -> str:
        return self.checkpoint

    def swap(self, checkpoint: str) -> None:
        self.sessions.swap(DraftHead.load(checkpoint, self.target.config, self.target.fingerprint))
        self.checkpoint = self.promoted = checkpoint
        self.swaps.append(checkpoint)

    def reconcile(self) -> int:
        if self.promoted is None or self.checkpoint == self.promoted:
            return 0
        self.swap(self.promoted)
        return 1


def test_the_watch_loop_adapts_every_n_captured_requests_promotes_through_the_gate_and_resumes_from_its_log(
        setup, ray_session, monkeypatch):
    """Round 1 (26 captured, every 20): the serving source is fine-tuned and promoted (its traffic tau
    rises; the margin is wide). 20 more requests are served with it, their outputs unchanged. A restarted
    loop serves the promoted version again (a replica restarted from the configured checkpoint is moved back),
    and round 2, from that version, is kept aside by a gain it cannot reach; with no new requests no round
    is due."""
    from taps_ray.adapt.promote import PromotionLog
    from taps_ray.adapt.watch import PROMOTION_FILE, Watch
    from taps_ray.data.capture import captured_requests

    path, target, source, traffic, tmp = setup
    monkeypatch.setenv("TAPS_CACHE", str(tmp / "cache"))
    loop = ["adapt.every=20", "adapt.rounds=1", "adapt.poll_s=0.01", "train.epochs=3", "train.lr=3e-3"]
    cfg = load_config(path, [*loop, "adapt.margin=100"])
    verifier = make_verifier(target, {"a": oracle_drafter(target)}, CaptureConfig(
        enabled=True, dir=str(traffic), rows_per_shard=10, mode="all"))
    served = InProcessDrafter(verifier, target, str(source))
    assert captured_requests(traffic) == (CAPTURED, CAPTURED)

    first = Watch(cfg, "a", served, traffic, target=target).run()
    assert len(first) == 1 and first[0].captured == CAPTURED and first[0].parent == str(source)
    gain = first[0].tau[TRAFFIC]["after"] - first[0].tau[TRAFFIC]["before"]
    assert gain > 0.05, first[0].tau
    assert first[0].promoted and served.swaps == [first[0].checkpoint]
    promoted = first[0].checkpoint
    assert json.loads((Path(promoted) / PROMOTION_FILE).read_text())["reason"] == first[0].reason

    prompts = [torch.randint(2, VOCAB, (7,), generator=torch.Generator().manual_seed(100 + i)).tolist()
               for i in range(20)]
    plain = make_verifier(target, {"a": oracle_drafter(target)}, None)  # the drafter of before the promotion
    expected = [(d["text"], d["usage"]) for d in (decode(plain, p) for p in prompts[:4])]
    served_now = [decode(verifier, prompt) for prompt in prompts]
    assert [(d["text"], d["usage"]) for d in served_now[:4]] == expected
    verifier.capture.flush()
    assert captured_requests(traffic)[0] == CAPTURED + 20
    plain.pool.shutdown()

    served.checkpoint = str(source)  # the replica came back from its configured checkpoint
    restarted = Watch(load_config(path, [*loop, "adapt.min_gain=1000"]), "a", served, traffic, target=target)
    assert served.promoted == promoted and restarted.baseline == CAPTURED
    second = restarted.run()
    assert served.checkpoint == promoted and served.swaps == [promoted, promoted]
    assert len(second) == 1 and second[0].parent == promoted and not second[0].promoted
    assert "is not above +1000.000" in second[0].reason and second[0].captured == CAPTURED + 20
    assert [e["version"] for e in PromotionLog(cfg.run_dir).entries()] == [first[0].version, second[0].version]
    assert PromotionLog(cfg.run_dir).last_promoted("a") == promoted
    assert restarted.due() is None
    verifier.pool.shutdown()


def test_an_eagle3_source_adapts_on_traffic_whose_eagle3_layers_are_recomputed(tmp_path, ray_session, monkeypatch):
    """Serving captures the last hidden state alone; adapting an EAGLE-3 drafter recomputes the three EAGLE-3
    layers and the last for every captured row in a copy it deletes afterwards (the capture folder is left as it
    was), fine-tunes from the source on it and the source's own eagle3 feature sets, and scores before / after."""
    from taps_ray.data.capture import with_feature_layers
    from taps_ray.data.feature_sets import open_feature_set
    from taps_ray.models.eagle3 import Eagle3Head, aux_layers

    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache"))
    path, target = tiny_experiment(tmp_path, [{"name": "unused", "mixture": "math-only"}], layers=6)
    eagle3_cfg = load_config(path, ["data.features.layers=eagle3"])
    write_features(eagle3_cfg, target, "math", 36, seed=1, token_range=(2, 70))
    write_features(eagle3_cfg, target, "chat", 36, seed=2, token_range=(40, VOCAB))
    source = tmp_path / "source"
    Eagle3Head(target.config, seed=5).save(source, target.fingerprint, extra={
        "algorithm": "eagle3", "data": {"math": {}, "chat": {}}, "objective": {"ttt_steps": 2}})
    traffic = tmp_path / "traffic"
    verifier = make_verifier(target, {"a": oracle_drafter(target)},
                             CaptureConfig(enabled=True, dir=str(traffic), rows_per_shard=8, mode="all"))
    for prompt in captured_prompts():
        decode(verifier, prompt)
    verifier.capture.flush()
    verifier.pool.shutdown()
    shards = {p.name: p.read_bytes() for p in traffic.glob("*.parquet")}

    layers = [i + 1 for i in aux_layers(6)] + [6]
    copy = with_feature_layers(traffic, tmp_path / "layered", target, "eagle3")
    layered = open_feature_set(copy, target.fingerprint.to_dict(), TRAFFIC)
    assert layered.layers == layers and layered.rows == CAPTURED
    import pyarrow.parquet as pq

    from taps_ray.data.feature_sets import decode_row
    row = pq.read_table(layered.shard_paths()).to_pylist()[0]
    decoded = decode_row(row, HIDDEN, 4)
    expected = target.hidden_states(decoded["input_ids"][None], layers=tuple(layers))[0].to(torch.bfloat16)
    assert torch.equal(decoded["hidden"], expected)
    assert {p.name: p.read_bytes() for p in traffic.glob("*.parquet")} == shards

    cfg = load_config(path, ["train.epochs=1"])
    result = run_adapt(cfg, traffic, str(source), share=0.5)
    meta = json.loads((result.out / "config.json").read_text())
    assert meta["algorithm"] == "eagle3" and meta["objective"]["ttt_steps"] == 2
    assert meta["init_from"] == str(source) and meta["adapt"]["rows"] == {"chat": 10, "math": 10, TRAFFIC: 20}
    assert "EAGLE-3 layers" in meta["adapt"]["traffic_layers"]
    assert set(meta["adapt"]["tau"]) == {TRAFFIC, "math", "chat"}
    assert all(t["before"] > 0 and t["after"] > 0 for t in meta["adapt"]["tau"].values())
    assert isinstance(DraftHead.load(result.out, target.config, target.fingerprint), Eagle3Head)
    assert not (cfg.run_dir / "adapt" / "adapt-v1-traffic").exists()
    assert {p.name: p.read_bytes() for p in traffic.glob("*.parquet")} == shards


def test_a_fresh_specialist_is_an_eagle2_drafter_whatever_the_source(tmp_path):
    from taps_ray.adapt.finetune import adapt_experiment

    cfg = load_config(None, ["data.datasets={math: {domain: math, alternatives: [{kind: gsm8k_test_split}]}}"])
    meta = {"algorithm": "eagle3", "data": ["math"], "objective": {"ttt_steps": 2}}
    _, variant = adapt_experiment(cfg, tmp_path, "runs/x/drafters/e3", meta, 0.5, False, 1)
    assert variant.algorithm == "eagle3" and variant.objective_config().ttt_steps == 2
    _, variant = adapt_experiment(cfg, tmp_path, "runs/x/drafters/e3", meta, 1.0, True, 1)
    assert variant.algorithm == "eagle2"
