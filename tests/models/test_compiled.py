"""models/compiled.py: one request's narrow int4 steps as one compiled forward, equal to the eager steps within
bf16 rounding, writing the same cache entries, compiled once per shape kind, refused where it cannot run."""

from __future__ import annotations

import pytest
import torch

from taps_ray.models.engine import StaticEngine
from taps_ray.models.quant import int4_unsupported
from taps_ray.models.target import TargetLoadError, TargetModel
from taps_ray.models.target_cache import Segment
from taps_ray.spec.machine import engine_label
from tests.conftest import make_tiny_target

needs_int4 = pytest.mark.skipif(int4_unsupported(torch.device("cpu"), torch.bfloat16) is not None,
                                reason="torch's int4 CPU kernel is not available here")


def _engines() -> tuple[StaticEngine, StaticEngine]:
    model = make_tiny_target(0).model.to(torch.bfloat16)
    windows = [None] * len(model.model.layers)
    return StaticEngine(model, windows, "int4"), StaticEngine(model, windows, "int4", compile=True)


def _tree_mask(parents: list[int], past: int) -> torch.Tensor:
    """The additive mask [n, past + n] of a tree given by its nodes' parents (-1: a root on the prefix)."""
    n = len(parents)
    mask = torch.full((n, past + n), torch.finfo(torch.float32).min)
    mask[:, :past] = 0
    for node, parent in enumerate(parents):
        mask[node, past + node] = 0
        while parent >= 0:
            mask[node, past + parent] = 0
            parent = parents[parent]
    return mask


def _step(engine: StaticEngine, cache, tokens: list[int], parents: list[int] | None = None) -> torch.Tensor:
    """One step of ``tokens`` on ``cache``: a chain (causal), or a tree given by its nodes' ``parents``."""
    if parents is None:
        positions, mask = torch.arange(cache.length, cache.length + len(tokens)), None
    else:
        depths: list[int] = []
        for parent in parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        positions, mask = cache.length + torch.tensor(depths), _tree_mask(parents, cache.length)
    return engine.forward(torch.tensor(tokens), positions, [Segment(cache, len(tokens), mask)])


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.03, atol=0.03 * float(theirs.abs().max()))


@pytest.mark.slow  # compiles two graphs: 15-30 s in a process whose inductor cache is cold
@needs_int4
def test_compiled_steps_follow_the_eager_steps_and_write_the_same_cache_entries():
    eager, compiled = _engines()
    with torch.inference_mode():
        _compare(eager, compiled)


def _compare(eager: StaticEngine, compiled: StaticEngine) -> None:
    steps = compiled.compiled
    assert steps is not None and eager.compiled is None and engine_label(compiled) == "static-int4-compiled"
    caches = {}
    for name, engine in (("eager", eager), ("compiled", compiled)):
        cache = engine.new_cache(16)
        _step(engine, cache, list(range(3, 12)))  # a prefill on an empty cache runs eagerly
        caches[name] = cache
    assert steps.compiles == 0, "a prefill is not a compiled step"
    for token in (5, 9, 2):
        _close(_step(compiled, caches["compiled"], [token]), _step(eager, caches["eager"], [token]))
    assert steps.compiles == 1 and steps.compile_s > 0, "the first one-token step compiled its graph, and timed it"
    for parents, tokens in (([-1, 0, 0, 1], [4, 8, 6, 1]), ([-1, 0, 1], [7, 3, 5]), ([-1, 0, 0, 1, 1, 2, 3], list(range(7)))):
        _close(_step(compiled, caches["compiled"], tokens, parents), _step(eager, caches["eager"], tokens, parents))
        assert caches["compiled"].length == caches["eager"].length
    assert steps.compiles == 2, "trees of any size and cache length share one graph"
    assert caches["compiled"].capacity > 16, "the cache grew past its first capacity under the compiled steps"
    length = caches["eager"].length
    for name in ("keys", "values"):
        _close(getattr(caches["compiled"], name)[:, :, :length], getattr(caches["eager"], name)[:, :, :length])
    batch = [Segment(caches["compiled"], 1), Segment(compiled.new_cache(), 1)]
    compiled.forward(torch.tensor([1, 2]), torch.tensor([length, 0]), batch)
    assert steps.compiles == 2, "a packed batch of requests runs eagerly"


@pytest.mark.slow
@needs_int4
def test_a_weight_changed_after_packing_is_an_error_on_the_compiled_path_too():
    _, compiled = _engines()
    cache = compiled.new_cache()
    down = compiled.base.layers[0].mlp.down_proj.weight
    with torch.inference_mode():
        _step(compiled, cache, [1, 2, 3])
    down.data = down.data.clone()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after they were packed to int4"):
        _step(compiled, cache, [4])


def test_compiled_steps_are_refused_where_they_cannot_run():
    model = make_tiny_target(0).model
    with pytest.raises(ValueError, match=r"compiled steps cannot run on this target: .*int4 weights on a CPU target"):
        StaticEngine(model, [None] * len(model.model.layers), "dense", compile=True)
    with pytest.raises(TargetLoadError, match=r"target.compile=true needs the static engine \(target.engine=hf\)"):
        TargetModel(model, None, "tiny", engine="hf", compile=True)
