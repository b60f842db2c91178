"""The ingress's admission gate and its streamed answer's clean-up, without Ray: a counter that admits
exactly ``capacity`` requests, and a stream that lets go of its admission and of the verifier call
however it ends (served, never started, never called)."""

from __future__ import annotations

import asyncio
import gc

from taps_ray.serving.admission import Admission, VerifierStream


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
