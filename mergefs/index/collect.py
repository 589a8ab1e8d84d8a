"""Garbage collection of an index directory (``mergefs index gc``) and the registrations of
live mounts that protect the pieces they use.

What is removed from ``index_dir/pieces/``, each rule on its own:

- *unreached* pieces: of another format version, or that no family reached recently (no usage
  record, :meth:`mergefs.index.store.PieceStore.note_use`, of the last ``keep_seconds`` lists
  it, or, when specs are given, not among the pieces those specs' families assemble now);
  pieces written in the last ``GRACE_SECONDS`` are kept (a build in progress writes its pieces
  before its usage record);
- *temporaries* of dead builds: ``.<name>.tmp-<pid>-<thread>`` older than ``GRACE_SECONDS``
  whose writer process no longer exists on this machine (a live pid, or one reused by another
  process, keeps its file; a young one may be another machine's, on a shared ``index_dir``);
- with a size cap, the least recently used pieces (last usage record, else the file's mtime)
  until the folder fits, young ones excepted;
- records left pointing at nothing: usage records whose pieces are all gone, source records
  whose content has no piece left.

Never removed: a piece a live mount registered (:func:`register_live`: ``live-<pid>-<n>.json``
listing its pieces, held under a shared ``flock`` while the mount runs; a registration whose
lock can be taken belongs to a process that died, and is removed). Blocking I/O; never on the
trio thread.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mergefs.core import format as fmt
from mergefs.core.process import pid_alive
from mergefs.index.store import PIECES_DIR, PIECES_VERSION, SOURCE_PREFIX, USAGE_PREFIX

log = logging.getLogger(__name__)

LIVE_PREFIX = "live-"
GRACE_SECONDS = 600.0  # files younger than this are never removed (a build in progress)
TMP_RE = re.compile(r"^\..+\.tmp-(\d+)-\d+$")
KINDS = ("unreached", "temporary", "over the size cap", "record")
_serial = itertools.count()


class LiveRegistration:
    """A live mount's claim on its pieces: the file exists and is locked until :meth:`close`
    (or the process ends: the kernel drops the lock)."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path, self._handle = path, handle

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._handle.close()


def register_live(index_dir: str | Path, pieces: Iterable[str]) -> LiveRegistration | None:
    """Register ``pieces`` (file names) as used by this process until the registration is
    closed; None (logged) where the index directory cannot be written."""
    folder = Path(index_dir) / PIECES_DIR
    path = folder / f"{LIVE_PREFIX}{os.getpid()}-{next(_serial)}.json"
    # written and locked under a temporary name, then renamed (the lock stays with the file):
    # a collection never sees a registration unlocked or empty and takes it for a dead one's
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(tmp, "w")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
            handle.write(json.dumps({"pid": os.getpid(), "pieces": sorted(pieces)}))
            handle.flush()
            os.replace(tmp, path)
        except OSError:
            handle.close()
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("%s: cannot register the pieces this mount uses (index gc may remove "
                    "them): %s", folder, exc.strerror)
        return None
    return LiveRegistration(path, handle)


def _live(folder: Path, dry_run: bool) -> set[str]:
    """Pieces registered by live processes; dead registrations are removed (unless
    ``dry_run``)."""
    out: set[str] = set()
    for path in sorted(folder.glob(f"{LIVE_PREFIX}*.json")):
        try:
            with open(path) as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # held: its mount is running
                    out.update(json.loads(f.read() or "{}").get("pieces", []))
                    continue
        except (OSError, ValueError):
            continue
        if not dry_run:
            path.unlink(missing_ok=True)
    return out


@dataclass(frozen=True)
class Removal:
    kind: str  # one of KINDS
    name: str
    size_bytes: int


@dataclass
class Collected:
    """What one collection removed (or would, ``dry_run``) and what is left."""

    folder: Path
    dry_run: bool
    removed: list[Removal] = field(default_factory=list)
    kept_pieces: int = 0
    kept_bytes: int = 0
    live_pieces: int = 0  # kept because a running mount registered them

    def freed_bytes(self, kind: str | None = None) -> int:
        return sum(r.size_bytes for r in self.removed if kind in (None, r.kind))


def _listing(folder: Path) -> dict[str, os.stat_result]:
    """The regular files of ``folder`` by name; one gone between the listing and its stat (a
    concurrent build's temporary renamed, another collection's removal) is skipped."""
    out = {}
    for p in folder.iterdir():
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[p.name] = st
    return out


def _meta(path: Path) -> dict[str, str] | None:
    """A piece's header metadata (None: unreadable, never trusted)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = fmt.header_length(prefix, os.fstat(f.fileno()).st_size)
            prefix += f.read(n)
        return dict(fmt.parse_file_prefix(prefix, os.path.getsize(path)).metadata or {})
    except (OSError, fmt.FormatError):
        return None


def collect(index_dir: str | Path, *, reached: set[str] | None = None,
            keep_seconds: float = 30 * 86400.0, max_size_bytes: int | None = None,
            dry_run: bool = False, now: float | None = None,
            protect: frozenset[str] = frozenset()) -> Collected:
    """Collect ``index_dir`` by the module's rules. ``reached``: the piece names the given
    specs reach (None: those of usage records of the last ``keep_seconds``); ``protect``:
    pieces never removed (the family just assembled), as a live mount's."""
    now = time.time() if now is None else now
    folder = Path(index_dir) / PIECES_DIR
    out = Collected(folder, dry_run)
    if not folder.is_dir():
        return out
    live = _live(folder, dry_run) | protect
    files = _listing(folder)
    pieces = {n: st for n, st in files.items() if n.endswith(".safetensors")
              and not n.startswith(".")}
    usage: dict[str, dict] = {}
    for n in files:
        if n.startswith(USAGE_PREFIX) and n.endswith(".json"):
            try:
                usage[n] = json.loads((folder / n).read_text())
            except (OSError, ValueError):
                usage[n] = {}
    last_use = {n: st.st_mtime for n, st in pieces.items()}
    recent: set[str] = set()
    for doc in usage.values():
        t = float(doc.get("used_unix", 0.0)) if isinstance(doc, dict) else 0.0
        for n in doc.get("pieces", []) if isinstance(doc, dict) else []:
            if n in last_use:
                last_use[n] = max(last_use[n], t)
            if t >= now - keep_seconds:
                recent.add(n)
    metas = {n: _meta(folder / n) for n in pieces}
    gone: set[str] = set()

    def drop(kind: str, name: str) -> None:
        out.removed.append(Removal(kind, name, files[name].st_size))
        gone.add(name)
        if not dry_run:
            (folder / name).unlink(missing_ok=True)

    def young(name: str) -> bool:
        return files[name].st_mtime >= now - GRACE_SECONDS

    for n in sorted(pieces):
        if n in live:
            continue
        meta = metas[n]
        stale = meta is None or meta.get("mergefs_index_version") != PIECES_VERSION
        wanted = n in (reached if reached is not None else recent) or (
            reached is None and last_use[n] >= now - keep_seconds)
        if stale or not (wanted or young(n)):
            drop("unreached", n)
    for n in sorted(files):
        m = TMP_RE.match(n)
        # young: perhaps being written by a build on another machine (a shared index_dir),
        # whose pid means nothing here
        if m and not young(n) and not pid_alive(int(m.group(1))):
            drop("temporary", n)
    if max_size_bytes is not None:
        left = [n for n in pieces if n not in gone]
        size = sum(st.st_size for n, st in files.items() if n not in gone)
        for n in sorted(left, key=lambda n: (last_use[n], n)):
            if size <= max_size_bytes:
                break
            if n in live or young(n):
                continue
            size -= files[n].st_size
            drop("over the size cap", n)
    held = {m["digest"] for n, m in metas.items()
            if m is not None and n not in gone and "digest" in m}
    for n in sorted(files):
        if n in gone:
            continue
        if n in usage and not any(p in pieces and p not in gone
                                  for p in (usage[n].get("pieces", [])
                                            if isinstance(usage[n], dict) else [])):
            drop("record", n)
        elif n.startswith(SOURCE_PREFIX) and n.endswith(".json"):
            try:
                digest = json.loads((folder / n).read_text()).get("digest")
            except (OSError, ValueError, AttributeError):
                digest = None
            if digest not in held:
                drop("record", n)
    kept = [n for n in pieces if n not in gone]
    out.kept_pieces, out.kept_bytes = len(kept), sum(pieces[n].st_size for n in kept)
    out.live_pieces = len((live - protect) & set(kept))
    return out
