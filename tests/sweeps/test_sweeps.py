"""``taps sweep`` on a tiny random target with features written straight into the cache.

One mixture sweep (2 trials, 6 Ray Train steps each, ASHA on the per-epoch simulated tau) trains the
drafters that an interpolation sweep then averages with a fresh drafter: it is interrupted after its
first trial, resumed through the CLI without redoing that trial, and one injected failing trial is
reported as failed while the others finish. Input problems are checked up front, before any trial.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from ray.tune import Callback

from taps_ray import cli
from taps_ray.config import load_config
from taps_ray.models.drafter import DraftHead
from taps_ray.runtime.faults import SWEEP_ENV as FAIL_ENV
from taps_ray.runtime.placement import RECORD
from taps_ray.sweeps.config import ObjectiveSpec, SweepError, SweepSpecError, parse_spec
from taps_ray.sweeps.run import run_sweep
from tests.conftest import REPO, make_tiny_target
from tests.train.train_helpers import HIDDEN, VOCAB, drafter_tensors, tiny_experiment

EVAL = {"prompts": {"math": {"source": "heldout", "limit": 2}, "chat": {"source": "heldout", "limit": 2}},
        "max_new_tokens": 8, "tree": {"depth": 2, "top_k": 3, "total_tokens": 6}}
MIXTURE = {
    "name": "mix", "kind": "mixture",
    "mixture": {"datasets": ["math", "chat"], "total": 12, "algorithm": "eagle2",
                "train": {"epochs": 2, "checkpoint_every": 50}},
    "search": {"ratio": [0.0, 1.0]},
    "scheduler": {"kind": "asha", "grace_period": 1, "reduction_factor": 2},
    "eval": EVAL,
    "resources": {"threads": 1},
}
ALPHAS = [1.0, 0.5, 0.0, 0.25]
FAILING = 0.25


def interpolation_spec(drafters: dict[str, str], **extra) -> dict:
    return {"name": "interp", "kind": "interpolation", "drafters": drafters, "search": {"alpha": ALPHAS},
            "eval": EVAL, "resources": {"threads": 1, "max_concurrent_trials": 1}, **extra}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """Tiny target folder, ``math``/``chat`` feature sets (36 rows each, 6 held out) and its config."""
    tmp = tmp_path_factory.mktemp("sweeps")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAPS_CACHE", str(tmp / "cache"))
        path, target = tiny_experiment(tmp, [])
        yield tmp, path, target


@pytest.fixture(scope="module")
def mixture(experiment, ray_session):
    tmp, path, target = experiment
    summary = run_sweep(parse_spec(MIXTURE), load_config(path), tmp / "mix", target=target)
    return summary


def trial_results(summary, trial_id: str) -> list[dict]:
    path = summary.out / "tune" / trial_id / "result.json"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tokens_per_step(target, cfg, drafter_dir: str) -> dict[str, float]:
    """Per domain: tokens the verification steps generated over those steps, when the drafter at
    ``drafter_dir`` decodes the sweep's held-out prompts greedily in this process, counted from the
    outputs (not the step records); each output's first token comes from the prefill, not a step."""
    import torch

    from taps_ray.config import TreeConfig
    from taps_ray.data.feature_sets import load_feature_sets
    from taps_ray.spec.compose import build_strategy
    from taps_ray.spec.decoder import generate
    from taps_ray.sweeps.context import resolve_prompts

    spec = parse_spec(MIXTURE)
    sets = load_feature_sets(cfg, target.fingerprint.to_dict(), {"math", "chat"})
    prompts = resolve_prompts(spec, cfg, target, sets, cfg.train.heldout_rows, cfg.train.heldout_seed)
    head = DraftHead.load(drafter_dir, target.config, target.fingerprint)
    strategy = build_strategy("single", [head], TreeConfig(**{**EVAL["tree"], "adaptive": False}))  # as trials measure
    rates = {}
    for domain, items in prompts.items():
        outputs = [generate(target, torch.tensor(ids), strategy, None, EVAL["max_new_tokens"]) for ids in items]
        rates[domain] = sum(len(o.token_ids) - 1 for o in outputs) / sum(len(o.steps) for o in outputs)
    return rates


def test_mixture_sweep_trains_evaluates_and_picks_the_best(mixture, experiment, ray_session):
    _, path, target = experiment
    rows = {r.config["ratio"]: r for r in mixture.rows}
    assert sorted(rows) == [0.0, 1.0] and {r.status for r in rows.values()} <= {"ok", "stopped"}
    ok = [r for r in rows.values() if r.status == "ok"]
    assert ok, "at least the first trial to reach a rung survives ASHA"
    for r in ok:
        taus = [r.metrics[f"tau/{d}"] for d in ("math", "chat")]
        expected = _tokens_per_step(target, load_config(path), r.metrics["drafter"])
        assert taus == pytest.approx([expected["math"], expected["chat"]], rel=1e-9)
        assert r.objective == pytest.approx(sum(taus) / 2) and r.metrics["steps"] == 6 and r.attempts == 1
        assert r.metrics["mixture"] == ("chat:12" if r.config["ratio"] == 0.0 else "math:12")
        head = DraftHead.load(r.metrics["drafter"], target.config, target.fingerprint)
        assert head.metadata["training"]["final"]
    for r in rows.values():
        records = trial_results(mixture, r.trial_id)
        assert records[0]["epoch"] == 1 and "evaluated" not in records[0], "epoch 1 reaches Tune before the end"
        assert all(x["sim_objective"] > 0 for x in records)
        assert [x.get("evaluated", False) for x in records] == ([False, True] if r.status == "ok" else [False])
    stopped = [r for r in rows.values() if r.status == "stopped"]
    if stopped:
        (survivor,) = ok
        first = {r.trial_id: trial_results(mixture, r.trial_id)[0]["sim_objective"] for r in rows.values()}
        assert first[stopped[0].trial_id] < first[survivor.trial_id]
        assert not (mixture.out / "trials" / stopped[0].trial_id / "drafter").exists()
    deadline = time.time() + 60
    while left := [{k: pg.get(k) for k in ("placement_group_id", "name", "bundles", "state", "stats")}
                   for pg in ray_session.util.placement_group_table().values() if pg["state"] != "REMOVED"]:
        recorded = {str(p.relative_to(mixture.out)): p.read_text().split() for p in mixture.out.rglob(RECORD)}
        assert time.time() < deadline, f"placement groups outlived the sweep: {left}; the runs recorded {recorded}"
        time.sleep(1)
    assert mixture.best is max(ok, key=lambda r: r.objective)
    best = json.loads((mixture.out / "best.json").read_text())
    assert best["trial_id"] == mixture.best.trial_id and best["drafter"] == mixture.best.metrics["drafter"]
    with (mixture.out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["ratio"] for row in table] == ["0.0", "1.0"]
    assert {"tau/math", "tau/chat", "objective", "sim_objective", "wall_s", "drafter"} <= set(table[0])
    assert (mixture.out / "tau_vs_ratio.png").read_bytes()[:4] == b"\x89PNG"


class InterruptAfterFirstTrial(Callback):
    """Sends this process SIGINT (Ctrl-C) once, after the first trial completes."""

    def __init__(self, flag: Path):
        self.flag = flag

    def on_trial_complete(self, iteration, trials, trial, **info):
        if not self.flag.exists():
            self.flag.touch()
            os.kill(os.getpid(), signal.SIGINT)


def test_interpolation_sweep_resumes_without_redoing_trials_and_reports_a_failed_trial(
        mixture, experiment, ray_session, tmp_path, monkeypatch, capsys):
    _, path, target = experiment
    trained = mixture.best.metrics["drafter"]
    fresh = DraftHead(target.config, draft_to_target=DraftHead.load(trained, target.config, target.fingerprint)
                      .draft_to_target, seed=5)
    fresh.save(tmp_path / "fresh", target.fingerprint)
    raw = interpolation_spec({"trained": trained, "fresh": str(tmp_path / "fresh")})
    spec_path = tmp_path / "interp.yaml"
    spec_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "out"
    monkeypatch.setenv(FAIL_ENV, f"alpha={FAILING}")

    first = run_sweep(parse_spec(raw), load_config(path), out, target=target,
                      callbacks=[InterruptAfterFirstTrial(tmp_path / "interrupted")])
    (done,) = first.rows
    assert done.status == "ok" and first.unfinished == len(ALPHAS) - 1
    with pytest.raises(SweepError, match="already holds sweep results; pass --resume"):
        run_sweep(parse_spec(raw), load_config(path), out, target=target)
    capsys.readouterr()

    assert cli.main(["sweep", str(spec_path), str(path), "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    rows = {r["alpha"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert sorted(float(a) for a in rows) == sorted(ALPHAS)
    assert {a: (r["status"], r["attempts"]) for a, r in rows.items() if float(a) != FAILING} == {
        a: ("ok", "1") for a in rows if float(a) != FAILING}, "a finished trial was redone"
    failed = rows[str(FAILING)]
    assert failed["status"] == "failed" and failed["attempts"] == "2" and "injected failure" in failed["error"]
    assert rows[str(done.config["alpha"])]["trial_id"] == done.trial_id

    at_one = rows["1.0"]
    source, averaged = drafter_tensors(Path(trained)), drafter_tensors(Path(at_one["drafter"]))
    assert source.keys() == averaged.keys() and all(np.array_equal(source[k], averaged[k]) for k in source)
    for domain in ("math", "chat"):
        assert float(at_one[f"tau/{domain}"]) == pytest.approx(mixture.best.metrics[f"tau/{domain}"])
    objectives = {a: float(r["objective"]) for a, r in rows.items() if r["status"] == "ok"}
    best = json.loads((out / "best.json").read_text())
    assert best["objective"] == max(objectives.values())
    assert objectives[str(best["config"]["alpha"])] == best["objective"]
    assert f"best drafter: {best['drafter']}" in printed and "| trial | alpha | tau math | tau chat |" in printed
    assert "failed (2 attempts): " in printed
    assert (out / "tau_vs_alpha.png").read_bytes()[:4] == b"\x89PNG"


def test_drafters_of_different_targets_are_refused(experiment, mixture, ray_session, tmp_path):
    _, path, target = experiment
    other = make_tiny_target(3, vocab_size=VOCAB, hidden_size=HIDDEN)
    DraftHead(other.config, seed=0).save(tmp_path / "other", other.fingerprint)
    spec = parse_spec(interpolation_spec({"a": mixture.best.metrics["drafter"], "b": str(tmp_path / "other")}))
    with pytest.raises(SweepError, match="'a' and 'b' were trained for different targets.*embed_hash"):
        run_sweep(spec, load_config(path), tmp_path / "out", target=target)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"resources": {"num_workers": 16}}, r"each trial needs 16.25 CPU and 0 GPU .* but the cluster has \d+ CPU and 0 GPU"),
    ({"resources": {"use_gpu": True}}, "resources.use_gpu is true but the cluster has no GPUs"),
    ({"search": {"ratio": [0.5], "total": [999]}}, "search.total: ratio 0.5 x total 999: mixture asks for 500 rows"),
    ({"eval": {**EVAL, "prompts": {"code": {"source": "heldout"}}}}, r"dataset\(s\) \['code'\] that the experiment"),
])
def test_input_problems_stop_the_sweep_before_any_trial(experiment, ray_session, tmp_path, change, message):
    _, path, target = experiment
    with pytest.raises(SweepError, match=message):
        run_sweep(parse_spec({**MIXTURE, **change}), load_config(path), tmp_path / "out", target=target)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"search": {}}, "search: the search space is empty"),
    ({"search": {"ratio": []}}, "search.ratio: grid is empty"),
    ({"search": {"ratio": [0.5, 1.5]}}, r"search.ratio: ratio must be a number in \[0, 1\].*got 1.5"),
    ({"search": {"ratio": {"uniform": [-0.5, 1.0]}}}, r"search.ratio: ratio must be a number in \[0, 1\].*got -0.5"),
    ({"search": {"train.lr": [0.0]}}, "search.train.lr: Input should be greater than 0"),
    ({"search": {"train.num_workers": [2]}}, "search.train.num_workers: not a searchable key"),
    ({"mixture": {"datasets": ["math", "chat"], "ratio": 1.5}}, "mixture.ratio: Input should be less than or equal to 1"),
    ({"scheduler": {"kind": "asha", "patience": 3}}, "scheduler.patience: unknown key; allowed keys: kind, grace"),
    ({"objective": "domain:code"}, "objective.domain: 'code' is not a domain of eval.prompts"),
])
def test_mixture_spec_errors_name_the_key(change, message):
    with pytest.raises(SweepSpecError, match=message):
        parse_spec({**MIXTURE, **change}, "tune/x.yaml")


@pytest.mark.parametrize(("change", "message"), [
    ({"search": {"alpha": [0.0, 1.2]}}, r"search.alpha: alpha must be a number in \[0, 1\], got 1.2"),
    ({"drafters": {"a": "random:0", "b": "random:1", "c": "random:2"}}, "search.alpha interpolates two drafters"),
    ({"search": {"weights": [[0.5, 0.6]]}}, r"search.weights.grid\[0\]: weights must sum to 1"),
    ({"search": {"beta": [0.5]}}, "search.beta: not a searchable key"),
])
def test_interpolation_spec_errors_name_the_key(change, message):
    with pytest.raises(SweepSpecError, match=message):
        parse_spec({**interpolation_spec({"a": "random:0", "b": "random:1"}), **change})


def test_spec_files_and_presets_load():
    from taps_ray.sweeps.config import load_spec

    quick = load_spec("tune/mixture.yaml", "quick")
    assert list(quick.search) == ["ratio"] and quick.scheduler.kind == "none" and quick.mixture.total == 48
    three = load_spec("tune/interpolation.yaml", "three")
    assert list(three.search) == ["weights"] and len(three.drafters) == 3
    with pytest.raises(SweepSpecError, match="unknown preset 'fast'; presets: \\['quick'\\]"):
        load_spec("tune/mixture.yaml", "fast")


def test_cli_spec_error_is_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**MIXTURE, "search": {"ratio": [2]}}))
    assert cli.main(["sweep", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("taps sweep: error:")]
    assert len(err) == 1 and "search.ratio: ratio must be a number in [0, 1]" in err[0]


def test_objectives():
    taus = {"math": 3.0, "chat": 2.0}
    assert ObjectiveSpec.model_validate("mean").value(taus) == 2.5
    assert ObjectiveSpec.model_validate("worst").value(taus) == 2.0
    assert ObjectiveSpec.model_validate("domain:math").value(taus) == 3.0
    assert math.isnan(ObjectiveSpec().value({"math": 3.0, "chat": math.nan}))


def test_a_trial_the_scheduler_stopped_keeps_no_drafter_even_when_its_training_finished_first(tmp_path):
    """ASHA's stop can reach a trial after its fit wrote the drafter, before it was evaluated: not a result."""
    from taps_ray.sweeps.results import TrialRow, discard_stopped_drafters

    rows = [TrialRow(trial_id, status, {}, {}, 1) for trial_id, status in
            (("a", "ok"), ("b", "stopped"), ("c", "failed"), ("d", "stopped"))]
    for trial_id in "abc":
        (tmp_path / "trials" / trial_id / "drafter").mkdir(parents=True)
        (tmp_path / "trials" / trial_id / "drafter" / "model.safetensors").write_bytes(b"x")
    discard_stopped_drafters(rows, tmp_path)
    assert [t for t in "abcd" if (tmp_path / "trials" / t / "drafter").exists()] == ["a", "c"]
    assert (tmp_path / "trials" / "b").is_dir(), "the trial's own records stay"


def test_a_sweep_that_may_train_eagle3_reads_feature_sets_with_eagle3s_layers(tmp_path):
    """``auto`` features follow the experiment's variants; a sweep whose trials may train eagle3 drafters reads the
    EAGLE-3 sets instead, and says how to prepare them when they are missing."""
    from taps_ray.sweeps.context import feature_sets, trial_algorithms, trial_features

    spec = parse_spec({**MIXTURE, "search": {"ratio": [0.0, 1.0], "algorithm": ["hass", "eagle3"]}})
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"output_dir={tmp_path}"])
    assert trial_algorithms(spec) == {spec.mixture.algorithm, "hass", "eagle3"}
    assert trial_features(spec, cfg).data.features.layers == "eagle3" and cfg.data.features.layers == "auto"
    plain = parse_spec({**MIXTURE, "search": {"ratio": [0.0, 1.0]}})
    assert trial_algorithms(plain) == {"eagle2"} and trial_features(plain, cfg) is cfg
    with pytest.raises(SweepError, match="data.features.layers: last"):
        trial_features(spec, load_config(None, ["data.features.layers=last"]))
    with pytest.raises(SweepError, match=r"taps prepare CONFIG data.features.layers=eagle3"):
        feature_sets(trial_features(spec, cfg), {"hidden_size": 1, "vocab_size": 1, "embed_hash": "none"},
                     {"math"})
