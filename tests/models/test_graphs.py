"""models/graphs.py on the CPU: the fixed-shape step a CUDA graph captures, run eagerly (capture=False),
against the eager forward; the cache pool; where the graphs step aside. Capture itself needs CUDA
(benchmarks/gpu_check.py runs it there)."""

import pytest
import torch

from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.engine import Segment
from taps_ray.models.graphs import StepGraphs, bucket, span
from taps_ray.models.target import TargetLoadError, TargetModel
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import SingleStrategy
from tests.conftest import make_tiny_target

TREE = TreeConfig(depth=3, top_k=3, total_tokens=12, lookup_tokens=0, adaptive=False)


@pytest.fixture()
def target():
    return make_tiny_target(3, layers=3)


def _graphed(target: TargetModel) -> StepGraphs:
    graphs = StepGraphs(target.engine, capture=False, capacity=512)
    target.engine.graphs = graphs
    return graphs


def _steps(target: TargetModel, masks: bool, prefill: int) -> list[torch.Tensor]:
    """Prefill ``prefill`` tokens, then steps of 1, 3 (bucket 4) and 5 (bucket 8) tokens, the last two with a tree-like
    mask when ``masks``; the hidden states and features of each."""
    cache = target.new_cache(prefill + 32)
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in (prefill, 1, 3, 5):
        past = cache.length
        tokens = torch.randint(2, target.vocab_size, (n,), generator=gen)
        positions = torch.arange(past, past + n)
        mask = None
        if masks and n > 1 and past:
            mask = torch.zeros(n, past + n)
            mask[:, past:] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
            mask[n - 1, past] = torch.finfo(torch.float32).min  # a sibling, not a child, of the first node
        hidden, features = target.engine.forward_layers(tokens, positions, [Segment(cache, n, mask)], (0, 2, 3))
        out += [hidden, features]
    assert cache.length == prefill + 9
    return out


@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("prefill", [9, 252])  # 252: the steps cross from a 256-entry span to a 512-entry one
def test_fixed_shape_step_matches_the_eager_forward(target, masks, prefill):
    eager = _steps(target, masks, prefill)
    _graphed(target)
    fixed = _steps(target, masks, prefill)
    for a, b in zip(eager, fixed):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_greedy_decoding_on_the_fixed_shape_step_is_vanilla(target):
    prompt = torch.randint(2, target.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    vanilla = generate(target, prompt, max_new_tokens=40)
    _graphed(target)
    assert generate(target, prompt, max_new_tokens=40).token_ids == vanilla.token_ids
    spec = generate(target, prompt, SingleStrategy(DraftHead(target.config, seed=2), TREE), max_new_tokens=40)
    assert spec.token_ids == vanilla.token_ids


def test_caches_come_from_the_pool_and_go_back_to_it(target):
    graphs = _graphed(target)
    cache = target.new_cache()
    assert cache.capacity == 512 and cache.keys.data_ptr() in graphs._pooled
    storage = cache.keys.data_ptr()
    del cache
    again = target.new_cache()
    assert again.keys.data_ptr() == storage
    assert target.new_cache().keys.data_ptr() != storage
    assert target.new_cache(4096).keys.data_ptr() not in graphs._pooled


def test_steps_the_graphs_cannot_take_run_eagerly(target):
    graphs = _graphed(target)
    cache = target.new_cache()
    assert graphs.applies([Segment(cache, 64)]) and not graphs.applies([Segment(cache, 65)])
    assert not graphs.applies([Segment(cache, 1), Segment(target.new_cache(), 1)])
    cache.length = 509
    assert graphs.applies([Segment(cache, 2)]) and not graphs.applies([Segment(cache, 3)])  # bucket 4 overflows
    assert [bucket(n) for n in (1, 2, 3, 17, 64, 65)] == [1, 2, 4, 32, 64, None]
    assert [span(n, 512) for n in (1, 256, 257, 512, 600)] == [256, 256, 512, 512, 512]


def test_graphs_on_where_they_cannot_run_is_a_clear_error():
    with pytest.raises(TargetLoadError, match="graphs=on needs the static engine on a CUDA device"):
        TargetModel.load(TargetConfig(model="embedded:smollm2-135m", device="cpu", dtype="float32", graphs="on"))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA target"):
        make_tiny_target(0).engine.__class__(make_tiny_target(0).model, [None, None], graphs=True)


def test_requests_decoded_from_several_threads_take_turns_on_the_static_inputs(target):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [torch.randint(2, target.vocab_size, (8 + i,), generator=torch.Generator().manual_seed(i))
               for i in range(4)]
    alone = [generate(target, prompt, max_new_tokens=48).token_ids for prompt in prompts]
    _graphed(target)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda prompt: generate(target, prompt, max_new_tokens=48).token_ids, prompts))
    assert together == alone
