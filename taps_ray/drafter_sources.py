"""Drafter sources: the strings that name a drafter, and what they resolve to (no model code).

- a checkpoint folder;
- ``release:NAME``: a release drafter, a small drafter for the embedded target shipped as package data in
  ``taps_ray/release/NAME/`` (``config.json``, ``model.safetensors``, a model card ``README.md`` saying how
  it was trained, ``trained_prompts.json``). Everywhere a drafter folder is accepted (``--drafter``,
  ``eval.drafters``, serve configs), ``release:NAME`` is too;
- ``random:SEED`` (evaluation): a freshly initialised, untrained drafter (:func:`random_drafter_seed`).
"""

from __future__ import annotations

from pathlib import Path

RELEASE_PREFIX = "release:"
RANDOM_DRAFTER = "random:"
RELEASE_DIR = Path(__file__).resolve().parent / "release"


class ReleaseDrafterError(ValueError):
    """``release:NAME`` names no shipped drafter; the message lists the shipped ones."""


def release_names() -> list[str]:
    """Names of the shipped release drafters (folders with a ``config.json``), sorted."""
    if not RELEASE_DIR.is_dir():
        return []
    return sorted(p.name for p in RELEASE_DIR.iterdir() if (p / "config.json").is_file())


def resolve_drafter_dir(spec: str | Path) -> Path:
    """The folder of ``spec``: ``release:NAME`` -> the shipped drafter, anything else -> ``Path(spec)``."""
    text = str(spec)
    if not text.startswith(RELEASE_PREFIX):
        return Path(spec)
    name = text[len(RELEASE_PREFIX):]
    if name not in release_names():
        shipped = ", ".join(f"release:{n}" for n in release_names()) or "none"
        raise ReleaseDrafterError(f"no release drafter {text!r}; shipped: {shipped}")
    return RELEASE_DIR / name


def absolute_drafter_spec(spec: str) -> str:
    """``spec`` as a worker in another working directory can load it: ``release:NAME`` as it is, a folder
    as its absolute path (resolved against this process's working directory)."""
    text = str(spec)
    return text if text.startswith(RELEASE_PREFIX) else str(Path(text).expanduser().resolve())


def default_release_drafter(role: str) -> str | None:
    """``release:ROLE`` when that drafter is shipped, else None."""
    return f"{RELEASE_PREFIX}{role}" if role in release_names() else None


def random_drafter_seed(source: str) -> int | None:
    """The seed of a ``random:SEED`` drafter source (a fresh, untrained drafter), or None for any other
    source (a checkpoint folder); ValueError when SEED is not an integer."""
    if not source.startswith(RANDOM_DRAFTER):
        return None
    try:
        return int(source[len(RANDOM_DRAFTER):])
    except ValueError:
        raise ValueError(f"drafter {source!r}: random:SEED needs an integer SEED") from None
