"""taps_ray.runtime.storage: the shared-storage decision with an injected probe (no Ray); the real probe on a
two-node cluster is in tests/test_multinode.py."""

from __future__ import annotations

import pytest

from taps_ray.runtime.storage import (
    MARKER_PREFIX,
    NodeRef,
    SharedStorageError,
    check_shared_storage,
    is_remote_uri,
)

HEAD = NodeRef("a" * 56, "10.0.0.1")
OTHER = NodeRef("b" * 56, "10.0.0.2")


def seeing(*blind: NodeRef):
    """A probe under which every node but ``blind`` reads the marker as written; records its calls."""
    calls = []

    def probe(marker, nodes):
        calls.append((marker, list(nodes)))
        with open(marker) as handle:
            content = handle.read()
        return {n.node_id: (None if n in blind else content) for n in nodes}

    probe.calls = calls
    return probe


def test_single_node_and_remote_uris_skip_the_probe(tmp_path):
    probe = seeing()
    assert check_shared_storage(tmp_path, nodes=[HEAD], probe=probe) == "single-node"
    assert check_shared_storage("s3://bucket/runs", nodes=[HEAD, OTHER], probe=probe) == "remote"
    assert probe.calls == []
    assert is_remote_uri("gs://b/x") and not is_remote_uri(tmp_path)


def test_every_node_seeing_the_marker_passes_and_the_marker_is_removed(tmp_path):
    probe = seeing()
    assert check_shared_storage(tmp_path, nodes=[HEAD, OTHER], probe=probe) == "shared"
    (marker, nodes), = probe.calls
    assert nodes == [HEAD, OTHER] and marker.startswith(str(tmp_path.resolve()))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(MARKER_PREFIX)]


def test_a_node_that_cannot_see_the_marker_is_refused_by_name(tmp_path):
    with pytest.raises(SharedStorageError) as caught:
        check_shared_storage(tmp_path, nodes=[HEAD, OTHER], probe=seeing(OTHER), what="run directory")
    message = str(caught.value)
    assert str(tmp_path.resolve()) in message and "run directory" in message
    assert OTHER.node_id[:12] in message and "10.0.0.2" in message and HEAD.address not in message
    assert "NFS" in message and "s3://" in message
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(MARKER_PREFIX)]


def test_a_marker_read_with_other_content_counts_as_not_seen(tmp_path):
    def stale(marker, nodes):
        return {HEAD.node_id: open(marker).read(), OTHER.node_id: "an older marker"}

    with pytest.raises(SharedStorageError, match="1 of the cluster's 2 alive nodes"):
        check_shared_storage(tmp_path, nodes=[HEAD, OTHER], probe=stale)
