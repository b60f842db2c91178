"""Top-level records of a JSON array or JSON-lines file, read incrementally."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from taps_ray.data.origins import SourceError


class JsonRecordReader:
    """Iterate the top-level records of a JSON array or JSON-lines file as ``(line, record)``.

    The file is read in chunks and decoded record by record with ``JSONDecoder.raw_decode``,
    so a JSON array cut off mid-record yields every complete record, then stops and sets
    ``truncated_at_line`` to the line where the partial record starts. Invalid JSON anywhere
    else is a :class:`SourceError` naming ``file:line``. ``line`` is 1-based.
    """

    def __init__(self, path: str | Path, chunk_chars: int = 1 << 23):
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.truncated_at_line: int | None = None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        with self.path.open(encoding="utf-8-sig") as fh:
            head = fh.read(self.chunk_chars)
            first = head.lstrip()[:1]
            if first == "[":
                yield from self._array(fh, head)
            elif first == "{" or not first:
                yield from self._lines(head, fh)
            else:
                raise SourceError(f"{self.path}:1: expected a JSON array or JSON lines, found {first!r}")

    def _lines(self, head: str, fh) -> Iterator[tuple[int, Any]]:
        chunks = _chain_lines(head, fh)
        for number, line in enumerate(chunks, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{self.path}:{number}: invalid JSON: {err.msg} (column {err.colno})") from None

    def _array(self, fh, buf: str) -> Iterator[tuple[int, Any]]:
        decoder = json.JSONDecoder()
        eof = len(buf) < self.chunk_chars
        pos = buf.index("[") + 1
        line, counted = 1, 0
        expect_comma = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            line += buf.count("\n", counted, pos)
            counted = pos
            if pos == len(buf):
                if eof:
                    self.truncated_at_line = line
                    return
                buf, pos, counted, eof = self._refill(fh, buf, pos)
                continue
            char = buf[pos]
            if char == "]":
                return
            if expect_comma:
                if char != ",":
                    raise SourceError(f"{self.path}:{line}: invalid JSON: expected ',' or ']' between records")
                pos += 1
                expect_comma = False
                continue
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not _ran_out_of_input(err):
                    at = line + buf.count("\n", pos, err.pos)
                    raise SourceError(f"{self.path}:{at}: invalid JSON: {err.msg}") from None
                if eof:
                    self.truncated_at_line = line
                    return
                buf, pos, counted, eof = self._refill(fh, buf, pos)
                continue
            if end == len(buf) and not eof:
                buf, pos, counted, eof = self._refill(fh, buf, pos)
                continue
            yield line, record
            pos = end
            expect_comma = True

    def _refill(self, fh, buf: str, pos: int) -> tuple[str, int, int, bool]:
        want = max(self.chunk_chars, len(buf) - pos)
        more = fh.read(want)
        return buf[pos:] + more, 0, 0, len(more) < want


def _chain_lines(head: str, fh) -> Iterator[str]:
    pending = head
    while True:
        parts = pending.split("\n")
        yield from parts[:-1]
        more = fh.read(1 << 22)
        if not more:
            if parts[-1]:
                yield parts[-1]
            return
        pending = parts[-1] + more


def _ran_out_of_input(err: json.JSONDecodeError) -> bool:
    return err.msg.startswith("Unterminated string") or err.pos >= len(err.doc) - 6

