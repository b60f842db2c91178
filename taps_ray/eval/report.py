"""The evaluation report: ``report.md``, ``tables/*.csv``, ``plots/*.png`` and ``summary.json`` from records.

The tables and their metric definitions live in :mod:`taps_ray.eval.tables`, the plots in
:mod:`taps_ray.eval.plots`, the eight claims of the TAPS paper in :mod:`taps_ray.eval.claims`
(evaluated at each temperature of the run, with bootstrap intervals; docs/DESIGN.md, "Claims the report
checks"). This module renders them: one function per section of ``report.md`` (:data:`SECTIONS`, also read by
``taps demo``), the run's exactness accounting and the sweeps it includes, and writes the files.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

from taps_ray.eval.claims import claim_line, evaluate_claims
from taps_ray.eval.intervals import LEVEL
from taps_ray.eval.plots import draw_plots
from taps_ray.eval.records import RECORDS, RUN_FILE, read_records
from taps_ray.eval.tables import INTERVAL_NOTE, Records, compute_tables, rows_at, with_interval
from taps_ray.runstate import atomic_write, write_json


def _fmt(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> str:
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(r.get(c, math.nan)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)



def build_tables(records: list[dict]) -> tuple[dict, Records]:
    """Every table of the report (:func:`taps_ray.eval.tables.compute_tables`) plus ``claims``, and the grouped records."""
    tables, data = compute_tables(records)
    tables["claims"] = evaluate_claims(data)
    return tables, data


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value



def _table_section(title: str, rows: list[dict], columns: list[str], note: str | None = None) -> list[str]:
    """A titled section of one table (with ``note`` above it), or nothing when there are no rows."""
    if not rows:
        return []
    return [f"### {title}", "", *([note, ""] if note else []), markdown_table(rows, columns), ""]


def tau_section(tables: dict, data: Records, t: float) -> list[str]:
    b = data.benchmarks
    raw = rows_at(tables, "tau", t)
    rows = [{"strategy": r["strategy"], **{c: with_interval(r, c) for c in [*b, "avg"]}} for r in raw]
    return ["### Acceptance length tau (Table 1)", "", INTERVAL_NOTE + ".", "",
            markdown_table(rows, ["strategy", *b, "avg"]), "",
            "Questions per cell: " + ", ".join(f"{x}: {raw[0].get(f'{x}_n', 0)}" for x in b) if raw else "", ""]


def routing_section(tables: dict, data: Records, t: float) -> list[str]:
    return _table_section("Routing decisions (Table 2)", rows_at(tables, "routing", t),
                         ["strategy", "benchmark", "drafter", "step_share", "question_share", "questions",
                          "of_questions", "mean_signal_when_chosen"],
                         "Share of verified steps and of questions (by majority of their steps) per drafter.")


def entropy_section(tables: dict, data: Records, t: float) -> list[str]:
    rows = rows_at(tables, "entropy", t, pooled=True)
    if not rows:
        return []
    return ["### Entropy at accepted vs rejected tokens (the paper's Tables 3-4 layout, Figure 7)", "",
            "Nats, all benchmarks pooled (per benchmark in `tables/entropy.csv`); draft = the drafter's distribution "
            "each token was drawn from, verifier = the target's it was verified against; delta = rejected - "
            "accepted. The paper gives one such table per backbone (EAGLE-2: Table 3, HASS: Table 4); here "
            "each row is one strategy of this run.", "",
            markdown_table(rows, ["strategy", "accepted_draft", "rejected_draft", "draft_delta", "accepted_target",
                                  "rejected_target", "target_delta", "accepted_tokens", "rejected_tokens"],
                           ["strategy", "draft: accepted", "draft: rejected", "draft: delta", "verifier: accepted",
                            "verifier: rejected", "verifier: delta", "accepted tokens", "rejected tokens"]), ""]


def depth_section(tables: dict, data: Records, t: float) -> list[str]:
    rows = rows_at(tables, "depth", t, pooled=True)
    if not rows:
        return []
    depths = sorted({int(k[1:]) for r in rows for k in r if k.startswith("d") and k[1:].isdigit()})
    return ["### Acceptance rate by depth (Tables 5-7)", "",
            "Share of the draft tokens tried at depth d that were accepted, all benchmarks; a step "
            "whose accepted path ended at a leaf before d tried nothing at d and is not a rejection. "
            "Per benchmark, with the tokens tried (`n<d>`), in `tables/acceptance_by_depth.csv`.", "",
            markdown_table(rows, ["strategy", *[f"d{d}" for d in depths]]), "",
            "Steps whose accepted path ended at a leaf before depth d (no token tried there):", "",
            markdown_table(rows, ["strategy", *[f"leaf{d}" for d in depths]]), ""]


def alpha_section(tables: dict, data: Records, t: float) -> list[str]:
    return _table_section("tau vs interpolation weight alpha (Figure 6)", rows_at(tables, "alpha", t),
                         ["alpha", *data.benchmarks, "avg"])


SPEED_COLUMNS = ["strategy", "questions", "tau", "tokens_per_s", "speedup", "tree_size", "union_size",
                 "draft_ms_per_step", "verify_ms_per_step", "same_output_as_vanilla"]


def speed_section(tables: dict, data: Records, t: float) -> list[str]:
    rows = [{**r, "speedup": with_interval(r, "speedup")} for r in rows_at(tables, "speed", t)]
    production = [r for r in rows if r["method"] == "production"]
    paper = [r for r in rows if r["method"] == "paper"]
    note = ("tokens/s over whole generate calls (prefill included) on the questions vanilla also ran, in this run; "
            f"speedup [{LEVEL:.0%} bootstrap interval over those questions, each paired with vanilla's].")
    batched = sorted({r.get("batched", 1) for s in data.strategies for r in data.get(t, s)} - {1})
    untimed = ([f"The paper's fixed trees (every other table) were decoded {', '.join(map(str, batched))} "
                "strategies at a time in one batched verification (what those tables measure does not depend on "
                "timing), so they have no speed of their own in this run.", ""] if batched else [])
    if not production:
        return [*_table_section("Wall-clock speed and verification cost", paper, SPEED_COLUMNS, note), *untimed]
    vanilla = [r for r in paper if r["strategy"] == "vanilla"]
    return [*_table_section("Wall-clock speed of the production decoder", vanilla + production, SPEED_COLUMNS,
                            f"{note} The configured tree is an upper bound: each step keeps the nodes the measured "
                            "cost model says pay, a plain step where none do, and no drafting while drafting "
                            "does not pay (prompt lookup as configured)."), *untimed,
            *_table_section("Speed of the paper's fixed trees", [r for r in paper if r["strategy"] != "vanilla"],
                            SPEED_COLUMNS, "The trees every other table measures: fixed in size, no prompt lookup, "
                            "verified whole at every step whatever they cost here.")]


SECTIONS = (tau_section, routing_section, entropy_section, depth_section, alpha_section, speed_section)
"""The sections of each temperature of ``report.md``, in order: each (tables, data, t) -> markdown lines."""


def section_text(section, tables: dict, data: Records, t: float | None = None, level: int = 3) -> str:
    """One of :data:`SECTIONS` as markdown at temperature ``t`` (the run's first by default), its headings at
    ``level`` (``taps demo`` prints and appends sections this way)."""
    t = data.temperatures[0] if t is None else t
    lines = [line.replace("### ", "#" * level + " ", 1) if line.startswith("### ") else line
             for line in section(tables, data, t)]
    return "\n".join(lines).strip()


def render_markdown(tables: dict, data: Records, run: dict, plots: list[str]) -> str:
    b = data.benchmarks
    ident = run.get("identity", {})
    lines = ["# TAPS evaluation report", ""]
    lines += [f"- target: `{ident.get('target', {}).get('model')}`; tree: {ident.get('tree')}; "
              f"max_new_tokens: {ident.get('max_new_tokens')}",
              "- drafters: " + ", ".join(f"`{n}` = {src}" for n, src in run.get("drafters", {}).items()),
              *([f"- production tree (speed table rows `production`): {ident['production_tree']}"]
                if ident.get("production_tree") else []),
              *[f"- cost model of the production records: {cost}" for cost in tables.get("cost_models", [])],
              f"- records: {len(data.records)}; temperatures: {data.temperatures}; benchmarks: {b}",
              "- tau = appended tokens per target verification step (accepted + bonus), micro-averaged per "
              "benchmark; avg = mean over benchmarks.", ""]
    lines += [f"- questions, {note}" for note in run.get("question_notes", [])] + [""] * bool(run.get("question_notes"))
    for t in data.temperatures:
        lines += [f"## Temperature {t:g}", ""]
        for section in SECTIONS:
            lines += section(tables, data, t)
        lines += [f"![{p}](plots/{p})" for p in plots if p.endswith(f"T{t:g}.png")] + [""]
    lines += ["## Claims of the TAPS paper, measured here", "",
              "Each line: the claim, whether it holds on this run's numbers (holds / does not hold: the whole "
              "95% bootstrap interval of its margin on one side of 0; inconclusive: it spans 0), those numbers "
              "and n. How each claim is checked: docs/DESIGN.md, section \"Claims the report checks\".", ""]
    for t in data.temperatures:
        lines += [f"### T={t:g}", ""] + [claim_line(c) for c in tables["claims"] if c["temperature"] == t] + [""]
    return "\n".join(lines)


SWEEPS_FILE = "sweeps.json"


def _number(text: str):
    """A CSV cell as a float when it is one (so tables format it), else the text."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def sweep_sections(out: Path, sweeps: list[str]) -> list[str]:
    """Markdown of each sweep folder's ``results.csv`` (evaluated trials) with its plot copied into
    ``out/plots`` as ``sweep-<name>.png``; a folder without results is named as missing."""
    lines = []
    for folder in map(Path, sweeps):
        results = folder / "results.csv"
        lines += [f"## Sweep `{folder.name}` ({folder})", ""]
        if not results.is_file():
            lines += [f"No `results.csv` in {folder}: the sweep has not finished.", ""]
            continue
        with results.open() as f:
            rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f) if r.get("objective")]
        if rows:
            keys = [k for k in rows[0] if k in ("alpha", "weights", "ratio", "total")]
            taus = [k for k in rows[0] if k.startswith("tau/")]
            lines += [markdown_table(rows, [*keys, *taus, "objective", "wall_s"]), ""]
        for plot in sorted(folder.glob("*.png")):
            name = f"sweep-{folder.name}-{plot.name}"
            shutil.copyfile(plot, out / "plots" / name)
            lines += [f"![{name}](plots/{name})", ""]
    return lines


def exactness_section(out: Path) -> list[str]:
    """The run's exactness accounting (``exactness.json``, written by ``taps eval``) as markdown lines."""
    from taps_ray.eval.exactness import (  # loads the target model code: only when a run has exactness
        EXACTNESS_FILE,
        Divergence,
        ExactnessReport,
    )

    path = out / EXACTNESS_FILE
    if not path.is_file():
        return []
    raw = json.loads(path.read_text())
    report = ExactnessReport(dtype=raw["dtype"], prompts=raw["prompts"], identical=raw["identical"],
                             divergences=[Divergence(**d) for d in raw["divergences"]],
                             max_logit_error=raw["max_logit_error"])
    return ["", "## Exactness (T = 0, each greedy turn against same-dtype vanilla)", "", report.to_markdown(), ""]


def write_report(out: str | Path, sweeps: list[str | Path] | None = None) -> Path:
    """Regenerate ``report.md``, ``tables/*.csv``, ``plots/*.png`` and ``summary.json`` in ``out`` from its
    records; returns the path of ``report.md``. ``sweeps``: sweep folders (``taps sweep`` outputs) whose
    results and plots the report includes; they are remembered in ``out/sweeps.json`` for later
    regenerations. FileNotFoundError when ``out`` has no records."""
    out = Path(out)
    records = read_records(out / RECORDS)
    if not records:
        raise FileNotFoundError(f"{out / RECORDS} has no records: run `taps eval` into {out} first")
    run = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else {}
    tables, data = build_tables(records)
    (out / "tables").mkdir(exist_ok=True)
    (out / "plots").mkdir(exist_ok=True)
    names = {"tau": "tau", "routing": "routing", "entropy": "entropy", "depth": "acceptance_by_depth",
             "alpha": "tau_vs_alpha", "speed": "speed", "claims": "claims"}
    for key, name in names.items():
        if tables[key]:
            write_csv(out / "tables" / f"{name}.csv", tables[key])
    plots = draw_plots(out / "plots", tables, data)
    summary = {"run": run, "records": len(records), "temperatures": data.temperatures, "benchmarks": data.benchmarks,
               "strategies": data.strategies, **tables, "plots": plots}
    write_json(out / "summary.json", _clean(summary))
    if sweeps is not None:
        write_json(out / SWEEPS_FILE, [str(Path(p).resolve()) for p in sweeps])
    remembered = json.loads((out / SWEEPS_FILE).read_text()) if (out / SWEEPS_FILE).is_file() else []
    path = out / "report.md"
    markdown = render_markdown(tables, data, run, plots)
    atomic_write(path, "\n".join([markdown, *exactness_section(out), *sweep_sections(out, remembered)]))
    return path
