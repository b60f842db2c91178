"""taps eval runner on a tiny target: strategy expansion, records, conversations, resume, refusal, Ray sharding."""

from __future__ import annotations

import json
from collections import Counter
from functools import partial

import pytest

from taps_ray.config import load_config
from taps_ray.data.benchmarks import BenchmarkQuestion
from taps_ray.eval.plan import EvalError, expand_strategies, make_plan
from taps_ray.eval.questions import select_questions
from taps_ray.eval.records import RECORDS, RUN_FILE, read_records, record_key
from taps_ray.eval.runner import run_eval
from taps_ray.eval.worker import EvalWorker, Unit, conversation_ids
from taps_ray.spec.decoder import generate
from tests.eval.eval_helpers import chat_tiny_target

QUESTIONS = {
    "mt_bench": [BenchmarkQuestion(81, "writing", ["Write a travel blog post.", "Rewrite it in one line."], "mt_bench")],
    "gsm8k": [BenchmarkQuestion(0, "gsm8k", ["What is 17 + 25?"], "gsm8k"),
              BenchmarkQuestion(7, "gsm8k", ["A train goes 60 km in 1.5 hours. Speed?"], "gsm8k")],
}
FACTORY = partial(chat_tiny_target, 0)
BASE = ["tree.depth=2", "tree.top_k=3", "tree.total_tokens=8", "tree.lookup_tokens=0", "eval.max_new_tokens=10", "eval.num_actors=0",
        "eval.benchmarks=[mt_bench, gsm8k]", "eval.temperatures=[0, 1]", "eval.drafters={math: 'random:0', chat: 'random:1'}"]


def config(*extra: str):
    return load_config(None, BASE + list(extra))


def by_key(records: list[dict]) -> dict:
    return {record_key(r): r for r in records}


def outcome(record: dict) -> tuple:
    """What a rerun reproduces: a paper record's output and steps; a production record's greedy output (its
    trees follow measured timings; at T > 0 another tree draws another sample of the same law)."""
    if record["method"] == "production":
        return record["output_crc"] if record["temperature"] == 0 else None
    return record["output_crc"], record["accepted"], record["steps"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "full"
    run_eval(config(), out, questions=QUESTIONS, target_factory=FACTORY, report=False)
    return out, read_records(out)


def test_expand_strategies():
    names = expand_strategies(["single", "averaged", "routed:confidence", "merged:budget"], ["math", "chat"],
                              ["math", "chat"], alphas=[0.25, 0.5])
    assert names == ["vanilla", "single:math", "single:chat", "averaged:0.5", "routed:confidence:step",
                     "merged:budget", "averaged:0.25"]
    assert expand_strategies(["averaged"], ["a", "b", "c"], ["a", "b", "c"]) == ["vanilla", "averaged"]
    with pytest.raises(EvalError, match="unknown strategy 'routed'"):
        expand_strategies(["routed"], ["a", "b"], ["a", "b"])
    with pytest.raises(EvalError, match="no drafter named 'math'"):
        expand_strategies(["single:math"], ["a"], ["a"])
    with pytest.raises(EvalError, match="needs at least 2 drafters"):
        expand_strategies(["merged:union"], ["a"], ["a"])
    with pytest.raises(EvalError, match="interpolates two drafters"):
        expand_strategies(["averaged:0.3"], ["a", "b", "c"], ["a", "b", "c"])


@pytest.mark.slow
def test_records_cover_every_cell_with_consistent_fields(full_run):
    out, records = full_run
    strategies = ["vanilla", "single:math", "single:chat", "averaged:0.5", "routed:confidence:step",
                  "routed:entropy:request", "merged:union", "merged:budget"]
    paper = [r for r in records if r["method"] == "paper"]
    production = [r for r in records if r["method"] == "production"]
    assert len(records) == len(by_key(records)) == 3 * 2 * (2 * len(strategies) - 1)
    assert {r["strategy"] for r in paper} == set(strategies) == {r["strategy"] for r in production} | {"vanilla"}
    assert {r.get("batched") for r in paper if r["strategy"] != "vanilla"} == {len(strategies) - 1}
    assert not any("batched" in r for r in production + [r for r in paper if r["strategy"] == "vanilla"])
    assert all(s <= 8 for r in paper if r["strategy"] != "merged:union" for s in r["tree_size"])
    assert not any(r["strategy"] == "merged:budget" and set(r["tree_size"]) != {8} for r in paper)
    run = json.loads((out / RUN_FILE).read_text())
    assert run["identity"]["drafters"] == {"math": {"random_seed": 0}, "chat": {"random_seed": 1}}
    for r in records:
        n = r["steps"]
        assert len(r["accepted"]) == len(r["step_appended"]) == len(r["tree_size"]) == len(r["tree_depth"]) == n
        assert r["appended"] == sum(r["step_appended"]) == sum(r["new_tokens"]) - r["turns"]
        assert r["tau"] == pytest.approx(r["appended"] / n) and r["tokens_per_s"] > 0
        assert r["drafters"] == {"vanilla": [], "single:math": ["math"], "single:chat": ["chat"]}.get(
            r["strategy"], ["math", "chat"])
        if r["strategy"] != "vanilla":
            assert len(r["draft_entropy"]) == len(r["rejected_draft_entropy"]) == n
            assert all(len(e) == a for e, a in zip(r["draft_entropy"], r["accepted"]))
        if r["strategy"].startswith("routed:"):
            plain = {None} if r["method"] == "production" else set()
            assert len(r["routes"]) == len(r["signals"]) == n and set(r["routes"]) <= {"math", "chat", *plain}
            assert len(r["decisions"]) == r["turns"]
        if r["strategy"].startswith("merged:"):
            assert len(r["union_size"]) == n
            assert all(s <= 1 + 2 * 7 for s in r["union_size"])
    greedy = [r for r in records if r["temperature"] == 0]
    vanilla = {(r["benchmark"], r["question_id"]): r["output_crc"] for r in greedy if r["strategy"] == "vanilla"}
    assert all(r["output_crc"] == vanilla[(r["benchmark"], r["question_id"])] for r in greedy)
    exactness = json.loads((out / "exactness.json").read_text())
    turns = sum(len(r["output_ids"]) for r in greedy if r["strategy"] == "vanilla")
    assert exactness["dtype"] == "float32" and exactness["prompts"] == turns and exactness["divergences"] == []
    assert exactness["identical"] == {name: turns for s in strategies if s != "vanilla"
                                      for name in (s, f"{s} (production)")}
    plan = make_plan(config())
    assert plan.tree["adaptive"] is False and plan.tree["lookup_tokens"] == 0 and plan.production_tree["adaptive"]
    assert make_plan(config("eval.method=paper")).production_tree is None
    only = make_plan(config("eval.method=production"))
    assert only.method == "production" and only.production_tree is None and only.tree["adaptive"]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paper_trees_decoded_together_equal_their_runs_one_by_one(temperature):
    """With production runs the paper-tree strategies of a question decode in one batch; their outputs, steps
    and acceptance (what the tables read) equal those of the same strategies run one after another."""
    both = EvalWorker(make_plan(config()), FACTORY, warmup=False)
    alone = EvalWorker(make_plan(config("eval.method=paper")), FACTORY, warmup=False)
    names = [n for n in both.plan.strategies if n != "vanilla"]
    question = QUESTIONS["mt_bench"][0]
    together = both.run(Unit(question, temperature, names))
    one_by_one = alone.run(Unit(question, temperature, names))
    assert [r["batched"] for r in together] == [len(names)] * len(names)
    assert [outcome(r) for r in together] == [outcome(r) for r in one_by_one]
    assert [r["prompt_ids"] for r in together] == [r["prompt_ids"] for r in one_by_one]


def test_second_turn_is_asked_after_the_first_answer():
    target = FACTORY()
    turns = QUESTIONS["mt_bench"][0].turns
    first = conversation_ids(target, turns[:1], [])
    answer = generate(target, first, max_new_tokens=6)
    second = conversation_ids(target, turns, [answer])
    assert second[:first.numel()].tolist() == first.tolist()
    assert second[first.numel():first.numel() + 6].tolist() == answer.token_ids
    assert second.numel() > first.numel() + 6


def test_worker_runs_mt_bench_as_a_conversation():
    plan = make_plan(config("eval.strategies=[vanilla]"))
    worker = EvalWorker(plan, FACTORY, warmup=False)
    question = QUESTIONS["mt_bench"][0]
    [record] = worker.run(Unit(question, 0.0, ["vanilla"]))
    assert record["turns"] == 2 and len(record["turn_steps"]) == 2
    first = conversation_ids(worker.target, question.turns[:1], [])
    assert record["prompt_tokens"][0] == first.numel()
    assert record["prompt_tokens"][1] > record["prompt_tokens"][0] + record["new_tokens"][0]


@pytest.mark.integration
def test_chat_template_conversation_includes_the_answer(embedded_target):
    class Answer:
        text = "Marmalade is a fine name."
        token_ids: list[int] = []

    ids = conversation_ids(embedded_target, ["Name a cat.", "Why that name?"], [Answer()])
    text = embedded_target.tokenizer.decode(ids.tolist())
    assert text.index("Name a cat.") < text.index("Marmalade is a fine name.") < text.index("Why that name?")
    assert text.rstrip().endswith("assistant")


@pytest.mark.slow
def test_interrupted_run_resumes_without_duplicates(full_run, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    calls = Counter()
    original = EvalWorker.run

    def killed_after_two_units(self, unit):
        calls["units"] += 1
        if calls["units"] > 2:
            raise KeyboardInterrupt
        return original(self, unit)

    monkeypatch.setattr(EvalWorker, "run", killed_after_two_units)
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(), out, questions=QUESTIONS, target_factory=FACTORY, report=False)
    partial_records = read_records(out)
    assert len(partial_records) == 2 * 15
    with open(out / RECORDS, "a") as handle:
        handle.write(json.dumps(partial_records[0])[:57])

    def counting(self, unit):
        calls["resumed"] += len(unit.strategies) + len(unit.production)
        return original(self, unit)

    monkeypatch.setattr(EvalWorker, "run", counting)
    run_eval(config(), out, questions=QUESTIONS, target_factory=FACTORY, report=False)
    assert calls["resumed"] == 6 * 15 - 2 * 15
    lines = (out / RECORDS).read_text().splitlines()
    keys = [record_key(json.loads(line)) for line in lines]
    assert len(keys) == len(set(keys)) == 6 * 15
    expected = by_key(full_run[1])
    assert {k: outcome(r) for k, r in by_key(read_records(out)).items()} == {k: outcome(r) for k, r in expected.items()}

    calls.clear()
    run_eval(config(), out, questions=QUESTIONS, target_factory=FACTORY, report=False)
    assert calls["resumed"] == 0 and len((out / RECORDS).read_text().splitlines()) == 6 * 15


@pytest.mark.slow
def test_folder_of_another_configuration_is_refused(full_run, tmp_path):
    out, _ = full_run
    with pytest.raises(EvalError, match=r"other settings \(max_new_tokens: 10 in the folder, 12 now\)"):
        run_eval(config("eval.max_new_tokens=12"), out, questions=QUESTIONS, target_factory=FACTORY, report=False)
    with pytest.raises(EvalError, match="drafters.chat.random_seed: 1 in the folder, 2 now"):
        run_eval(config("eval.drafters={math: 'random:0', chat: 'random:2'}"), out, questions=QUESTIONS,
                 target_factory=FACTORY, report=False)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / RECORDS).write_text("{}\n")
    with pytest.raises(EvalError, match="no run.json"):
        run_eval(config(), stray, questions=QUESTIONS, target_factory=FACTORY, report=False)


def test_missing_drafter_folder_is_an_error(tmp_path):
    with pytest.raises(EvalError, match="drafter 'math': .* is not a drafter checkpoint folder"):
        make_plan(config(f"eval.drafters={{math: '{tmp_path}/nope', chat: 'random:1'}}"))


def test_ray_actors_shard_the_units_and_match_in_process(full_run, tmp_path, ray_session):
    out = tmp_path / "ray"
    run_eval(config("eval.num_actors=2", "eval.temperatures=[0]"), out, questions=QUESTIONS, target_factory=FACTORY,
             report=False)
    records = read_records(out)
    assert len(records) == 3 * 15 and len({r["worker"] for r in records}) == 2
    expected = by_key(full_run[1])
    assert all(outcome(r) == outcome(expected[record_key(r)]) for r in records)


# -- contamination guard and unavailable benchmarks ------------------------------------------------

def _trained_drafter(folder, prompts: list[str]):
    """A real (untrained) drafter of the test target whose ``trained_prompts.json`` lists ``prompts``."""
    from taps_ray.data.contamination import prompt_hash, trained_prompts_record, write_trained_prompts
    from taps_ray.models.drafter import DraftHead

    target = FACTORY()
    DraftHead(target.config, seed=5).save(folder, target.fingerprint)
    write_trained_prompts(folder, trained_prompts_record({prompt_hash(p) for p in prompts}, ["test"]))
    return folder


def test_selection_excludes_exactly_the_questions_a_drafter_trained_on(tmp_path):
    from taps_ray.data.benchmarks import benchmark_questions
    from taps_ray.data.sources import seeded_subset

    gsm8k, _ = benchmark_questions("gsm8k")
    seen = [gsm8k[i].turns[0] for i in (0, 3, 4)] + ["  " + gsm8k[10].turns[0].upper()]  # normalized alike
    math = _trained_drafter(tmp_path / "math", seen)
    plan = make_plan(config(f"eval.drafters={{math: '{math}', chat: 'random:1'}}",
                                   "eval.benchmarks=[gsm8k, mt_bench]", "eval.limit=null"))
    selection = select_questions(plan)
    assert {q.question_id for q in gsm8k} - {q.question_id for q in selection.questions["gsm8k"]} == {0, 3, 4, 10}
    assert selection.info["gsm8k"] == {"origin": selection.info["gsm8k"]["origin"], "total": 1319, "excluded": 4,
                                       "excluded_by": ["math"], "selected": 1315}
    assert selection.info["mt_bench"]["excluded"] == 0 and selection.info["mt_bench"]["selected"] == 80
    assert selection.notes[0] == "gsm8k: 1315 of 1315 questions drawn; 4 of 1319 excluded as seen in training by math"
    assert plan.identity()["excluded_prompts"]
    # The seeded limit is drawn after the exclusion, from the questions left.
    limited = select_questions(make_plan(config(
        f"eval.drafters={{math: '{math}', chat: 'random:1'}}", "eval.benchmarks=[gsm8k]", "eval.limit=5")))
    kept = [q for q in gsm8k if q.question_id not in (0, 3, 4, 10)]
    assert limited.questions["gsm8k"] == [kept[i] for i in seeded_subset(len(kept), 5, 0)]
    assert limited.notes == ["gsm8k: 5 of 1315 questions drawn; 4 of 1319 excluded as seen in training by math"]


def test_unavailable_benchmarks_are_skipped_with_one_line(tmp_path, monkeypatch):
    from tests.data.data_helpers import cut_off_hub

    monkeypatch.delenv("TAPS_DATA_DIR", raising=False)
    cut_off_hub(monkeypatch)
    plan = make_plan(config("eval.benchmarks=[math_500, gsm8k, svamp]", "eval.limit=2"))
    selection = select_questions(plan)
    assert list(selection.questions) == ["gsm8k"] and len(selection.questions["gsm8k"]) == 2
    skipped = [n for n in selection.notes if "skipped" in n]
    assert [n.split(":")[0] for n in skipped] == ["math_500", "svamp"]
    assert all("\n" not in n and "TAPS_DATA_DIR is not set" in n and "127.0.0.1:9" in n for n in skipped)
    assert "skipped" in selection.info["svamp"]
    with pytest.raises(EvalError, match="no benchmark of \\['math_500'\\] can be evaluated here"):
        select_questions(make_plan(config("eval.benchmarks=[math_500]")))


@pytest.mark.slow
def test_run_prints_and_records_exclusions_and_the_report_says_them(tmp_path, capsys):
    math = _trained_drafter(tmp_path / "math", ["what is 17 + 25?"])
    out = tmp_path / "run"
    run_eval(config(f"eval.drafters={{math: '{math}', chat: 'random:1'}}", "eval.strategies=[single]",
                    "eval.temperatures=[0]"), out, questions=QUESTIONS, target_factory=FACTORY)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("taps eval: ")]
    assert "taps eval: gsm8k: 1 of 1 questions drawn; 1 of 2 excluded as seen in training by math" in printed
    assert "taps eval: mt_bench: 1 of 1 questions drawn; none excluded" in printed
    assert {(r["benchmark"], r["question_id"]) for r in read_records(out)} == {("mt_bench", 81), ("gsm8k", 7)}
    run = json.loads((out / RUN_FILE).read_text())
    assert run["questions"]["gsm8k"]["excluded"] == 1 and run["identity"]["excluded_prompts"]
    report = (out / "report.md").read_text()
    assert "- questions, gsm8k: 1 of 1 questions drawn; 1 of 2 excluded as seen in training by math" in report


def test_the_warm_up_teaches_the_production_budgets_nothing():
    """The warm-up decodes a few tokens of a meaningless prompt with every strategy; a production budget that
    kept what it saw there would start the real questions believing drafting does not pay."""
    worker = EvalWorker(make_plan(config()), FACTORY, warmup=True)
    budgets = [s.tree_budget for s in worker.production.values() if getattr(s, "tree_budget", None) is not None]
    assert budgets and all(not b.chosen and b.should_draft() for b in budgets)
    assert all(b.cost is not None for b in budgets), "the cost model measured during the warm-up is kept"
