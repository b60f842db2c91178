"""``taps``: one subcommand per job.

Each subcommand is an ``add_NAME(parser)`` and ``run_NAME(args)`` pair in a module of :mod:`taps_ray.commands`
(by group, registered in :data:`COMMANDS`; the help line is ``run_NAME``'s docstring); ``run`` gets the parsed
namespace and returns a process exit code. Errors that are the user's (bad config, bad value, missing file) print one clear line and exit 2,
never a traceback. Each ``run`` imports what its job needs inside it, so ``taps --help`` and the light
commands load neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from taps_ray.commands import checkpoints, drafting, study
from taps_ray.commands.common import UserError, load_experiment
from taps_ray.config import ConfigError, load_config
from taps_ray.runstate import RunStateError

log = logging.getLogger("taps")


COMMANDS: dict[str, ModuleType] = {
    "demo": study, "prepare": study, "generate": drafting, "eval": study, "report": study, "average": checkpoints,
    "export": checkpoints, "bench": drafting, "calibrate": drafting, "train": study, "adapt": study,
    "serve": drafting, "config-help": study, "sweep": study,
}
"""Each subcommand -> the module of :mod:`taps_ray.commands` with its ``add_NAME`` and ``run_NAME`` (``-`` as ``_``)."""


def command(name: str) -> tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """The help line (``run_NAME``'s docstring), ``add_arguments`` and ``run`` of subcommand ``name``."""
    attribute = name.replace("-", "_")
    run = getattr(COMMANDS[name], f"run_{attribute}")
    help_text = " ".join((run.__doc__ or "").split()).rstrip(".")
    return help_text, getattr(COMMANDS[name], f"add_{attribute}"), run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taps", description="Task-aware speculative decoding on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        help_text, add_arguments, _ = command(name)
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; dotted overrides (``key.path=value``) may also follow the flags."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _run_folder(args: argparse.Namespace) -> Path | None:
    """The run folder of a command that runs Ray (its Ray log goes to ``<run folder>/logs/ray.log``); None
    for the others, or when the config does not load (the command then reports why)."""
    try:
        if args.command == "demo":
            from taps_ray.demo import demo_config

            return demo_config(args.config, args.overrides, args.full).run_dir
        if args.command in ("prepare", "train", "adapt", "eval"):
            return load_experiment(args).run_dir
        if args.command == "sweep":
            from taps_ray.sweeps.config import load_spec

            config, overrides = args.config, list(args.overrides)
            if config is not None and "=" in config and not Path(config).exists():
                config, overrides = None, [config, *overrides]
            return load_config(config or load_spec(args.spec, args.preset, overrides).experiment).run_dir
    except Exception:  # noqa: BLE001  (the command itself reports a bad config)
        return None
    return None


def _shown(path: Path) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars, here and in actors
    import transformers

    transformers.utils.logging.disable_progress_bar()
    _, _, run = command(args.command)
    ray_log = _route_ray_logs(args)
    try:
        return run(args)
    except (ConfigError, UserError, FileNotFoundError, ValueError, RunStateError) as err:
        print(f"taps {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if ray_log is not None:
            _end_ray_log(args, ray_log)


def _route_ray_logs(args: argparse.Namespace) -> Path | None:
    """Ray's own messages to ``<run folder>/logs/ray.log`` for a command that runs Ray (see
    :func:`taps_ray.runtime.cluster.route_ray_logs`); the path, named on the console, or None."""
    run_folder = _run_folder(args)
    if run_folder is None:
        return None
    from taps_ray.runtime.cluster import ray_log_path, route_ray_logs

    try:
        path = route_ray_logs(ray_log_path(run_folder))
    except OSError:  # an unwritable output_dir: the command itself says so
        return None
    print(f"taps {args.command}: Ray's own messages go to {_shown(path)}", file=sys.stderr, flush=True)
    return path


def _end_ray_log(args: argparse.Namespace, path: Path) -> None:
    """Name the Ray log again when Ray ran; otherwise give Ray's loggers their console back."""
    import ray

    from taps_ray.runtime.cluster import stop_routing_ray_logs

    if ray.is_initialized():  # stays routed until exit: Ray's shutdown still writes
        print(f"taps {args.command}: Ray's log of this run: {_shown(path)}", file=sys.stderr, flush=True)
    else:
        stop_routing_ray_logs()


if __name__ == "__main__":
    sys.exit(main())
