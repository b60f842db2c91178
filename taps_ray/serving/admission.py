"""Admission to the verifiers, per ingress replica: at most every verifier slot plus
``serve.admission.max_queued_requests`` requests pass at once (:class:`Admission`), the rest are answered 429 by
the ingress. The count is exact; Serve's own queue bound on the ingress's handle counts loosely
under a burst (it can let more through than its bound) and stays behind it as a second line.
A streamed answer holds its admission until it ends, however it ends (:class:`VerifierStream`)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

from fastapi.responses import StreamingResponse

log = logging.getLogger(__name__)


def cancel_call(events) -> None:
    """Cancel a verifier call (best effort). ``cancel()`` re-raises a failed assignment's error (a full
    queue, say): that call is over already, so the error is moot here."""
    try:
        events.cancel()
    except Exception as err:
        log.debug("cancelling a verifier call: %r", err)


class Admission:
    """The requests this ingress replica has passed to the verifiers and not yet seen end: at most
    ``capacity``, and at most ``per_key`` of them under one API key (None: no per-key bound), so one key
    cannot hold every slot. Used from the replica's event loop only, so plain counters are exact."""

    def __init__(self, capacity: int, per_key: int | None = None):
        self.capacity, self.per_key = capacity, per_key
        self.held = 0
        self.held_by: dict[str, int] = {}

    def admit(self, key: str | None = None) -> Callable[[], None] | str:
        """A release function for one more request under ``key`` (None: no key), or why not: ``"capacity"``
        when ``capacity`` are held, ``"key"`` when ``key`` holds ``per_key``. Calling the release more than
        once releases once."""
        if self.held >= self.capacity:
            return "capacity"
        if key is not None and self.per_key is not None and self.held_by.get(key, 0) >= self.per_key:
            return "key"
        self.held += 1
        if key is not None:
            self.held_by[key] = self.held_by.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= 1
                if key is not None:
                    self.held_by[key] -= 1
                    if not self.held_by[key]:
                        del self.held_by[key]

        return release


class VerifierStream(StreamingResponse):
    """A streamed answer that lets go of its admission however it ends, and of the verifier call when
    its body never started (the client left first): on return from ``__call__``, or, when it is never
    called, once the response is dropped."""

    def __init__(self, body, events, release: Callable[[], None], started: Callable[[], bool]):
        super().__init__(body, media_type="text/event-stream")
        self._end = weakref.finalize(self, _end_stream, events, release, started)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()


def _end_stream(events, release: Callable[[], None], started: Callable[[], bool]) -> None:
    release()
    if not started():
        cancel_call(events)
