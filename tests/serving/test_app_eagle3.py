"""An EAGLE-3 drafter served beside an EAGLE-2 one, end to end on the embedded target: the verifier asks each
drafter deployment the target layers it reads, ships each its own, and greedy outputs equal in-process
decoding (single EAGLE-3) and vanilla (merged with the EAGLE-2 head), with no drafter skipped."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from taps_ray.config import TreeConfig, load_config
from taps_ray.models.eagle3 import Eagle3Head
from taps_ray.spec.compose import build_strategy
from taps_ray.spec.decoder import generate
from tests.serving.helpers import served_app

pytestmark = pytest.mark.integration

APP = "taps-test-eagle3"
NEW = 16
TREE = {"depth": 2, "top_k": 4, "total_tokens": 10, "adaptive": False, "lookup_tokens": 0}
PROMPT = "What is 7 times 8?"


@pytest.fixture(scope="module")
def served(ray_session, embedded_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3") / "e3"
    head = Eagle3Head(embedded_target.config, seed=0).eval()
    head.save(folder, embedded_target.fingerprint)
    cfg = load_config(None, [
        f"tree={json.dumps(TREE)}", "target.threads=1", "target.dtype=float32",
        f"serve.drafters={{e3: {{checkpoint: {folder}}}, e2: {{seed: 1}}}}", "serve.routing.draft_deadline_s=60",
        "serve.limits.request_timeout_s=180", "serve.show_acceptance=true",
    ])

    def reference() -> dict:
        messages = [{"role": "user", "content": PROMPT}]
        e3 = Eagle3Head.load(folder, embedded_target.config, embedded_target.fingerprint)
        return {"single": generate(embedded_target, messages, build_strategy("single", [e3], TreeConfig(**TREE)),
                                   max_new_tokens=NEW),
                "vanilla": generate(embedded_target, messages, max_new_tokens=NEW)}

    with served_app(cfg, APP, reference) as app:
        yield app


@pytest.mark.parametrize("strategy, drafters, expected", [
    ("single", ["e3"], "single"),
    ("merged:union", ["e3", "e2"], "vanilla"),
    ("routed:confidence", ["e3", "e2"], "vanilla"),
])
def test_served_eagle3_drafters_decode_as_in_process(served, strategy, drafters, expected):
    server, reference = served
    client = OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=240)
    response = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=NEW,
        extra_body={"taps": {"strategy": strategy, "drafters": drafters}})
    assert response.choices[0].message.content == reference[expected].text
    taps = response.model_extra["taps"]
    assert taps["skipped"] == {} and taps["drafters"] == drafters
    assert taps["drafted_steps"] > 0
    if strategy == "single":
        assert taps["accept_lengths"] == reference["single"].accept_lengths
