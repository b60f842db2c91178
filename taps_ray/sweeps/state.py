"""A sweep folder's settings: where it goes, what a resumed sweep must share, and the resume check.

``sweep.json`` holds the settings of the sweep that started in a folder (:func:`identity`); Ray Tune's
own state is in ``tune/``. :func:`check_out` decides whether a sweep restores that state or starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from taps_ray.config import ExperimentConfig
from taps_ray.runstate import changed_settings, describe_changes, write_json
from taps_ray.sweeps.config import SweepError, SweepSpec

TUNE_DIR = "tune"
STATE_FILE = "sweep.json"


def sweep_dir(spec: SweepSpec, cfg: ExperimentConfig, out: str | Path | None) -> Path:
    return Path(out).resolve() if out else (cfg.run_dir / "sweeps" / spec.name).resolve()


def absolute_target(cfg: ExperimentConfig) -> ExperimentConfig:
    model = cfg.target.model
    if Path(model).exists():
        model = str(Path(model).resolve())
    return cfg.model_copy(update={"target": cfg.target.model_copy(update={"model": model})})


def identity(spec: SweepSpec, cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps({
        "spec": spec.model_dump(exclude={"presets", "num_samples", "resources"}),
        "experiment": {"name": cfg.name, "target": cfg.target.model, "data": cfg.data.model_dump(),
                       "train": cfg.train.model_dump(), "drafter": cfg.drafter.model_dump(), "tree": cfg.tree.model_dump()},
    }, default=str))


def check_out(out: Path, spec: SweepSpec, cfg: ExperimentConfig, resume: bool) -> bool:
    """Whether to restore the Ray Tune state in ``out``. SweepError when ``out`` holds a sweep and
    ``resume`` is off, or holds one with other settings and ``resume`` is on. With ``resume`` and no
    saved Tune state (an empty folder, or a sweep killed before Tune saved anything) the sweep starts
    over, so a retried job can always pass ``--resume``."""
    from ray.tune import Tuner

    state = out / STATE_FILE
    tune_dir = out / TUNE_DIR
    restorable = tune_dir.is_dir() and Tuner.can_restore(str(tune_dir))
    if resume:
        if state.is_file():
            changed = changed_settings(json.loads(state.read_text()), identity(spec, cfg))
            if changed:
                raise SweepError(f"{out}: settings changed since the sweep started ({describe_changes(changed)}); "
                                 f"resume with the same spec and config, or use another --out")
        if not restorable:
            print(f"taps sweep {spec.name}: nothing to resume in {out} (no saved Ray Tune state); starting the sweep",
                  flush=True)
        return restorable
    if restorable or state.is_file():
        raise SweepError(f"{out} already holds sweep results; pass --resume to continue that sweep, or --out to start "
                         f"another (nothing was overwritten)")
    return False


def write_state(out: Path, spec: SweepSpec, cfg: ExperimentConfig) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / STATE_FILE, identity(spec, cfg))
    except OSError as err:
        raise SweepError(f"output directory {str(out)!r} is not writable: {err.strerror or err}") from None
