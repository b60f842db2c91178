"""Serving test helpers: in-process drafter clients with fault injection, recording strategies."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from taps_ray.serving.drafter import DraftSessions
from taps_ray.spec.protocol import SingleStrategy

POOL = ThreadPoolExecutor(8, thread_name_prefix="test-drafter")


class LocalReply:
    def __init__(self, future: Future):
        self.future = future

    def result(self, timeout: float) -> dict:
        return self.future.result(timeout=max(timeout, 0.0))


class LocalClient:
    """A :class:`~taps_ray.serving.drafting.DrafterClient` over in-process :class:`DraftSessions`.

    ``replicas`` > 1 spreads calls round-robin over independent session stores (a request's state
    then has to be rebuilt on each switch). ``fail`` (a set of call indices) makes those calls raise,
    ``slow`` those calls sleep ``delay_s`` first; ``calls`` counts propose calls.
    """

    def __init__(self, replicas: list[DraftSessions], fail: set[int] | None = None, slow: set[int] | None = None,
                 delay_s: float = 0.0):
        self.replicas = replicas
        self.fail = fail or set()
        self.slow = slow or set()
        self.delay_s = delay_s
        self.calls = 0
        self.lock = threading.Lock()
        self.ended: list[str] = []

    def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                support: torch.Tensor | None = None, depth: int | None = None) -> LocalReply:
        with self.lock:
            index = self.calls
            self.calls += 1
        replica = self.replicas[index % len(self.replicas)]

        def call() -> dict:
            if index in self.slow:
                time.sleep(self.delay_s)
            if index in self.fail:
                raise RuntimeError(f"injected failure on call {index}")
            return replica.propose(rid, offset, tokens, features, support, depth)

        return LocalReply(POOL.submit(call))

    def vocabulary(self) -> LocalReply:
        return LocalReply(POOL.submit(self.replicas[0].vocabulary))

    def layers(self) -> LocalReply:
        return LocalReply(POOL.submit(self.replicas[0].layers))

    def end(self, rid: str) -> None:
        self.ended.append(rid)
        for replica in self.replicas:
            replica.end(rid)


class RecordingSingle(SingleStrategy):
    """SingleStrategy that keeps every proposed tree by root position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trees: dict[int, object] = {}

    def propose(self, state):
        tree = super().propose(state)
        self.trees[state.prefix_len] = tree
        return tree


def same_tree(a, b) -> bool:
    return (a.prefix_len == b.prefix_len and torch.equal(a.tokens, b.tokens) and torch.equal(a.parent, b.parent)
            and torch.allclose(a.score, b.score, atol=1e-5))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_app(cfg, name: str, reference: Callable[[], object]) -> Iterator[tuple[str, object]]:
    """The serving application of ``cfg`` under ``name`` on a free local port, and ``reference()`` computed
    while it starts: yields (base URL, reference); the application is deleted and Serve shut down after."""
    from ray import serve

    from taps_ray.serving.app import application

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    starting = threading.Thread(target=serve.run, args=(application(cfg),),
                                kwargs={"name": name, "route_prefix": "/", "blocking": False})
    starting.start()
    expected = reference()
    starting.join()
    try:
        yield f"http://127.0.0.1:{port}", expected
    finally:
        serve.delete(name)
        serve.shutdown()


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))
