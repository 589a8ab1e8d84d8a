"""The virtual directory of a sweep mount: one model directory per variant, FUSE-free.

::

    MNT/variants.json           every variant: name, the settings it varies, its full resolved
                                spec, its plan (hash, budget, planned bytes, bound), removed flag
    MNT/<variant>/...           a Hugging Face model directory (what ``from_pretrained`` loads),
                                byte-identical to ``mergefs merge --variant <variant>``
    MNT/.mergefs/stats.json     per-variant and shared counters (:meth:`SweepView.stats`)
    MNT/.mergefs/manifest.jsonl the sweep manifest so far (complete lines)

Every variant's weight files are served by its own :class:`VariantReader` over its own session,
all sharing one :class:`~mergefs.core.cache.UnitCache` keyed by content
(:func:`~mergefs.mount.sweepsession.unit_key_of`) and the sweep's shared source-block cache.
:meth:`SweepView.reload` adds the variants a changed spec file lists as new directories while
readers of the others keep reading; variants the file no longer lists keep being served (and are
flagged ``removed`` in variants.json) until unmounted: a reader of one is never cut off.

Thread use: as :mod:`mergefs.mount.view` (namespace calls on the trio thread; ``open``, ``read`` and
``reload`` in worker threads).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mergefs.core.version import __version__
from mergefs.core.cache import UnitCache
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.mount.pages import StoreFn
from mergefs.mount.sweepsession import SweepSession, VariantRecorder, VariantState
from mergefs.mount.files import Segment, Stream, UnitReader, WeightFile
from mergefs.mount.view import (
    LAST_ERRORS, MANIFEST_NAME, ROOT_INODE, STATE_DIR, STATS_NAME, STATS_SCHEMA, View, _Handle,
    _Node, model_entries,
)

log = logging.getLogger(__name__)

VARIANTS_NAME = "variants.json"


class VariantReader(UnitReader):
    """A variant's unit reader: units another variant merged are recorded for this one too
    (an output record marked shared), and the in-memory fast path serves only units already
    recorded for this variant (the first serving of a shared unit takes the worker path)."""

    def __init__(self, state: VariantState, cache: UnitCache, source_cache: Any = None,
                 **options: Any) -> None:
        super().__init__(state.session, cache, **options)
        self.recorder: VariantRecorder = state.recorder
        self.source_cache = source_cache

    def segment_bytes(self, wf: WeightFile, seg: Segment) -> bytes:
        try:
            data = super().segment_bytes(wf, seg)
        except SourceChanged:
            # the shared source blocks may hold the changed bytes: dropped, so that a source
            # restored to its indexed bytes is served again (as a plain mount recovers)
            if self.source_cache is not None:
                self.source_cache.clear()
            raise
        if seg.merged and seg.tensor is not None:
            self.recorder.note_served(seg.key, seg.tensor, seg.b0, seg.b1,
                                      seg.start - seg.tensor_start, seg.end - seg.tensor_start,
                                      data)
        return data

    def read_cached(self, wf: WeightFile, start: int, end: int, stream: Stream | None = None
                    ) -> bytes | memoryview | None:
        recorded = self.recorder.recorded

        def lookup(key: str) -> bytes | None:
            return self.cache.peek(key) if key in recorded else None

        out = self._assemble(wf, start, end, lookup)
        if out is not None and stream is not None and len(out):
            self._noted(wf, stream, start, start + len(out), wf.index_at(start + len(out) - 1))
        return out


class SweepView(View):
    """The sweep mount's tree over a :class:`SweepSession`. Thread-safe."""

    def __init__(self, sweep: SweepSession, cache: UnitCache, *, readahead_units: int = 4,
                 readahead_threads: int = 2, readahead_pending: int = 16) -> None:
        # View.__init__ is for one session; the same state, for many:
        self.sweep = sweep
        self.cache = cache
        self._reader_options = {"readahead_units": readahead_units,
                                "readahead_threads": readahead_threads,
                                "readahead_pending": readahead_pending}
        self._lock = threading.Lock()
        self._insert_lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._fh = itertools.count(1)
        self.started_unix = time.time()
        self._started = time.monotonic()
        self.served_weight_bytes = 0
        self.served_other_bytes = 0
        self.read_calls = 0
        self._fast_read_calls = 0
        self._fast_served_bytes = 0
        self.passthrough_file_bytes_read = 0
        self.read_errors = 0
        self.last_errors: deque[dict[str, Any]] = deque(maxlen=LAST_ERRORS)
        self._served_by: dict[str, int] = {}  # under _lock
        self._fast_by: dict[str, int] = {}  # trio thread only
        self.readers: dict[str, VariantReader] = {}
        self._store: StoreFn | None = None
        self.reload_state: dict[str, Any] = {"generation": 0, "last": None}
        self._nodes: dict[int, _Node] = {}
        sources = [sweep.base, *sweep.experts]
        self._weights_mtime = max((i.mtime_ns for c in sources for i in c.identities.values()),
                                  default=0)
        mount_ns = int(self.started_unix * 1e9)
        self._nodes[ROOT_INODE] = _Node(ROOT_INODE, "", "", ROOT_INODE, "dir",
                                        mtime_ns=self._weights_mtime)
        self._by_path = {"": ROOT_INODE}
        self._next_inode = itertools.count(ROOT_INODE + 1)
        self._insert({VARIANTS_NAME: ("variants", {"mtime_ns": mount_ns}),
                      f"{STATE_DIR}/{STATS_NAME}": ("stats", {"mtime_ns": mount_ns}),
                      f"{STATE_DIR}/{MANIFEST_NAME}": ("manifest", {"mtime_ns": mount_ns})},
                     self._weights_mtime)
        for st in sweep.variants.values():
            self._add(st)
        self._warn_large_units()

    # -- variants ---------------------------------------------------------------------------
    def _add(self, st: VariantState) -> None:
        reader = VariantReader(st, self.cache, self.sweep.source_cache, **self._reader_options)
        entries = model_entries(st.session.engine, self._weights_mtime, st.key_of)
        with self._insert_lock:
            self.readers[st.name] = reader
            self._insert(entries, self._weights_mtime, prefix=st.name, reader=reader,
                         variant=st.name)
            if self._store is not None:
                reader.pages.enable(self._store, self._inodes_of(reader))

    def _inodes_of(self, reader: UnitReader) -> dict[int, int]:
        return {id(n.weights): n.inode for n in list(self._nodes.values())
                if n.weights is not None and n.reader is reader}

    def reload(self) -> dict[str, Any]:
        """Re-read the spec file and add its new variants (blocking: a worker thread). Returns
        the outcome (also in stats.json ``reload.last``); an invalid spec changes nothing."""
        gen = self.reload_state["generation"] + 1
        try:
            opened, removed = self.sweep.reload()
            for st in opened:
                self._add(st)
                st.recorder.publish()
        except Exception as exc:  # a reload must never take the mount down (logged)
            why = str(exc) if isinstance(exc, MergefsError) else f"{type(exc).__name__}: {exc}"
            log.error("reload of %s failed, the mount is unchanged: %s", self.sweep.spec_path,
                      why, exc_info=not isinstance(exc, MergefsError))
            last: dict[str, Any] = {"ok": False, "error": why, "added": [], "removed": []}
        else:
            added = [st.name for st in opened]
            log.info("reloaded %s: %d variants added (%s), %d no longer listed (still served "
                     "until unmounted: %s)", self.sweep.spec_path, len(added),
                     ", ".join(added) or "-", len(removed), ", ".join(removed) or "-")
            last = {"ok": True, "error": None, "added": added, "removed": removed}
        last["unix_time"] = round(time.time(), 3)
        self.reload_state = {"generation": gen, "last": last}
        return last

    def variants_doc(self) -> dict[str, Any]:
        return {"schema": 1, "spec": str(self.sweep.spec_path),
                "reload_generation": self.reload_state["generation"],
                "variants": [st.describe() for st in list(self.sweep.variants.values())]}

    # -- View hooks --------------------------------------------------------------------------
    def _snapshot(self, n: _Node) -> bytes:
        if n.kind == "variants":
            return (json.dumps(self.variants_doc(), indent=1, sort_keys=True) + "\n").encode()
        return super()._snapshot(n)

    def _manifest_bytes(self) -> bytes:
        path = self.sweep.manifest.path
        if path is None:
            return self.sweep.manifest.text().encode()
        with open(path, "rb") as f:
            blob = f.read()
        return blob[:blob.rfind(b"\n") + 1]

    def _served(self, n: _Node, nbytes: int) -> None:
        if n.variant:
            self._served_by[n.variant] = self._served_by.get(n.variant, 0) + nbytes

    def _fast_served(self, n: _Node, nbytes: int) -> None:
        self._fast_by[n.variant] = self._fast_by.get(n.variant, 0) + nbytes

    # -- stats ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``.mergefs/stats.json`` of a sweep mount (``kind: sweep``). Byte counters count
        since the mount started.

        - ``variants[name]``: ``served_bytes`` (bytes read from the variant's directory),
          ``units_merged`` / ``blocks_merged`` (by its own engine), ``units_shared`` (units it
          was served from another variant's merge), ``requested_bytes_read[source]`` (source
          bytes its merges asked for, whether the shared source cache or the disk answered),
          its plan (``plan_hash``, ``budget_bytes``, ``planned_expert_bytes``,
          ``total_expert_bytes``), ``removed``;
        - ``shared``: ``physical_bytes_read[source]`` (bytes pread from each source for all
          variants together; index building not counted), ``expert_bytes_read`` (their sum over
          experts), ``source_cache`` (:class:`~mergefs.sources.blockcache.SourceBlockCache` counters; null
          when disabled), ``cache`` (the merged-unit cache), ``units_merged``, ``units_shared``;
        - the mount's ``served_bytes``, ``read_calls``, ``read_errors``, ``last_errors``,
          ``open_handles``, ``reload`` (``generation`` and the ``last`` outcome).
        """
        sweep = self.sweep
        with self._lock:
            served = dict(self._served_by)
            counters = {
                "served_bytes": {"weights": self.served_weight_bytes + self._fast_served_bytes,
                                 "other": self.served_other_bytes},
                "read_calls": self.read_calls + self._fast_read_calls,
                "read_errors": self.read_errors,
                "last_errors": list(self.last_errors),
                "passthrough_file_bytes_read": self.passthrough_file_bytes_read,
                "open_handles": len(self._handles),
            }
        for name, n in list(self._fast_by.items()):
            served[name] = served.get(name, 0) + n
        variants = {}
        for name, st in list(sweep.variants.items()):
            totals = sweep.variant_totals(st)
            variants[name] = {
                "served_bytes": served.get(name, 0),
                "units_merged": totals["units_merged"], "blocks_merged": totals["blocks_merged"],
                "units_shared": totals["units_shared"],
                "units_from_disk_cache": totals["units_from_disk_cache"],
                "requested_bytes_read": totals["requested_bytes_read"],
                "method": st.spec.method, "plan_hash": st.session.plan.plan_hash,
                "budget_bytes": st.session.plan.budget_bytes,
                "planned_expert_bytes": totals["expert_bytes_planned"],
                "total_expert_bytes": totals["total_expert_bytes"], "removed": st.removed}
        physical = sweep.source_bytes()
        shared = {
            "physical_bytes_read": physical,
            "expert_bytes_read": sum(v for k, v in physical.items() if k != "base"),
            "source_cache": sweep.source_cache.stats() if sweep.source_cache else None,
            "cache": self.cache.stats().to_json(),
            "units_merged": sum(v["units_merged"] for v in variants.values()),
            "units_shared": sum(v["units_shared"] for v in variants.values()),
        }
        return {
            "schema": STATS_SCHEMA, "kind": "sweep", "mergefs_version": __version__,
            "pid": os.getpid(), "spec": str(sweep.spec_path),
            "variants": variants, "shared": shared,
            "physical_bytes_read": physical, "expert_bytes_read": shared["expert_bytes_read"],
            "cache": shared["cache"], "reload": dict(self.reload_state),
            "uptime_seconds": round(time.monotonic() - self._started, 3),
            **counters,
        }

    # -- the kernel page cache ----------------------------------------------------------------
    def enable_page_store(self, store: StoreFn) -> None:
        with self._insert_lock:
            self._store = store
            for reader in self.readers.values():
                reader.pages.enable(store, self._inodes_of(reader))

    def start_warm(self, lookup: Callable[[str], None], budget_bytes: int | None = None) -> None:
        """Warm every variant, each up to its share of the budget (default: the cache)."""
        files = self.weight_files()
        names = {id(wf): path for path, _, wf in files}
        total = self.cache.capacity_bytes if budget_bytes is None else budget_bytes
        share = total // max(1, len(self.readers))
        for reader in list(self.readers.values()):
            mine = [wf for _, _, wf in files
                    if any(n.weights is wf and n.reader is reader for n in self._nodes.values())]
            reader.pages.start_warm(mine, share, lambda wf: lookup(names[id(wf)]))

    def disable_pages(self, timeout_seconds: float = 5.0) -> bool:
        drained = [r.pages.disable(timeout_seconds) for r in list(self.readers.values())]
        return all(drained)  # every reader disabled, even after one that timed out

    def close(self) -> None:
        for reader in list(self.readers.values()):
            reader.close()
        self.cache.close()
