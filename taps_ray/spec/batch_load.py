"""What the other requests verified by one shared forward add to a request's step: :class:`Others` (their
rows in the forward, the tokens they are expected to append, the drafting seconds the forward waits for,
and how many share the request's budget) and :class:`BatchLoad`, each request's last step in one verifier,
from which a request's :class:`~taps_ray.spec.cost.TreeBudget` counts the rest of its batch.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class Others(NamedTuple):
    """The other requests of a batch, as this request's step sees them: ``peers``, how many share its budget
    (they decide alike); the rest's ``rows`` in the forward, the ``tokens`` they are expected to append and the
    ``draft_s`` seconds of drafting the forward waits for."""

    rows: int = 0
    tokens: int = 0
    draft_s: float = 0.0
    peers: int = 0


class BatchLoad:
    """The rows, appended tokens and drafting seconds of each request's last step in one shared verifier
    (thread-safe):
    what the other requests of a batch add to a forward (see :mod:`taps_ray.spec.cost`); and the rows and
    seconds of the verifier's last forward itself (``last_forward``: what a request waiting in the batch
    for the others' drafting would not tell)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[int, tuple[Others, int | None]] = {}
        self.last_forward: tuple[int, float] | None = None

    def forward(self, rows: int, seconds: float) -> None:
        self.last_forward = (rows, seconds)

    def note(self, key: int, rows: int, tokens: int, draft_s: float = 0.0, group: int | None = None) -> None:
        """Request ``key``'s last step; ``group``: the id of the budget it decides with (None: none)."""
        with self._lock:
            self._last[key] = (Others(rows, tokens, draft_s), group)

    def drop(self, key: int) -> None:
        with self._lock:
            self._last.pop(key, None)

    def others(self, key: int, group: int | None = None) -> Others:
        """Every request but ``key`` at its last step: how many are in ``group``, the sums over the rest."""
        with self._lock:
            last = [(v, g) for k, (v, g) in self._last.items() if k != key]
        rest = [v for v, g in last if group is None or g != group]
        return Others(sum(v.rows for v in rest), sum(v.tokens for v in rest), sum(v.draft_s for v in rest),
                      len(last) - len(rest))
