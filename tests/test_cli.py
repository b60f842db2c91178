"""``taps`` argument handling that does not need a model: eval flags become config overrides."""

from __future__ import annotations

from taps_ray.cli import _eval_overrides, build_parser
from taps_ray.config import load_config
from tests.conftest import REPO

DEMO = str(REPO / "configs" / "demo.yaml")


def _eval_config(*flags: str):
    args = build_parser().parse_args(["eval", DEMO, *flags])
    return load_config(args.config, list(args.overrides) + _eval_overrides(args))


def test_drafters_flag_composes_the_given_drafters_unless_told_otherwise():
    assert _eval_config().eval.compose == ["math", "chat"]
    cfg = _eval_config("--drafters", "regen=a,ref=b,fresh=random:0", "--limit", "20")
    assert cfg.eval.drafters == {"regen": "a", "ref": "b", "fresh": "random:0"} and cfg.eval.compose is None
    assert cfg.eval.limit == 20
    cfg = _eval_config("--drafters", "x=a,y=b,z=c", "--compose", "z,x")
    assert cfg.eval.compose == ["z", "x"]
