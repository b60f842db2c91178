import json

import numpy as np
import pytest
import torch

from taps_ray.config import load_config
from taps_ray.data import feature_sets, regeneration
from taps_ray.data.contamination import FEATURE_PROMPTS, prompt_hash
from taps_ray.data.feature_sets import (
    MANIFEST,
    FeatureCacheError,
    feature_set_path,
    load_feature_set,
    open_feature_set,
)
from taps_ray.data.features import prepare_features, summary_table, tokenize_conversation
from taps_ray.train.shards import FEATURE_COLUMNS
from taps_ray.train.variant import heldout_tables

CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


def _masked_text(tokenizer, tc):
    ids = [i for i, m in zip(tc.input_ids, tc.loss_mask) if m]
    return tokenizer.decode(ids)


@pytest.mark.integration
def test_loss_mask_single_turn(embedded_target):
    tok = embedded_target.tokenizer
    tc = tokenize_conversation(tok, CHAT[:2], max_len=512)
    assert tc.input_ids == tok.apply_chat_template(CHAT[:2], tokenize=True, return_dict=False)
    assert _masked_text(tok, tc) == "Hello! How can I help?<|im_end|>"
    assert not tc.truncated


@pytest.mark.integration
def test_loss_mask_multi_turn_and_system(embedded_target):
    tok = embedded_target.tokenizer
    conv = [{"role": "system", "content": "Be brief."}, *CHAT]
    tc = tokenize_conversation(tok, conv, max_len=512)
    assert _masked_text(tok, tc) == "Hello! How can I help?<|im_end|>4<|im_end|>"
    user_ids = tok("What is 2+2?", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(tc.input_ids)) if tc.input_ids[i:i + len(user_ids)] == user_ids)
    assert not any(tc.loss_mask[start:start + len(user_ids)])


@pytest.mark.integration
def test_truncation(embedded_target):
    tc = tokenize_conversation(embedded_target.tokenizer, CHAT, max_len=20)
    assert len(tc.input_ids) == 20 and len(tc.loss_mask) == 20 and tc.truncated


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _tiny_config(tmp_path, rows):
    data = tmp_path / "chat.jsonl"
    _write_jsonl(data, rows)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        "name: t\n"
        f"output_dir: {tmp_path / 'runs'}\n"
        "target: {dtype: float32}\n"  # as the embedded_target fixture, so the actors' features match it
        "data:\n  datasets:\n    chat:\n      domain: chat\n"
        f"      alternatives:\n        - {{kind: jsonl, path: {data}}}\n"
        "  features: {max_len: 48, batch_tokens: 96, rows_per_shard: 2}\n"
        "mixtures:\n  all: {counts: {chat: 3}}\n"
    )
    return load_config(cfg_path)


@pytest.mark.integration
def test_prepare_writes_rereads_and_hits_cache(tmp_path, monkeypatch, embedded_target, ray_session):
    monkeypatch.setattr(feature_sets, "features_root", lambda: tmp_path / "features")
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: add {i} and {i}?"},
                          {"role": "assistant", "content": f"{i} + {i} = {2 * i}. " * (1 + i)}]} for i in range(5)]
    rows.append({"messages": []})
    cfg = _tiny_config(tmp_path, rows)
    first = prepare_features(cfg, target=embedded_target)[0]
    assert not first.cache_hit and first.rows == 5
    lengths = [len(embedded_target.encode_chat(r["messages"], False)[0]) for r in rows[:5]]
    assert first.tokens == sum(min(48, n) for n in lengths)
    assert first.truncated == sum(n > 48 for n in lengths) > 0
    assert sum(first.skipped.values()) >= 1
    table = summary_table([first])
    assert f"| {first.truncated} |" in table
    fs = load_feature_set(cfg, "chat", embedded_target.fingerprint.to_dict())
    decoded = {r["row_id"]: r for r in fs.read_rows()}
    assert len(decoded) == 5 and len(fs.shard_paths()) >= 2
    for row in decoded.values():
        expected = embedded_target.hidden_states(row["input_ids"][None])[0]
        assert torch.allclose(row["hidden"].float(), expected.to(torch.bfloat16).float(), atol=1e-2)
    subset = fs.read_rows(np.array([1, 3]))
    assert sorted(r["row_id"] for r in subset) == [1, 3]
    monkeypatch.setattr(feature_sets, "SELECT_BATCH_ROWS", 1)  # a selection streamed row by row, across shards
    held = heldout_tables({"chat": fs}, {"chat": np.array([4, 0, 3])})["chat"]
    assert held["row_id"].to_pylist() == [0, 3, 4] and held["dataset"].to_pylist() == ["chat"] * 3
    assert held.column_names == [*FEATURE_COLUMNS, "dataset"]
    whole = {r["row_id"]: r for r in fs.read_table(columns=FEATURE_COLUMNS).to_pylist()}
    assert held.drop_columns(["dataset"]).to_pylist() == [whole[i] for i in (0, 3, 4)]
    assert fs.read_table(np.array([], dtype=np.int64)).num_rows == 0
    assert fs.prompt_hashes() == [prompt_hash(f"Question {i}: add {i} and {i}?") for i in range(5)]
    (fs.path / FEATURE_PROMPTS).unlink()  # as prepared before prompts were recorded
    second = prepare_features(cfg, target=embedded_target)[0]
    assert second.cache_hit and second.rows == first.rows and second.path == first.path
    assert second.truncated == first.truncated
    assert fs.prompt_hashes() == [prompt_hash(f"Question {i}: add {i} and {i}?") for i in range(5)]
    assert json.loads((fs.path / FEATURE_PROMPTS).read_text())["superset"] is True


def test_incomplete_or_foreign_cache_is_rejected(tmp_path):
    fp = {"name": "a", "hidden_size": 8, "vocab_size": 16, "embed_hash": "abc"}
    folder = tmp_path / "chat-123"
    folder.mkdir()
    with pytest.raises(FeatureCacheError, match="incomplete"):
        open_feature_set(folder, fp, "chat")
    (folder / MANIFEST).write_text(json.dumps({"rows": 1, "target": {**fp, "embed_hash": "zzz", "name": "b"}}))
    with pytest.raises(FeatureCacheError, match="embed_hash"):
        open_feature_set(folder, fp, "chat")


def test_feature_key_includes_data_dir_only_for_sources_that_read_it(monkeypatch):
    fp = {"name": "a", "hidden_size": 8, "vocab_size": 16, "embed_hash": "abc"}
    chat = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}"])
    math = load_config(None, ["data.datasets={math: {domain: math, alternatives: [{kind: gsm8k_train}, "
                              "{kind: hf, name: openai/gsm8k}]}}"])
    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    unset = feature_set_path(chat, "chat", fp), feature_set_path(math, "math", fp)
    monkeypatch.setenv("TAPS_DATA_DIR", "/somewhere/data")
    assert feature_set_path(chat, "chat", fp) == unset[0]
    assert feature_set_path(math, "math", fp) != unset[1]


def test_feature_key_depends_on_max_len_and_target(tmp_path):
    cfg = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}"])
    fp = {"name": "a", "hidden_size": 8, "vocab_size": 16, "embed_hash": "abc"}
    base = feature_set_path(cfg, "chat", fp)
    assert base == feature_set_path(cfg, "chat", {**fp, "name": "renamed"})
    assert base != feature_set_path(cfg, "chat", {**fp, "embed_hash": "other"})
    cfg2 = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}",
                              "data.features.max_len=99"])
    assert base != feature_set_path(cfg2, "chat", fp)
    batch = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}",
                               "data.features.regeneration.batch_size=64"])
    assert base == feature_set_path(batch, "chat", fp)
    drafted = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}",
                                 "data.features.regeneration.drafter=release:chat"])
    assert base == feature_set_path(drafted, "chat", fp), "the drafter that speeds regeneration up is not keyed"
    longer = load_config(None, ["data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}}",
                                "data.features.regeneration.max_new_tokens=7"])
    assert base != feature_set_path(longer, "chat", fp)
    with pytest.raises(ValueError, match="unknown dataset"):
        feature_set_path(cfg, "math", fp)


@pytest.mark.integration
def test_prompt_only_source_is_regenerated_by_the_target(tmp_path, monkeypatch, embedded_target, ray_session):
    monkeypatch.setattr(feature_sets, "features_root", lambda: tmp_path / "features")
    monkeypatch.setattr(regeneration, "regenerations_root", lambda: tmp_path / "regenerations")
    data = tmp_path / "problems.jsonl"
    too_long = "Add these numbers: " + " + ".join(str(n) for n in range(100))
    _write_jsonl(data, [{"problem": "What is 3 + 4?"}, {"problem": too_long}, {"problem": "Name a prime number."}])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        "target: {dtype: float32}\n"  # the regeneration actors load the target as configured; the reference is fp32
        "data:\n  datasets:\n    math:\n      domain: math\n"
        f"      alternatives:\n        - {{kind: jsonl, path: {data}, regenerate: true}}\n"
        "  features: {max_len: 96, regeneration: {max_new_tokens: 12, batch_size: 2}}\n"
    )
    cfg = load_config(cfg_path)
    result = prepare_features(cfg, target=embedded_target)[0]
    assert result.regenerated == 2 and result.rows == 2
    assert result.skipped["prompt_fills_max_len"] == 1
    tok = embedded_target.tokenizer
    rows = load_feature_set(cfg, "math", embedded_target.fingerprint.to_dict()).read_rows()
    for row in rows:
        question = "What is 3 + 4?" if "3 + 4" in tok.decode(row["input_ids"]) else "Name a prime number."
        prompt = embedded_target.encode_chat([{"role": "user", "content": question}])[0]
        greedy = embedded_target.model.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, prompt.numel():]
        assistant = tok.decode(row["input_ids"][row["loss_mask"].bool()]).replace("<|im_end|>", "")
        assert assistant.strip() and assistant.strip() == tok.decode(greedy, skip_special_tokens=True).strip()
    stored = [json.loads(line) for path in (tmp_path / "regenerations").glob("*.jsonl")
              for line in path.read_text().splitlines()]
    assert len(stored) == 2 and all(entry["response"] for entry in stored)


def test_eagle3_feature_sets_store_the_three_layers_and_change_the_key():
    """A dataset an eagle3 variant reads (or every dataset under ``data.features.layers: eagle3``) stores
    hidden states 2, L/2, L-3 and L; its key changes, the key of a last-state set does not."""
    fp = {"name": "a", "hidden_size": 8, "vocab_size": 16, "embed_hash": "abc"}
    datasets = ("data.datasets={chat: {domain: chat, alternatives: [{kind: sharegpt}]}, "
                "math: {domain: math, alternatives: [{kind: gsm8k_test_split}]}}")
    mixtures = "mixtures={m: {counts: {math: 4}}, c: {counts: {chat: 4}}}"
    plain = load_config(None, [datasets, mixtures, "variants=[{name: v, mixture: c}]"])
    eagle3 = load_config(None, [datasets, mixtures, "variants=[{name: v, mixture: c}, "
                                                    "{name: w, mixture: m, algorithm: eagle3}]"])
    forced = load_config(None, [datasets, mixtures, "data.features.layers=eagle3"])
    last = load_config(None, [datasets, mixtures, "variants=[{name: w, mixture: m, algorithm: eagle3}]",
                              "data.features.layers=last"])
    assert [feature_sets.feature_kind(eagle3, n) for n in ("math", "chat")] == ["eagle3", "last"]
    assert feature_sets.feature_kind(forced, "chat") == "eagle3" and feature_sets.feature_kind(last, "math") == "last"
    base = {n: feature_set_path(plain, n, fp) for n in ("math", "chat")}
    assert base["math"].name == "math-" + feature_sets.feature_key(fp, plain.data.datasets["math"], 384,
                                                                    plain.data.features.regeneration)
    assert feature_set_path(eagle3, "chat", fp) == base["chat"] == feature_set_path(last, "chat", fp)
    assert feature_set_path(eagle3, "math", fp) != base["math"]
    assert feature_set_path(forced, "math", fp) == feature_set_path(eagle3, "math", fp)
    assert feature_sets.stored_layers("eagle3", 30) == (2, 15, 27, 30)
    assert feature_sets.stored_layers("last", 30) == (30,)


def test_rows_decode_the_layers_a_drafter_needs():
    """The last hidden state ends every row: an EAGLE-2 drafter reads the last H columns of an EAGLE-3 row,
    an EAGLE-3 drafter all four blocks; a row of the last state alone is refused for EAGLE-3, naming the fix."""
    hidden = torch.arange(3 * 4 * 8, dtype=torch.bfloat16).view(3, 32)
    row = {"row_id": 5, "length": 3, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1],
           "hidden": hidden.contiguous().view(torch.int16).numpy().tobytes()}
    assert torch.equal(feature_sets.decode_row(row, 8)["hidden"], hidden[:, 24:])
    assert torch.equal(feature_sets.decode_row(row, 8, 4)["hidden"], hidden)
    narrow = {**row, "hidden": hidden[:, 24:].contiguous().view(torch.int16).numpy().tobytes()}
    with pytest.raises(ValueError, match=r"feature row 5 stores 1 hidden state\(s\) of size 8, 4 needed: .*"
                                         r"data.features.layers: eagle3"):
        feature_sets.decode_row(narrow, 8, 4)


def test_a_selection_comes_back_in_row_order_whatever_the_shard_order(tmp_path, monkeypatch):
    """Parallel actors write shards in any order: a held-out selection is sorted by row_id, streamed batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def shard(name, ids):
        pq.write_table(pa.table({"row_id": pa.array(ids, pa.int64()), "length": pa.array([1] * len(ids), pa.int64())}),
                       tmp_path / name)

    shard("part-0.parquet", [7, 3])
    shard("part-1.parquet", [5, 0, 9])
    fs = feature_sets.FeatureSet("chat", tmp_path, {"rows": 5})
    monkeypatch.setattr(feature_sets, "SELECT_BATCH_ROWS", 1)
    assert fs.read_table([9, 0, 7, 3]).column("row_id").to_pylist() == [0, 3, 7, 9]
    assert fs.read_table([5], ["row_id"]).to_pylist() == [{"row_id": 5}]
    assert fs.read_table().column("row_id").to_pylist() == [7, 3, 5, 0, 9]
