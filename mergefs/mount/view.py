"""The virtual merged model directory, independent of FUSE (the adapter is ``mergefs.mount.fuse``).

A :class:`View` over an opened :class:`~mergefs.engine.session.Session` looks like a Hugging Face model
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
of a weight file to the header and the merge units it overlaps and merges only those
(:class:`~mergefs.mount.files.UnitReader`, through the :class:`~mergefs.core.cache.UnitCache`), returning
exactly those bytes; each open handle is a :class:`~mergefs.mount.files.Stream`, so a sequential
reader gets the next units merged in the background.

Thread use: ``lookup``, ``getattr``, ``readdir``, ``release`` and ``attr`` only touch in-memory
tables and are safe on the trio thread. ``open`` (snapshots, may read the manifest file) and
``read`` (merges, disk reads, waits for other threads) block: run them in worker threads.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from mergefs.core.version import __version__
from mergefs.core.cache import UnitCache
from mergefs.sources.base import INDEX_NAME
from mergefs.engine.merger import Engine
from mergefs.engine.session import Session
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.mount.pages import StoreFn
from mergefs.mount.files import Stream, UnitReader, WeightFile, weight_file

log = logging.getLogger(__name__)

ROOT_INODE = 1
STATE_DIR = ".mergefs"
STATS_NAME = "stats.json"
MANIFEST_NAME = "manifest.jsonl"
STATS_SCHEMA = 1
LAST_ERRORS = 10  # read errors kept (newest last) for `mergefs stats`

Kind = Literal["dir", "weights", "passthrough", "static", "stats", "manifest", "variants"]
#: kinds whose content changes while mounted: snapshotted at open, size 0 (direct I/O)
DYNAMIC_KINDS = frozenset({"stats", "manifest", "variants"})
Entries = dict[str, tuple[Kind, dict[str, Any]]]


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
    weights: WeightFile | None = None
    static: bytes | None = None
    source: Path | None = None  # passthrough: the base's file
    reader: UnitReader | None = None  # weights: the reader that serves it
    variant: str = ""  # a sweep mount's variant the node belongs to ("" elsewhere)


@dataclass
class _Handle:
    node: _Node
    snapshot: bytes | None  # dynamic files: the content when opened
    stream: Stream = field(default_factory=Stream)


def model_entries(engine: Engine, weights_mtime_ns: int,
                  key_of: Callable[[str, int, int], str] | None = None) -> Entries:
    """The files of a merged model directory by relative path: the base's non-weight files
    (passed through, or rewritten by the merge), the merge's weight files and shard index;
    ``key_of``: the cache keys of merge units (:func:`~mergefs.mount.files.weight_file`)."""
    base = engine.base
    entries: Entries = {}
    for rel, data in engine.extra_overrides.items():  # files the merge adds (tokenizer)
        if rel not in base.extra_files:
            entries[PurePosixPath(rel).as_posix()] = (
                "static", {"size_bytes": len(data), "mtime_ns": weights_mtime_ns, "static": data})
    for rel in base.extra_files:
        if rel in engine.extra_hidden and rel not in engine.extra_overrides:
            continue
        if base.is_remote:  # small files beside remote weights: fetched once, kept in memory
            data = base.read_extra(rel)
            entries[PurePosixPath(rel).as_posix()] = (
                "static", {"size_bytes": len(data), "mtime_ns": weights_mtime_ns, "static": data})
            continue
        src = base.root / rel
        st = os.stat(src)
        rewritten = engine.extra_overrides.get(rel)
        if rewritten is not None:  # e.g. config.json with the output dtype
            entries[PurePosixPath(rel).as_posix()] = (
                "static", {"size_bytes": len(rewritten), "mtime_ns": st.st_mtime_ns,
                           "static": rewritten})
            continue
        entries[PurePosixPath(rel).as_posix()] = (
            "passthrough", {"size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "source": src})
    for f in engine.out_files:
        if f.name in entries:
            log.warning("base file %s is shadowed by the merged weight file", f.name)
        entries[f.name] = ("weights", {"size_bytes": f.size_bytes, "mtime_ns": weights_mtime_ns,
                                       "weights": weight_file(engine, f, key_of)})
    if engine.index_json is not None:
        entries[INDEX_NAME] = ("static", {"size_bytes": len(engine.index_json),
                                          "mtime_ns": weights_mtime_ns,
                                          "static": engine.index_json})
    return entries


class View:
    """The virtual directory over a session. Thread-safe."""

    def __init__(self, session: Session, cache: UnitCache, *, readahead_units: int = 4,
                 readahead_threads: int = 2, readahead_pending: int = 16) -> None:
        self.session = session
        self.engine = session.engine
        self.cache = cache
        self.units = UnitReader(session, cache, readahead_units=readahead_units,
                                readahead_threads=readahead_threads,
                                readahead_pending=readahead_pending)
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
        self._fast_read_calls = 0  # read_cached's own counters (one thread, no lock)
        self._fast_served_bytes = 0
        self.passthrough_file_bytes_read = 0
        self.read_errors = 0
        self.last_errors: deque[dict[str, Any]] = deque(maxlen=LAST_ERRORS)
        self._nodes: dict[int, _Node] = {}
        self._build()
        self._warn_large_units()

    # -- building the tree ------------------------------------------------------------------
    def _build(self) -> None:
        sources = [self.session.base, *self.session.experts]
        weights_mtime = max((i.mtime_ns for c in sources for i in c.identities.values()),
                            default=0)
        mount_ns = int(self.started_unix * 1e9)
        entries = model_entries(self.engine, weights_mtime)
        entries[f"{STATE_DIR}/{STATS_NAME}"] = ("stats", {"mtime_ns": mount_ns})
        entries[f"{STATE_DIR}/{MANIFEST_NAME}"] = ("manifest", {"mtime_ns": mount_ns})
        self._nodes[ROOT_INODE] = _Node(ROOT_INODE, "", "", ROOT_INODE, "dir",
                                        mtime_ns=weights_mtime)
        self._by_path = {"": ROOT_INODE}
        self._next_inode = itertools.count(ROOT_INODE + 1)
        self._insert(entries, weights_mtime, reader=self.units)

    def _insert(self, entries: Entries, dir_mtime_ns: int, prefix: str = "",
                reader: UnitReader | None = None, variant: str = "") -> None:
        """Add ``entries`` (paths relative to ``prefix``) to the tree, in path order (inode
        numbers are stable across mounts); parents first. A new node becomes visible to
        lookups only once it is complete: entries of the root are linked last (the caller
        serialises inserts)."""
        by_path = self._by_path
        at_root: list[tuple[str, int]] = []
        full = {(f"{prefix}/{p}" if prefix else p): v for p, v in entries.items()}
        if prefix and prefix not in by_path:
            full[prefix] = ("dir", {})
        for path in sorted(full):
            parts = path.split("/")
            parent = ROOT_INODE
            for depth in range(1, len(parts)):
                dpath = "/".join(parts[:depth])
                if dpath not in by_path:
                    ino = next(self._next_inode)
                    self._nodes[ino] = _Node(ino, parts[depth - 1], dpath, parent, "dir",
                                             mtime_ns=dir_mtime_ns, variant=variant)
                    self._link(parent, parts[depth - 1], ino, at_root)
                    by_path[dpath] = ino
                parent = by_path[dpath]
            if path in by_path:
                continue
            kind, extra = full[path]
            ino = next(self._next_inode)
            if kind == "dir":
                extra = {"mtime_ns": dir_mtime_ns, **extra}
            node = _Node(ino, parts[-1], path, parent, kind, variant=variant,
                         reader=reader if kind == "weights" else None, **extra)
            self._nodes[ino] = node
            by_path[path] = ino
            self._link(parent, parts[-1], ino, at_root)
        for name, ino in at_root:
            self._nodes[ROOT_INODE].children[name] = ino

    def _link(self, parent: int, name: str, ino: int, at_root: list[tuple[str, int]]) -> None:
        if parent == ROOT_INODE:
            at_root.append((name, ino))
        else:
            self._nodes[parent].children[name] = ino

    def _warn_large_units(self) -> None:
        largest = max((s.end - s.start for n in list(self._nodes.values()) if n.weights
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
            subdirs = sum(self._nodes[c].kind == "dir" for c in list(n.children.values()))
            return Attr(inode, True, 0, stat.S_IFDIR | 0o555, 2 + subdirs, n.mtime_ns, False)
        dynamic = n.kind in DYNAMIC_KINDS
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
        size = sum(n.size_bytes for n in list(self._nodes.values()))  # (a reload adds nodes)
        return len(self._nodes), size

    # -- handles ----------------------------------------------------------------------------
    def open(self, inode: int) -> int:
        """Open a file for reading; returns a handle. Blocks (snapshots dynamic files)."""
        n = self._nodes[inode]
        if n.kind == "dir":
            raise IsADirectoryError(n.path)
        snapshot = self._snapshot(n) if n.kind in DYNAMIC_KINDS else None
        fh = next(self._fh)
        with self._lock:
            self._handles[fh] = _Handle(n, snapshot)
        return fh

    def _snapshot(self, n: _Node) -> bytes:
        """The content of a dynamic file now (blocking)."""
        if n.kind == "stats":
            return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
        return self._manifest_bytes()

    def release(self, fh: int) -> None:
        with self._lock:
            self._handles.pop(fh, None)

    def open_path(self, path: str) -> int:
        return self.open(self.inode_of(path))

    # -- reading (blocking) -----------------------------------------------------------------
    def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        """Exactly the bytes ``[offset, offset + size)`` of the file (fewer at its end); a
        memoryview (no copy) when they lie in one merge unit."""
        with self._lock:
            h = self._handles[fh]
            self.read_calls += 1
        n = h.node
        if offset < 0 or size < 0:
            raise ValueError("negative offset or size")
        data: bytes | memoryview
        try:
            if n.kind == "weights":
                assert n.weights is not None and n.reader is not None
                data = n.reader.read(n.weights, offset, offset + size, h.stream)
            elif n.kind == "passthrough":
                data = self._read_passthrough(n, offset, size)
            else:
                blob = n.static if n.kind == "static" else h.snapshot
                assert blob is not None
                data = blob[offset:offset + size]
        except Exception as exc:
            with self._lock:
                self.read_errors += 1
                self.last_errors.append({
                    "unix_time": round(time.time(), 3), "path": n.path, "offset": offset,
                    "size": size, "error": str(exc) if isinstance(exc, MergefsError)
                    else f"{type(exc).__name__}: {exc}"})
            raise
        with self._lock:
            if n.kind == "weights":
                self.served_weight_bytes += len(data)
            else:
                self.served_other_bytes += len(data)
            self._served(n, len(data))
        return data

    def _served(self, n: _Node, nbytes: int) -> None:
        """Called with ``_lock`` held after each read of a node (per-variant counters)."""

    def read_cached(self, fh: int, offset: int, size: int) -> bytes | memoryview | None:
        """The bytes of a weight-file read if they are all in memory, else None; never blocks
        and takes no lock (see :meth:`UnitReader.read_cached`). Call it from one thread only
        (the FUSE adapter's trio thread): its counters are that thread's own."""
        h = self._handles.get(fh)  # one atomic dict lookup
        if h is None or h.node.kind != "weights" or offset < 0 or size < 0:
            return None
        assert h.node.weights is not None and h.node.reader is not None
        data = h.node.reader.read_cached(h.node.weights, offset, offset + size, h.stream)
        if data is not None:
            self._fast_read_calls += 1
            self._fast_served_bytes += len(data)
            self._fast_served(h.node, len(data))
        return data

    def _fast_served(self, n: _Node, nbytes: int) -> None:
        """Called on the trio thread only, after a read served from memory (no lock)."""

    def read_path(self, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """Convenience for tests and tools: open, read, release."""
        fh = self.open_path(path)
        try:
            return bytes(self.read(fh, offset, (1 << 62) if size is None else size))
        finally:
            self.release(fh)

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

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The content of ``.mergefs/stats.json``. Byte counters count since the view was built.

        - ``served_bytes.weights`` / ``.other``: bytes ``read`` returned from weight files / from
          every other file (passthrough files, shard index, ``.mergefs/``);
        - ``physical_bytes_read[source]``: bytes ``pread`` returned from that source's weight
          files (``base``, or the expert's label: its shortest unique trailing path
          components); ``expert_bytes_read`` is their sum over experts; index
          building is not counted;
        - ``passthrough_file_bytes_read``: bytes read from the base's non-weight files;
        - ``units_merged`` / ``blocks_merged``: merge units produced by the engine / blocks
          they cover;
        - ``cache``: :class:`~mergefs.core.cache.CacheStats` (hits, misses, waits, evictions,
          bytes cached, merges in flight, disk tier);
        - ``readahead.units_scheduled``: units queued for background merging; ``units_pending``
          queued or running now; ``errors``: failed readahead merges (the reader sees the error);
        - ``kernel_pages``: units merged ahead and pushed into the kernel page cache
          (:meth:`~mergefs.mount.pages.PagePusher.stats`: bytes, calls, errors, the warm-up);
        - ``read_calls``, ``read_errors`` (reads that raised), ``last_errors`` (the newest
          ten: time, path, offset, size, cause), ``open_handles``;
        - plan facts: ``plan_hash``, ``budget_bytes``, ``planned_expert_bytes``,
          ``total_expert_bytes``; sizes: ``weight_file_bytes`` (the virtual weight files),
          ``base_tensor_bytes`` (the base's tensors).

        The only paths are the spec's own: the spec file and the base and expert paths.
        """
        s = self.session
        now = s.source_bytes()
        physical = {k: v - self._read_base.get(k, 0) for k, v in now.items()}
        plan = s.plan
        with self._lock:
            counters = {
                "served_bytes": {"weights": self.served_weight_bytes + self._fast_served_bytes,
                                 "other": self.served_other_bytes},
                "read_calls": self.read_calls + self._fast_read_calls,
                "read_errors": self.read_errors,
                "last_errors": list(self.last_errors),
                "passthrough_file_bytes_read": self.passthrough_file_bytes_read,
                "open_handles": len(self._handles),
            }
        return {
            "schema": STATS_SCHEMA,
            "mergefs_version": __version__,
            "pid": os.getpid(),
            "spec": s.spec.source,
            "method": s.spec.method,
            "sources": {"base": s.spec.base,
                        **{lab: e.path for lab, e in zip(self.engine.labels, s.spec.experts)}},
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
            "readahead": self.units.stats(),
            "kernel_pages": self.units.pages.stats(),
            "uptime_seconds": round(time.monotonic() - self._started, 3),
            **counters,
        }

    # -- the kernel page cache ----------------------------------------------------------------
    def weight_files(self) -> list[tuple[str, int, WeightFile]]:
        """(path, inode, weight file) of every weight file, in path order."""
        return [(n.path, n.inode, n.weights) for n in sorted(list(self._nodes.values()),
                                                             key=lambda n: n.path)
                if n.weights is not None]

    def enable_page_store(self, store: StoreFn) -> None:
        """Push units merged ahead of readers into the kernel page cache through
        ``store(inode, offset, data)`` (the FUSE layer's ``notify_store``)."""
        self.units.pages.enable(store, {id(wf): ino for _, ino, wf in self.weight_files()})

    def start_warm(self, lookup: Callable[[str], None], budget_bytes: int | None = None) -> None:
        """Merge (and push, when enabled) every unit of every weight file in the background, up
        to ``budget_bytes`` (default: the cache's capacity). ``lookup(path)`` stats the file
        through the mount so that the kernel knows its inode."""
        names = {id(wf): path for path, _, wf in self.weight_files()}
        self.units.pages.start_warm(
            [wf for _, _, wf in self.weight_files()],
            self.cache.capacity_bytes if budget_bytes is None else budget_bytes,
            lambda wf: lookup(names[id(wf)]))

    def disable_pages(self, timeout_seconds: float = 5.0) -> bool:
        """Stop pushing into the kernel page cache; False if a store is still waiting."""
        return self.units.pages.disable(timeout_seconds)

    def close(self) -> None:
        """Stop background readahead (running merges finish; queued ones are dropped), then
        finish the cache's queued disk writes."""
        self.units.close()
        self.cache.close()

