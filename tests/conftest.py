"""Shared fixtures: tiny random Llama targets for unit tests, the embedded target for integration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from taps_ray.config import TargetConfig
from taps_ray.models.engine import StaticEngine
from taps_ray.models.quant import quantize_rtn
from taps_ray.models.target import TargetModel

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Ray never starts a cluster behind a test's back: a call that needs one before the ``ray_session``
    fixture (or a test's own cluster) started it fails, instead of starting a default cluster that
    ``ray_session`` would then join (2 CPUs, not 4). Read when Ray is imported, which no import above
    does.

    Serve's routers wait up to 1 s (Ray's default: 0.1 s) for a replica's queue length before passing it
    over: with both cores busy an idle replica can miss 0.1 s on every probe, and a router then sends
    everything to the replica it already knows (``test_metrics_export`` saw 24 of 24 requests go to one
    of two ingress replicas). Every process of the tests' clusters inherits it.

    The tests' clusters run without Ray's token authentication (as CI always has; set RAY_AUTH_MODE=token to
    run them with it); ``taps`` itself never turns it off (``tests/runtime/test_cluster.py``).

    pytest-xdist (3.6 on) hands out test files by their number of tests, most first, unless told not to:
    that would undo :data:`LONGEST_FIRST` and leave the longest modules, which have few tests, to the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the tests' own clusters; the product keeps Ray's default
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch intra-op thread in every test: the models are tiny, the suite runs one test per core
    (``make test``: pytest-xdist), and OpenMP spin-waits between threads on a loaded CPU make every
    small matmul many times slower. Session scope, so it is in force before any fixture decodes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Each test leaves torch's thread count as it found it: an actor class run in-process sets its own (the
    feature actors take every core), and the next test of its process would compare batched rows against lone
    ones (bitwise equal at one thread, not at two) on that count."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


def tiny_llama_config(vocab_size: int = 256, hidden_size: int = 64, layers: int = 2) -> LlamaConfig:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
        bos_token_id=0,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def make_tiny_target(seed: int = 0, **kwargs) -> TargetModel:
    """A random tiny Llama wrapped as a TargetModel (no tokenizer), fp32 on CPU."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kwargs)).eval()
    return TargetModel(model, tokenizer=None, name=f"tiny-llama-seed{seed}")


def make_tiny_int4_target(seed: int = 0) -> TargetModel:
    """A tiny bf16 Llama whose layer weights are their own round-to-nearest int4 codes' values, on an int4 engine
    given those codes, as a GGUF target's: its products read the codes in narrow steps and a packed dense copy
    in wide ones (CPU with native bf16 only)."""
    target = make_tiny_target(seed)
    model = target.model.to(torch.bfloat16)
    codes = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                codes[name] = quantize_rtn(param)
                param.copy_(codes[name].dequantize())
    target.dtype = torch.bfloat16
    target.engine = StaticEngine(model, [None] * len(model.model.layers), "int4", codes)
    return target


@pytest.fixture(scope="session")
def tiny_target() -> TargetModel:
    return make_tiny_target(0)


@pytest.fixture(scope="session")
def embedded_target() -> TargetModel:
    """The embedded SmolLM2-135M target in float32, where speculative greedy output equals vanilla exactly
    (fetched once into TAPS_CACHE)."""
    return TargetModel.load(TargetConfig(dtype="float32"))


def data_dir() -> Path | None:
    value = os.environ.get("TAPS_DATA_DIR")
    return Path(value) if value and Path(value).is_dir() else None


requires_data = pytest.mark.skipif(
    data_dir() is None, reason="TAPS_DATA_DIR is not set or missing (benchmark/training data lives in ../shared/data)"
)


@pytest.fixture(scope="session")
def ray_session():
    """One in-process Ray cluster for the whole test run."""
    from taps_ray.runtime.cluster import init_ray

    ray = init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


SLOW_FIXTURES = {"embedded_target", "ray_session"}
LONGEST_FIRST = ("test_crash_resume.py", "test_multinode.py", "serving/test_app.py", "adapt/test_finetune.py",
                 "spec/test_sampling_composed.py", "serving/test_lm_eval_lossless.py", "sweeps/test_sweeps.py",
                 "serving/test_load_public.py", "train/test_launch.py", "data/test_clean_clone.py",
                 "train/test_eagle3_train.py", "spec/test_embedded.py", "spec/test_sampling.py",
                 "serving/test_app_eagle3.py", "data/test_features.py", "serving/test_load.py",
                 "serving/test_metrics_export.py", "serving/test_served_cli.py", "test_cli.py", "eval/test_runner.py")
"""The modules that take longest (30 s or more each in ``make test``, longest first; docs/BENCHMARKS.md, the
thirty-fourth session): collected first, and handed out in this order (``pytest_configure``), so that
``make test``'s processes start on them and the short modules fill the end."""
RAY_FIXTURES = {"ray_session"}


def pytest_collection_modifyitems(config, items):
    """Mark ``ray`` every test that joins the session's Ray cluster (tests that start their own carry
    ``@pytest.mark.ray`` themselves), and ``slow`` every test that loads the embedded model or uses Ray
    (by fixture or by the ``integration`` or ``ray`` marker); tests that take long otherwise carry
    ``@pytest.mark.slow`` themselves. ``make test-fast`` runs the rest, the pure unit tier. The
    :data:`LONGEST_FIRST` modules come first, each in its own order."""
    def rank(item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if RAY_FIXTURES & fixtures:
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("integration") or item.get_closest_marker("ray") or SLOW_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
