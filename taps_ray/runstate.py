"""Crash-safe run state: the one way run folders are written, read back and guarded.

* :func:`atomic_write` / :func:`write_json`: a state file (``variant.json``, eval ``run.json``,
  ``sweep.json``, summaries, manifests) is written to a temporary file with a unique name (pid and
  random suffix) in the same folder, fsynced, then renamed over the old one: a reader sees the old
  file or the new one, never half of one, and two writers never share a temporary file.
* :func:`append_jsonl` / :func:`read_jsonl`: JSON-lines logs (``metrics.jsonl``, eval
  ``records.jsonl``, ``attempts.jsonl``, the regeneration store) are appended line by line; a
  writer killed mid-line leaves a torn last line, which readers skip with a warning and the next
  append cuts off first. A damaged line elsewhere is not a crash artifact and is an error.
* :func:`changed_settings`: what differs between the settings a run folder recorded and the ones
  asked for now (train, eval and sweep refuse to resume into a folder whose settings changed).
* :func:`folder_lock`: one process at a time writes a run folder (eval, prepare, train, sweep, a round of
  ``taps adapt --watch``). The lock is an ``flock`` on ``.taps.lock`` in the folder, so the kernel
  releases it when its holder dies (a ``kill -9`` leaves no stale lock); the file names the holder
  (pid, host, command) for the error the next process gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = ".taps.lock"


class RunStateError(RuntimeError):
    """A run folder cannot be read or written as asked; the message says why."""


class FolderLocked(RunStateError):
    """Another process holds the folder's lock; the message names it."""


# -- atomic files ---------------------------------------------------------------------------------

def temp_name(path: str | Path) -> Path:
    """A temporary sibling of ``path`` no other writer uses: ``.NAME.<pid>.<random>.tmp``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``data`` atomically (unique temp file in the same folder, fsync, rename)."""
    path = Path(path)
    tmp = temp_name(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:
        with open(tmp, "xb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path: str | Path, payload: Any, indent: int | None = 1, default=None) -> Path:
    """:func:`atomic_write` of ``payload`` as JSON."""
    return atomic_write(path, json.dumps(payload, indent=indent, default=default))


def atomic_copy(source: str | Path, path: str | Path) -> Path:
    """Copy ``source`` over ``path`` atomically."""
    return atomic_write(path, Path(source).read_bytes())


# -- JSON lines -----------------------------------------------------------------------------------

def read_jsonl(path: str | Path, skip_damaged: bool = False) -> list:
    """The JSON values of ``path``, one per line (``[]`` when it is missing). A torn last line (a writer
    killed mid-line: no newline after it, or not JSON) is skipped with a warning; an unreadable line
    before the last raises :class:`RunStateError` naming the file and line, or with ``skip_damaged``
    (a cache, which older versions appended to after a torn line) is skipped with a warning too."""
    path = Path(path)
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    out = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if number == len(complete) and not tail.strip():
                log.warning("%s: skipped a torn last line (an interrupted write)", path)
                continue
            if skip_damaged:
                log.warning("%s: skipped line %d, which is not JSON", path, number)
                continue
            raise RunStateError(f"{path}: line {number} is not JSON and is not the last line, so it is not an "
                                "interrupted write; the file is damaged") from None
    if tail.strip():
        log.warning("%s: skipped a torn last line (an interrupted write)", path)
    return out


def repair_jsonl(path: str | Path) -> bool:
    """Cut a torn last line off ``path`` (so appends start on a fresh line); True when one was cut."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb+") as handle:
        data = handle.read()
        keep = len(data)
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
        elif data:
            last = data[:-1].rfind(b"\n") + 1
            try:
                json.loads(data[last:-1] or b"null")
            except ValueError:
                keep = last
        if keep == len(data):
            return False
        log.warning("%s: cut a torn last line (an interrupted write) before appending", path)
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def append_jsonl(path: str | Path, records: Iterable, default=None) -> None:
    """Append ``records`` to ``path``, one JSON line each, flushed and fsynced before returning; a torn
    last line left by a killed writer is cut off first."""
    path = Path(path)
    text = "".join(json.dumps(r, default=default, ensure_ascii=False) + "\n" for r in records)
    if not text:
        return
    repair_jsonl(path)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_jsonl(path: str | Path, records: Iterable, default=None) -> Path:
    """Replace ``path`` with ``records`` as JSON lines, atomically."""
    return atomic_write(path, "".join(json.dumps(r, default=default, ensure_ascii=False) + "\n" for r in records))


# -- settings a run depends on --------------------------------------------------------------------

def changed_settings(previous: Any, current: Any, prefix: str = "") -> list[str]:
    """One line per setting that differs: ``a.b: OLD in the folder, NEW now`` (nested dicts compared
    key by key; values compared as JSON, so tuples equal lists)."""
    previous, current = json.loads(json.dumps(previous, default=str)), json.loads(json.dumps(current, default=str))
    return _differences(previous, current, prefix)


def _differences(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in sorted(set(old) | set(new)) for d in _differences(old.get(key), new.get(key),
                                                                              f"{prefix}{key}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} in the folder, {new!r} now"]


def describe_changes(changes: list[str], limit: int = 6) -> str:
    """``changes`` joined for an error message, at most ``limit`` of them."""
    more = f"; and {len(changes) - limit} more" if len(changes) > limit else ""
    return "; ".join(changes[:limit]) + more


# -- one writer per folder ------------------------------------------------------------------------

_held: dict[str, list] = {}
_held_guard = threading.Lock()


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not written its name yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('command')!s}, since {since})"


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str, name: str = LOCK_FILE) -> Iterator[Path]:
    """Hold ``folder``'s lock while the block runs (``what``: the command, for the holder's record;
    ``name``: the lock file in ``folder``, for a lock on something the folder holds, such as one
    feature set of the feature cache).

    Raises :class:`FolderLocked` naming the holder when another process holds it. Reentrant within a
    process (a command that runs another one on the same folder). The lock file stays; it is released
    when the block ends or the process dies. A folder this call created is removed again when the
    block leaves nothing in it but the lock file (a command refused before writing leaves no trace).
    """
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    key = str(path.resolve())
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _held_guard:
                _held[key][1] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        where = folder if name == LOCK_FILE else path
        raise FolderLocked(f"{where} is in use by {_holder(path)}: {what} would write the same files; wait for it "
                           "to finish (or stop it), or use another folder") from None
    try:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": what,
                  "argv": " ".join(sys.argv)[:300], "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        with _held_guard:
            _held[key] = [fd, 1]
        try:
            yield path
        finally:
            with _held_guard:
                _held.pop(key, None)
            os.ftruncate(fd, 0)
            if created and [p.name for p in folder.iterdir()] == [name]:
                path.unlink()
                folder.rmdir()
    finally:
        os.close(fd)
