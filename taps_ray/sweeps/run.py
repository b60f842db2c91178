"""``taps sweep``: Ray Tune sweeps over data-mixture ratios and checkpoint-interpolation weights.

:func:`run_sweep` checks the trials' resources against ``ray.cluster_resources()`` before anything
starts, resolves on the driver everything trials need (the target's embedding and LM head and the
held-out feature rows in the object store, held-out prompts as token ids, absolute paths), runs a
``Tuner`` (or ``Tuner.restore`` with ``resume``: finished trials are kept, unfinished ones run) and
writes, under ``runs/<experiment>/sweeps/<name>/`` (or ``out``): ``results.csv`` (one row per trial:
config, tau per domain, objective, wall time, status), a PNG plot (tau per domain vs ratio, or vs
alpha: the paper's Figure 6), ``best.json`` (the best config and its drafter's path) and
``sweep.json`` (the settings a resumed sweep must share). Ray Tune's own state is in ``tune/``, each
trial's outputs (drafter, Ray Train run, attempts) in ``trials/<trial_id>/``.

A trial that fails is retried ``max_failures`` times, then reported as failed; the sweep goes on.

This module is the driver (the Tune wiring) and the command line; the pieces it drives are
:mod:`~taps_ray.sweeps.resources` (per-trial resources against the cluster),
:mod:`~taps_ray.sweeps.state` (the folder's settings and the resume check),
:mod:`~taps_ray.sweeps.context` (what trials need, resolved on the driver) and
:mod:`~taps_ray.sweeps.results` (rows, CSV, plot, best config, the printed table).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from taps_ray.config import ExperimentConfig, load_config
from taps_ray.runstate import folder_lock
from taps_ray.sweeps.config import InterpolationSweepSpec, MixtureSweepSpec, SweepError, SweepSpec, load_spec
from taps_ray.sweeps.context import interpolation_context, mixture_context
from taps_ray.sweeps.resources import TrialResources, cluster_resources, plan_resources
from taps_ray.sweeps.results import (
    SweepSummary,
    best_row,
    collect_rows,
    describe_config,
    discard_stopped_drafters,
    report,
    short,
    write_outputs,
)
from taps_ray.sweeps.state import TUNE_DIR, absolute_target, check_out, sweep_dir, write_state

log = logging.getLogger(__name__)


def _trial_dirname(trial) -> str:
    return trial.trial_id


def _progress_callback(name: str, domains: list[str]):
    from ray.tune import Callback

    class Progress(Callback):
        """One line per trial event on stdout."""

        def on_trial_result(self, iteration, trials, trial, result, **info):
            head = f"taps sweep {name}: trial {trial.trial_id} ({describe_config(trial.config)})"
            if result.get("evaluated"):
                taus = ", ".join(f"{d} {result.get(f'tau/{d}', math.nan):.3f}" for d in domains)
                print(f"{head} done in {result.get('wall_s', 0):.0f}s: tau {taus}; objective "
                      f"{result.get('objective', math.nan):.3f}", flush=True)
            elif "sim_objective" in result:
                sims = ", ".join(f"{d} {result.get(f'sim_tau/{d}', math.nan):.3f}" for d in domains)
                print(f"{head} epoch {result.get('epoch')}: simulated tau {sims}; sim. objective "
                      f"{result['sim_objective']:.3f}", flush=True)

        def on_trial_recover(self, iteration, trials, trial, **info):
            print(f"taps sweep {name}: trial {trial.trial_id} failed; retrying", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"taps sweep {name}: trial {trial.trial_id} ({describe_config(trial.config)}) failed", flush=True)

    return Progress()


def _quiet_tune() -> None:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    for logger in ("ray.tune", "ray.train", "ray.air"):
        logging.getLogger(logger).setLevel(logging.ERROR)


def _trainable(spec: SweepSpec, cfg: ExperimentConfig, out: Path, resources: TrialResources, target) -> Any:
    """The Tune trainable with its context (``with_parameters``, everything resolved and checked on the
    driver) and the trial actor's resources (``with_resources``)."""
    from ray import tune

    if isinstance(spec, MixtureSweepSpec):
        from taps_ray.sweeps.mixture import mixture_trial

        trainable = tune.with_parameters(mixture_trial, context=mixture_context(spec, cfg, out, resources, target))
    else:
        from taps_ray.sweeps.interpolation import interpolation_trial

        trainable = tune.with_parameters(interpolation_trial,
                                         context=interpolation_context(spec, cfg, out, resources, target))
    return tune.with_resources(trainable, resources.actor)


def run_sweep(spec: SweepSpec, cfg: ExperimentConfig, out: str | Path | None = None, resume: bool = False,
              num_samples: int | None = None, target=None, callbacks: list | None = None) -> SweepSummary:
    """Run (or, with ``resume``, continue) the sweep ``spec`` over experiment ``cfg`` (see module docstring).

    ``target``: an already loaded :class:`TargetModel` (default: ``cfg.target`` on the CPU; the driver
    uses its tokenizer, fingerprint, embedding and LM head). ``callbacks``: extra Ray Tune callbacks (a
    resumed sweep keeps those of the run it continues: Tune restores its ``RunConfig``).
    Raises :class:`SweepError` for input problems before any trial starts. One process at a time
    writes a sweep folder (:func:`taps_ray.runstate.folder_lock`).
    """
    started = time.time()
    cfg = absolute_target(cfg)
    out = sweep_dir(spec, cfg, out)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(out, "taps sweep"))
        except OSError as err:
            raise SweepError(f"output directory {str(out)!r} is not writable: {err.strerror or err}") from None
        return _sweep(spec, cfg, out, resume, num_samples, target, callbacks, started)


def _sweep(spec: SweepSpec, cfg: ExperimentConfig, out: Path, resume: bool, num_samples: int | None, target,
           callbacks: list | None, started: float) -> SweepSummary:
    """:func:`run_sweep` into ``out``, whose lock this process holds."""
    from ray import tune

    from taps_ray.runtime.cluster import init_ray
    from taps_ray.runtime.placement import remove_recorded
    from taps_ray.runtime.storage import SharedStorageError, check_shared_storage

    init_ray()
    _quiet_tune()
    try:
        check_shared_storage(out, what="sweep directory")
    except SharedStorageError as err:
        raise SweepError(str(err)) from None
    cluster, nodes = cluster_resources()
    resources = plan_resources(spec, cluster, nodes)
    resume = check_out(out, spec, cfg, resume)
    if target is None:
        from taps_ray.models.target import TargetLoadError, TargetModel

        try:
            target = TargetModel.load(cfg.target.model_copy(update={"device": "cpu"}))
        except TargetLoadError as err:
            raise SweepError(str(err)) from None
    trainable = _trainable(spec, cfg, out, resources, target)
    write_state(out, spec, cfg)
    print(f"taps sweep {spec.name}: {spec.kind} sweep of {_describe_search(spec)} -> {out}; per trial "
          f"{resources.describe}; up to {resources.max_concurrent} trial(s) at once", flush=True)
    run_callbacks = [_progress_callback(spec.name, spec.domains), *(callbacks or [])]
    if resume:
        tuner = tune.Tuner.restore(str(out / TUNE_DIR), trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
    else:
        tuner = _new_tuner(spec, trainable, out, num_samples, resources, run_callbacks)
    grid = tuner.fit()
    reaped = remove_recorded(out / "trials")
    if reaped:
        log.info("sweep %s: removed %d placement group(s) left by stopped or failed trials", spec.name, reaped)
    statuses = {t.trial_id: t.status for t in tune.ExperimentAnalysis(str(out / TUNE_DIR)).trials}
    rows = collect_rows(grid, statuses, out)
    discard_stopped_drafters(rows, out)
    summary = SweepSummary(spec.name, spec.kind, out, spec.objective.describe(), spec.domains, list(spec.search),
                           rows, time.time() - started,
                           expected=(num_samples or spec.num_samples) * math.prod(
                               len(d.grid) for d in spec.search.values() if d.grid is not None))
    summary.best = best_row(summary.rows)
    write_outputs(summary, spec)
    return summary


def _new_tuner(spec: SweepSpec, trainable, out: Path, num_samples: int | None, resources: TrialResources,
               callbacks: list):
    """A fresh ``tune.Tuner`` of ``spec`` storing into ``out / TUNE_DIR``: ``num_samples`` (None: the spec's)
    samples, ``resources.max_concurrent`` trials at once, ASHA early stopping when a mixture sweep asks for it."""
    from ray import tune

    scheduler = None
    if isinstance(spec, MixtureSweepSpec) and spec.scheduler.kind == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="epoch", metric="sim_objective", mode="max",
                                  max_t=spec.max_epochs(), grace_period=spec.scheduler.grace_period,
                                  reduction_factor=spec.scheduler.reduction_factor)
    return tune.Tuner(
        trainable,
        param_space=spec.param_space(),
        tune_config=tune.TuneConfig(num_samples=num_samples or spec.num_samples, scheduler=scheduler,
                                    max_concurrent_trials=resources.max_concurrent,
                                    reuse_actors=isinstance(spec, InterpolationSweepSpec),
                                    trial_dirname_creator=_trial_dirname, trial_name_creator=_trial_dirname),
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=str(out), verbose=0, callbacks=callbacks,
                                  failure_config=tune.FailureConfig(max_failures=spec.max_failures)),
    )


def _describe_search(spec: SweepSpec) -> str:
    parts = []
    for key, dim in spec.search.items():
        values = dim.finite
        parts.append(f"{key} {dim.kind} {[short(v) for v in values] if values else list(getattr(dim, dim.kind))}")
    return ", ".join(parts)

# -- command line ----------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    """Arguments of ``taps sweep``."""
    parser.add_argument("spec", help="sweep spec YAML: tune/mixture.yaml or tune/interpolation.yaml")
    parser.add_argument("config", nargs="?", default=None,
                        help="experiment YAML (default: the spec's 'experiment', e.g. configs/demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the spec, e.g. resources.num_workers=2")
    parser.add_argument("--preset", default=None, help="a preset of the spec (e.g. quick)")
    parser.add_argument("--num-samples", type=int, default=None, help="samples per grid point (default: the spec's)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials are kept")
    parser.add_argument("--out", default=None, help="output folder (default: runs/<experiment>/sweeps/<name>)")
    parser.add_argument("--json", action="store_true", help="print the rows and the best trial as JSON")


def run_command(args) -> int:
    """``taps sweep``: 0 when every trial finished and one was evaluated, else 1."""
    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not Path(config).exists():
        overrides, config = [config, *overrides], None
    if args.num_samples is not None and args.num_samples < 1:
        raise SweepError(f"--num-samples must be >= 1, got {args.num_samples}")
    spec = load_spec(args.spec, args.preset, overrides)
    cfg = load_config(config or spec.experiment)
    summary = run_sweep(spec, cfg, args.out, resume=args.resume, num_samples=args.num_samples)
    if args.json:
        print(json.dumps({"rows": [vars(r) for r in summary.rows], "best": summary.best and vars(summary.best),
                          "files": {k: str(v) for k, v in summary.files.items()}}, indent=1, default=str))
    else:
        print(report(summary))
    sys.stdout.flush()
    return 0 if summary.best is not None and not summary.unfinished else 1

