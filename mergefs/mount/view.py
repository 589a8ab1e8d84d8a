"""The virtual directory of a mount, independent of FUSE (the adapter is ``mergefs.mount.fuse``).

A :class:`View` over a :class:`~mergefs.mount.session.MountSession` shows each variant it serves
as a Hugging Face model directory (what ``from_pretrained`` loads), byte-identical to ``mergefs
merge`` of that variant:

- the base's non-weight files (config, tokenizer, ...), passed through from the base directory
  (a file that changed since the mount started is refused with :class:`SourceChanged`), or
  rewritten by the merge;
- weight files mirroring the base's sharding (``Engine.out_files``): a synthesized safetensors
  header followed by the merged tensors, byte-identical to ``Engine.materialise``;
- ``model.safetensors.index.json`` when the base is sharded.

A plain spec's one model is that directory at the mount's root; a sweep's variants are one
directory each, ``MNT/<variant>/``, beside ``MNT/variants.json`` (every variant: name, the
settings it varies, its full resolved spec, its plan, removed flag). Either way the root has a
hidden ``.mergefs/`` directory with ``stats.json`` (live counters, :mod:`mergefs.mount.stats`)
and ``manifest.jsonl`` (the mount's manifest so far, complete lines only). :meth:`View.reload`
adds the variants a sweep's changed spec file lists as new directories while readers of the
others keep reading; variants the file no longer lists keep being served (and are flagged
``removed`` in variants.json) until unmounted: a reader of one is never cut off.

Every size, inode number and attribute is fixed when a file is added, without merging
anything, except the dynamic files (``.mergefs/*``, ``variants.json``), whose content is
snapshotted when opened (their size reads as 0: open them with direct I/O). ``read(fh, offset,
size)`` maps a byte range of a weight file to the header and the merge units it overlaps and
merges only those (the variant's :class:`~mergefs.mount.files.UnitReader`, through the mount's
one :class:`~mergefs.core.cache.UnitCache`), returning exactly those bytes; each open handle is a
:class:`~mergefs.mount.files.Stream`, so a sequential reader gets the next units merged in the
background.

Thread use: ``lookup``, ``getattr``, ``readdir``, ``release``, ``attr`` and ``read_cached`` only
touch in-memory tables and are safe on the trio thread. ``open`` (snapshots, may read the
manifest file), ``read`` (merges, disk reads, waits for other threads) and ``reload`` (opens
and plans variants) block: run them in worker threads.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from mergefs.core.cache import UnitCache
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.engine.merger import Engine
from mergefs.mount.files import Stream, UnitReader, WeightFile, weight_file
from mergefs.mount.pages import PagePusher, StoreFn
from mergefs.mount.session import KeyFn, MountSession, VariantState
from mergefs.mount.stats import ReadCounters, stats_document
from mergefs.sources.base import CONFIG_NAME, INDEX_NAME

log = logging.getLogger(__name__)

ROOT_INODE = 1
STATE_DIR = ".mergefs"
STATS_NAME = "stats.json"
MANIFEST_NAME = "manifest.jsonl"
VARIANTS_NAME = "variants.json"

Kind = Literal["dir", "weights", "passthrough", "static", "stats", "manifest", "variants"]
#: kinds whose content changes while mounted: snapshotted at open, size 0 (direct I/O)
DYNAMIC_KINDS = frozenset({"stats", "manifest", "variants"})
#: the auto warm-up starts once a variant's readers have read this many different tensors (a
#: loader of the whole model reads every tensor; inspecting one or a few never starts it)
AUTO_WARM_TENSORS = 8


def auto_warm_tensors(merged_tensors: int) -> int:
    """How many different tensors a variant's readers read before its auto warm-up starts:
    :data:`AUTO_WARM_TENSORS`, or half of a smaller model's merged tensors (at least 2)."""
    return max(2, min(AUTO_WARM_TENSORS, merged_tensors // 2))
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
    variant: str | None = None  # the variant the node belongs to (None: the mount's own files)


@dataclass
class _Handle:
    node: _Node
    snapshot: bytes | None  # dynamic files: the content when opened
    stream: Stream = field(default_factory=Stream)


def model_entries(engine: Engine, weights_mtime_ns: int, key_of: KeyFn | None = None,
                  name: str = "") -> Entries:
    """The files of a merged model directory by relative path, as ``Engine.materialise``
    writes them: the base's non-weight files (passed through, or rewritten by the merge), the
    model card of a model named ``name`` (the mountpoint's or variant directory's base name),
    the merge's weight files and shard index; ``key_of``: the cache keys of merge units
    (:func:`~mergefs.mount.files.weight_file`)."""
    base = engine.base
    entries: Entries = {}
    added = {**engine.extra_overrides, **engine.card_files(name)}
    for rel, data in added.items():  # files the merge adds (tokenizer, model card)
        if rel not in base.extra_files or rel in engine.extra_hidden:
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
    """The virtual directory over a mount session. Thread-safe."""

    def __init__(self, mount: MountSession, cache: UnitCache, *, readahead_units: int = 4,
                 readahead_threads: int = 2, readahead_pending: int = 16,
                 name: str = "") -> None:
        """``name``: the model's name in its card (a plain mount's: the mountpoint's base name;
        a sweep's variants are named by their directories)."""
        self.mount = mount
        self.name = name
        self.cache = cache
        self._reader_options = {"readahead_units": readahead_units,
                                "readahead_threads": readahead_threads,
                                "readahead_pending": readahead_pending}
        self.pages = PagePusher(cache)
        self.readers: dict[str, UnitReader] = {}  # by variant
        self.counters = ReadCounters()
        self.reload_state: dict[str, Any] = {"generation": 0, "last": None}
        self._lock = threading.Lock()  # handles
        self._insert_lock = threading.Lock()  # the tree's inserts (a reload adds variants)
        self._handles: dict[int, _Handle] = {}
        self._warm_started: set[str] = set()  # variants whose warm-up has started
        self._auto_warm: Callable[[str], None] | None = None  # armed: arm_auto_warm's lookup
        self._fh = itertools.count(1)
        self.started_unix = time.time()
        self._started = time.monotonic()
        self._nodes: dict[int, _Node] = {}
        self._weights_mtime = max((i.mtime_ns for c in [mount.base, *mount.experts]
                                   for i in c.identities.values()), default=0)
        self._nodes[ROOT_INODE] = _Node(ROOT_INODE, "", "", ROOT_INODE, "dir",
                                        mtime_ns=self._weights_mtime)
        self._by_path = {"": ROOT_INODE}
        self._next_inode = itertools.count(ROOT_INODE + 1)
        mount_ns = int(self.started_unix * 1e9)
        state: Entries = {f"{STATE_DIR}/{STATS_NAME}": ("stats", {"mtime_ns": mount_ns}),
                          f"{STATE_DIR}/{MANIFEST_NAME}": ("manifest", {"mtime_ns": mount_ns})}
        if mount.sweep:
            state[VARIANTS_NAME] = ("variants", {"mtime_ns": mount_ns})
        self._insert(state, self._weights_mtime)
        for st in mount.variants.values():
            self._add(st)
        self._warn_large_units()

    # -- building the tree ------------------------------------------------------------------
    def _add(self, st: VariantState) -> None:
        """Serve a variant: its model directory at ``st.name`` (a plain spec's: the root)."""
        reader = UnitReader(st, self.cache, source_cache=self.mount.source_cache,
                            reached=self._reached_by(st.name), merged_ahead=self.pages.push,
                            **self._reader_options)
        entries = model_entries(st.session.engine, self._weights_mtime, st.key_of,
                                name=st.name if self.mount.sweep else self.name)
        with self._insert_lock:
            self.readers[st.name] = reader
            self._insert(entries, self._weights_mtime, prefix=st.name, reader=reader,
                         variant=st.name)
            self.pages.add_inodes({id(n.weights): n.inode for n in list(self._nodes.values())
                                   if n.weights is not None and n.reader is reader}, st.name)

    def _insert(self, entries: Entries, dir_mtime_ns: int, prefix: str = "",
                reader: UnitReader | None = None, variant: str | None = None) -> None:
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

    # -- variants ---------------------------------------------------------------------------
    def reload(self) -> dict[str, Any]:
        """Re-read a sweep's spec file and add its new variants (blocking: a worker thread).
        Returns the outcome (also in stats.json ``reload.last``); an invalid spec changes
        nothing."""
        gen = self.reload_state["generation"] + 1
        try:
            opened, removed = self.mount.reload()
            for st in opened:
                self._add(st)
                self.mount.publish(st)
        except Exception as exc:  # a reload must never take the mount down (logged)
            why = str(exc) if isinstance(exc, MergefsError) else f"{type(exc).__name__}: {exc}"
            log.error("reload of %s failed, the mount is unchanged: %s", self.mount.spec_path,
                      why, exc_info=not isinstance(exc, MergefsError))
            last: dict[str, Any] = {"ok": False, "error": why, "added": [], "removed": []}
        else:
            added = [st.name for st in opened]
            log.info("reloaded %s: %d variants added (%s), %d no longer listed (still served "
                     "until unmounted: %s)", self.mount.spec_path, len(added),
                     ", ".join(added) or "-", len(removed), ", ".join(removed) or "-")
            last = {"ok": True, "error": None, "added": added, "removed": removed}
        last["unix_time"] = round(time.time(), 3)
        self.reload_state = {"generation": gen, "last": last}
        return last

    def variants_doc(self) -> dict[str, Any]:
        """The content of a sweep's ``variants.json``."""
        return {"schema": 1, "spec": str(self.mount.spec_path),
                "reload_generation": self.reload_state["generation"],
                "variants": [st.describe() for st in list(self.mount.variants.values())]}

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
        lookup = self._auto_warm
        if (lookup is not None and n.name == CONFIG_NAME and n.variant is not None
                and n.variant not in self._warm_started and n.variant in self.readers):
            # a loader's first step (from_pretrained, vLLM): merging starts while it builds
            # the model, before its first weight read
            log.info("%s read: merging the model ahead (auto warm-up; --warm off turns it off)",
                     n.path)
            self.start_warm(lookup, variants=[n.variant])
        fh = next(self._fh)
        with self._lock:
            self._handles[fh] = _Handle(n, snapshot)
        return fh

    def _snapshot(self, n: _Node) -> bytes:
        """The content of a dynamic file now (blocking)."""
        if n.kind == "stats":
            return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
        if n.kind == "variants":
            return (json.dumps(self.variants_doc(), indent=1, sort_keys=True) + "\n").encode()
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
        h = self._handles[fh]  # (one atomic dict lookup; KeyError: not open)
        self.counters.called()
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
            self.counters.failed(n.path, offset, size, exc, time.time())
            raise
        self.counters.served(n.variant, n.kind == "weights", len(data))
        return data

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
            self.counters.served_fast(h.node.variant, len(data))
        return data

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
        self.counters.passthrough(len(data))
        return data

    def _manifest_bytes(self) -> bytes:
        m = self.mount.manifest
        if m is None:
            return b""
        if m.path is None:
            return m.text().encode()
        with open(m.path, "rb") as f:
            blob = f.read()
        return blob[:blob.rfind(b"\n") + 1]  # complete lines only

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The content of ``.mergefs/stats.json`` (:func:`~mergefs.mount.stats.stats_document`).
        Byte counters count since the view was built; source bytes since the mount session
        opened its variants."""
        with self._lock:
            handles = len(self._handles)
        return stats_document(
            self.mount, self.cache, self.counters.to_json(handles), self.counters.by_variant(),
            self.pages.stored_by_variant(), self.mount.source_bytes(),
            time.monotonic() - self._started,
            {name: r.stats() for name, r in list(self.readers.items())}, self.pages.stats(),
            self.reload_state)

    # -- the kernel page cache ----------------------------------------------------------------
    def weight_files(self) -> list[tuple[str, int, WeightFile]]:
        """(path, inode, weight file) of every weight file, in path order."""
        nodes = list(self._nodes.values())  # a snapshot: a reload may add nodes meanwhile
        return [(n.path, n.inode, n.weights) for n in sorted(nodes, key=lambda n: n.path)
                if n.weights is not None]

    def enable_page_store(self, store: StoreFn) -> None:
        """Push units merged ahead of readers into the kernel page cache through
        ``store(inode, offset, data)`` (the FUSE layer's ``notify_store``)."""
        self.pages.enable(store)

    def start_warm(self, lookup: Callable[[str], None], budget_bytes: int | None = None,
                   variants: Iterable[str] | None = None) -> None:
        """Merge (and push, when enabled) every unit of every weight file in the background,
        each variant up to its share of ``budget_bytes`` (default: the cache's capacity; the
        share is the same whether the variants start together or one by one). ``lookup(path)``
        stats the file through the mount so that the kernel knows its inode. ``variants``: only
        these (default: all)."""
        files = self.weight_files()
        names = {id(wf): path for path, _, wf in files}
        total = self.cache.capacity_bytes if budget_bytes is None else budget_bytes
        share = total // max(1, len(self.readers))
        by_reader = {id(n.weights): n.reader for n in list(self._nodes.values())
                     if n.weights is not None}
        chosen = self.readers if variants is None else {v: self.readers[v] for v in variants}
        for name, reader in list(chosen.items()):
            with self._lock:
                if name in self._warm_started:
                    continue
                self._warm_started.add(name)
            mine = [wf for _, _, wf in files if by_reader[id(wf)] is reader]
            self.pages.start_warm(reader, mine, share, lambda wf: lookup(names[id(wf)]))

    def arm_auto_warm(self, lookup: Callable[[str], None]) -> None:
        """The default warm-up (``--warm auto``): a variant is warmed (:meth:`start_warm`) once
        its ``config.json`` is opened (the first thing ``from_pretrained`` and vLLM read) or its
        weight files have been read in :func:`auto_warm_tensors` different tensors (a loader of
        the whole model that skips the config); a reader of a few tensors starts nothing."""
        self._auto_warm = lookup

    def _reached_by(self, variant: str) -> Callable[[WeightFile, int], None]:
        """The readers' ``reached`` callback for ``variant``: the page pusher's frontier, and
        the auto warm-up's trigger. Runs on the trio thread too: no waiting (a set insert under
        a lock held for no I/O; starting the warm-up starts a thread)."""
        note = self.pages.note_reached
        touched: set[str] = set()
        needed: list[int] = []

        def reached(wf: WeightFile, end: int) -> None:
            note(wf, end)
            lookup = self._auto_warm
            if lookup is None or variant in self._warm_started or end <= 0:
                return
            seg = wf.segments[wf.index_at(end - 1)]
            if seg.tensor is None or not seg.merged:
                return
            with self._lock:
                touched.add(seg.tensor)
                if not needed:
                    needed.append(auto_warm_tensors(self.merged_tensor_count(variant)))
                go = len(touched) >= needed[0]
            if go:
                log.info("%s: a reader of %d tensors: merging the rest ahead (auto warm-up; "
                         "--warm off turns it off)", variant or "the merge", len(touched))
                self.start_warm(lookup, variants=[variant])

        return reached

    def merged_tensor_count(self, variant: str) -> int:
        """How many different merged tensors the weight files of ``variant`` hold."""
        reader = self.readers.get(variant)
        names = {s.tensor for n in list(self._nodes.values())
                 if n.weights is not None and n.reader is reader
                 for s in n.weights.segments if s.tensor is not None and s.merged}
        return len(names)

    def disable_pages(self, timeout_seconds: float = 5.0) -> bool:
        """Stop pushing into the kernel page cache; False if a store is still waiting."""
        return self.pages.disable(timeout_seconds)

    def close(self) -> None:
        """Stop the warm-up and background readahead (running merges finish; queued ones are
        dropped), then finish the cache's queued disk writes."""
        self.pages.stop()
        for reader in list(self.readers.values()):
            reader.close()
        self.cache.close()
