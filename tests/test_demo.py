"""``taps demo`` wiring: the demo evaluates this run's HASS drafters, the full variant is a separate run."""

from __future__ import annotations

import pytest

from taps_ray.demo import ROLES, _section, demo_config
from tests.conftest import REPO

DEMO = REPO / "configs" / "demo.yaml"


def test_demo_evaluates_this_runs_hass_drafters():
    cfg = demo_config(DEMO, [], full=False)
    assert cfg.eval.drafters == {role: str((cfg.run_dir / "drafters" / v).resolve()) for role, v in ROLES.items()}
    assert cfg.eval.compose == ["math", "chat"] and cfg.eval.benchmarks == ["mt_bench", "gsm8k", "math_500", "svamp"]
    full = demo_config(DEMO, ["eval.limit=4"], full=True)
    assert full.name == "demo-full" and full.eval.limit == 4 and full.train.epochs > cfg.train.epochs
    assert full.eval.drafters["math"].endswith("demo-full/drafters/hass-math")
    assert all(a.regenerate for a in full.data.datasets["math"].alternatives), "full: math is self-distilled"
    assert not any(a.regenerate for a in cfg.data.datasets["math"].alternatives)


def test_demo_needs_the_hass_variants():
    with pytest.raises(ValueError, match=r"no variant for role\(s\) \['mixed'\]"):
        demo_config(DEMO, ["variants=[{name: hass-math, algorithm: hass, mixture: math-only},"
                           "{name: hass-chat, algorithm: hass, mixture: chat-only}]"], full=False)


def test_section_extracts_one_table():
    text = "# r\n### Acceptance length tau (Table 1)\n\n| a |\n|---|\n### Routing\nx"
    assert _section(text, "Acceptance length tau") == "### Acceptance length tau (Table 1)\n\n| a |\n|---|"


def test_release_drafters_are_evaluated_beside_the_demo_ones(monkeypatch):
    from taps_ray import demo
    from taps_ray.models import release

    cfg = demo_config(DEMO, [], full=False)
    monkeypatch.setattr(release, "release_names", lambda: ["chat", "math"])
    shipped = demo.release_config(cfg)
    assert shipped.eval.drafters == {"math": "release:math", "chat": "release:chat"}
    assert shipped.eval.strategies == demo.RELEASE_STRATEGIES and shipped.eval.out.endswith("eval-release")
    assert shipped.eval.benchmarks == cfg.eval.benchmarks and shipped.eval.limit == cfg.eval.limit
    monkeypatch.setattr(release, "release_names", lambda: ["math"])
    assert demo.release_config(cfg) is None
