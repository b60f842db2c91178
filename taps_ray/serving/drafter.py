"""Drafter deployment: one drafter checkpoint, per-request drafting sessions, sticky routing.

The verifier drives a session with :meth:`DraftSessions.propose` once per step, sending the pairs
``(token_{i+1}, f_i)`` accepted since the drafter's last confirmed count (``offset``). A session
that does not hold the pairs up to ``offset`` (a new replica, a reaped or lost session) answers
``{"need": held}`` and the verifier resends from there, so state is rebuilt exactly; pairs it
already holds (a late call that did complete) are skipped. Sessions are freed by ``end`` or after
``ttl_s`` idle seconds.

Routed and budget-merged requests compare the trees of several drafters, so the verifier sends the
union of their draft vocabularies (``support``, see :func:`taps_ray.spec.compose.union_support`) with
the call that opens a session (offset 0); the session drafts every tree over it, as the in-process
strategies do. A drafter whose vocabulary the support misses (swapped since the verifier asked)
answers ``{"unsupported": message}`` and opens no session.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from ray.serve.request_router import RequestRouter

from taps_ray.config import TargetConfig, TreeConfig
from taps_ray.models.drafter import DraftHead, average_drafters
from taps_ray.models.target import TargetModel
from taps_ray.models.target_head import load_target_head
from taps_ray.runtime import faults
from taps_ray.spec.batch import DraftBatcher
from taps_ray.spec.decoder import load_drafter
from taps_ray.spec.protocol import at_depth
from taps_ray.spec.tree import DIRECT, DraftCompute, DrafterState, DraftTree, draft_tree

log = logging.getLogger(__name__)


@dataclass
class _Session:
    state: DrafterState
    held: int = 0
    wanted: int = 0
    tree_at: int = -1
    last_used: float = field(default_factory=time.monotonic)
    last_tree: DraftTree | None = None
    support: torch.Tensor | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class DraftSessions:
    """Per-request :class:`DrafterState` keyed by request id; thread-safe, no Ray.

    ``target`` supplies the embeddings, LM head and device (a :class:`~taps_ray.models.target_head.TargetHead`
    is enough).
    A session keeps the drafter it started with, so :meth:`swap` never disturbs running requests.
    ``compute`` runs the drafter for every session (:data:`~taps_ray.spec.tree.DIRECT`, or a
    :class:`~taps_ray.spec.batch.DraftBatcher` when sessions draft at once on several threads).
    """

    def __init__(self, target: TargetModel, drafter: DraftHead, tree: TreeConfig, ttl_s: float = 300.0,
                 compute: DraftCompute = DIRECT):
        self.target = target
        self.drafter = drafter
        self.compute = compute
        self.tree = tree
        self.ttl_s = ttl_s
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._last_reap = time.monotonic()
        self.opened = 0
        self.resends = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, rid: str) -> bool:
        return rid in self._sessions

    def swap(self, drafter: DraftHead) -> None:
        """Draft new sessions with ``drafter``; running sessions keep theirs. ValueError (nothing swapped) when
        ``drafter`` reads other target layers than the served one: the verifiers ship each drafter its layers."""
        if drafter.feature_layers != self.drafter.feature_layers:
            raise ValueError(f"cannot swap a {self.drafter.architecture} drafter reading target layers "
                             f"{list(self.drafter.feature_layers)} for a {drafter.architecture} one reading "
                             f"{list(drafter.feature_layers)}: serve it as another drafter")
        self.drafter = drafter

    def layers(self) -> list[int]:
        """The target hidden states the served drafter reads (its ``feature_layers``), which a session's
        ``features`` hold, concatenated."""
        return list(self.drafter.feature_layers)

    def vocabulary(self) -> torch.Tensor | None:
        """The draft vocabulary new sessions draft with: sorted target ids [V_draft] on the CPU, None for
        the whole target vocabulary."""
        ids = self.drafter.draft_to_target
        return None if ids is None else ids.sort().values.cpu()

    def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                support: torch.Tensor | None = None, depth: int | None = None) -> dict:
        """Add the pairs ``tokens`` [m] / ``features`` [m, F] (the target hidden states :meth:`layers`,
        concatenated) that follow the first ``offset`` pairs of
        request ``rid`` and draft a tree rooted at the last token, no deeper than node depth ``depth`` (None:
        the deployment's tree; see :class:`~taps_ray.spec.protocol.DecodeState`).

        ``support`` (sorted target ids containing the draft vocabulary; None: the draft vocabulary) is
        read when the call opens the session (``offset`` 0): the session's trees are drafted over it
        (:func:`~taps_ray.spec.tree.draft_tree`); ``{"unsupported": message}`` (no session) when it misses
        a draft id.

        Returns ``{"tree": DraftTree, "held": pairs held, "compute_s": seconds spent adding the pairs and
        drafting, "adapted": the session's drafter is a ``taps adapt`` version (:func:`drafter_version`)}``; ``{"need": held}`` when the session holds
        fewer than ``offset`` pairs (resend from ``held``); ``{"superseded": True, "held": held}``
        when a newer call of the same request is already waiting (its pairs are kept, no tree is
        drafted for a step the verifier has given up on).
        """
        self._maybe_reap()
        upto = offset + tokens.numel()
        with self._lock:
            session = self._sessions.get(rid)
            if session is None:
                if offset != 0:
                    self.resends += 1
                    return {"need": 0}
                state = DrafterState(self.drafter, self.compute, layers=self.drafter.feature_layers)
                try:
                    state.support_rows(self.target, support)
                except ValueError as err:
                    return {"unsupported": str(err)}
                session = self._sessions[rid] = _Session(state, support=support)
                self.opened += 1
            session.wanted = max(session.wanted, upto)
        with session.lock:
            session.last_used = time.monotonic()
            if session.held < offset:
                self.resends += 1
                return {"need": session.held}
            start = time.perf_counter()
            try:
                if upto > session.held:
                    skip = session.held - offset
                    session.state.add(tokens[skip:], features[skip:])
                    session.held = upto
                if upto < session.wanted or upto < session.held:
                    return {"superseded": True, "held": session.held}
                if session.tree_at != upto:
                    session.last_tree = draft_tree(session.state.drafter, self.target, session.state,
                                                   at_depth(self.tree, depth), session.support)
                    session.tree_at = upto
            except Exception:
                self.end(rid)
                raise
            return {"tree": session.last_tree, "held": session.held, "compute_s": time.perf_counter() - start,
                    "adapted": drafter_version(session.state.drafter) > 0}

    def end(self, rid: str) -> bool:
        with self._lock:
            return self._sessions.pop(rid, None) is not None

    def reap(self, now: float | None = None) -> int:
        """Drop sessions idle for more than ``ttl_s``; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [rid for rid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
            for rid in stale:
                del self._sessions[rid]
        if stale:
            log.info("reaped %d idle drafting sessions", len(stale))
        return len(stale)

    def _maybe_reap(self) -> None:
        now = time.monotonic()
        if now - self._last_reap > min(5.0, self.ttl_s):
            self._last_reap = now
            self.reap(now)


def build_drafter(target: TargetModel, spec: dict, name: str = "drafter") -> DraftHead:
    """The drafter a ``user_config`` describes: ``checkpoint`` (None: fresh from ``seed``) or
    ``average`` (two such specs) with ``alpha``."""
    if spec.get("average"):
        parts = [build_drafter(target, part, f"{name}/{i}") for i, part in enumerate(spec["average"])]
        alpha = float(spec.get("alpha", 0.5))
        log.info("drafter %s: weight average alpha=%.3f of %s", name, alpha, spec["average"])
        return average_drafters(parts, [alpha, 1.0 - alpha]).eval()
    checkpoint = spec.get("checkpoint")
    if checkpoint is None:
        log.warning("drafter %s: no checkpoint, serving a freshly initialised (untrained) drafter, seed %d",
                    name, spec.get("seed", 0))
    return load_drafter(target, checkpoint, spec.get("seed", 0))


def drafter_version(drafter: DraftHead) -> int:
    """The version ``taps adapt`` recorded in the drafter's ``config.json`` (0: not an adapted version)."""
    version = drafter.metadata.get("version")
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


class Drafter:
    """Ray Serve deployment body for one drafter checkpoint (see :mod:`taps_ray.serving.app`).

    ``user_config`` (hot-swappable through :meth:`reconfigure`): ``checkpoint``, ``seed``,
    ``average`` + ``alpha``, ``fault`` and ``delay_s``.

    ``batch_sessions`` > 1: up to that many :meth:`propose` calls run at once, each on its own thread,
    and the sessions drafting together share each drafter forward and LM-head product
    (:class:`~taps_ray.spec.batch.DraftBatcher`, waiting at most ``batch_wait_s`` for one another);
    1: one call at a time.
    """

    def __init__(self, name: str, target: dict, tree: dict, ttl_s: float = 300.0, threads: int | None = 1,
                 batch_sessions: int = 1, batch_wait_s: float = 0.002):
        self.threads = threads
        self.drafting = 0
        self.pool = ThreadPoolExecutor(batch_sessions, thread_name_prefix="taps-draft")
        self.compute = DIRECT if batch_sessions <= 1 else DraftBatcher(batch_sessions, batch_wait_s,
                                                                     expected=lambda: self.drafting)
        self.name = name
        self.target = load_target_head(TargetConfig(**target))  # drafting needs only the embedding and LM head
        self.tree = TreeConfig(**tree)
        self.ttl_s = ttl_s
        self.sessions: DraftSessions | None = None
        self.spec: dict | None = None
        self.version = 0
        self.fault: str | None = None
        self.delay_s = 0.0

    def reconfigure(self, user_config: dict) -> None:
        spec = {k: user_config.get(k) for k in ("checkpoint", "seed", "average", "alpha") if k in user_config}
        if spec != self.spec:
            drafter = build_drafter(self.target, spec, self.name)
            if self.sessions is None:
                self.sessions = DraftSessions(self.target, drafter, self.tree, self.ttl_s, self.compute)
            else:
                self.sessions.swap(drafter)
            self.spec, self.version = spec, drafter_version(drafter)
            log.info("drafter %s: now serving %s, version %d (running sessions keep their drafter)", self.name,
                     spec, self.version)
        self.fault = user_config.get("fault")
        self.delay_s = float(user_config.get("delay_s") or 0.0)

    def vocabulary(self) -> torch.Tensor | None:
        return self.sessions.vocabulary()

    def layers(self) -> list[int]:
        return self.sessions.layers()

    async def propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                      support: torch.Tensor | None = None, depth: int | None = None) -> dict:
        """:meth:`DraftSessions.propose` on the replica's drafting pool (see the class docs)."""
        self.drafting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._propose, rid, offset, tokens,
                                                                    features, support, depth)
        finally:
            self.drafting -= 1

    def _propose(self, rid: str, offset: int, tokens: torch.Tensor, features: torch.Tensor,
                 support: torch.Tensor | None, depth: int | None = None) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        faults.drafter_fault(self.fault, self.name)
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.sessions.propose(rid, offset, tokens, features, support, depth)

    def end(self, rid: str) -> bool:
        return self.sessions.end(rid)

    def stats(self) -> dict:
        """This replica's name, actor name, pid, Ray node id (``node_id``, hex), live / opened sessions, resend
        requests, weights spec, drafter version and resident memory."""
        self.sessions.reap()
        return {"name": self.name, "replica": _replica_actor_name(), "pid": os.getpid(), "node_id": node_id(),
                "sessions": len(self.sessions), "opened": self.sessions.opened, "resends": self.sessions.resends,
                "spec": self.spec, "version": self.version, "rss_bytes": rss_bytes()}


def _replica_actor_name() -> str | None:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:
        return None


def node_id() -> str | None:
    """The Ray node id (hex) this process runs on; None outside a Ray worker."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


def rss_bytes() -> int:
    """Resident set size of this process (-1 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return -1


def _affinity(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")


class SessionAffinityRouter(RequestRouter):
    """Routes every call of one request (first argument: the request id) to the same replica, by
    rendezvous hashing over the live replicas; the others rank second (a full or dead replica is
    passed over, and the session is then rebuilt where the call lands)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None or not pending_request.args or not candidate_replicas:
            return [candidate_replicas]
        key = str(pending_request.args[0])
        ranked = sorted(candidate_replicas, key=lambda r: _affinity(key, r.replica_id.unique_id), reverse=True)
        return [ranked[:1], ranked[1:]]
