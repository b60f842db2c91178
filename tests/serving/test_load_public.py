"""benchmarks/load_public.py: the public load generator (guidellm) against a real ``taps serve``.

The pure parts (status of a request, its prompt, the comparison with in-process decoding, what fails a run)
on hand-made guidellm records; then the script end to end, tiny (two rates, four requests each, one slot and
one queue place so that the higher rate is refused), and the comparison on that run's own report with one
reference answer altered."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.load_public import (
    QUANTILES,
    compare,
    failures,
    markdown,
    parse_rates,
    prompt_of,
    status_of,
    summarize,
)
from tests.conftest import REPO

REFUSED = ("HTTPStatusError(\"Client error '429 Too Many Requests' for url 'http://127.0.0.1:8000/v1/chat/"
           "completions'\\nFor more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/429\")")
FAILED = ("HTTPStatusError(\"Server error '500 Internal Server Error' for url 'http://127.0.0.1:8000/v1/chat/"
          "completions'\")")
STREAM_ERROR = "ValueError('Streaming response returned an error: The server had an error while processing')"


def _args(prompt: str, parts: bool = True) -> str:
    content = [{"type": "text", "text": prompt}] if parts else prompt
    return json.dumps({"stream": True, "body": {"model": "m", "temperature": 0,
                                                "messages": [{"role": "user", "content": content}]}})


def _request(prompt: str | None, output: str | None, error: str | None = None, tokens: int = 4) -> dict:
    return {"request_args": None if prompt is None else _args(prompt), "output": output,
            "info": {"error": error}, "output_metrics": {"text_tokens": tokens}}


def _report(successful: list[dict], errored: list[dict] = (), incomplete: list[dict] = ()) -> dict:
    """A guidellm JSON report of one constant-rate benchmark, with the fields the script reads."""
    stat = {"successful": {"percentiles": {"p50": 1.0, "p90": 2.0, "p99": 3.0}}}
    metrics = {key: stat for key in ("time_to_first_token_ms", "inter_token_latency_ms",
                                     "time_per_output_token_ms", "request_latency")}
    return {"benchmarks": [{"config": {"strategy": {"rate": 2.0}}, "duration": 4.0, "metrics": metrics,
                            "requests": {"successful": successful, "errored": list(errored),
                                         "incomplete": list(incomplete)}}]}


def test_statuses_from_guidellm_errors():
    assert status_of(None) == "200"
    assert status_of(REFUSED) == "429"
    assert status_of(FAILED) == "500"
    assert status_of(STREAM_ERROR) == "error"
    assert status_of("ReadTimeout('')") == "error"


def test_the_prompt_of_a_chat_request():
    assert prompt_of(_args("How many?")) == "How many?"
    assert prompt_of(_args("How many?", parts=False)) == "How many?"
    assert prompt_of(None) is None


def test_an_altered_answer_is_caught():
    expected = {"q1": "The answer is 4.", "q2": "Ten."}
    same = compare([("q1", "The answer is 4."), ("q2", "Ten."), ("q1", "The answer is 4.")], expected)
    assert same == {"checked": 3, "identical": 3, "mismatched": []}
    altered = compare([("q1", "The answer is 5."), ("q2", "Ten."), ("q3", "?"), ("q2", None)], expected)
    assert altered["checked"] == 4 and altered["identical"] == 1
    assert [m["prompt"] for m in altered["mismatched"]] == ["q1", "q3", "q2"]
    assert altered["mismatched"][0] == {"prompt": "q1", "served": "The answer is 5.", "expected": "The answer is 4."}


def test_only_429_and_identical_answers_pass():
    expected = {"q": "Yes."}
    passing = summarize(_report([_request("q", "Yes.")], [_request(None, None, REFUSED)]), expected)
    assert passing["statuses"] == {"200": 1, "429": 1} and passing["sent"] == 2
    assert passing["answers"]["identical"] == 1 and passing["throughput_rps"] == 0.25
    assert passing["output_tokens_per_s"] == 1.0
    assert passing["latency"]["ttft_ms"] == {"p50": 1.0, "p90": 2.0, "p99": 3.0}
    assert failures([passing]) == []
    assert failures([passing], require_429=True) == []
    assert "| 2 | 2 | 1 | 1 | 0 | 1/1 |" in markdown([passing])

    unrefused = summarize(_report([_request("q", "Yes.")]), expected)
    assert failures([passing, unrefused]) == []
    assert "no 429 at the highest rate" in failures([passing, unrefused], require_429=True)[0]

    wrong = summarize(_report([_request("q", "No.")]), expected)
    assert "answers differ" in failures([wrong])[0]
    for error in (FAILED, STREAM_ERROR):
        broken = summarize(_report([_request("q", "Yes.")], [_request(None, None, error)]), expected)
        assert "errors other than 429" in failures([broken])[0]
    stuck = summarize(_report([_request("q", "Yes.")], incomplete=[_request(None, None, "Request was cancelled")]),
                      expected)
    assert "incomplete" in failures([stuck])[0]
    dropped = _report([_request("q", "Yes.")])
    dropped["benchmarks"][0]["scheduler_state"] = {"created_requests": 2}
    assert summarize(dropped, expected)["unsent"] == 1
    assert "never sent" in failures([summarize(dropped, expected)])[0]
    dropped["benchmarks"][0]["scheduler_state"] = {"created_requests": 1}
    assert summarize(dropped, expected)["unsent"] == 0 and failures([summarize(dropped, expected)]) == []


def test_a_rate_guidellm_left_unsent_is_run_again(tmp_path, monkeypatch):
    """guidellm dropping a request it never sent reruns the rate once; a second drop is reported."""
    from benchmarks import load_public

    reports = [{"created_requests": 2}, {"created_requests": 1}]
    runs = []

    def fake_run(cmd, log, cache, within_s):
        report = _report([_request("q", "Yes.")])
        report["benchmarks"][0]["scheduler_state"] = reports[len(runs)]
        runs.append(cmd)
        (tmp_path / "r.json").write_text(json.dumps(report))

    monkeypatch.setattr(load_public, "run_rate", fake_run)
    cmd = ["guidellm", "--profile", "kind=constant,rate=2", "--constraint", "kind=max_requests,count=1"]
    result = load_public.measure_rate(cmd, tmp_path / "r.json", tmp_path / "log", "", 10, {"q": "Yes."})
    assert len(runs) == 2 and result["unsent"] == 0 and result["sent"] == 1
    runs.clear()
    reports[:] = [{"created_requests": 3}, {"created_requests": 3}]
    result = load_public.measure_rate(cmd, tmp_path / "r.json", tmp_path / "log", "", 10, {"q": "Yes."})
    assert len(runs) == 2 and result["unsent"] == 2


def test_rates_rise():
    assert parse_rates("0.25,0.5,1") == [0.25, 0.5, 1.0]
    for bad in ("", "1,0.5", "0,1", "1,1", "-1"):
        with pytest.raises(ValueError):
            parse_rates(bad)


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_guidellm_against_taps_serve(tmp_path):
    """The script end to end: exit 0, only 200 and 429 (the higher rate refused), every answer identical to
    in-process decoding, the percentiles reported; its comparison on this run's report catches an altered
    reference answer."""
    pytest.importorskip("guidellm")
    out = tmp_path / "load"
    cmd = [sys.executable, "benchmarks/load_public.py", "--rates", "0.5,8", "--requests", "4", "--max-tokens", "8",
           "--prompts", "2", "--set", "serve.admission.max_concurrent_requests=1", "--set", "serve.admission.max_queued_requests=1",
           "--set", "serve.drafters={a: {seed: 0}}", "--set", "target.threads=1", "--set", "target.dtype=float32",
           "--require-429", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "load_public.json").read_text())
    assert summary["failures"] == [] and [r["rate"] for r in summary["rates"]] == [0.5, 8.0]
    answered = 0
    for rate in summary["rates"]:
        assert set(rate["statuses"]) <= {"200", "429"} and rate["incomplete"] == 0 and rate["sent"] == 4
        assert rate["answers"]["checked"] == rate["statuses"].get("200", 0)
        assert rate["answers"]["identical"] == rate["answers"]["checked"]
        answered += rate["answers"]["checked"]
        if rate["statuses"].get("200"):
            for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_s"):
                values = [rate["latency"][name][q] for q in QUANTILES]
                assert all(isinstance(v, float) and v >= 0 for v in values) and values == sorted(values), name
    assert summary["rates"][-1]["statuses"].get("429", 0) > 0, "the higher rate is past capacity"
    assert answered > 0 and summary["identical"] == summary["checked"] == answered
    assert "TTFT ms p50/p90/p99" in (out / "load_public.md").read_text()

    report = json.loads((out / "guidellm" / "rate_0.5.json").read_text())
    served = {prompt_of(r["request_args"]): r["output"] for r in report["benchmarks"][0]["requests"]["successful"]}
    assert summarize(report, served)["answers"]["mismatched"] == []
    altered = dict(served)
    first = next(iter(altered))
    altered[first] += " (altered)"
    found = failures([summarize(report, altered)])
    assert len(found) == 1 and "answers differ" in found[0]
