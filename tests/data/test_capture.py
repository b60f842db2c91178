"""Serving capture: finished requests kept in the feature-cache format, read back by the reader ``taps
train`` uses, with the features ``taps prepare`` computes for the same token ids and no extra target
forward pass; sampling, the row / byte budget (oldest shards first), token-only rows and their features
computed later, routing labels.

The real :class:`Verifier` decode loop runs in-process (no Ray) over an in-process drafter, on a tiny
float32 target whose attention matters (a bigram target with small random attention and MLP outputs, so
an oracle drafter is often but not always right: steps accept 0..depth tokens)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from taps_ray.config import ServeConfig, TreeConfig
from taps_ray.config_serve import CaptureConfig
from taps_ray.data.capture import CaptureWriter, captured_requests, fill_features, snapshot
from taps_ray.data.contamination import FEATURE_PROMPTS, prompt_hash
from taps_ray.data.feature_sets import MANIFEST, FeatureCacheError, decode_row, open_feature_set
from taps_ray.data.features import FeatureActor
from taps_ray.serving.drafter import DraftSessions
from taps_ray.serving.plan import DecodeRequest, resolve_plan
from taps_ray.serving.verifier import Verifier
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from taps_ray.train.variant import FEATURE_COLUMNS
from tests.serving.helpers import LocalClient
from tests.spec.spec_helpers import bigram_target, oracle_drafter

TREE = TreeConfig(depth=3, top_k=4, total_tokens=12, lookup_tokens=0, adaptive=False)
NEW = 20


@pytest.fixture(scope="module")
def target():
    target = bigram_target(0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in target.model.model.layers:
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                weight.copy_(0.02 * torch.randn(weight.shape, generator=g))
    target.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return target


@pytest.fixture(scope="module")
def drafters(target):
    return {"a": oracle_drafter(target), "b": oracle_drafter(target, seed=1, gain=20.0)}


def make_verifier(target, drafters, capture: CaptureConfig | None, **fields) -> Verifier:
    verifier = object.__new__(Verifier)
    verifier.target, verifier.tree = target, TREE
    routing = {"draft_deadline_s": 30, **fields.pop("routing", {})}
    verifier.cfg = ServeConfig(drafters={n: None for n in drafters}, routing=routing,
                               capture=capture or CaptureConfig(), **fields)
    verifier.clients = {n: LocalClient([DraftSessions(target, d, TREE)]) for n, d in drafters.items()}
    verifier.pool = ThreadPoolExecutor(1)
    verifier._init_counts()
    if capture is not None:
        verifier.capture = CaptureWriter(capture, capture.dir, target.fingerprint.to_dict(), seed=0)
    return verifier


def decode(verifier, prompt: list[int], strategy: str = "single", order=None, **fields) -> dict:
    events = []
    fields.setdefault("store", True)
    request = DecodeRequest(rid=f"r{len(prompt)}-{prompt[0]}", prompt=prompt,
                            plan=resolve_plan(strategy, order, verifier.cfg), max_tokens=NEW, raw=True,
                            prompt_param="prompt", **fields)
    verifier.decode(request, events.append)
    assert events[-1]["type"] == "done", events[-1]
    return events[-1]


def counting(target, monkeypatch) -> dict:
    """Count the target's forward passes (prefill, cached forward, teacher-forced hidden states)."""
    calls = {"prefill": 0, "forward": 0, "hidden_states": 0}
    for name in calls:
        original = getattr(target, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(target, name, wrapped)
    return calls


def prepare_features(target, table):
    """The features ``taps prepare``'s target actor computes for the rows of ``table`` (one padded batch)."""
    actor = object.__new__(FeatureActor)
    actor.target, actor.label, actor.total_rows = target, "", 0
    actor.rows = actor.tokens = actor.reported = 0
    actor.started = time.perf_counter()
    with torch.inference_mode():
        return actor(table.select(["row_id", "input_ids", "loss_mask"]))


PROMPTS = [torch.randint(2, 256, (8 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
           for seed in range(5)]


def test_captured_rows_are_a_feature_set_with_prepares_features_and_no_extra_forward(target, drafters, tmp_path,
                                                                                  monkeypatch):
    plain = make_verifier(target, drafters, None)
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), rows_per_shard=2)
    captured = make_verifier(target, drafters, capture)
    calls = counting(target, monkeypatch)
    for prompt in PROMPTS:
        decode(plain, prompt)
    without = dict(calls)
    for name in calls:
        calls[name] = 0
    outputs = [decode(captured, prompt) for prompt in PROMPTS]
    captured.capture.flush()
    assert calls == without and calls["hidden_states"] == 0
    monkeypatch.undo()

    fs = open_feature_set(tmp_path / "cap", target.fingerprint.to_dict(), "captured")
    assert fs.rows == len(PROMPTS) and len(fs.shard_paths()) == 3
    table = pq.read_table(fs.shard_paths(), columns=FEATURE_COLUMNS)
    rows = [decode_row(r, fs.hidden_size) for r in table.to_pylist()]
    prepared = [decode_row(r, fs.hidden_size) for r in prepare_features(target, table).to_pylist()]
    accepted = []
    for prompt, row, ref, out in zip(PROMPTS, rows, prepared, outputs, strict=True):
        vanilla = generate(target, torch.tensor(prompt), max_new_tokens=NEW).token_ids
        assert row["input_ids"].tolist() == prompt + vanilla[:-1]
        assert row["loss_mask"].tolist() == [0.0] * len(prompt) + [1.0] * (len(vanilla) - 1)
        assert row["hidden"].dtype == torch.bfloat16 == ref["hidden"].dtype
        torch.testing.assert_close(row["hidden"].float(), ref["hidden"].float(), rtol=2 ** -7, atol=1e-5)
        accepted += out["taps"]["accept_lengths"]
    assert 0 in accepted and max(accepted) >= 2, accepted
    assert json.loads((tmp_path / "cap" / FEATURE_PROMPTS).read_text())["sha256"] == [
        prompt_hash(" ".join(map(str, p))) for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["vanilla", "single"])
def test_the_loops_features_equal_teacher_forced_ones_in_fp32(target, drafters, strategy):
    sink: list[torch.Tensor] = []
    spec = None if strategy == "vanilla" else build_strategy(strategy, [drafters["a"]], TREE, names=["a"])
    result = generate(target, torch.tensor(PROMPTS[3]), spec, max_new_tokens=NEW, feature_sink=sink)
    assert strategy == "vanilla" or any(s.accepted >= 2 for s in result.steps)
    ids = torch.tensor(PROMPTS[3] + result.token_ids)
    features = torch.cat(sink)
    assert features.shape == (ids.numel() - 1, target.hidden_size)
    with torch.inference_mode():
        teacher = target.hidden_states(ids[None])[0, :-1]
    torch.testing.assert_close(features, teacher, rtol=0, atol=1e-5)


def test_routing_labels_are_columns_the_training_reader_leaves_out(target, drafters, tmp_path):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"))
    verifier = make_verifier(target, drafters, capture, routing={"probe_steps": 2})
    out = decode(verifier, PROMPTS[1], "routed:confidence:request", ["a", "b"])
    verifier.capture.flush()
    table = pq.read_table(open_feature_set(tmp_path / "cap", target.fingerprint.to_dict(), "c").shard_paths())
    assert set(FEATURE_COLUMNS) < set(table.column_names)
    row = table.to_pylist()[0]
    labels = json.loads(row["labels"])
    assert row["strategy"] == out["taps"]["strategy"] and row["finish_reason"] == out["finish_reason"]
    assert labels["drafters"] == ["a", "b"] and labels["route_decisions"] == out["taps"]["route_decisions"]
    assert [s["route"] for s in labels["steps"]] == out["taps"]["route_per_step"]
    probes = [s for s in labels["steps"] if s["signals"] is not None]
    assert probes and all(len(s["signals"]) == 2 for s in probes)
    assert all(s["route"] in ("a", "b") for s in labels["steps"])


def test_sampling_budget_and_oldest_first_eviction(target, drafters, tmp_path):
    off = make_verifier(target, drafters, CaptureConfig(enabled=True, dir=str(tmp_path / "none"), sample_rate=0.0))
    decode(off, PROMPTS[0])
    assert off.capture.flush() is None and not (tmp_path / "none").exists()

    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), rows_per_shard=1, max_rows=3)
    verifier = make_verifier(target, drafters, capture)
    for prompt in PROMPTS:
        decode(verifier, prompt)
    fs = open_feature_set(tmp_path / "cap", target.fingerprint.to_dict(), "captured")
    table = pq.read_table(fs.shard_paths())
    assert fs.rows == 3 == table.num_rows and [p.rsplit("/", 1)[1] for p in fs.shard_paths()] == [
        "part-000000000002.parquet", "part-000000000003.parquet", "part-000000000004.parquet"]
    assert table.column("row_id").to_pylist() == [2, 3, 4]
    assert [ids[:len(p)] for ids, p in zip(table.column("input_ids").to_pylist(), PROMPTS[2:], strict=True)] == PROMPTS[2:]
    assert fs.manifest["capture"]["evicted_rows"] == 2

    size = (tmp_path / "cap" / "part-000000000004.parquet").stat().st_size
    small = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), rows_per_shard=1, max_rows=None, max_bytes=size)
    verifier.capture = CaptureWriter(small, tmp_path / "cap", target.fingerprint.to_dict())
    decode(verifier, PROMPTS[0])
    manifest = json.loads((tmp_path / "cap" / MANIFEST).read_text())
    assert list(manifest["capture"]["shards"]) == ["part-000000000005.parquet"]
    assert sorted(p.name for p in (tmp_path / "cap").glob("*.parquet")) == ["part-000000000005.parquet"]


def test_only_requests_that_ask_to_be_stored_are_kept_unless_the_operator_keeps_all(target, drafters, tmp_path):
    stored = make_verifier(target, drafters, CaptureConfig(enabled=True, dir=str(tmp_path / "s"), rows_per_shard=1))
    decode(stored, PROMPTS[0], store=False)
    decode(stored, PROMPTS[1], store=True)
    assert captured_requests(tmp_path / "s") == (1, 1)
    table = pq.read_table(open_feature_set(tmp_path / "s", target.fingerprint.to_dict(), "c").shard_paths())
    assert table.column("input_ids").to_pylist()[0][:len(PROMPTS[1])] == PROMPTS[1]
    every = make_verifier(target, drafters, CaptureConfig(enabled=True, dir=str(tmp_path / "a"), rows_per_shard=1,
                                                          mode="all"))
    decode(every, PROMPTS[0], store=False)
    assert captured_requests(tmp_path / "a") == (1, 1)


def test_capture_files_and_folders_are_private_and_old_shards_age_out(target, drafters, tmp_path, monkeypatch):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "user" / "cap"), rows_per_shard=1, max_rows=None,
                            max_age_s=60)
    verifier = make_verifier(target, drafters, capture)
    clock = [1_000_000.0]
    monkeypatch.setattr("taps_ray.data.capture.time.time", lambda: clock[0])
    for prompt in PROMPTS[:2]:
        decode(verifier, prompt)
        clock[0] += 45
    folder = tmp_path / "user" / "cap"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if not p.name.startswith(".")} == {
        "part-000000000000.parquet": 0o600, "part-000000000001.parquet": 0o600, MANIFEST: 0o600,
        FEATURE_PROMPTS: 0o600}
    decode(verifier, PROMPTS[2])  # 90 s after the first shard, 45 s after the second: the first ages out
    manifest = json.loads((folder / MANIFEST).read_text())
    assert list(manifest["capture"]["shards"]) == ["part-000000000001.parquet", "part-000000000002.parquet"]
    assert manifest["capture"]["evicted_rows"] == 1 and not (folder / "part-000000000000.parquet").exists()
    snap = snapshot(folder, tmp_path / "snap")
    assert snap.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in snap.iterdir()} == {0o600}


def test_eviction_names_only_existing_shards_even_if_killed_before_unlinking(target, drafters, tmp_path,
                                                                             monkeypatch):
    """The manifest is written before evicted shards are unlinked: a kill between the two leaves an extra
    file, never a manifest naming a missing one (which would fail every later write and read)."""
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), rows_per_shard=1, max_rows=1)
    verifier = make_verifier(target, drafters, capture)
    decode(verifier, PROMPTS[0])

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt("killed between the manifest and the unlink")

    monkeypatch.setattr("pathlib.Path.unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        decode(verifier, PROMPTS[1])
    monkeypatch.undo()
    manifest = json.loads((tmp_path / "cap" / MANIFEST).read_text())
    assert list(manifest["capture"]["shards"]) == ["part-000000000001.parquet"]
    assert all((tmp_path / "cap" / name).exists() for name in manifest["capture"]["shards"])
    fs = open_feature_set(tmp_path / "cap", target.fingerprint.to_dict(), "captured")
    assert fs.rows == 1
    decode(verifier, PROMPTS[2])  # the next write goes on
    assert json.loads((tmp_path / "cap" / MANIFEST).read_text())["capture"]["next_row_id"] == 3


def test_a_snapshot_stays_as_it_was_while_the_server_captures_and_evicts(target, drafters, tmp_path):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), rows_per_shard=1, max_rows=3)
    verifier = make_verifier(target, drafters, capture)
    for prompt in PROMPTS[:3]:
        decode(verifier, prompt)
    frozen = snapshot(tmp_path / "cap", tmp_path / "frozen")
    rows = pq.read_table(open_feature_set(frozen, target.fingerprint.to_dict(), "t").shard_paths()).to_pylist()
    assert (frozen / "part-000000000000.parquet").stat().st_ino == (tmp_path / "cap" / "part-000000000000.parquet").stat().st_ino
    for prompt in PROMPTS[3:]:  # two more rows: the two oldest shards of the live folder are evicted
        decode(verifier, prompt)
    assert captured_requests(tmp_path / "cap") == (len(PROMPTS), 3) and captured_requests(frozen) == (3, 3)
    again = open_feature_set(frozen, target.fingerprint.to_dict(), "t")
    assert pq.read_table(again.shard_paths()).to_pylist() == rows and again.rows == 3
    assert json.loads((frozen / FEATURE_PROMPTS).read_text())["sha256"] == [
        prompt_hash(target.tokenizer.decode(p)) for p in PROMPTS[:3]]
    assert snapshot(tmp_path / "cap", tmp_path / "frozen") == tmp_path / "frozen"  # replaced: the live rows now
    assert captured_requests(tmp_path / "frozen") == (len(PROMPTS), 3)


def test_token_ids_only_rows_open_once_their_features_are_computed(target, drafters, tmp_path):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"), features=False)
    verifier = make_verifier(target, drafters, capture)
    decode(verifier, PROMPTS[2])
    verifier.capture.flush()
    fingerprint = target.fingerprint.to_dict()
    with pytest.raises(FeatureCacheError, match="token ids only"):
        open_feature_set(tmp_path / "cap", fingerprint, "captured")
    vanilla = generate(target, torch.tensor(PROMPTS[2]), max_new_tokens=NEW).token_ids
    assert fill_features(tmp_path / "cap", target) == 1
    row = open_feature_set(tmp_path / "cap", fingerprint, "captured").read_rows()[0]
    assert row["input_ids"].tolist() == PROMPTS[2] + vanilla
    with torch.inference_mode():
        teacher = target.hidden_states(row["input_ids"][None])[0].to(torch.bfloat16)
    assert torch.equal(row["hidden"], teacher)


def test_a_stop_sequence_keeps_the_output_the_response_kept(target, drafters, tmp_path):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"))
    verifier = make_verifier(target, drafters, capture)
    vanilla = generate(target, torch.tensor(PROMPTS[4]), max_new_tokens=NEW).token_ids
    stop = str(vanilla[5])
    out = decode(verifier, PROMPTS[4], stop=[stop])
    verifier.capture.flush()
    row = open_feature_set(tmp_path / "cap", target.fingerprint.to_dict(), "captured").read_rows()[0]
    completion = out["usage"]["completion_tokens"]
    assert out["finish_reason"] == "stop" and completion < NEW
    assert row["input_ids"].tolist() == PROMPTS[4] + vanilla[:completion - 1]


def test_a_features_source_names_a_folder_and_stands_alone(tmp_path):
    from taps_ray.config import DatasetConfig, ExperimentConfig
    from taps_ray.data.feature_sets import feature_set_path

    with pytest.raises(ValueError, match="needs 'path'"):
        DatasetConfig(domain="chat", alternatives=[{"kind": "features"}])
    with pytest.raises(ValueError, match="only alternative"):
        DatasetConfig(domain="chat", alternatives=[{"kind": "features", "path": "x"}, {"kind": "sharegpt"}])
    cfg = ExperimentConfig.model_validate({"data": {"datasets": {"c": {
        "domain": "chat", "alternatives": [{"kind": "features", "path": str(tmp_path / "cap")}]}}}})
    assert feature_set_path(cfg, "c", {}) == tmp_path / "cap"


def test_a_folder_of_another_target_is_refused_at_start(target, drafters, tmp_path):
    capture = CaptureConfig(enabled=True, dir=str(tmp_path / "cap"))
    verifier = make_verifier(target, drafters, capture)
    decode(verifier, PROMPTS[0])
    verifier.capture.flush()
    other = bigram_target(1, hidden_size=32)
    with pytest.raises(ValueError, match="another target"):
        CaptureWriter(capture, tmp_path / "cap", other.fingerprint.to_dict())
