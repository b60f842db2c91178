"""What the ``taps`` subcommands share: the user-error type, the experiment arguments, drafter loading."""

from __future__ import annotations

import argparse
import sys

from taps_ray.config import ExperimentConfig, load_config


class UserError(Exception):
    """An error caused by the command line or its inputs; printed without a traceback."""


def config_args(parser: argparse.ArgumentParser) -> None:
    """The positional arguments of a command that reads an experiment: its YAML and dotted overrides."""
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.features.max_len=512 "
                                                     "(`taps config-help` lists every key)")


def load_experiment(args: argparse.Namespace) -> ExperimentConfig:
    """The experiment config of ``args.config`` with ``args.overrides`` applied."""
    return load_config(args.config, args.overrides)


def load_drafters(target, dirs: list[str], seed: int) -> list:
    """The drafters of the sources ``dirs`` (folders, ``release:NAME``, ``random:SEED``) for ``target`` (none
    given: the shipped math drafter, else a fresh one of ``seed``); a drafter that cannot be loaded, or a bad
    source, is a :class:`UserError`."""
    from taps_ray.drafter_sources import default_release_drafter
    from taps_ray.models.drafter import DrafterLoadError
    from taps_ray.spec.decoder import load_drafter, load_drafter_source

    if not dirs:
        shipped = default_release_drafter("math")
        if shipped is None:
            print("taps: no --drafter given: using a freshly initialised (untrained) drafter", file=sys.stderr)
            return [load_drafter(target, None, seed)]
        print(f"taps: no --drafter given: using {shipped}", file=sys.stderr)
        dirs = [shipped]
    try:
        return [load_drafter_source(target, d, d) for d in dirs]
    except DrafterLoadError as err:
        raise UserError(str(err)) from err
    except ValueError as err:
        raise UserError(str(err)) from None


def int_list(text: str, flag: str) -> list[int]:
    """The comma-separated integers of ``flag``'s ``text``; :class:`UserError` when there are none or one is not."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag} is empty")
    return values
