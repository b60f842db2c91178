"""spec/strategy.py: StrategySpec.bind, the one check of a strategy against the drafters it may use."""

from __future__ import annotations

import pytest

from taps_ray.config import ServeConfig
from taps_ray.eval.plan import EvalError, expand_strategies
from taps_ray.serving.plan import RequestError, resolve_plan
from taps_ray.spec.strategy import StrategyError, parse_strategy


@pytest.mark.parametrize(("name", "drafters", "bound"), [
    ("vanilla", ["a", "b"], ()),
    ("single", ["a", "b"], ("a",)),
    ("single:b", ["a", "b"], ("b",)),
    ("averaged", ["a", "b", "c"], ("a", "b", "c")),
    ("averaged:0.25", ["a", "b"], ("a", "b")),
    ("routed:entropy", ["b", "a"], ("b", "a")),
    ("merged:budget", ["a", "b"], ("a", "b")),
])
def test_bind_picks_the_drafters_a_strategy_drafts_with(name, drafters, bound):
    assert parse_strategy(name).bind(drafters) == bound


@pytest.mark.parametrize(("name", "drafters", "field", "message"), [
    ("single", [], "drafters", "needs a drafter, got 0"),
    ("single:math", ["chat"], "strategy", "no drafter named 'math'; drafters: \\['chat'\\]"),
    ("merged:union", ["a"], "drafters", "needs at least 2 drafters, got 1"),
    ("routed:confidence", ["a", "a"], "drafters", "takes distinct drafters; \\['a', 'a'\\] repeats \\['a'\\]"),
    ("averaged:0.3", ["a", "b", "c"], "drafters", "interpolates two drafters, got 3"),
])
def test_bind_refuses_drafters_that_do_not_fit_naming_what_to_change(name, drafters, field, message):
    with pytest.raises(StrategyError, match=message) as err:
        parse_strategy(name).bind(drafters)
    assert err.value.field == field and isinstance(err.value, ValueError)


def test_the_evaluation_plan_and_a_served_request_refuse_with_binds_message():
    """The same misfit, the same words, in the error type of each boundary."""
    with pytest.raises(StrategyError) as direct:
        parse_strategy("merged:union").bind(["a"])
    with pytest.raises(EvalError) as evaluated:
        expand_strategies(["merged:union"], ["a"], ["a"])
    with pytest.raises(RequestError) as served:
        resolve_plan("merged:union", ["a"], ServeConfig(drafters={"a": None, "b": None}))
    assert str(direct.value) in str(evaluated.value) and str(direct.value) in served.value.message
    assert served.value.param == "taps.drafters" and served.value.status == 400
