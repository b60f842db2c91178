"""Where source data is read from: files under ``$TAPS_DATA_DIR`` or at a given path, and the HF hub.

Both readers raise the two errors every data reader shares: :class:`SourceUnavailable` when the
data cannot be obtained here (an alternative then falls through) and :class:`SourceError` when it is
malformed. The hub is probed once with a short timeout, so an unreachable hub is a quick
:class:`SourceUnavailable` instead of ``datasets``' retries.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

HUB_PROBE_TIMEOUT_S = 3.0
HUB_PROBE_TTL_S = 300.0
_TRUE_ENV = ("1", "true", "yes", "on")


class SourceError(ValueError):
    """Source data is malformed or unusable; the message names the file and line (or row)."""


class SourceUnavailable(RuntimeError):
    """A source cannot be obtained here (file or data dir missing, hub unreachable, package
    missing); the message gives the reason. Alternatives fall through on this error only."""


def data_dir() -> Path | None:
    """``$TAPS_DATA_DIR`` as a path, or None when unset."""
    value = os.environ.get("TAPS_DATA_DIR")
    return Path(value) if value else None


def data_file(relative: str) -> Path:
    """A file under ``$TAPS_DATA_DIR``; :class:`SourceUnavailable` if the variable is unset or the file is missing."""
    root = data_dir()
    if root is None:
        raise SourceUnavailable(f"TAPS_DATA_DIR is not set (needed for {relative})")
    return existing_file(root / relative)


def existing_file(path: str | Path) -> Path:
    """``path`` if it is a file; otherwise :class:`SourceUnavailable` naming it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SourceUnavailable(f"file not found: {path}")
    return path



def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _hub_offline_mode() -> bool:
    return any(os.environ.get(name, "").lower() in _TRUE_ENV for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


_hub_probes: dict[str, tuple[float, str | None]] = {}


def hub_unreachable_reason() -> str | None:
    """Why the HF hub cannot be used now, or None when it answers (or offline mode uses the local cache).

    Probes ``$HF_ENDPOINT`` once with a short timeout; the answer is remembered for a few minutes,
    so unreachable hubs cost one quick probe instead of ``datasets``' retries.
    """
    if _hub_offline_mode():
        return None
    endpoint = _hub_endpoint()
    cached = _hub_probes.get(endpoint)
    if cached is not None and time.monotonic() - cached[0] < HUB_PROBE_TTL_S:
        return cached[1]
    reason: str | None = None
    try:
        request = urllib.request.Request(endpoint + "/api/whoami-v2", method="HEAD")
        urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        reason = None
    except (urllib.error.URLError, OSError) as err:
        detail = getattr(err, "reason", err)
        reason = f"HF hub {endpoint} unreachable ({detail}); set HF_HUB_OFFLINE=1 to use a local HF cache"
    _hub_probes[endpoint] = (time.monotonic(), reason)
    return reason


def load_hf_dataset(name: str, subset: str | None = None, split: str = "train"):
    """``datasets.load_dataset(name, subset, split=split)``, or :class:`SourceUnavailable` with the
    reason (hub unreachable, ``datasets`` missing, dataset/split not found) without long retries."""
    label = hf_label(name, subset, split)
    reason = hub_unreachable_reason()
    if reason:
        raise SourceUnavailable(f"{label}: {reason}")
    try:
        import datasets
    except ImportError as err:
        raise SourceUnavailable(f"{label}: the 'datasets' package is not installed ({err})") from None
    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as err:
        raise SourceUnavailable(f"{label}: {type(err).__name__}: {err}") from None


def hf_label(name: str, subset: str | None, split: str) -> str:
    """Human-readable origin of an HF dataset split: ``hf:name[/subset] split=...``."""
    return f"hf:{name}" + (f"/{subset}" if subset else "") + f" split={split}"

