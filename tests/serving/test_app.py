"""The Serve application end to end on the embedded target, through the official OpenAI client:
greedy outputs equal in-process decoding, streaming, concurrent isolation, bad input, drafter faults,
hot swaps, a killed drafter replica, metrics. One application for the whole module."""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest
import ray
import requests
import torch
from openai import OpenAI
from ray import serve

from taps_ray.adapt.promote import ServedDrafter
from taps_ray.config import TreeConfig, load_config
from taps_ray.data.feature_sets import MANIFEST, open_feature_set
from taps_ray.serving.app import drafter_deployment_name
from taps_ray.spec.decoder import generate, load_drafter
from taps_ray.spec.protocol import SingleStrategy
from tests.serving.helpers import metric as _metric
from tests.serving.helpers import served_app

pytestmark = pytest.mark.integration

APP = "taps-test"
MODEL = "smollm2-135m"
NEW = 16
TREE = {"depth": 2, "top_k": 4, "total_tokens": 10, "adaptive": False}
PROMPTS = [
    "What is 7 times 8?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "Give me a synonym for quick.",
    "What is the capital of France?",
    "Count from one to five.",
]


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("capture")


@pytest.fixture(scope="module")
def served(ray_session, embedded_target, capture_dir):
    """The application on a free port, and (computed while it starts) the in-process reference per
    prompt: greedy decoding with the same fresh drafter (seed 0) as drafter ``a``. Capture is on (one
    shard per request, into ``capture_dir``)."""
    cfg = load_config(None, [
        f"tree={json.dumps(TREE)}", "target.threads=1", "target.dtype=float32",
        "serve.drafters={a: {seed: 0}, b: {seed: 1}}", "serve.routing.draft_deadline_s=30",
        "serve.admission.max_concurrent_requests=8", "serve.limits.request_timeout_s=120",
        f"serve.capture={json.dumps({'enabled': True, 'dir': str(capture_dir), 'rows_per_shard': 1, 'mode': 'all'})}",
        "serve.show_acceptance=true",  # the tests read the acceptance figures, which capture would withhold
    ])
    def reference() -> dict:
        drafter = load_drafter(embedded_target, None, 0)
        return {p: generate(embedded_target, [{"role": "user", "content": p}],
                            SingleStrategy(drafter, TreeConfig(**TREE)), max_new_tokens=NEW) for p in PROMPTS}

    with served_app(cfg, APP, reference) as served:
        yield served


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def reference(served) -> dict:
    return served[1]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=180)


def _chat(client, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", NEW)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def _drafter(name: str):
    return serve.get_deployment_handle(drafter_deployment_name(name), APP)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert set(models.data[0].model_extra["taps"]["drafters"]) == {"a", "b"}
    assert requests.get(f"{server}/health", timeout=30).json() == {"status": "ok"}


def test_served_requests_are_captured_as_a_feature_set(client, reference, capture_dir, embedded_target):
    """serve.capture through Serve: the finished request is a row of the capture folder's feature set, its
    features those the target computes teacher-forced, its routing outcome a label."""
    prompt = PROMPTS[5]
    response = _chat(client, prompt, extra_body={"taps": {"strategy": "routed:entropy"}})
    ids = embedded_target.encode_chat([{"role": "user", "content": prompt}])[0].tolist()
    expected = ids + reference[prompt].token_ids[:response.usage.completion_tokens - 1]
    for _ in range(100):  # the row is written right after the response is sent
        if (capture_dir / MANIFEST).exists():
            fs = open_feature_set(capture_dir, embedded_target.fingerprint.to_dict(), "captured")
            table = pq.read_table(fs.shard_paths())
            if expected in table.column("input_ids").to_pylist():
                break
        time.sleep(0.1)
    index = table.column("input_ids").to_pylist().index(expected)
    row = fs.read_rows([table.column("row_id")[index].as_py()])[0]
    with torch.inference_mode():
        teacher = embedded_target.hidden_states(row["input_ids"][None])[0].to(torch.bfloat16)
    torch.testing.assert_close(row["hidden"].float(), teacher.float(), rtol=2 ** -7, atol=1e-4)
    labels = json.loads(table.column("labels")[index].as_py())
    assert table.column("strategy")[index].as_py() == "routed:entropy:request"
    assert [s["route"] for s in labels["steps"]] == response.model_extra["taps"]["route_per_step"]


@pytest.mark.parametrize("strategy", ["single", "merged:union", "routed:confidence", "routed:entropy", "vanilla"])
def test_chat_greedy_equals_in_process(client, reference, strategy):
    prompt = PROMPTS[0]
    response = _chat(client, prompt, extra_body={"taps": {"strategy": strategy}})
    expected = reference[prompt]
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.choices[0].finish_reason == ("stop" if expected.finish_reason == "eos" else "length")
    taps = response.model_extra["taps"]
    assert taps["strategy"] == {"routed:confidence": "routed:confidence:step",
                                "routed:entropy": "routed:entropy:request"}.get(strategy, strategy)
    assert taps["skipped"] == {} and taps["steps"] == len(taps["accept_lengths"])
    if strategy == "single":
        assert taps["drafters"] == ["a"] and taps["accept_lengths"] == expected.accept_lengths
    if strategy.startswith("routed"):
        assert sum(taps["route_decisions"].values()) == taps["steps"] and set(taps["route_decisions"]) <= {"a", "b"}
    if strategy == "vanilla":
        assert taps["drafted_steps"] == 0 and taps["plain_steps"] == taps["steps"]


def test_completions_and_streaming_match(client, embedded_target, reference):
    raw = "The three primary colours are"
    ids = embedded_target.tokenizer(raw)["input_ids"]
    expected = generate(embedded_target, ids, max_new_tokens=NEW)
    done = client.completions.create(model=MODEL, prompt=raw, max_tokens=NEW, temperature=0)
    assert done.choices[0].text == expected.text and done.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=raw, max_tokens=NEW, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"taps": {"strategy": "merged:budget"}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) and not chunks[-1].choices

    prompt = PROMPTS[1]
    stream = list(_chat(client, prompt, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == reference[prompt].text and len([d for d in deltas if d]) > 1
    assert stream[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] in ("stop", "length")
    assert stream[-1].usage.completion_tokens == len(reference[prompt].token_ids)


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_openai_conformance_and_logprobs_through_the_server(server, embedded_target, path):
    """One real-server pass of tests/serving/test_conformance.py: the body and every chunk validate strictly
    against the openai types, with and without include_usage; speculative greedy logprobs equal the
    target's log-softmax from vanilla decoding within 1e-4 (fp32), streamed and not."""
    import openai.types as oai
    import openai.types.chat as oai_chat

    from tests.serving.test_access import sse_events
    from tests.serving.test_conformance import CompletionChunk, conforms, entries_of

    chat, top = path == "chat/completions", 3
    raw = "The three primary colours are"
    prompt = [{"role": "user", "content": PROMPTS[2]}] if chat else embedded_target.tokenizer(raw)["input_ids"]
    vanilla = generate(embedded_target, prompt, max_new_tokens=NEW, logprobs=top)
    body = {"model": MODEL, "max_tokens": NEW, "temperature": 0, "taps": {"strategy": "single"},
            **({"messages": prompt, "logprobs": True, "top_logprobs": top} if chat else {"prompt": raw, "logprobs": top})}
    kind = "/v1/chat/completions" if chat else "/v1/completions"
    response = requests.post(f"{server}/v1/{path}", json=body, timeout=180)
    whole = response.json()
    assert response.status_code == 200, whole
    conforms(oai_chat.ChatCompletion if chat else oai.Completion, whole)
    assert whole["taps"]["drafted_steps"] > 0, "the logprobs came from tree verifications"
    served = entries_of(kind, whole["choices"][0]["logprobs"])
    torch.testing.assert_close(torch.tensor([lp for _, lp, _ in served]), vanilla.logprobs.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor([[lp for _, lp in alts] for _, _, alts in served]),
                               vanilla.logprobs.top_logprobs, atol=1e-4, rtol=0)
    for usage in (False, True):
        options = {"stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
        response = requests.post(f"{server}/v1/{path}", json={**body, **options}, timeout=180)
        events = sse_events(response.content)
        assert events[-1] == "[DONE]" and ("usage" in events[-2]) == usage
        chunks = [e for e in events[:-1] if e["choices"]]
        for chunk in events[:-1]:
            conforms(oai_chat.ChatCompletionChunk if chat else CompletionChunk, chunk)
        assert [e for c in chunks for e in entries_of(kind, c["choices"][0]["logprobs"])] == served


def test_stop_sequences_and_sampling_seed(client, reference):
    prompt = PROMPTS[5]
    full = reference[prompt].text
    cut = full.split()[2]
    stopped = _chat(client, prompt, stop=[cut])
    assert stopped.choices[0].message.content == full[:full.index(cut)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < len(reference[prompt].token_ids)
    first, again = (_chat(client, prompt, temperature=0.9, top_p=0.9, seed=123, max_tokens=8).choices[0].message.content
                    for _ in range(2))
    assert first == again


def test_concurrent_requests_are_isolated(client, reference):
    strategies = ["single", "merged:union", "routed:confidence", "single", "merged:budget", "routed:entropy"]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = _chat(client, PROMPTS[i], extra_body={"taps": {"strategy": strategies[i]}}).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results.get(i) for i in range(len(PROMPTS))] == [reference[p].text for p in PROMPTS]
    sessions = [_drafter(n).stats.remote().result(timeout_s=30)["sessions"] for n in ("a", "b")]
    assert sessions == [0, 0], "finished requests must free their drafting sessions"
    assert serve.get_deployment_handle("Verifier", APP).info.remote().result(timeout_s=30)["active"] == 0


CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, status, param", [
    (CHAT, '{"model": "smollm2-135m", "messages": [', 400, None),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "taps": {"strategy": "routed:nope"}}, 400, "taps.strategy"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "taps": {"drafters": ["zzz"]}}, 400, "taps.drafters"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "taps": {"strategy": "merged:union", "drafters": ["a"]}}, 400,
     "taps.drafters"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "taps": {"colour": 1}}, 400, "taps.colour"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "n": 2}, 400, "n"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10 ** 7]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, param):
    if isinstance(body, str):
        response = requests.post(server + path, data=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        response = requests.post(server + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"].endswith("_error")
    assert error["message"].startswith(param) if param else "not valid JSON" in error["message"]


def test_the_server_keeps_serving_after_bad_input(server, client):
    metrics = requests.get(f"{server}/metrics", timeout=30).text
    assert _metric(metrics, "taps_request_failure_total") >= 19
    assert _chat(client, "hi", max_tokens=2).usage.completion_tokens == 2


def test_deadline_and_failing_drafter_fall_back_losslessly(client, reference):
    prompt = PROMPTS[2]
    late = _chat(client, prompt, extra_body={"taps": {"strategy": "merged:union", "draft_deadline_s": 0}})
    taps = late.model_extra["taps"]
    assert late.choices[0].message.content == reference[prompt].text
    assert taps["plain_steps"] == taps["steps"] and taps["skipped"]["a"]["deadline"] >= 1
    assert sum(taps["skipped"]["a"].values()) == taps["steps"]
    b = _drafter("b")
    b.broadcast("reconfigure", {"checkpoint": None, "seed": 1, "fault": "raise"}).results(timeout_s=30)
    try:
        merged = _chat(client, prompt, extra_body={"taps": {"strategy": "merged:union"}})
        alone = _chat(client, prompt, extra_body={"taps": {"strategy": "single:b"}})
    finally:
        b.broadcast("reconfigure", {"checkpoint": None, "seed": 1}).results(timeout_s=30)
    for response in (merged, alone):
        assert response.choices[0].message.content == reference[prompt].text
    skipped = merged.model_extra["taps"]["skipped"]
    assert set(skipped) == {"b"} and skipped["b"]["error"] >= 1
    assert sum(skipped["b"].values()) == merged.model_extra["taps"]["steps"]
    assert merged.model_extra["taps"]["drafted_steps"] == merged.model_extra["taps"]["steps"]
    assert alone.model_extra["taps"]["plain_steps"] == alone.model_extra["taps"]["steps"]


def test_checkpoint_swap_in_flight_keeps_running_requests(client, reference):
    prompt = PROMPTS[3]
    a = _drafter("a")
    stream = _chat(client, prompt, stream=True, extra_body={"taps": {"strategy": "single:a"}})
    texts = [next(stream).choices[0].delta.content or "", next(stream).choices[0].delta.content or ""]
    a.broadcast("reconfigure", {"checkpoint": None, "seed": 5}).results(timeout_s=30)
    try:
        texts += [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(texts) == reference[prompt].text
        assert a.stats.remote().result(timeout_s=30)["spec"] == {"checkpoint": None, "seed": 5}
        after = _chat(client, prompt, extra_body={"taps": {"strategy": "single:a"}})
        assert after.choices[0].message.content == reference[prompt].text and not after.model_extra["taps"]["skipped"]
    finally:
        a.broadcast("reconfigure", {"checkpoint": None, "seed": 0}).results(timeout_s=30)


def _served_versions(server: str, client) -> tuple[dict, dict]:
    """``/v1/models``' drafters and ``/metrics``' ``taps_drafter_version`` samples ((drafter, version) -> value)."""
    drafters = client.models.list().data[0].model_extra["taps"]["drafters"]
    page = requests.get(f"{server}/metrics", timeout=30).text
    samples = {}
    for line in page.splitlines():
        if line.startswith("taps_drafter_version{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            samples[labels["drafter"].strip('"'), labels["version"].strip('"')] = float(line.rsplit(" ", 1)[1])
    return drafters, samples


def _until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_a_promoted_version_serves_new_requests_and_shows_in_models_and_metrics(server, client, reference,
                                                                                 embedded_target, tmp_path):
    folder = tmp_path / "adapt-v7"
    load_drafter(embedded_target, None, 5).save(folder, embedded_target.fingerprint, extra={"version": 7})
    cfg = load_config(None, [f"serve.app_name={APP}", "serve.drafters={a: {seed: 0}, b: {seed: 1}}"])
    promoted = ServedDrafter(cfg, "a")
    assert promoted.serving() is None and promoted.reconcile() == 0  # nothing promoted yet: nothing to move
    try:
        stats = promoted.swap(str(folder))
        assert [(r["version"], r["spec"]["checkpoint"]) for r in stats] == [(7, str(folder))]
        drafters, samples = _until(lambda: (v := _served_versions(server, client))[0]["a"]["version"] == 7 and v)
        assert drafters["a"] == {"checkpoint": "local", "version": 7, "replicas": {"7": 1}}
        assert drafters["b"] == {"checkpoint": None, "version": 0, "replicas": {"0": 1}}
        assert samples[("a", "7")] == 1 and samples[("a", "0")] == 0 and samples[("b", "0")] == 1
        after = _chat(client, PROMPTS[0], extra_body={"taps": {"strategy": "single:a"}})
        assert after.choices[0].message.content == reference[PROMPTS[0]].text
        assert after.model_extra["taps"]["drafted_steps"] == after.model_extra["taps"]["steps"]
        # a replica Serve starts again begins from the deployment's user_config: reconcile moves it back
        _drafter("a").broadcast("reconfigure", {"checkpoint": None, "seed": 0}).results(timeout_s=30)
        assert promoted.serving() is None
        assert promoted.reconcile() == 1 and promoted.serving() == str(folder) and promoted.reconcile() == 0
    finally:
        _drafter("a").broadcast("reconfigure", {"checkpoint": None, "seed": 0}).results(timeout_s=30)
    _, samples = _until(lambda: (v := _served_versions(server, client))[1][("a", "0")] == 1 and v)
    assert samples[("a", "7")] == 0 and samples[("a", "0")] == 1


def test_a_client_that_disconnects_mid_stream_frees_its_sessions(server):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "stream": True, "temperature": 0,
            "taps": {"strategy": "merged:union"}}
    finished = _metric(requests.get(f"{server}/metrics", timeout=30).text, "taps_request_success_total")
    with requests.post(server + "/v1/completions", json=body, stream=True, timeout=60) as response:
        data = [line for _, line in zip(range(6), response.iter_lines()) if line.startswith(b"data:")]
        assert len(data) >= 2
    deadline = time.monotonic() + 30
    while True:
        sessions = [_drafter(n).stats.remote().result(timeout_s=30)["sessions"] for n in ("a", "b")]
        running = _metric(requests.get(f"{server}/metrics", timeout=30).text, "taps_num_requests_running")
        if sessions == [0, 0] and running == 0:
            break
        assert _metric(requests.get(f"{server}/metrics", timeout=30).text, "taps_request_success_total") == finished
        assert time.monotonic() < deadline, f"cancelled request still holds sessions {sessions} / running {running}"
        time.sleep(0.5)
    assert _metric(requests.get(f"{server}/metrics", timeout=30).text, "taps_request_success_total") == finished


def test_metrics_count_drafts_routes_and_skips(server, client):
    before = requests.get(f"{server}/metrics", timeout=30).text
    response = _chat(client, PROMPTS[4], extra_body={"taps": {"strategy": "routed:confidence"}})
    bad = requests.post(f"{server}{CHAT}", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, timeout=30)
    after = requests.get(f"{server}/metrics", timeout=30).text
    taps = response.model_extra["taps"]
    for name, delta in [("taps_spec_decode_num_drafts_total", taps["drafted_steps"]),
                        ("taps_spec_decode_num_draft_tokens_total", taps["draft_tokens"]),
                        ("taps_spec_decode_num_accepted_tokens_total", taps["accepted_tokens"]),
                        ("taps_spec_decode_route_decisions_total", taps["steps"]),
                        ("taps_generation_tokens_total", response.usage.completion_tokens),
                        ("taps_request_success_total", 1), ("taps_e2e_request_latency_seconds_count", 1),
                        ("taps_acceptance_length_count", 1), ("taps_request_failure_total", 1)]:
        assert _metric(after, name) - _metric(before, name) == pytest.approx(delta), name
    assert bad.status_code == 400
    assert _metric(after, "taps_drafter_skipped_steps_total") >= 1
    assert "taps_time_to_first_token_seconds_bucket" in after


def test_killed_drafter_replica_is_replaced_and_used_again(client, reference):
    prompt = PROMPTS[0]
    b = _drafter("b")
    victim = b.stats.remote().result(timeout_s=30)
    ray.kill(ray.get_actor(victim["replica"], namespace="serve"), no_restart=True)
    during = _chat(client, prompt, extra_body={"taps": {"strategy": "merged:union", "draft_deadline_s": 2}})
    assert during.choices[0].message.content == reference[prompt].text
    deadline = time.monotonic() + 150
    while True:
        try:
            replaced = b.stats.remote().result(timeout_s=10)
            if replaced["replica"] != victim["replica"]:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "Serve did not replace the killed drafter replica"
        time.sleep(1.0)
    after = _chat(client, prompt, extra_body={"taps": {"strategy": "merged:union"}})
    assert after.choices[0].message.content == reference[prompt].text
    assert after.model_extra["taps"]["skipped"] == {} and after.model_extra["taps"]["drafted_steps"] >= 1
