"""The ingress's admission gate and its streamed answer's clean-up, without Ray: a counter that admits
exactly ``capacity`` requests, and a stream that lets go of its admission and of the verifier call
however it ends (served, never started, never called); the verifier's bound on a request's unread events."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from taps_ray.config import ServeConfig
from taps_ray.serving.admission import Admission, VerifierStream
from taps_ray.serving.plan import DecodeRequest, resolve_plan
from taps_ray.serving.verifier import Verifier


class FakeEvents:
    """Stands in for the verifier's stream handle: counts ``cancel()`` calls."""

    def __init__(self):
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def test_admission_admits_exactly_capacity_and_each_release_counts_once():
    gate = Admission(3)
    releases = [gate.admit() for _ in range(3)]
    assert all(callable(r) for r in releases) and gate.held == 3
    assert gate.admit() == "capacity" and gate.held == 3
    releases[0]()
    releases[0]()
    assert gate.held == 2
    again = gate.admit()
    assert callable(again) and gate.held == 3 and gate.admit() == "capacity"
    for release in (*releases[1:], again):
        release()
    assert gate.held == 0


def test_one_key_cannot_hold_every_slot():
    gate = Admission(4, per_key=2)
    mine = [gate.admit("key-a") for _ in range(2)]
    assert all(callable(r) for r in mine) and gate.admit("key-a") == "key"
    theirs = [gate.admit("key-b"), gate.admit()]
    assert all(callable(r) for r in theirs) and gate.held == 4 and gate.admit("key-c") == "capacity"
    mine[0]()
    mine[0]()
    assert gate.held_by == {"key-a": 1, "key-b": 1} and callable(gate.admit("key-a"))


async def _serve_stream(response: VerifierStream, disconnect_first: bool) -> list[dict]:
    """Run ``response`` as an ASGI app; the client hangs up at once when ``disconnect_first``."""
    sent: list[dict] = []

    async def receive() -> dict:
        if disconnect_first:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)
        if disconnect_first:
            await asyncio.sleep(0.05)

    await response({"type": "http", "asgi": {"spec_version": "2.0"}}, receive, send)
    return sent


def _stream(gate: Admission, chunks: list[str]):
    events, started = FakeEvents(), asyncio.Event()
    seen: list[str] = []

    async def body():
        started.set()
        for chunk in chunks:
            seen.append(chunk)
            yield chunk

    return VerifierStream(body(), events, gate.admit(), started.is_set), events, seen


def test_a_served_stream_releases_its_admission_and_leaves_the_finished_call_alone():
    gate = Admission(1)
    response, events, seen = _stream(gate, ["data: 1\n\n", "data: [DONE]\n\n"])
    assert gate.held == 1
    sent = asyncio.run(_serve_stream(response, disconnect_first=False))
    assert seen == ["data: 1\n\n", "data: [DONE]\n\n"]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert gate.held == 0 and events.cancelled == 0


def test_a_client_gone_before_the_body_started_releases_and_cancels_the_verifier_call():
    gate = Admission(1)
    response, events, seen = _stream(gate, ["data: 1\n\n"])
    asyncio.run(_serve_stream(response, disconnect_first=True))
    assert seen == [] and gate.held == 0 and events.cancelled == 1


def test_a_stream_dropped_without_being_served_releases_and_cancels():
    gate = Admission(1)
    response, events, _ = _stream(gate, ["data: 1\n\n"])
    assert gate.held == 1
    del response
    gc.collect()
    assert gate.held == 0 and events.cancelled == 1


# -- the verifier's bound on unread events ----------------------------------------------------------------

BOUND, STEPS = 5, 200


class Stepper:
    """A decode loop standing in for :meth:`Verifier.decode`: ``start``, ``STEPS`` deltas, ``done``; like the real
    loop it checks the cancel flag and the deadline before every step (504 past it). ``produced``: the deltas
    whose ``emit`` returned; ``outcome``: how it ended."""

    def __init__(self):
        self.produced, self.outcome = 0, None

    def __call__(self, request, emit, cancel, queued):
        emit({"type": "start"})
        for i in range(STEPS):
            if cancel.is_set():
                self.outcome = "cancelled"
                return
            if time.time() > request.expires_at:
                self.outcome = "timeout"
                emit({"type": "error", "status": 504})
                return
            emit({"type": "delta", "text": str(i)})
            self.produced += 1
        self.outcome = "finished"
        emit({"type": "done"})


def _buffered_verifier(timeout_s: float = 60.0) -> tuple[Verifier, Stepper, DecodeRequest]:
    cfg = ServeConfig(drafters={"a": None}, limits={"max_buffered_events": BOUND})
    verifier = object.__new__(Verifier)
    verifier.cfg, verifier.pool, verifier._active_lock = cfg, ThreadPoolExecutor(1), threading.Lock()
    verifier.waiting = verifier.stalled = 0
    verifier.decode = Stepper()
    request = DecodeRequest(rid="r", prompt=[1], plan=resolve_plan("vanilla", None, cfg), raw=True,
                            prompt_param="prompt", expires_at=time.time() + timeout_s)
    return verifier, verifier.decode, request


async def _until(check, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_reader_that_falls_behind_pauses_its_decoding_and_loses_nothing():
    """The reader takes ``start`` and then nothing: the loop emits BOUND deltas and waits (``stalled``) instead of
    running on; once read, every delta arrives in order and the loop finishes."""
    verifier, stepper, request = _buffered_verifier()

    async def run():
        events = verifier.generate(request)
        assert (await events.__anext__())["type"] == "start"
        await _until(lambda: verifier.stalled == 1 or stepper.outcome is not None)
        await asyncio.sleep(0.2)
        assert (stepper.produced, verifier.stalled, stepper.outcome) == (BOUND, 1, None)
        rest = [event async for event in events]
        assert [e["text"] for e in rest[:-1]] == [str(i) for i in range(STEPS)] and rest[-1]["type"] == "done"
        assert stepper.outcome == "finished" and verifier.stalled == 0

    asyncio.run(run())


def test_a_stalled_decode_stops_when_its_reader_goes_away_or_its_deadline_passes():
    """Stalled behind an unread buffer: closing the stream cancels the loop within a poll; a deadline that passes
    ends it with its 504, which is delivered after the unread deltas although the buffer is full."""
    verifier, stepper, request = _buffered_verifier()

    async def hang_up():
        events = verifier.generate(request)
        await events.__anext__()
        await _until(lambda: verifier.stalled == 1 and stepper.produced == BOUND)
        await asyncio.wait_for(events.aclose(), 10)
        assert (stepper.outcome, stepper.produced, verifier.stalled) == ("cancelled", BOUND + 1, 0), \
            "the delta that waited is dropped, and the loop stops at its next check"

    asyncio.run(hang_up())
    verifier, stepper, request = _buffered_verifier(timeout_s=1.0)

    async def time_out():
        events = verifier.generate(request)
        await events.__anext__()
        await _until(lambda: stepper.outcome is not None)
        rest = [event async for event in events]
        assert stepper.outcome == "timeout" and stepper.produced == BOUND + 1
        assert [e["type"] for e in rest] == ["delta"] * BOUND + ["error"] and rest[-1]["status"] == 504

    asyncio.run(time_out())
