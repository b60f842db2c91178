"""Refuse a run's output directory that the nodes of a multi-node Ray cluster do not share.

Ray Train and Tune write checkpoints from the node a worker runs on and read them back from another
(the driver, a restarted worker); a local path that is not shared storage (NFS and the like) works on
one node and fails later, on more, as missing files. :func:`check_shared_storage` finds out before
anything is trained: it writes a random marker file into the directory and runs one tiny task pinned
to every alive node (``NodeAffinitySchedulingStrategy(soft=False)``, no CPU) that reads it back.
A single-node cluster and a ``scheme://`` URI (``s3://``, ``gs://``: pyarrow filesystems every node
reaches alike) skip the check.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER_PREFIX = ".taps_shared_storage."
PROBE_TIMEOUT_S = 120.0


class SharedStorageError(RuntimeError):
    """The output directory is not visible, with the same content, from every alive node."""


@dataclass(frozen=True)
class NodeRef:
    """An alive Ray node: its id (hex) and address, for pinning probes and naming it in errors."""

    node_id: str
    address: str

    def __str__(self) -> str:
        return f"{self.node_id[:12]} ({self.address})"


# probe(marker path, nodes) -> per node id: the marker's content as that node reads it (None: absent)
Probe = Callable[[str, list[NodeRef]], dict[str, str | None]]


def is_remote_uri(path: str | Path) -> bool:
    """True for a ``scheme://...`` URI (``s3://``, ``gs://``, ``hdfs://``...), false for a local path."""
    return "://" in str(path)


def alive_nodes() -> list[NodeRef]:
    """The alive nodes of the connected Ray cluster (``ray.nodes()``)."""
    import ray

    return [NodeRef(n["NodeID"], n.get("NodeManagerAddress", "?")) for n in ray.nodes() if n.get("Alive")]


def _read_marker(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def ray_probe(marker: str, nodes: list[NodeRef], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str | None]:
    """Read ``marker`` on each of ``nodes`` with one task pinned there (``num_cpus=0``); a node whose task
    fails or does not answer within ``timeout_s`` reads as ``None`` (not seen)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0, max_retries=0)(_read_marker)
    refs = {n.node_id: read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote(marker) for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    seen: dict[str, str | None] = {}
    for node_id, ref in refs.items():
        try:
            seen[node_id] = ray.get(ref) if ref in ready_set else None
        except Exception:  # a node that died or cannot run the task cannot vouch for the directory
            seen[node_id] = None
        if ref not in ready_set:
            ray.cancel(ref, force=True)
    return seen


def check_shared_storage(directory: str | Path, *, nodes: list[NodeRef] | None = None,
                         probe: Probe | None = None, what: str = "output directory") -> str:
    """Check that every alive node sees ``directory`` as the same storage; return how it was decided.

    Returns ``"remote"`` for a ``scheme://`` URI, ``"single-node"`` when the cluster has at most one alive
    node (``nodes``, default :func:`alive_nodes`) and ``"shared"`` when a marker written here was read back
    with the same content on every node (by ``probe``, default :func:`ray_probe`). Raises
    :class:`SharedStorageError` naming the directory and the nodes that did not see the marker otherwise.
    The marker is removed either way; ``directory`` must exist and be writable.
    """
    if is_remote_uri(directory):
        return "remote"
    nodes = alive_nodes() if nodes is None else nodes
    if len(nodes) <= 1:
        return "single-node"
    directory = Path(directory).resolve()
    token = secrets.token_hex(16)
    marker = directory / f"{MARKER_PREFIX}{token}"
    marker.write_text(token)
    try:
        seen = (probe or ray_probe)(str(marker), nodes)
    finally:
        marker.unlink(missing_ok=True)
    blind = [n for n in nodes if seen.get(n.node_id) != token]
    if blind:
        raise SharedStorageError(
            f"{what} {str(directory)!r} is not shared storage: {len(blind)} of the cluster's {len(nodes)} alive "
            f"nodes cannot see a file written there ({', '.join(map(str, blind))}). Ray Train and Tune write "
            f"checkpoints on one node and read them on another, so a local directory fails later as missing "
            f"files. Put it on storage every node mounts at the same path (NFS, a shared volume) or give an "
            f"s3:// or gs:// URI.")
    return "shared"
