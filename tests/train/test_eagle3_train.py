"""An EAGLE-3 variant end to end on the embedded target: ``taps prepare`` stores the three EAGLE-3 layers and the
last hidden state for the dataset it reads, ``taps train`` trains it with training-time test into a checkpoint
that loads as an :class:`~taps_ray.models.eagle3.Eagle3Head` with its held-out acc@k and tau, and the drafter
decodes exactly as vanilla greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch

from taps_ray.config import load_config
from taps_ray.data import feature_sets
from taps_ray.data.features import prepare_features
from taps_ray.models.drafter import DraftHead, read_drafter_meta
from taps_ray.models.eagle3 import Eagle3Head
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from taps_ray.train.launch import run_training

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 3}?"},
                      {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}. So the answer is {2 * i + 3}."}]}
        for i in range(24)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, embedded_target, ray_session):
    tmp = tmp_path_factory.mktemp("eagle3")
    data = tmp / "math.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    path = tmp / "cfg.yaml"
    path.write_text(
        "name: e3\n"
        f"output_dir: {tmp / 'runs'}\n"
        "target: {dtype: float32}\n"
        "data:\n  datasets:\n    math:\n      domain: math\n"
        f"      alternatives:\n        - {{kind: jsonl, path: {data}}}\n"
        "  features: {max_len: 48, batch_tokens: 192, rows_per_shard: 8}\n"
        "mixtures:\n  m: {counts: {math: 20}}\n"
        "drafter: {draft_vocab_size: 256}\n"
        "train: {epochs: 2, batch_size: 4, lr: 0.002, heldout_rows: 4, eval_depth: 3, threads: 1, log_every: 2}\n"
        "variants:\n  - {name: e3, mixture: m, algorithm: eagle3, objective: {ttt_steps: 2}}\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(feature_sets, "features_root", lambda: tmp / "features")
        cfg = load_config(path)
        prepared = prepare_features(cfg, target=embedded_target)[0]
        summary = run_training(cfg, target=embedded_target)
    return cfg, prepared, summary


@pytest.mark.slow
def test_prepare_stores_the_eagle3_layers_and_the_last_hidden_state(run, embedded_target):
    cfg, prepared, _ = run
    fs = feature_sets.open_feature_set(feature_sets.Path(prepared.path), embedded_target.fingerprint.to_dict(), "math")
    assert fs.layers == [2, 15, 27, 30]
    raw = __import__("pyarrow.parquet", fromlist=["read_table"]).read_table(fs.shard_paths()).to_pylist()[0]
    row = feature_sets.decode_row(raw, embedded_target.hidden_size, 4)
    expected = embedded_target.hidden_states(row["input_ids"][None], layers=(2, 15, 27, 30))[0]
    assert row["hidden"].shape == expected.shape == (len(row["input_ids"]), 4 * embedded_target.hidden_size)
    torch.testing.assert_close(row["hidden"].float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0.15)


@pytest.mark.slow
def test_taps_train_trains_an_eagle3_drafter_that_decodes_losslessly(run, embedded_target):
    cfg, _, summary = run
    assert [(r.variant, r.algorithm, r.status) for r in summary.variants] == [("e3", "eagle3", "ok")]
    folder = cfg.run_dir / "drafters" / "e3"
    meta = read_drafter_meta(folder)
    assert meta["architecture"] == "TapsEagle3Head" and meta["aux_layers"] == [1, 14, 26]
    assert meta["algorithm"] == "eagle3" and meta["objective"]["ttt_steps"] == 2
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    heldout = [r for r in records if "heldout/tau" in r]
    assert heldout and all(f"heldout/acc{k}" in heldout[-1] for k in (1, 2, 3))
    assert heldout[-1]["heldout/tau"] >= 1.0 and "heldout/feature" not in heldout[-1]
    drafter = DraftHead.load(folder, embedded_target.config, embedded_target.fingerprint)
    assert type(drafter) is Eagle3Head and drafter.draft_vocab_size == 256
    prompt = embedded_target.encode_chat(ROWS[20]["messages"][:1])[0]
    vanilla = generate(embedded_target, prompt, max_new_tokens=24)
    spec = generate(embedded_target, prompt, build_strategy("single", [drafter]), max_new_tokens=24)
    assert spec.token_ids == vanilla.token_ids


def test_two_workers_train_one_eagle3_drafter(tmp_path, ray_session, monkeypatch):
    """``train.num_workers: 2`` on EAGLE-3: two Ray Train workers each unroll training-time test on their shard
    through one DDP-wrapped drafter; rank 0 saves an Eagle3Head that moved from its initialisation, with held-out
    metrics."""
    from tests.train.train_helpers import drafter_tensors, tiny_experiment

    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache"))
    variant = {"name": "e3x2", "mixture": "math-only", "algorithm": "eagle3", "objective": {"ttt_steps": 2},
               "train": {"num_workers": 2}}
    path, target = tiny_experiment(tmp_path, [variant], layers=6, data={
        "datasets": {n: {"domain": n, "alternatives": [{"kind": "jsonl", "path": f"/missing/{n}.jsonl"}]}
                     for n in ("math", "chat")}, "features": {"max_len": 64, "layers": "eagle3"}})
    cfg = load_config(path)
    summary = run_training(cfg, target=target)
    assert [(r.variant, r.algorithm, r.status) for r in summary.variants] == [("e3x2", "eagle3", "ok")]
    folder = cfg.run_dir / "drafters" / "e3x2"
    meta = read_drafter_meta(folder)
    assert meta["algorithm"] == "eagle3" and meta["train"]["num_workers"] == 2 and meta["training"]["final"]
    drafter = DraftHead.load(folder, target.config, target.fingerprint)
    assert type(drafter) is Eagle3Head
    fresh = Eagle3Head(target.config, draft_to_target=drafter.draft_to_target, seed=cfg.drafter.seed)
    moved = drafter_tensors(folder)
    assert any(not torch.allclose(torch.from_numpy(moved[name]).float(), tensor.float())
               for name, tensor in fresh.state_dict().items() if name in moved)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert any("heldout/tau" in r for r in records)
