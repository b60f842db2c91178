import json

import pytest

from taps_ray.config import ExperimentConfig, RegenerationConfig
from taps_ray.data import features, regeneration
from taps_ray.data.regeneration import ResponseStore, prompt_key, store_key

FP = {"name": "t", "hidden_size": 8, "vocab_size": 16, "embed_hash": "abc"}


def test_store_key_ignores_batch_size_but_not_what_decides_the_response():
    base = store_key(FP, "cpu:bfloat16", RegenerationConfig())
    assert base == store_key(FP, "cpu:bfloat16", RegenerationConfig(batch_size=64))
    assert base == store_key(FP, "cpu:bfloat16", RegenerationConfig(drafter="release:chat"))
    assert base == store_key({**FP, "name": "renamed"}, "cpu:bfloat16", RegenerationConfig())
    assert base != store_key(FP, "cpu:float32", RegenerationConfig())
    assert base != store_key(FP, "cpu:bfloat16", RegenerationConfig(max_new_tokens=7))
    assert base != store_key({**FP, "embed_hash": "abd"}, "cpu:bfloat16", RegenerationConfig())


def test_prompt_key_depends_on_roles_and_order():
    user = [{"role": "user", "content": "2+2?"}]
    assert prompt_key(user) == prompt_key([dict(user[0])])
    assert prompt_key(user) != prompt_key([{"role": "system", "content": "2+2?"}])
    assert prompt_key([{"role": "system", "content": "a"}, *user]) != prompt_key([*user, {"role": "system", "content": "a"}])


def test_store_persists_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "s.jsonl"
    store = ResponseStore(path)
    store.add([("k1", "one"), ("k2", "two\nlines")])
    with path.open("a") as fh:
        fh.write('{"prompt": "k3", "resp')
    reopened = ResponseStore(path)
    assert len(reopened) == 2 and reopened.get("k2") == "two\nlines" and reopened.get("k3") is None
    reopened.add([("k3", "three")])
    again = ResponseStore(path)
    assert again.get("k3") == "three" and len(again) == 3
    assert all(json.loads(line)["prompt"] for line in path.read_text().splitlines()[-1:])


class _FakeTarget:
    class device:
        type = "cpu"

    class fingerprint:
        @staticmethod
        def to_dict():
            return FP

    @staticmethod
    def describe():
        return {"dtype": "bfloat16"}


def test_regenerate_reuses_stored_responses_without_decoding(tmp_path, monkeypatch):
    monkeypatch.setattr(regeneration, "regenerations_root", lambda: tmp_path)
    cfg = ExperimentConfig()
    conversations = [[{"role": "user", "content": q}] for q in ("a?", "b?")]
    store = ResponseStore.open(FP, "cpu:bfloat16", cfg.data.features.regeneration)
    store.add([(prompt_key(c), f"answer {c[0]['content']}") for c in conversations])

    def no_ray(*args, **kwargs):
        raise AssertionError("every response is stored; nothing should be decoded")

    monkeypatch.setattr(features, "RegenerateActor", no_ray)
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    out = features._regenerate(cfg, conversations, _FakeTarget(), "math")
    assert [c[-1] for c in out] == [{"role": "assistant", "content": "answer a?"},
                                    {"role": "assistant", "content": "answer b?"}]
    with pytest.raises(ImportError):
        features._regenerate(cfg, [[{"role": "user", "content": "new?"}]], _FakeTarget(), "math")


@pytest.mark.slow
def test_regeneration_decodes_a_batch_with_the_release_drafter_losslessly(embedded_target):
    """The actor answers a batch together, drafted by release:math and sized by the cost model: each
    answer is the target's own greedy answer decoded alone."""
    from taps_ray.config import TargetConfig
    from taps_ray.spec.decoder import generate

    questions = ["What is 12 times 7?", "Name a primary colour.", "If I have 3 apples and eat one, how many are left?"]
    batch = {"row_id": [5, 6, 7], "messages": [json.dumps([{"role": "user", "content": q}]) for q in questions]}
    actor = features.RegenerateActor(TargetConfig(dtype="float32").model_dump(),
                                     RegenerationConfig(max_new_tokens=24).model_dump())
    assert actor.drafter is not None and actor.drafter.metadata.get("name")
    out = actor(batch)
    alone = [generate(embedded_target, [{"role": "user", "content": q}], max_new_tokens=24).text for q in questions]
    assert list(out["response"]) == alone and list(out["row_id"]) == [5, 6, 7]
    assert actor.budget.cost is not None and actor.budget.chosen
    plain = features.RegenerateActor(TargetConfig(dtype="float32").model_dump(),
                                     RegenerationConfig(max_new_tokens=24, drafter=None).model_dump())
    assert plain.drafter is None and list(plain(batch)["response"]) == alone


def test_regeneration_measures_both_modes_then_keeps_the_faster_and_tries_the_other_again(capsys):
    """With a drafter the first batch drafts and the second decodes plainly; then the faster mode runs, the
    slower one every RECHECK_EVERY-th batch; without a drafter every batch decodes plainly."""
    actor = features.RegenerateActor.__new__(features.RegenerateActor)
    actor.drafter, actor.rates, actor.batches, actor.label = object(), {}, 0, "math"
    modes = []
    for _ in range(2 * features.RECHECK_EVERY):
        drafting = actor.drafting()
        modes.append(drafting)
        actor.observe(drafting, 50.0 if drafting else 100.0)
    assert modes[:2] == [True, False]
    assert [i for i, mode in enumerate(modes) if mode] == [0, features.RECHECK_EVERY]
    assert "50 tokens/s with the drafter, 100 plainly batched: decoding plainly" in capsys.readouterr().out
    actor.rates = {True: 120.0, False: 100.0}
    assert actor.drafting() is (actor.batches % features.RECHECK_EVERY != 0)
    actor.drafter = None
    assert actor.drafting() is False
