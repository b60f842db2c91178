"""``taps demo``: the TAPS study end to end on one experiment config (``make demo``).

prepare (target features, cached) -> train (every variant concurrently; finished drafters are
kept) -> eval (the config's ``eval`` section: benchmarks x strategies over the trained drafters;
finished records are kept) -> the shipped release drafters (``release:math``, ``release:chat``, ``release:mixed``)
under :data:`RELEASE_STRATEGIES` on the same questions, when the package has them ->
interpolation sweep (``tune/interpolation.yaml`` over the ``math`` and ``chat`` drafters; a
finished sweep is kept) -> report (``<run_dir>/eval/report.md`` with the sweep's plot and the
release drafters' tau and speed tables). ``full`` applies :data:`FULL`: a separate run
(``demo-full``) whose math drafters learn from the target's own answers (self-distillation), with
more training and larger evaluation limits. Prints the tau table, the claims, each stage's wall
time and the report's path.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from taps_ray.config import ExperimentConfig, load_config
from taps_ray.eval.claims import claim_line
from taps_ray.eval.records import RECORDS, read_records
from taps_ray.eval.report import build_tables, section_text, speed_section, tau_section, write_report
from taps_ray.eval.tables import Records
from taps_ray.runstate import write_json

SWEEP_SPEC = Path(__file__).resolve().parents[1] / "tune" / "interpolation.yaml"
FULL = [
    "name=demo-full",
    "data.datasets.math.alternatives=[{kind: gsm8k_train, limit: 320, seed: 0, regenerate: true}, "
    "{kind: gsm8k_test_split, limit: 320, seed: 0, regenerate: true}]",
    "train.epochs=4", "train.lr=1.0e-3", "eval.limit=10", "eval.max_new_tokens=96",
]
ROLES = {"math": "hass-math", "chat": "hass-chat", "mixed": "hass-mixed"}
RELEASE_STRATEGIES = ["vanilla", "single", "routed:confidence:request", "routed:confidence:step", "merged:budget"]
RELEASE_SECTIONS = (tau_section, speed_section)


@dataclass
class DemoTimes:
    """Wall seconds per stage, in order."""

    stages: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        rows = [f"| {name} | {seconds:.0f} |" for name, seconds in self.stages.items()]
        total = sum(self.stages.values())
        return "\n".join(["| stage | wall s |", "|---|---:|", *rows, f"| total | {total:.0f} |"])


def demo_config(path: str | Path, overrides: list[str], full: bool) -> ExperimentConfig:
    """The experiment with the eval drafters pointed at this run's trained HASS variants."""
    cfg = load_config(path, [*(FULL if full else []), *overrides])
    drafters = {role: str((cfg.run_dir / "drafters" / variant).resolve()) for role, variant in ROLES.items()
                if any(v.name == variant for v in cfg.variants)}
    missing = sorted(set(ROLES) - set(drafters))
    if missing:
        raise ValueError(f"the demo evaluates the variants {sorted(ROLES.values())}; "
                         f"{path} has no variant for role(s) {missing}")
    evaluation = cfg.eval.model_copy(update={"drafters": {**cfg.eval.drafters, **drafters}})
    return cfg.model_copy(update={"eval": evaluation})


def release_config(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """The demo's evaluation over the shipped release drafters (``release:math``, ``release:chat``, and
    ``release:mixed`` alone when shipped) with :data:`RELEASE_STRATEGIES`, into ``<run_dir>/eval-release``;
    None when the two specialists are not shipped."""
    from taps_ray.drafter_sources import release_names

    shipped = set(release_names())
    if not {"math", "chat"} <= shipped:
        return None
    drafters = {role: f"release:{role}" for role in ("math", "chat", "mixed") if role in shipped}
    evaluation = cfg.eval.model_copy(update={
        "drafters": drafters, "compose": ["math", "chat"],
        "strategies": RELEASE_STRATEGIES, "out": str(cfg.run_dir / "eval-release"), "temperatures": [0.0]})
    return cfg.model_copy(update={"eval": evaluation})


def release_sections(tables: dict, data) -> str:
    """The release drafters' :data:`RELEASE_SECTIONS` of the report, from its tables, headings one level down."""
    return "\n\n".join(section_text(section, tables, data, level=4) for section in RELEASE_SECTIONS)


def interpolation_sweep(cfg: ExperimentConfig, full: bool, target) -> Path:
    """:data:`SWEEP_SPEC` (its ``demo`` profile unless ``full``) over the demo's ``math`` and ``chat`` drafters into
    ``<run_dir>/sweeps/<name>``, resuming an interrupted one and keeping a finished one; returns that folder."""
    from taps_ray.sweeps.config import load_spec
    from taps_ray.sweeps.results import report as sweep_report
    from taps_ray.sweeps.run import run_sweep

    spec = load_spec(SWEEP_SPEC, None if full else "demo",
                     [f"drafters.{role}={cfg.eval.drafters[role]}" for role in ("math", "chat")])
    sweep_out = cfg.run_dir / "sweeps" / spec.name
    done = (sweep_out / "results.csv").is_file()
    if done:
        print(f"taps demo: {sweep_out} holds a finished sweep; kept", flush=True)
    else:
        summary = run_sweep(spec, cfg, sweep_out, resume=(sweep_out / "tune").is_dir(), target=target)
        print(sweep_report(summary), flush=True)
    return sweep_out


def append_release_report(report: Path, drafters: Iterable[str], release_report: Path,
                          shipped: tuple[dict, Records]) -> None:
    """Append to ``report`` a section on the release ``drafters``: a link to ``release_report`` and their
    :data:`RELEASE_SECTIONS` from ``shipped`` (its tables and data)."""
    names = ", ".join(drafters)
    report.write_text(report.read_text() + f"\n## Release drafters ({names}; shipped with the "
                      f"package)\n\nFrom [{release_report.parent.name}/report.md]({release_report}).\n\n"
                      + release_sections(*shipped) + "\n")


def print_results(tables: dict, data: Records, shipped: tuple[dict, Records] | None) -> None:
    """Print the tau table, the release drafters' sections when ``shipped`` (their tables and data), and the
    paper's claims at each temperature."""
    print("\n" + section_text(tau_section, tables, data))
    if shipped is not None:
        print("\nRelease drafters:\n" + "\n\n".join(section_text(s, *shipped) for s in RELEASE_SECTIONS))
    print("\nClaims of the TAPS paper (holds / does not hold / inconclusive from the 95% bootstrap interval of each "
          "claim's margin; how each is checked: docs/DESIGN.md, \"Claims the report checks\"):\n"
          + "\n".join(f"[T={c['temperature']:g}] " + claim_line(c, bold=False) for c in tables["claims"]))


def run_demo(path: str | Path, overrides: list[str] | None = None, full: bool = False,
             sweep: bool = True) -> Path:
    """Run every stage (see module docstring); returns the report's path."""
    from taps_ray.data.features import prepare_features, summary_table
    from taps_ray.eval.runner import run_eval
    from taps_ray.models.target import TargetModel
    from taps_ray.train.launch import run_training
    from taps_ray.train.launch import summary_table as train_table

    cfg = demo_config(path, list(overrides or []), full)
    times = DemoTimes()

    release = release_config(cfg)
    stages = 4 + bool(sweep) + (release is not None)

    def stage(name: str):
        print(f"\n== taps demo: {name} ({len(times.stages) + 1}/{stages}) ==", flush=True)
        return time.perf_counter()

    started = stage("prepare target features")
    target = TargetModel.load(cfg.target.model_copy(update={"device": "cpu"}))
    print(summary_table(prepare_features(cfg, target=target)), flush=True)
    times.stages["prepare"] = time.perf_counter() - started

    started = stage(f"train {len(cfg.variants)} drafter variants concurrently")
    summary = run_training(cfg, mode="resume", target=target)
    print(train_table(summary), flush=True)
    if summary.failed:
        raise RuntimeError(f"training failed for {[r.variant for r in summary.failed]}; see the log above, then "
                           f"rerun `make demo` (finished variants are kept)")
    times.stages["train"] = time.perf_counter() - started

    started = stage("evaluate strategies on the benchmarks")
    out = run_eval(cfg, report=False)
    times.stages["eval"] = time.perf_counter() - started

    release_report = None
    if release is not None:
        started = stage("evaluate the shipped release drafters beside them")
        release_report = write_report(run_eval(release, report=False))
        times.stages["release eval"] = time.perf_counter() - started

    sweeps = []
    if sweep:
        started = stage("interpolation sweep (tau vs alpha)")
        sweeps.append(interpolation_sweep(cfg, full, target))
        times.stages["sweep"] = time.perf_counter() - started

    started = stage("report")
    report = write_report(out, sweeps)
    tables, data = build_tables(read_records(out / RECORDS))
    shipped = build_tables(read_records(release_report.parent / RECORDS)) if release_report is not None else None
    if shipped is not None:
        append_release_report(report, release.eval.drafters.values(), release_report, shipped)
    times.stages["report"] = time.perf_counter() - started
    print_results(tables, data, shipped)
    print("\n" + times.table())
    write_json(out / "demo_times.json", times.stages)
    print(f"\nreport: {report}", flush=True)
    return report
