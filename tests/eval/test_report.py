"""The report generator on hand-made records: every table and claim computed from known numbers, files written."""

from __future__ import annotations

import json
import random

import pytest

from taps_ray.cli import main
from taps_ray.eval.claims import CLAIMS, FAILS, HOLDS, INCONCLUSIVE, MISSING, claim_line, evaluate_claims
from taps_ray.eval.records import RECORDS, RUN_FILE
from taps_ray.eval.report import build_tables, write_report

DEPTH = 4
HI = [1, 2, 3, 4, 4] * 2       # tau 3.8; depth rates 1, .8, .75, 4/6
MID = [0, 1, 2, 3, 4] * 2      # tau 3.0
LO = [0, 0, 1, 2, 2] * 2       # tau 2.0
MIN = [0, 0, 0, 1, 1] * 2      # tau 1.4
TOP = [2, 3, 4, 4, 4] * 2      # tau 4.4
COMPOSE = ["math", "chat"]


def record(strategy: str, bench: str, qid: int, accepted: list[int], speedup: float = 1.0, routes=None,
           crc: int = 7, drafters=None) -> dict:
    """A record whose entropies are 1.0 (draft) / 0.5 (target) at accepted tokens and 2.0 / 1.5 at rejected
    ones, with tokens/s = 10 * ``speedup``."""
    appended = [a + 1 for a in accepted]
    new_tokens = sum(appended) + 1
    r = {
        "benchmark": bench, "question_id": qid, "category": bench, "strategy": strategy,
        "drafters": drafters if drafters is not None else COMPOSE, "temperature": 0.0, "turns": 1,
        "prompt_tokens": [20], "new_tokens": [new_tokens], "finish": ["length"], "output_crc": [crc],
        "turn_steps": [len(accepted)], "steps": len(accepted), "appended": sum(appended),
        "tau": sum(appended) / len(accepted), "accepted": accepted, "step_appended": appended,
        "tree_size": [1 if strategy == "vanilla" else 8] * len(accepted),
        "tree_depth": [0 if strategy == "vanilla" else DEPTH] * len(accepted),
        "prefill_s": 0.01, "draft_s": 0.001 * len(accepted), "verify_s": 0.002 * len(accepted),
        "total_s": new_tokens / (10 * speedup), "tokens_per_s": 10 * speedup,
    }
    if strategy != "vanilla":
        r.update(draft_entropy=[[1.0] * a for a in accepted], target_entropy=[[0.5] * a for a in accepted],
                 rejected_draft_entropy=[2.0 if a < DEPTH else None for a in accepted],
                 rejected_target_entropy=[1.5 if a < DEPTH else None for a in accepted])
    if routes is not None:
        r.update(routes=routes, signals=[[0.3, 0.1] if x == "math" else [0.1, 0.3] for x in routes],
                 probes=[True] * len(routes), decisions=[None])
    if strategy.startswith("merged:"):
        r.update(union_size=[15] * len(accepted))
        if strategy == "merged:union":
            r["tree_size"] = [15] * len(accepted)
    return r


def paper_like_records(swap: bool = False) -> list[dict]:
    """Two questions of MT-Bench and GSM8K where every claim the report checks holds (docs/DESIGN.md, "Claims
    the report checks"; ``swap``: the math and chat drafters' results are exchanged, so claims 1 and 6 do not)."""
    math_p, chat_p = ("math", "chat") if not swap else ("chat", "math")
    plan = {
        "vanilla": {"mt_bench": [0] * 27, "gsm8k": [0] * 27},
        f"single:{math_p}": {"mt_bench": LO, "gsm8k": HI},
        f"single:{chat_p}": {"mt_bench": HI, "gsm8k": LO},
        "single:mixed": {"mt_bench": MID, "gsm8k": MID},
        "averaged:0.5": {"mt_bench": MIN, "gsm8k": MIN},
        "averaged:0": {"mt_bench": HI, "gsm8k": LO},
        "averaged:1": {"mt_bench": LO, "gsm8k": HI},
        "routed:confidence:step": {"mt_bench": HI, "gsm8k": HI},
        "routed:entropy:request": {"mt_bench": MID, "gsm8k": MID},
        "merged:union": {"mt_bench": TOP, "gsm8k": TOP},
        "merged:budget": {"mt_bench": MID, "gsm8k": MID},
    }
    out = []
    for strategy, cells in plan.items():
        for bench, accepted in cells.items():
            for qid in (0, 1):
                routes = None
                if strategy == "routed:confidence:step":
                    main_route = math_p if bench == "gsm8k" else chat_p
                    other = chat_p if main_route == math_p else math_p
                    routes = [main_route] * 8 + [other] * 2
                elif strategy == "routed:entropy:request":
                    routes = ["math" if qid == 0 else "chat"] * 10
                drafters = [] if strategy == "vanilla" else [strategy[7:]] if strategy.startswith("single:") else None
                out.append(record(strategy, bench, qid, list(accepted), speedup=1.5 if strategy != "vanilla" else 1.0,
                                  routes=routes, crc=8 if strategy == "merged:budget" and qid == 1 else 7,
                                  drafters=drafters))
    return out


def row(rows: list[dict], **match) -> dict:
    [found] = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found


@pytest.fixture(scope="module")
def tables():
    return build_tables(paper_like_records())[0]


def test_tau_table_is_appended_tokens_per_step(tables):
    math = row(tables["tau"], strategy="single:math")
    assert (math["mt_bench"], math["gsm8k"], math["avg"]) == pytest.approx((2.0, 3.8, 2.9))
    assert math["gsm8k_n"] == 2 and math["gsm8k_tau_q"] == pytest.approx(3.8)
    assert row(tables["tau"], strategy="vanilla")["avg"] == 1.0
    assert row(tables["tau"], strategy="merged:union")["avg"] == pytest.approx(4.4)


def test_routing_table_counts_steps_and_questions(tables):
    conf = row(tables["routing"], strategy="routed:confidence:step", benchmark="gsm8k", drafter="math")
    assert conf["step_share"] == pytest.approx(0.8) and conf["question_share"] == 1.0
    assert (conf["questions"], conf["of_questions"]) == (2, 2)
    assert conf["mean_signal_when_chosen"] == pytest.approx(0.3)
    ent = row(tables["routing"], strategy="routed:entropy:request", benchmark="mt_bench", drafter="chat")
    assert ent["step_share"] == 0.5 and ent["question_share"] == 0.5


def test_entropy_table_separates_accepted_and_rejected(tables):
    r = row(tables["entropy"], strategy="single:math", benchmark="all")
    assert (r["accepted_draft"], r["rejected_draft"], r["accepted_target"], r["rejected_target"]) == (1.0, 2.0, 0.5, 1.5)
    assert (r["draft_delta"], r["target_delta"]) == (1.0, 1.0)
    assert r["accepted_tokens"] == sum(HI) * 2 + sum(LO) * 2
    assert r["rejected_tokens"] == sum(a < DEPTH for a in HI + LO) * 2


def test_acceptance_by_depth(tables):
    r = row(tables["depth"], strategy="single:math", benchmark="gsm8k")
    assert [r[f"d{d}"] for d in range(1, 5)] == pytest.approx([1.0, 0.8, 0.75, 4 / 6])
    assert [r[f"n{d}"] for d in range(1, 5)] == [20, 20, 16, 12]


def test_acceptance_by_depth_counts_a_path_ending_at_a_leaf_apart_from_a_rejection():
    leafy = record("single:math", "gsm8k", 1, [1, 1, 2, 0])
    leafy["rejected"] = [True, False, False, True]
    r = row(build_tables([leafy])[0]["depth"], benchmark="gsm8k")
    assert [r[f"n{d}"] for d in range(1, 5)] == [4, 2, 0, 0]
    assert [r[f"leaf{d}"] for d in range(1, 5)] == [0, 1, 1, 0]
    assert [r[f"d{d}"] for d in range(1, 3)] == pytest.approx([3 / 4, 1 / 2])


def test_tau_vs_alpha(tables):
    assert [r["alpha"] for r in tables["alpha"]] == [0.0, 0.5, 1.0]
    assert [r["avg"] for r in tables["alpha"]] == pytest.approx([2.9, 1.4, 2.9])


def test_speed_against_vanilla_on_the_same_questions(tables):
    r = row(tables["speed"], strategy="single:math")
    assert r["speedup"] == pytest.approx(1.5) and r["vanilla_tokens_per_s"] == pytest.approx(10.0)
    assert r["same_output_as_vanilla"] == 1.0 and r["tree_size"] == 8
    assert (r["speedup_low"], r["speedup_high"]) == pytest.approx((1.5, 1.5)), "1.5x on every question"
    budget = row(tables["speed"], strategy="merged:budget")
    assert budget["same_output_as_vanilla"] == 0.5 and budget["union_size"] == 15 and budget["tree_size"] == 8
    assert row(tables["speed"], strategy="merged:union")["tree_size"] == 15


def test_a_speedup_that_varies_by_question_is_printed_with_its_interval():
    from taps_ray.eval.report import speed_section

    records = [record("vanilla", b, q, [0] * 10) for b in ("gsm8k", "mt_bench") for q in range(3)]
    records += [record("single:math", b, q, [1] * 10, speedup=s)
                for b, speeds in (("gsm8k", (0.8, 1.3, 1.0)), ("mt_bench", (1.2, 0.9, 1.1))) for q, s in enumerate(speeds)]
    tables, data = build_tables(records)
    r = row(tables["speed"], strategy="single:math")
    assert r["speedup_low"] < 1.0 < r["speedup_high"] and r["speedup_low"] < r["speedup"] < r["speedup_high"]
    text = "\n".join(speed_section(tables, data, 0.0))
    assert f"| {r['speedup']:.2f} [{r['speedup_low']:.2f}, {r['speedup_high']:.2f}] |" in text
    assert "95% bootstrap interval over those questions" in text


def test_records_decoded_in_a_batch_have_no_speed_and_the_report_says_why():
    from taps_ray.eval.report import speed_section

    records = [{**r, "batched": 7} if r["strategy"] not in ("vanilla", "single:math") else r
               for r in paper_like_records()]
    tables, data = build_tables(records)
    assert {r["strategy"] for r in tables["speed"]} == {"vanilla", "single:math"}
    assert row(tables["tau"], strategy="merged:budget")["avg"] == row(build_tables(paper_like_records())[0]["tau"],
                                                                        strategy="merged:budget")["avg"]
    text = "\n".join(speed_section(tables, data, 0.0))
    assert "decoded 7 strategies at a time" in text


def test_claims_hold_on_paper_like_numbers(tables):
    """Every claim holds on these numbers but two. 5b: the budget merge (tau 3.0) is below confidence routing
    (3.8). 6 holds only on the run's own two questions: entropy routing sends one of them to each drafter, so
    a resample of the same question twice separates as well as confidence routing (margin 0 inside its
    interval): inconclusive, as two questions should be."""
    claims = {c["id"]: c for c in tables["claims"]}
    assert [c["id"] for c in tables["claims"]] == [1, 2, 3, 4, 5, "5b", 6, 7, 8]
    assert [c["status"] for c in tables["claims"]] == [HOLDS] * 5 + [FAILS, INCONCLUSIVE] + [HOLDS] * 2
    assert "merged:union 4.40 (15.00 nodes verified per step)" in claims[5]["evidence"]
    assert "highest other routed:confidence:step 3.80 (8.00 nodes)" in claims["5b"]["evidence"]
    assert "higher in 20/20 cells" in claims[7]["evidence"] and "verifier entropy at rejected 1.50" in claims[7]["evidence"]
    assert claims[6]["margin"] > 0 and claims[6]["low"] <= 0 < claims[6]["high"]
    assert all(c["low"] == pytest.approx(c["margin"]) == pytest.approx(c["high"]) for c in tables["claims"]
               if c["id"] != 6), "identical questions: no spread"
    assert "n = 2 questions per benchmark" in claims[1]["evidence"]
    assert "gsm8k: math 3.80 vs chat 2.00" in claims[1]["evidence"]
    assert "not measured: math_500, svamp" in claims[1]["evidence"]
    assert "single:mixed 3.00" in claims[2]["evidence"]
    assert "averaged:0.5 1.40" in claims[3]["evidence"]
    assert "merged:union 4.40" in claims[5]["evidence"]
    assert "4/4 math-benchmark questions" not in claims[6]["evidence"]
    assert "2/2 math-benchmark questions to math" in claims[6]["evidence"]
    assert "rejected 2.00" in claims[7]["evidence"] and "accepted 1.00" in claims[7]["evidence"]
    assert "negative in 9/9 strategies" in claims[8]["evidence"], "averaged:0.5 reaches one depth with support"


def noisy_specialists(questions: int, lead: float) -> list[dict]:
    """single:math and single:chat on GSM8K and MT-Bench, each question's accepted lengths drawn around the
    specialist's ``lead`` in tau on its own benchmark (seeded)."""
    rng = random.Random(questions)
    out = []
    for bench, own in (("gsm8k", "single:math"), ("mt_bench", "single:chat")):
        for qid in range(questions):
            for strategy in ("single:math", "single:chat"):
                base = 1.5 + (lead if strategy == own else 0.0)
                accepted = [max(0, min(DEPTH, round(rng.gauss(base, 1.5)))) for _ in range(10)]
                out.append(record(strategy, bench, qid, accepted, drafters=[strategy[7:]]))
    return out


@pytest.mark.slow
def test_a_claim_is_inconclusive_on_few_noisy_questions_and_decided_on_many():
    few = {c["id"]: c for c in evaluate_claims(build_tables(noisy_specialists(3, 0.3))[1])}
    many = {c["id"]: c for c in evaluate_claims(build_tables(noisy_specialists(200, 0.3))[1])}
    wrong = {c["id"]: c for c in evaluate_claims(build_tables(noisy_specialists(200, -0.3))[1])}
    assert few[1]["status"] == INCONCLUSIVE and few[1]["low"] < 0 < few[1]["high"]
    assert many[1]["status"] == HOLDS and many[1]["low"] > 0
    assert wrong[1]["status"] == FAILS and wrong[1]["high"] < 0
    assert (many[1]["high"] - many[1]["low"]) < (few[1]["high"] - few[1]["low"]) / 3
    assert "n = 200 questions per benchmark" in many[1]["evidence"]
    assert few[2]["status"] == MISSING and few[2]["margin"] is None
    same = [record(s, b, q, [q % 3, 2, 1, 3], drafters=[s[7:]]) for s in ("single:math", "single:chat")
            for b in ("gsm8k", "mt_bench") for q in range(4)]
    tie = {c["id"]: c for c in evaluate_claims(build_tables(same)[1])}
    assert (tie[1]["low"], tie[1]["high"]) == (0.0, 0.0) and tie[1]["status"] == FAILS, "a tie is not a lead"


@pytest.mark.slow
def test_claims_follow_the_numbers_not_the_expectations():
    claims = {c["id"]: c["status"] for c in build_tables(paper_like_records(swap=True))[0]["claims"]}
    assert claims[1] == FAILS and claims[6] == FAILS
    assert claims[3] == HOLDS and claims[5] == HOLDS
    few = [r for r in paper_like_records() if r["strategy"] in ("vanilla", "single:math")]
    statuses = {c["id"]: c["status"] for c in build_tables(few)[0]["claims"]}
    assert all(statuses[i] == MISSING for i in range(1, 7))


@pytest.mark.slow
def test_report_states_each_claim_in_words(tmp_path):
    """A report read on its own says what each claim is, whether it holds and on which numbers."""
    out = tmp_path / "run"
    out.mkdir()
    few = [r for r in paper_like_records(swap=True) if not r["strategy"].startswith(("routed:", "merged:"))]
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in few))
    text = write_report(out).read_text()
    ids = [str(c) for c in CLAIMS]
    lines = {line.split(".")[0]: line for line in text.splitlines() if line.split(".")[0] in ids}
    assert sorted(lines) == sorted(ids)
    lines = {int(k) if k.isdigit() else k: v for k, v in lines.items()}
    assert lines[1].startswith("1. The math-trained drafter has a higher tau than the chat-trained one on GSM8K, "
                               "MATH-500 and SVAMP; the chat-trained one is higher on MT-Bench. — **does not hold** (")
    assert "gsm8k: math 2.00 vs chat 3.80" in lines[1]
    assert lines[3].startswith("3. Averaging the weights of the math and chat drafters (alpha = 0.5) gives a lower "
                               "average tau than either of them. — **holds** (average tau: averaged:0.5 1.40")
    assert lines[5].startswith("5. Verifying the merged trees of the two drafters (their union, which verifies up to both "
                               "trees' nodes) gives the highest average tau of all strategies. — **not measured** "
                               "(needs merged:union")
    for claim in build_tables(few)[0]["claims"]:
        assert lines[claim["id"]] == claim_line(claim)
        assert CLAIMS[claim["id"]].text in lines[claim["id"]] and claim["evidence"] in lines[claim["id"]]
    assert "section 10" not in text and "shared/" not in text
    plain = claim_line({"id": 7, "claim": CLAIMS[7].text, "status": HOLDS, "evidence": "2.00 vs 1.00"}, bold=False)
    assert plain == ("7. Rejected draft tokens have a higher draft entropy than accepted ones, in every strategy and "
                     "benchmark. — holds (2.00 vs 1.00)")


@pytest.mark.slow
def test_write_report_and_cli(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    records = paper_like_records()
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / RUN_FILE).write_text(json.dumps({"identity": {"target": {"model": "tiny"}}, "drafters": {"math": "m"}}))
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "## Claims" in text and "| single:math | 2.00 [2.00, 2.00] | 3.80 [3.80, 3.80] | 2.90 [2.90, 2.90] |" in text
    assert "| single:math | 1.00 | 2.00 | 1.00 | 0.50 | 1.50 | 1.00 |" in text, "draft and verifier, with deltas"
    for name in ("tau", "routing", "entropy", "acceptance_by_depth", "tau_vs_alpha", "speed", "claims"):
        assert (out / "tables" / f"{name}.csv").read_text().count("\n") > 1
    for name in ("tau_T0", "acceptance_by_depth_T0", "entropy_T0", "depth_grid_T0", "tau_vs_alpha_T0", "speedup_T0"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == len(records) and len(summary["claims"]) == len(CLAIMS) == 9
    assert row(summary["tau"], strategy="single:chat")["avg"] == pytest.approx(2.9)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    with pytest.raises(FileNotFoundError, match="no records"):
        write_report(empty)


@pytest.mark.slow
def test_report_includes_sweeps_and_remembers_them(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in paper_like_records()))
    sweep = tmp_path / "interpolation"
    sweep.mkdir()
    (sweep / "results.csv").write_text("trial_id,status,alpha,tau/math,tau/chat,objective,wall_s\n"
                                       "t0,ok,0.0,1.5,2.5,2.0,12.0\nt1,error,0.5,,,,3.0\nt2,ok,1.0,2.75,1.25,2.0,11.0\n")
    (sweep / "tau_vs_alpha.png").write_bytes(b"\x89PNG fake")
    unfinished = tmp_path / "mixture"
    assert main(["report", str(out), "--sweep", str(sweep), "--sweep", str(unfinished)]) == 0
    text = (out / "report.md").read_text()
    assert "| 0.00 | 1.50 | 2.50 | 2.00 | 12.00 |" in text and "| 1.00 | 2.75 | 1.25 | 2.00 | 11.00 |" in text
    sweep_part = text[text.index("## Sweep `interpolation`"):]
    assert "| 0.50 |" not in sweep_part, "a trial without an objective is not a result"
    assert "![sweep-interpolation-tau_vs_alpha.png](plots/sweep-interpolation-tau_vs_alpha.png)" in text
    assert (out / "plots" / "sweep-interpolation-tau_vs_alpha.png").read_bytes() == b"\x89PNG fake"
    assert f"No `results.csv` in {unfinished}" in text
    write_report(out)
    assert "| 1.00 | 2.75 | 1.25 | 2.00 | 11.00 |" in (out / "report.md").read_text(), "regeneration keeps the sweeps"


@pytest.mark.slow
def test_claims_are_checked_at_each_temperature_on_its_own_records(tmp_path):
    """T=1 records whose specialists are swapped: claim 1 holds at T=0 and does not at T=1, each line in its
    temperature's section of the report."""
    hot = [{**r, "temperature": 1.0} for r in paper_like_records(swap=True)]
    tables = build_tables(paper_like_records() + hot)[0]
    status = {(c["temperature"], c["id"]): c["status"] for c in tables["claims"]}
    assert len(tables["claims"]) == 2 * len(CLAIMS)
    assert status[(0.0, 1)] == HOLDS and status[(1.0, 1)] == FAILS and status[(1.0, 3)] == HOLDS
    out = tmp_path / "run"
    out.mkdir()
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in paper_like_records() + hot))
    (out / RUN_FILE).write_text(json.dumps({"identity": {"target": {"model": "tiny"}}, "drafters": {}}))
    text = write_report(out).read_text()
    claims = text[text.index("## Claims"):]
    hot_part = claims[claims.index("### T=1"):]
    assert "### T=0" in claims and "1. The math-trained drafter" in hot_part
    assert "**does not hold**" in hot_part.splitlines()[2]
