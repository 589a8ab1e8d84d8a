"""The manifest: an append-only JSON-lines record of everything a merge read and produced.

One complete JSON object per line, flushed after each line, so a crash leaves only whole lines
(plus at most one torn last line, which readers ignore and report). Records (schema in
docs/manifest.md): ``header`` first, then ``read`` and ``output`` records as they happen, then
``totals``. The writer is thread-safe; writes are small and may run on any worker thread.

A manifest that stays names a run that completed (its totals written), one still running (its
writer holds the file's ``flock``), or one killed before it could clean up. A run closed without
its totals (an error, Ctrl-C) removes its own file; a killed run's is removed by the next run
beside the same pointer (:func:`collect_incomplete`). The pointer moves only to a complete run.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergefs.core.errors import ManifestError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: a sweep mount's manifest: a ``sweep`` header, then every variant's records tagged "variant"
SWEEP_SCHEMA_VERSION = 2
#: an empty run manifest younger than this may be a run between creating and locking its file
EMPTY_GRACE_SECONDS = 60.0
#: how much of a manifest's end is read to find its last record (a totals record is small)
TAIL_BYTES = 1 << 20


class ManifestWriter:
    """Appends records to a new JSON-lines file; keeps a copy of every line in memory if asked.

    A manifest is never truncated or shared: the file is created exclusively (``O_EXCL``) at the
    first record and held under an exclusive ``flock`` until :meth:`close`, so a second writer
    of the same path is refused naming the holder's pid (recorded in the header as ``pid``).
    ``ManifestWriter(path)`` writes exactly ``path`` (refused if it exists);
    :meth:`for_run` writes a new timestamped file beside a *pointer* path and, once the run is
    complete, points the pointer (a symlink) at it, so every run keeps its own record and the
    pointer names the latest complete one. A run is complete once its final ``totals`` record
    is written (a record of type ``totals`` without ``variant``: a merge's, a plain mount's, a
    sweep mount's own); :meth:`close` of an incomplete run removes its file.
    """

    def __init__(self, path: str | Path | None, keep_lines: bool = False, *,
                 pointer: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.pointer = Path(pointer) if pointer is not None else None
        self._lock = threading.Lock()
        self._file: Any = None
        self._keep = keep_lines
        self.lines: list[str] = []
        self.complete = False  # the run's final totals record is written
        if self.path is not None and self.pointer is None:
            refuse_existing(self.path)

    @classmethod
    def for_run(cls, pointer: str | Path, keep_lines: bool = False) -> ManifestWriter:
        """A writer of a fresh ``<stem>.<UTC time>.jsonl`` beside ``pointer`` (created at the
        first record); the pointer becomes a symlink to it when the run completes (:meth:`close`
        after the totals). A regular file already at the pointer (a manifest of an older
        mergefs) is then kept, renamed to its own timestamped name. Manifests of killed runs
        beside the pointer are removed now (:func:`collect_incomplete`)."""
        pointer = Path(pointer)
        _check_pointer(pointer)
        collect_incomplete(pointer)
        return cls(_run_path(pointer, time.time()), keep_lines, pointer=pointer)

    def _open(self) -> None:
        """Create the file (exclusively) and lock it. Under ``_lock``."""
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.pointer is not None:
                self.path, fd = _create_unique(self.path, os.O_WRONLY | os.O_APPEND)
            else:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                             | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            raise ManifestError(_exists_message(self.path)) from None
        except OSError as exc:
            raise ManifestError(f"{self.path}: cannot write manifest: {exc.strerror}") from None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
        self._file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") == "header":
            record = {**record, "pid": os.getpid()}
        line = json.dumps(record, separators=(",", ":"), sort_keys=True)
        with self._lock:
            if self._keep:
                self.lines.append(line)
            if self.path is None:
                return
            if self._file is None:
                self._open()
            self._file.write(line + "\n")
            self._file.flush()
            if _is_final_totals(record):
                self.complete = True

    def text(self) -> str:
        with self._lock:
            return "".join(line + "\n" for line in self.lines)

    def close(self) -> None:
        """Finish the file: a complete run's is synced and (for :meth:`for_run`) the pointer
        moved to it; an incomplete run's (an error or an interrupt before the totals) is removed.
        Either while the file is still locked; closing twice does nothing."""
        with self._lock:
            f, self._file = self._file, None
            if f is None:
                return
            assert self.path is not None
            if not self.complete:
                try:
                    self.path.unlink(missing_ok=True)
                    # (debug: the run's own error is the one line the CLI prints)
                    log.debug("%s: removed the manifest of a run that did not complete",
                              self.path)
                finally:
                    try:
                        f.close()  # releases the flock
                    except OSError:  # (a failed flush of what is removed anyway)
                        pass
                return
            try:
                f.flush()
                os.fsync(f.fileno())
                if self.pointer is not None:
                    _point(self.pointer, self.path)
            finally:
                f.close()  # releases the flock


def _is_final_totals(record: Any) -> bool:
    """The record that completes a run: ``totals`` of the whole run, not of one sweep variant."""
    return isinstance(record, dict) and record.get("type") == "totals" \
        and "variant" not in record


def _is_manifest(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read existing file: {exc.strerror}") from None
    try:
        rec = json.loads(first)
    except ValueError:
        return False
    return isinstance(rec, dict) and rec.get("type") == "header" and "mergefs_version" in rec


def holder_pid(path: Path) -> int | None:
    """The pid of the process writing manifest ``path`` (it holds its flock), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            return None  # nobody writes it
    finally:
        os.close(fd)
    try:
        with open(path, encoding="utf-8") as f:
            pid = json.loads(f.readline(1 << 20)).get("pid")
    except (OSError, ValueError, AttributeError):
        return -1
    return pid if isinstance(pid, int) else -1


def _exists_message(path: Path) -> str:
    pid = holder_pid(path)
    if pid is not None:
        who = f"pid {pid}" if pid > 0 else "another process"
        return (f"{path}: manifest is being written by {who}; two runs never share a manifest "
                "(choose another --manifest path, or leave it out for a timestamped one)")
    what = "a manifest of an earlier run" if path.is_file() and _is_manifest(path) else \
        "a file that is not a mergefs manifest"
    return (f"{path}: exists ({what}); refusing to overwrite it (choose another --manifest path, "
            "or leave it out for a new timestamped one)")


def refuse_existing(path: Path) -> None:
    """Refuse a manifest path that exists: nothing is ever truncated."""
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise ManifestError(f"{path}: manifest path exists and is not a regular file")
        raise ManifestError(_exists_message(path))


def _check_pointer(pointer: Path) -> None:
    """The pointer may be absent, our symlink, or an older mergefs's manifest (kept)."""
    if pointer.is_symlink() or not pointer.exists():
        if pointer.is_symlink() and os.sep in os.readlink(pointer):
            raise ManifestError(f"{pointer}: is a symlink mergefs did not make; refusing to "
                                "replace it (choose another manifest path)")
        return
    if not pointer.is_file():
        raise ManifestError(f"{pointer}: manifest path exists and is not a regular file")
    if pointer.stat().st_size and not _is_manifest(pointer):
        raise ManifestError(f"{pointer}: exists and is not a mergefs manifest; refusing to "
                            "overwrite it (choose another manifest path)")


def _run_path(pointer: Path, when: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    suffix = pointer.suffix or ".jsonl"
    stem = pointer.name[: -len(pointer.suffix)] if pointer.suffix else pointer.name
    return pointer.with_name(f"{stem}.{stamp}{suffix}")


def _create_unique(path: Path, flags: int = os.O_WRONLY) -> tuple[Path, int]:
    """Create ``path`` exclusively, or ``<stem>-2<suffix>``, ``-3``, ... if taken; returns the
    name and a descriptor opened with ``flags``."""
    stem, suffix = path.name[: -len(path.suffix)], path.suffix
    for k in range(1, 10000):
        cand = path if k == 1 else path.with_name(f"{stem}-{k}{suffix}")
        try:
            return cand, os.open(cand, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
    raise ManifestError(f"{path}: cannot find a free manifest name")


def _point(pointer: Path, target: Path) -> None:
    """Point ``pointer`` at a complete run's ``target``, unless something not ours appeared at
    the pointer meanwhile (then only logged: the run itself completed)."""
    try:
        _check_pointer(pointer)
        _repoint(pointer, target)
    except (ManifestError, OSError) as exc:
        log.warning("%s: not pointed at the manifest %s: %s", pointer, target, exc)


def _run_pattern(pointer: Path) -> re.Pattern[str]:
    """The names :func:`_run_path` and :func:`_create_unique` give runs beside ``pointer``."""
    suffix = pointer.suffix or ".jsonl"
    stem = pointer.name[: -len(pointer.suffix)] if pointer.suffix else pointer.name
    return re.compile(rf"{re.escape(stem)}\.\d{{8}}T\d{{6}}Z(-\d+)?{re.escape(suffix)}")


def collect_incomplete(pointer: Path) -> list[Path]:
    """Remove the run manifests beside ``pointer`` that no run will complete: named as runs
    are, a mergefs manifest (or empty for longer than :data:`EMPTY_GRACE_SECONDS`), not locked by
    a writer (a live run), without a final totals record (a killed run: kill -9, power loss).
    Each is checked and removed while this process holds its lock. Returns what was removed."""
    pattern = _run_pattern(pointer)
    try:
        names = sorted(n for n in os.listdir(pointer.parent) if pattern.fullmatch(n))
    except OSError:
        return []
    removed = []
    for name in names:
        path = pointer.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, a symlink, not ours to read
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it
            if _incomplete(fd):
                os.unlink(path)
                removed.append(path)
                log.info("%s: removed the manifest of a run that was killed before it "
                         "completed (no totals)", path)
        except OSError as exc:
            log.warning("%s: cannot check or remove an incomplete manifest: %s", path, exc)
        finally:
            os.close(fd)
    return removed


def _incomplete(fd: int) -> bool:
    """Whether the regular file ``fd`` is a mergefs manifest without its final totals (or has
    stayed empty past the grace period)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return False
    if st.st_size == 0:
        return time.time() - st.st_mtime > EMPTY_GRACE_SECONDS
    first = os.pread(fd, min(st.st_size, 1 << 20), 0).split(b"\n", 1)[0]
    try:
        header = json.loads(first)
    except ValueError:
        return False  # not a manifest: never removed
    if not (isinstance(header, dict) and header.get("type") == "header"
            and "mergefs_version" in header):
        return False
    start = max(0, st.st_size - TAIL_BYTES)
    tail = os.pread(fd, st.st_size - start, start)
    lines = tail[:tail.rfind(b"\n") + 1].splitlines()
    if not lines:
        return True
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return True
    return not _is_final_totals(last)


def _repoint(pointer: Path, target: Path) -> None:
    """Make ``pointer`` a relative symlink to ``target`` (atomically). A regular file there (an
    older mergefs's manifest, checked by ``_check_pointer``) is first kept under its own
    timestamped name."""
    if pointer.exists() and not pointer.is_symlink():
        kept, fd = _create_unique(_run_path(pointer, pointer.stat().st_mtime))
        os.close(fd)
        os.replace(pointer, kept)
        log.info("kept the earlier manifest %s as %s", pointer, kept)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, pointer)


@dataclass(frozen=True)
class ManifestContents:
    header: dict[str, Any]
    reads: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    totals: dict[str, Any] | None
    torn_lines: int
    #: files the run generated beside the weights (the model card), with their text
    files: list[dict[str, Any]] = field(default_factory=list)


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
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not a mergefs manifest (not UTF-8 text; is it a weights "
                            "file?)") from None


class _Parts:
    """One manifest's (or one sweep variant's) records by type, as read."""

    def __init__(self) -> None:
        self.header: dict[str, Any] | None = None
        self.totals: dict[str, Any] | None = None
        self.lists: dict[str, list[dict[str, Any]]] = {"read": [], "output": [], "tensor": [],
                                                       "file": []}

    def add(self, kind: Any, rec: dict[str, Any]) -> None:
        if kind == "header":
            self.header = rec
        elif kind == "totals":
            self.totals = rec
        elif kind in self.lists:
            self.lists[kind].append(rec)

    def contents(self, torn: int) -> ManifestContents:
        assert self.header is not None
        return ManifestContents(self.header, self.lists["read"], self.lists["output"],
                                self.lists["tensor"], self.totals, torn, self.lists["file"])


def read_manifest(path: str | Path) -> ManifestContents:
    parts = _Parts()
    torn = 0
    for k, rec in enumerate(iter_records(path)):
        if rec is None:
            torn += 1
            continue
        kind = rec.get("type")
        if k == 0:
            if kind != "header":
                raise ManifestError(f"{path}: first record is {kind!r}, expected 'header'")
            if rec.get("schema") == SWEEP_SCHEMA_VERSION:
                raise ManifestError(f"{path}: a sweep manifest (schema 2): read it with "
                                    "read_sweep_manifest")
            if rec.get("schema") != SCHEMA_VERSION:
                raise ManifestError(f"{path}: unsupported manifest schema {rec.get('schema')!r}")
            parts.add(kind, rec)
        elif kind != "header":
            parts.add(kind, rec)
    if parts.header is None:
        raise ManifestError(f"{path}: empty manifest (no header record)")
    return parts.contents(torn)


def manifest_schema(path: str | Path) -> int | None:
    """The schema of a manifest's header (None if its first line is not a header)."""
    for rec in iter_records(path):
        if rec is None or rec.get("type") != "header":
            return None
        schema = rec.get("schema")
        return schema if isinstance(schema, int) else None
    return None


@dataclass(frozen=True)
class SweepContents:
    """A sweep manifest: its header, each variant's records (as a schema-1 manifest's), the
    sweep's own totals (None if the mount did not finish) and the torn lines."""

    header: dict[str, Any]
    variants: dict[str, ManifestContents]
    totals: dict[str, Any] | None
    torn_lines: int


def read_sweep_manifest(path: str | Path) -> SweepContents:
    header = None
    parts: dict[str, _Parts] = {}
    totals = None
    torn = 0
    for k, rec in enumerate(iter_records(path)):
        if rec is None:
            torn += 1
            continue
        kind = rec.get("type")
        if k == 0:
            if kind != "header" or rec.get("schema") != SWEEP_SCHEMA_VERSION:
                raise ManifestError(f"{path}: not a sweep manifest (schema 2 header)")
            header = rec
            continue
        name = rec.get("variant")
        if name is None:
            if kind == "totals":
                totals = rec
            continue
        if not isinstance(name, str):
            raise ManifestError(f"{path}: a record names the variant {name!r}")
        parts.setdefault(name, _Parts()).add(kind, rec)
    if header is None:
        raise ManifestError(f"{path}: empty manifest (no header record)")
    variants = {}
    for name, part in parts.items():
        if part.header is None:
            raise ManifestError(f"{path}: variant {name!r} has records but no header")
        variants[name] = part.contents(0)
    return SweepContents(header, variants, totals, torn)
