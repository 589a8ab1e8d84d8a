"""The manifest: an append-only JSON-lines record of everything a merge read and produced.

One complete JSON object per line, flushed after each line, so a crash leaves only whole lines
(plus at most one torn last line, which readers ignore and report). Records (schema in
docs/manifest.md): ``header`` first, then ``read`` and ``output`` records as they happen, then
``totals``. The writer is thread-safe; writes are small and may run on any worker thread.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ManifestError

SCHEMA_VERSION = 1


class ManifestWriter:
    """Appends records to a JSON-lines file; keeps a copy of every line in memory if asked."""

    def __init__(self, path: str | Path | None, keep_lines: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._file = None
        self._keep = keep_lines
        self.lines: list[str] = []
        if self.path is not None:
            _refuse_clobber(self.path)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "w", encoding="utf-8")
            except OSError as exc:
                raise ManifestError(f"{self.path}: cannot write manifest: {exc.strerror}") from None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), sort_keys=True)
        with self._lock:
            if self._keep:
                self.lines.append(line)
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    def text(self) -> str:
        with self._lock:
            return "".join(line + "\n" for line in self.lines)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


def _refuse_clobber(path: Path) -> None:
    """Never overwrite a file that is not a mergefs manifest (a spec must not be able to make
    mergefs destroy arbitrary files through its ``manifest`` key)."""
    if not path.exists():
        return
    if not path.is_file():
        raise ManifestError(f"{path}: manifest path exists and is not a regular file")
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read existing file: {exc.strerror}") from None
    if not first:
        return
    try:
        rec = json.loads(first)
    except ValueError:
        rec = None
    if not (isinstance(rec, dict) and rec.get("type") == "header" and "mergefs_version" in rec):
        raise ManifestError(f"{path}: exists and is not a mergefs manifest; refusing to "
                            "overwrite it (choose another manifest path)")


@dataclass(frozen=True)
class ManifestContents:
    header: dict[str, Any]
    reads: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    totals: dict[str, Any] | None
    torn_lines: int


def iter_records(path: str | Path) -> Iterator[dict[str, Any] | None]:
    """Yield each record; ``None`` for a line that is not a complete JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    yield None
                    continue
                yield rec if isinstance(rec, dict) and line.endswith("\n") else None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc.strerror}") from None


def read_manifest(path: str | Path) -> ManifestContents:
    header = None
    reads: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    tensors: list[dict[str, Any]] = []
    totals = None
    torn = 0
    for k, rec in enumerate(iter_records(path)):
        if rec is None:
            torn += 1
            continue
        kind = rec.get("type")
        if k == 0:
            if kind != "header":
                raise ManifestError(f"{path}: first record is {kind!r}, expected 'header'")
            if rec.get("schema") != SCHEMA_VERSION:
                raise ManifestError(f"{path}: unsupported manifest schema {rec.get('schema')!r}")
            header = rec
        elif kind == "read":
            reads.append(rec)
        elif kind == "output":
            outputs.append(rec)
        elif kind == "tensor":
            tensors.append(rec)
        elif kind == "totals":
            totals = rec
    if header is None:
        raise ManifestError(f"{path}: empty manifest (no header record)")
    return ManifestContents(header, reads, outputs, tensors, totals, torn)
