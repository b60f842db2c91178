"""What the ingress's status routes report: ``/ready`` from the deployments' running replicas
(:func:`readiness`), the drafter version each drafter's replicas serve for ``/v1/models`` and ``/metrics``
(:func:`served_versions`), with no filesystem paths (:func:`public_checkpoint`), and the shared, time-limited
fill those routes read through (:class:`SharedFill`)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from taps_ray.serving.plan import VERIFIER_DEPLOYMENT, drafter_deployment_name


def public_checkpoint(checkpoint: str | None) -> str | None:
    """What ``/v1/models`` shows of a drafter's checkpoint: ``release:NAME`` as is, None (untrained) as
    None, any folder as ``"local"`` (no filesystem paths)."""
    if checkpoint is None or checkpoint.startswith("release:"):
        return checkpoint
    return "local"


def version_counts(stats: list[dict]) -> dict[int, int]:
    """Drafter version -> replicas serving it, from a deployment's replicas' ``stats``."""
    return dict(Counter(replica["version"] for replica in stats))


def served_versions(stats: list[dict]) -> dict:
    """What ``/v1/models`` shows of the drafter a deployment's replicas serve (their ``stats``):
    ``version`` and ``checkpoint`` of most replicas, and ``replicas`` per version."""
    counts = version_counts(stats)
    if not counts:
        return {"version": None, "replicas": {}}
    version = max(counts, key=lambda v: (counts[v], v))
    checkpoint = next(r["spec"].get("checkpoint") for r in stats if r["version"] == version)
    return {"version": version, "checkpoint": public_checkpoint(checkpoint),
            "replicas": {str(v): n for v, n in sorted(counts.items())}}


def readiness(running: dict[str, int], drafters: list[str]) -> dict:
    """The ``/ready`` report from running replicas per deployment: ``ready`` (verifier and every drafter
    up), ``degraded`` (the verifier up, a drafter down) or ``not_ready`` (no verifier replica)."""
    verifier = running.get(VERIFIER_DEPLOYMENT, 0) > 0
    up = {name: "up" if running.get(drafter_deployment_name(name), 0) > 0 else "down" for name in drafters}
    status = "not_ready" if not verifier else "ready" if all(v == "up" for v in up.values()) else "degraded"
    return {"status": status, "verifier": "up" if verifier else "down", "drafters": up}


class SharedFill:
    """A value reused for ``ttl`` seconds, then filled again with one fill in flight: requests that arrive
    while it is being filled await that fill instead of starting their own (a burst of ``/ready``,
    ``/v1/models`` or ``/metrics`` calls asks the controller and the drafters once)."""

    def __init__(self, ttl: float):
        self.ttl = ttl
        self._value: tuple[float, object] | None = None
        self._filling: asyncio.Future | None = None

    async def get(self, fill):
        """The value, from ``fill()`` (a coroutine function) when it is older than ``ttl`` or missing."""
        if self._value is not None and time.monotonic() - self._value[0] <= self.ttl:
            return self._value[1]
        if self._filling is None:
            self._filling = asyncio.ensure_future(self._fill(fill))
        return await asyncio.shield(self._filling)

    async def _fill(self, fill):
        try:
            value = await fill()
            self._value = (time.monotonic(), value)
            return value
        finally:
            self._filling = None
