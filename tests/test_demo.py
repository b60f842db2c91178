"""``taps demo`` wiring: the demo evaluates this run's HASS drafters, the full variant is a separate run."""

from __future__ import annotations

import pytest

from taps_ray.demo import ROLES, demo_config, release_sections
from taps_ray.eval.report import build_tables, render_markdown
from tests.conftest import REPO
from tests.eval.test_report import paper_like_records

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


def test_release_sections_come_from_the_tables_not_the_markdown():
    tables, data = build_tables(paper_like_records())
    text = release_sections(tables, data)
    assert text.startswith("#### Acceptance length tau (Table 1)") and "\n#### Wall-clock speed" in text
    assert "###" not in text.replace("####", "")
    report = render_markdown(tables, data, {}, [])
    for section in text.split("\n\n#### "):
        assert section.removeprefix("#### ").strip() in report, "the same sections as the run's report.md"


def test_release_drafters_are_evaluated_beside_the_demo_ones(monkeypatch):
    from taps_ray import demo
    from taps_ray import drafter_sources as release

    cfg = demo_config(DEMO, [], full=False)
    monkeypatch.setattr(release, "release_names", lambda: ["chat", "math"])
    shipped = demo.release_config(cfg)
    assert shipped.eval.drafters == {"math": "release:math", "chat": "release:chat"}
    assert shipped.eval.strategies == demo.RELEASE_STRATEGIES and shipped.eval.out.endswith("eval-release")
    assert shipped.eval.benchmarks == cfg.eval.benchmarks and shipped.eval.limit == cfg.eval.limit
    monkeypatch.setattr(release, "release_names", lambda: ["chat", "math", "mixed"])
    shipped = demo.release_config(cfg)
    assert shipped.eval.drafters == {"math": "release:math", "chat": "release:chat", "mixed": "release:mixed"}
    assert shipped.eval.compose == ["math", "chat"]
    monkeypatch.setattr(release, "release_names", lambda: ["math", "mixed"])
    assert demo.release_config(cfg) is None
