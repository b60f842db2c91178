"""``taps``: one subcommand per job.

Each subcommand is a ``(add_arguments, run)`` pair registered in :data:`COMMANDS`; ``run`` gets
the parsed namespace and returns a process exit code. Errors that are the user's (bad config,
bad value, missing file) print one clear line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from taps_ray.config import ConfigError, load_config

log = logging.getLogger("taps")


class UserError(Exception):
    """An error caused by the command line or its inputs; printed without a traceback."""


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.features.max_len=512")


def _load(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


# -- prepare -------------------------------------------------------------------------------------

def _add_prepare(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--datasets", default=None, help="comma-separated dataset names (default: all)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_prepare(args: argparse.Namespace) -> int:
    from taps_ray.data.features import prepare_features, summary_table

    cfg = _load(args)
    names = args.datasets.split(",") if args.datasets else None
    results = prepare_features(cfg, names)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(summary_table(results))
    return 0


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "prepare": ("compute and cache target features for the config's datasets", _add_prepare, _run_prepare),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taps", description="Task-aware speculative decoding on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _, _, run = COMMANDS[args.command]
    try:
        return run(args)
    except (ConfigError, UserError, FileNotFoundError, ValueError) as err:
        print(f"taps {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
