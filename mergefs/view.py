"""The virtual merged model directory, independent of FUSE (the adapter is ``mergefs.fuse``).

A :class:`View` over an opened :class:`~mergefs.engine.Session` looks like a Hugging Face model
directory:

- the base's non-weight files (config, tokenizer, ...), passed through from the base directory
  (a file that changed since the mount started is refused with :class:`SourceChanged`);
- weight files mirroring the base's sharding (``Engine.out_files``): a synthesized safetensors
  header followed by the merged tensors, byte-identical to ``Engine.materialise``;
- ``model.safetensors.index.json`` when the base is sharded;
- a hidden ``.mergefs/`` directory with ``stats.json`` (live counters, see :meth:`View.stats`)
  and ``manifest.jsonl`` (the session's manifest so far, complete lines only).

Every size, inode number and attribute is fixed when the view is built, without merging
anything, except the two files under ``.mergefs/``, whose content is snapshotted when opened
(their size reads as 0: open them with direct I/O). ``read(fh, offset, size)`` maps a byte range
of a weight file to the header and the merge units it overlaps (block runs from ``Engine.units``;
one unit per tensor for whole-tensor operators), merges only those through the
:class:`~mergefs.cache.UnitCache` and returns exactly those bytes. When a handle reads
sequentially, the next units are merged in the background (bounded, see ``_readahead``); a
stream that started inside a tensor reads ahead only within that tensor, so reading one tensor
never reads another tensor's sources.

Thread use: ``lookup``, ``getattr``, ``readdir``, ``release`` and ``attr`` only touch in-memory
tables and are safe on the trio thread. ``open`` (snapshots, may read the manifest file) and
``read`` (merges, disk reads, waits for other threads) block: run them in worker threads.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from . import __version__
from .cache import UnitCache
from .checkpoint import INDEX_NAME, ReadRange
from .engine import OutFile, Session
from .errors import MergefsError, SourceChanged

log = logging.getLogger(__name__)

ROOT_INODE = 1
STATE_DIR = ".mergefs"
STATS_NAME = "stats.json"
MANIFEST_NAME = "manifest.jsonl"
STATS_SCHEMA = 1
PAGE = 4096
STREAM_SLACK = 1 << 20  # reads this close to a handle's run continue it

Kind = Literal["dir", "weights", "passthrough", "static", "stats", "manifest"]


@dataclass(frozen=True)
class Attr:
    """Attributes of one node. ``dynamic`` nodes change content; their size reads as 0."""

    inode: int
    is_dir: bool
    size_bytes: int
    mode: int
    nlink: int
    mtime_ns: int
    dynamic: bool


@dataclass(frozen=True)
class Segment:
    """A contiguous piece of a weight file: ``[start, end)`` absolute in the file.

    ``tensor`` is None for the header. ``b0, b1`` is the unit's block run (-1, -1 for a tensor
    passed through from the base, read as needed and not cached). ``tensor_start, tensor_end``
    bound the whole tensor.
    """

    start: int
    end: int
    tensor: str | None
    b0: int
    b1: int
    tensor_start: int
    tensor_end: int

    @property
    def key(self) -> str:
        return f"unit\x00{self.tensor}\x00{self.b0}\x00{self.b1}"


@dataclass(frozen=True)
class _WeightFile:
    out: OutFile
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]


@dataclass
class _Node:
    inode: int
    name: str
    path: str  # relative to the mount root, "" for the root
    parent: int
    kind: Kind
    size_bytes: int = 0
    mtime_ns: int = 0
    children: dict[str, int] = field(default_factory=dict)
    weights: _WeightFile | None = None
    static: bytes | None = None
    source: Path | None = None  # passthrough: the base's file


@dataclass
class _Handle:
    node: _Node
    snapshot: bytes | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    run_start: int = -1  # where the current sequential run of reads began
    max_end: int = -1  # furthest byte the run has reached


class View:
    """The virtual directory over a session. Thread-safe."""

    def __init__(self, session: Session, cache: UnitCache, *, readahead_units: int = 4,
                 readahead_threads: int = 2, readahead_pending: int = 16) -> None:
        self.session = session
        self.engine = session.engine
        self.cache = cache
        self.readahead_units = readahead_units
        self._ra_pending_max = readahead_pending
        self._ra_pool = ThreadPoolExecutor(max_workers=max(1, readahead_threads),
                                           thread_name_prefix="mergefs-readahead")
        self._ra_keys: set[str] = set()
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._fh = itertools.count(1)
        self.started_unix = time.time()
        self._started = time.monotonic()
        self._read_base = session.source_bytes()
        self._blocks_base = self.engine.blocks_merged
        self._units_base = self.engine.units_merged
        self.served_weight_bytes = 0
        self.served_other_bytes = 0
        self.read_calls = 0
        self.passthrough_file_bytes_read = 0
        self.readahead_scheduled = 0
        self.readahead_errors = 0
        self.read_errors = 0
        self._nodes: dict[int, _Node] = {}
        self._build()
        self._warn_large_units()

    # -- building the tree ------------------------------------------------------------------
    def _build(self) -> None:
        base = self.session.base
        sources = [base, *self.session.experts]
        weights_mtime = max((i.mtime_ns for c in sources for i in c.identities.values()),
                            default=0)
        mount_ns = int(self.started_unix * 1e9)
        entries: dict[str, tuple[Kind, dict[str, Any]]] = {}
        for rel in base.extra_files:
            src = base.root / rel
            st = os.stat(src)
            entries[PurePosixPath(rel).as_posix()] = (
                "passthrough", {"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                                "source": src})
        for f in self.engine.out_files:
            if f.name in entries:
                log.warning("base file %s is shadowed by the merged weight file", f.name)
            entries[f.name] = ("weights", {"size_bytes": f.size_bytes, "mtime_ns": weights_mtime,
                                           "weights": _segments(self, f)})
        if self.engine.index_json is not None:
            entries[INDEX_NAME] = ("static", {"size_bytes": len(self.engine.index_json),
                                              "mtime_ns": weights_mtime,
                                              "static": self.engine.index_json})
        entries[f"{STATE_DIR}/{STATS_NAME}"] = ("stats", {"mtime_ns": mount_ns})
        entries[f"{STATE_DIR}/{MANIFEST_NAME}"] = ("manifest", {"mtime_ns": mount_ns})

        self._nodes[ROOT_INODE] = _Node(ROOT_INODE, "", "", ROOT_INODE, "dir",
                                        mtime_ns=weights_mtime)
        by_path = {"": ROOT_INODE}
        next_inode = itertools.count(ROOT_INODE + 1)
        for path in sorted(entries):  # sorted: inode numbers are stable across mounts
            parts = path.split("/")
            parent = ROOT_INODE
            for depth in range(1, len(parts)):
                dpath = "/".join(parts[:depth])
                if dpath not in by_path:
                    ino = next(next_inode)
                    self._nodes[ino] = _Node(ino, parts[depth - 1], dpath, parent, "dir",
                                             mtime_ns=weights_mtime)
                    self._nodes[parent].children[parts[depth - 1]] = ino
                    by_path[dpath] = ino
                parent = by_path[dpath]
            kind, extra = entries[path]
            ino = next(next_inode)
            self._nodes[ino] = _Node(ino, parts[-1], path, parent, kind, **extra)
            self._nodes[parent].children[parts[-1]] = ino
            by_path[path] = ino
        self._by_path = by_path

    def _warn_large_units(self) -> None:
        largest = max((s.end - s.start for n in self._nodes.values() if n.weights
                       for s in n.weights.segments), default=0)
        if largest > self.cache.capacity_bytes:
            log.warning("the largest merge unit (%d bytes) exceeds the cache (%d bytes): every "
                        "read of it merges it again; raise --cache-size", largest,
                        self.cache.capacity_bytes)

    # -- namespace (in memory; safe on the trio thread) --------------------------------------
    def lookup(self, parent: int, name: str) -> Attr | None:
        node = self._nodes.get(parent)
        if node is None or node.kind != "dir":
            return None
        ino = node.children.get(name)
        return None if ino is None else self.attr(ino)

    def inode_of(self, path: str) -> int:
        """Inode of a path relative to the root ("" is the root); KeyError if absent."""
        return self._by_path[PurePosixPath(path).as_posix() if path else ""]

    def attr(self, inode: int) -> Attr:
        n = self._nodes[inode]  # KeyError for an unknown inode
        if n.kind == "dir":
            subdirs = sum(self._nodes[c].kind == "dir" for c in n.children.values())
            return Attr(inode, True, 0, stat.S_IFDIR | 0o555, 2 + subdirs, n.mtime_ns, False)
        dynamic = n.kind in ("stats", "manifest")
        return Attr(inode, False, n.size_bytes, stat.S_IFREG | 0o444, 1, n.mtime_ns, dynamic)

    def readdir(self, inode: int) -> list[tuple[str, Attr]]:
        """Entries of a directory, sorted by name (without "." and "..")."""
        n = self._nodes[inode]
        if n.kind != "dir":
            raise NotADirectoryError(n.path)
        return [(name, self.attr(ino)) for name, ino in sorted(n.children.items())]

    def parent_of(self, inode: int) -> int:
        return self._nodes[inode].parent

    def totals(self) -> tuple[int, int]:
        """(number of nodes, bytes of all non-dynamic files): for statfs."""
        size = sum(n.size_bytes for n in self._nodes.values())
        return len(self._nodes), size

    # -- handles ----------------------------------------------------------------------------
    def open(self, inode: int) -> int:
        """Open a file for reading; returns a handle. Blocks (snapshots dynamic files)."""
        n = self._nodes[inode]
        if n.kind == "dir":
            raise IsADirectoryError(n.path)
        snapshot = None
        if n.kind == "stats":
            snapshot = (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
        elif n.kind == "manifest":
            snapshot = self._manifest_bytes()
        fh = next(self._fh)
        with self._lock:
            self._handles[fh] = _Handle(n, snapshot)
        return fh

    def release(self, fh: int) -> None:
        with self._lock:
            self._handles.pop(fh, None)

    def open_path(self, path: str) -> int:
        return self.open(self.inode_of(path))

    # -- reading (blocking) -----------------------------------------------------------------
    def read(self, fh: int, offset: int, size: int) -> bytes:
        """Exactly the bytes ``[offset, offset + size)`` of the file (fewer at its end)."""
        with self._lock:
            h = self._handles[fh]
            self.read_calls += 1
        n = h.node
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        try:
            if n.kind == "weights":
                assert n.weights is not None
                data = self._read_weights(n.weights, offset, offset + size)
                self._note_stream(h, n.weights, offset, offset + len(data))
            elif n.kind == "passthrough":
                data = self._read_passthrough(n, offset, size)
            else:
                blob = n.static if n.kind == "static" else h.snapshot
                assert blob is not None
                data = blob[offset:offset + size]
        except MergefsError:
            with self._lock:
                self.read_errors += 1
            raise
        with self._lock:
            if n.kind == "weights":
                self.served_weight_bytes += len(data)
            else:
                self.served_other_bytes += len(data)
        return data

    def read_path(self, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """Convenience for tests and tools: open, read, release."""
        fh = self.open_path(path)
        try:
            return self.read(fh, offset, (1 << 62) if size is None else size)
        finally:
            self.release(fh)

    def _read_weights(self, wf: _WeightFile, start: int, end: int) -> bytes:
        end = min(end, wf.out.size_bytes)
        if start >= end:
            return b""
        parts: list[memoryview] = []
        i = bisect.bisect_right(wf.starts, start) - 1
        while i < len(wf.segments) and wf.segments[i].start < end:
            seg = wf.segments[i]
            lo, hi = max(start, seg.start) - seg.start, min(end, seg.end) - seg.start
            if seg.tensor is not None and seg.b0 < 0:
                parts.append(self._passthrough_range(seg.tensor, lo, hi))
            else:
                parts.append(memoryview(self._segment_bytes(wf, seg))[lo:hi])
            i += 1
        out = b"".join(parts)
        if len(out) != end - start:  # tiling is checked at build time; never serve a short read
            raise MergefsError(f"{wf.out.name}: internal error: assembled {len(out)} bytes for "
                               f"[{start}, {end})")
        return out

    def _segment_bytes(self, wf: _WeightFile, seg: Segment) -> bytes:
        """The bytes of a header or merge unit segment (through the cache)."""
        if seg.tensor is None:
            return wf.out.header
        name, b0, b1 = seg.tensor, seg.b0, seg.b1
        data = self.cache.get(seg.key, lambda: self.engine.merge_unit(name, b0, b1))
        if len(data) != seg.end - seg.start:
            raise MergefsError(f"{wf.out.name}: unit {name!r} [{b0}, {b1}) has {len(data)} "
                               f"bytes, expected {seg.end - seg.start}")
        return data

    def _passthrough_range(self, name: str, lo: int, hi: int) -> memoryview:
        """Bytes ``[lo, hi)`` of a tensor that is not merged: the base's, read as needed."""
        loc = self.session.base.tensors[name]
        data = self.session.base.read_ranges([ReadRange(loc.file, loc.start + lo,
                                                        loc.start + hi)])[0]
        self.session.base.check_unchanged()  # non-float tensors have no index hashes
        return data

    def _read_passthrough(self, n: _Node, offset: int, size: int) -> bytes:
        assert n.source is not None
        try:
            fd = os.open(n.source, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceChanged(f"{n.source}: cannot open: {exc.strerror}") from None
        try:
            before = os.fstat(fd)
            data = os.pread(fd, max(0, min(size, n.size_bytes - offset)), offset)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        for st in (before, after):
            if st.st_size != n.size_bytes or st.st_mtime_ns != n.mtime_ns:
                raise SourceChanged(f"{n.source}: changed since the mount started")
        with self._lock:
            self.passthrough_file_bytes_read += len(data)
        return data

    def _manifest_bytes(self) -> bytes:
        m = self.session.manifest
        if m is None:
            return b""
        if m.path is None:
            return m.text().encode()
        with open(m.path, "rb") as f:
            blob = f.read()
        return blob[:blob.rfind(b"\n") + 1]  # complete lines only

    # -- readahead --------------------------------------------------------------------------
    def _note_stream(self, h: _Handle, wf: _WeightFile, start: int, end: int) -> None:
        """Track the handle's run of nearby reads (the kernel's concurrent readahead requests
        may arrive out of order, hence the slack) and read ahead when it continues."""
        with h.lock:
            sequential = (h.max_end >= 0
                          and h.run_start - STREAM_SLACK <= start <= h.max_end + STREAM_SLACK)
            if sequential:
                h.run_start = min(h.run_start, start)
                h.max_end = max(h.max_end, end)
            else:
                h.run_start, h.max_end = start, end
            run_start = h.run_start
        if sequential and self.readahead_units > 0 and end < wf.out.size_bytes:
            self._readahead(wf, end, run_start)

    def _readahead(self, wf: _WeightFile, end: int, run_start: int) -> None:
        """Merge the next ``readahead_units`` units after ``end`` in the background.

        A run that began inside the current tensor stays within it; a run that already crossed
        into this tensor from before may continue into the following tensors. At most
        ``readahead_pending`` units are queued at once (further requests are dropped).
        """
        cur = wf.segments[bisect.bisect_right(wf.starts, end - 1) - 1]
        # page-aligned readers (mmap) touch the page before a tensor: only a run that began in
        # an earlier page has really crossed into this tensor
        crossed = run_start < (cur.tensor_start & ~(PAGE - 1))
        limit = wf.out.size_bytes if crossed else cur.tensor_end
        i = bisect.bisect_right(wf.starts, end) - 1
        scheduled = 0
        while i < len(wf.segments) and scheduled < self.readahead_units:
            seg = wf.segments[i]
            i += 1
            if seg.start >= limit:
                break
            if seg.tensor is None or seg.b0 < 0 or seg.end <= end:
                continue
            key = seg.key
            if self.cache.contains(key):
                continue
            with self._lock:
                if key in self._ra_keys or len(self._ra_keys) >= self._ra_pending_max:
                    continue
                self._ra_keys.add(key)
                self.readahead_scheduled += 1
            scheduled += 1
            try:
                self._ra_pool.submit(self._readahead_one, wf, seg)
            except RuntimeError:  # pool shut down: the view is closing
                with self._lock:
                    self._ra_keys.discard(key)
                return

    def _readahead_one(self, wf: _WeightFile, seg: Segment) -> None:
        try:
            self._segment_bytes(wf, seg)
        except Exception as exc:  # noqa: BLE001 - the reader's own read reports it
            log.debug("readahead of %s [%d, %d) failed: %s", seg.tensor, seg.b0, seg.b1, exc)
            with self._lock:
                self.readahead_errors += 1
        finally:
            with self._lock:
                self._ra_keys.discard(seg.key)

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The content of ``.mergefs/stats.json``: each key has one meaning (docs in README).

        Byte counters count since the view was created. ``physical_bytes_read`` is what
        ``pread`` returned from each source's weight files (index building excluded);
        ``passthrough_file_bytes_read`` is what was read from the base's other files;
        ``served_bytes`` is what ``read`` returned, for weight files and for other files.
        Paths are only the spec's own (spec file, base and expert paths).
        """
        s = self.session
        now = s.source_bytes()
        physical = {k: v - self._read_base.get(k, 0) for k, v in now.items()}
        plan = s.plan
        with self._lock:
            counters = {
                "served_bytes": {"weights": self.served_weight_bytes,
                                 "other": self.served_other_bytes},
                "read_calls": self.read_calls,
                "read_errors": self.read_errors,
                "passthrough_file_bytes_read": self.passthrough_file_bytes_read,
                "readahead": {"units_scheduled": self.readahead_scheduled,
                              "units_pending": len(self._ra_keys),
                              "errors": self.readahead_errors},
                "open_handles": len(self._handles),
            }
        return {
            "schema": STATS_SCHEMA,
            "mergefs_version": __version__,
            "pid": os.getpid(),
            "spec": s.spec.source,
            "method": s.spec.method,
            "sources": {"base": s.spec.base,
                        **{f"expert:{i}": e.path for i, e in enumerate(s.spec.experts)}},
            "plan_hash": plan.plan_hash,
            "budget_bytes": plan.budget_bytes,
            "planned_expert_bytes": plan.planned_bytes,
            "total_expert_bytes": plan.total_expert_bytes,
            "weight_file_bytes": sum(f.size_bytes for f in self.engine.out_files),
            "base_tensor_bytes": sum(t.size_bytes for t in s.base.tensors.values()),
            "physical_bytes_read": physical,
            "expert_bytes_read": sum(v for k, v in physical.items() if k != "base"),
            "units_merged": self.engine.units_merged - self._units_base,
            "blocks_merged": self.engine.blocks_merged - self._blocks_base,
            "cache": self.cache.stats().to_json(),
            "uptime_seconds": round(time.monotonic() - self._started, 3),
            **counters,
        }

    def close(self) -> None:
        """Stop background readahead (running merges finish; queued ones are dropped), then
        finish the cache's queued disk writes."""
        self._ra_pool.shutdown(wait=True, cancel_futures=True)
        self.cache.close()


def _segments(view: View, f: OutFile) -> _WeightFile:
    """The header and every merge unit of an output file, in file order, tiling it exactly."""
    eng = view.engine
    segs = [Segment(0, len(f.header), None, -1, -1, 0, len(f.header))]
    for t in f.tensors:
        if t.end == t.start:
            continue
        if t.layout_index is None:
            segs.append(Segment(t.start, t.end, t.name, -1, -1, t.start, t.end))
            continue
        for b0, b1 in eng.units(t.name):
            u0, u1 = eng.unit_out_range(t.name, b0, b1)
            if u1 > u0:
                segs.append(Segment(t.start + u0, t.start + u1, t.name, b0, b1, t.start, t.end))
    pos = 0
    for s in segs:
        if s.start != pos:
            raise MergefsError(f"{f.name}: internal error: units do not tile the file at {pos}")
        pos = s.end
    if pos != f.size_bytes:
        raise MergefsError(f"{f.name}: internal error: units end at {pos}, file is "
                           f"{f.size_bytes} bytes")
    return _WeightFile(f, tuple(segs), tuple(s.start for s in segs))
