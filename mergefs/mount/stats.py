"""What a mount has served, and the content of its ``.mergefs/stats.json``.

:class:`ReadCounters` counts the view's reads. :func:`stats_document` lays them out with the
mount session's counters in one of two schemas, by the mount's kind: a plain spec's mount
(:func:`model_stats`: its one model's plan and counters at the top level, as ``mergefs stats``
and the tests read them) or a sweep's (:func:`sweep_stats`: ``kind: sweep``, per-variant and
shared counters, the reload state). Both have the same top-level ``served_bytes``,
``physical_bytes_read``, ``expert_bytes_read``, ``cache``, ``read_calls``, ``read_errors``,
``last_errors``, ``open_handles`` and ``uptime_seconds``.

Served bytes (:func:`served_bytes`) are what the mount handed to the kernel for readers: what
FUSE reads returned, plus the pages it pushed into the kernel's page cache, which readers get
without a FUSE read (so FUSE reads alone count less than a ``cat`` of a file reads).

Thread use: :meth:`ReadCounters.served_fast` runs on the trio thread only (no lock: its own
counters); everything else takes the counters' lock and runs anywhere.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

from mergefs.core.cache import UnitCache
from mergefs.core.errors import MergefsError
from mergefs.core.version import __version__
from mergefs.mount.session import ROOT, MountSession

STATS_SCHEMA = 1
LAST_ERRORS = 10  # read errors kept (newest last) for `mergefs stats`


class ReadCounters:
    """The view's reads: bytes served (weight files / other files, and per variant), calls,
    errors (the newest ten, with their cause), bytes read from the base's non-weight files."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.weight_bytes = 0
        self.other_bytes = 0
        self.calls = 0
        self.errors = 0
        self.passthrough_file_bytes = 0
        self.last_errors: deque[dict[str, Any]] = deque(maxlen=LAST_ERRORS)
        self._by_variant: dict[str, int] = {}
        self._fast_calls = 0  # served_fast's own (one thread, no lock)
        self._fast_bytes = 0
        self._fast_by_variant: dict[str, int] = {}

    def called(self) -> None:
        with self._lock:
            self.calls += 1

    def served(self, variant: str | None, weights: bool, nbytes: int) -> None:
        """A read returned ``nbytes`` of a variant's file (None: the mount's own files)."""
        with self._lock:
            if weights:
                self.weight_bytes += nbytes
            else:
                self.other_bytes += nbytes
            if variant is not None:
                self._by_variant[variant] = self._by_variant.get(variant, 0) + nbytes

    def served_fast(self, variant: str | None, nbytes: int) -> None:
        """A weight-file read answered from memory on the trio thread (the only caller)."""
        self._fast_calls += 1
        self._fast_bytes += nbytes
        if variant is not None:
            self._fast_by_variant[variant] = self._fast_by_variant.get(variant, 0) + nbytes

    def failed(self, path: str, offset: int, size: int, exc: BaseException, unix_time: float
               ) -> None:
        with self._lock:
            self.errors += 1
            self.last_errors.append({
                "unix_time": round(unix_time, 3), "path": path, "offset": offset, "size": size,
                "error": str(exc) if isinstance(exc, MergefsError)
                else f"{type(exc).__name__}: {exc}"})

    def passthrough(self, nbytes: int) -> None:
        with self._lock:
            self.passthrough_file_bytes += nbytes

    def by_variant(self) -> dict[str, int]:
        """Bytes served per variant (from its directory), both paths."""
        with self._lock:
            out = dict(self._by_variant)
        for name, n in list(self._fast_by_variant.items()):
            out[name] = out.get(name, 0) + n
        return out

    def to_json(self, open_handles: int) -> dict[str, Any]:
        """The counters; ``served_bytes`` has the FUSE reads only (:func:`served_bytes` adds
        the pushed pages)."""
        with self._lock:
            return {
                "served_bytes": {"weights_fuse_reads": self.weight_bytes + self._fast_bytes,
                                 "other": self.other_bytes},
                "read_calls": self.calls + self._fast_calls,
                "read_errors": self.errors,
                "last_errors": list(self.last_errors),
                "passthrough_file_bytes_read": self.passthrough_file_bytes,
                "open_handles": open_handles,
            }


def served_bytes(fuse_reads: dict[str, int], pushed_bytes: int) -> dict[str, int]:
    """``served_bytes`` of stats.json, one meaning per key:

    - ``weights_fuse_reads``: bytes FUSE read requests of weight files returned;
    - ``weights_pushed``: bytes of weight files pushed into the kernel's page cache
      (``kernel_pages.stored_bytes``): readers get them without a FUSE read;
    - ``weights``: the two together, every weight byte the mount handed to the kernel. One
      read of a whole file counts at least its size; a page is counted twice when it was
      handed over twice (pushed with each unit on its boundary, or pushed while the kernel was
      also reading it), and a read the kernel answers from its page cache again is not seen;
    - ``other``: bytes FUSE read requests of every other file returned (nothing else is
      pushed).
    """
    weights = fuse_reads["weights_fuse_reads"]
    return {"weights": weights + pushed_bytes, "weights_fuse_reads": weights,
            "weights_pushed": pushed_bytes, "other": fuse_reads["other"]}


def stats_document(mount: MountSession, cache: UnitCache, reads: dict[str, Any],
                   read_by: dict[str, int], pushed_by: dict[str, int],
                   physical: dict[str, int], uptime_seconds: float,
                   reader_stats: dict[str, dict[str, Any]], pages: dict[str, Any],
                   reload_state: dict[str, Any]) -> dict[str, Any]:
    """The content of ``.mergefs/stats.json``: ``reads`` is :meth:`ReadCounters.to_json`,
    ``read_by`` :meth:`ReadCounters.by_variant` (FUSE reads), ``pushed_by`` the bytes pushed
    into the page cache by variant (:meth:`~mergefs.mount.pages.PagePusher.stored_by_variant`),
    ``physical`` the bytes read per source since the mount session opened its variants,
    ``reader_stats`` each variant's readahead counters, ``pages`` the page pusher's."""
    common = {
        "schema": STATS_SCHEMA, "mergefs_version": __version__, "pid": os.getpid(),
        "physical_bytes_read": physical,
        "expert_bytes_read": sum(v for k, v in physical.items() if k != "base"),
        "cache": cache.stats().to_json(), "uptime_seconds": round(uptime_seconds, 3), **reads,
        "served_bytes": served_bytes(reads["served_bytes"], pages["stored_bytes"]),
    }
    if not mount.sweep:
        return {**common, **model_stats(mount, reader_stats[ROOT], pages)}
    served_by = {name: read_by.get(name, 0) + pushed_by.get(name, 0)
                 for name in {*read_by, *pushed_by}}
    return {**common, **sweep_stats(mount, served_by, reload_state, common)}


def model_stats(mount: MountSession, readahead: dict[str, Any], pages: dict[str, Any]
                ) -> dict[str, Any]:
    """A plain spec's mount (besides the common keys):

    - ``physical_bytes_read[source]``: bytes ``pread`` returned from that source's weight files
      (``base``, or the expert's label: its shortest unique trailing path components);
      ``expert_bytes_read`` is their sum over experts; index building is not counted;
    - ``served_bytes``: :func:`served_bytes`: ``weights`` = ``weights_fuse_reads`` (FUSE reads
      of weight files) + ``weights_pushed`` (pages pushed into the kernel page cache);
      ``other``: FUSE reads of every other file (passthrough files, shard index, ``.mergefs/``);
    - ``passthrough_file_bytes_read``: bytes read from the base's non-weight files;
    - ``units_merged`` / ``blocks_merged``: merge units produced by the engine / blocks they
      cover;
    - ``cache``: :class:`~mergefs.core.cache.CacheStats` (hits, misses, waits, evictions, bytes
      cached, merges in flight, disk tier);
    - ``readahead.units_scheduled``: units queued for background merging; ``units_pending``
      queued or running now; ``errors``: failed readahead merges (the reader sees the error);
    - ``kernel_pages``: units merged ahead and pushed into the kernel page cache
      (:meth:`~mergefs.mount.pages.PagePusher.stats`: bytes, calls, errors, the warm-up);
    - ``read_calls``, ``read_errors`` (reads that raised), ``last_errors`` (the newest ten:
      time, path, offset, size, cause), ``open_handles``;
    - plan facts: ``plan_hash``, ``budget_bytes``, ``planned_expert_bytes``,
      ``total_expert_bytes``; sizes: ``weight_file_bytes`` (the virtual weight files),
      ``base_tensor_bytes`` (the base's tensors).

    The only paths are the spec's own: the spec file and the base and expert paths.
    """
    s = mount.variants[ROOT].session
    plan, engine = s.plan, s.engine
    return {
        "spec": s.spec.source,
        "method": s.spec.method,
        "sources": {"base": s.spec.base,
                    **{lab: e.path for lab, e in zip(engine.labels, s.spec.experts)}},
        "plan_hash": plan.plan_hash,
        "budget_bytes": plan.budget_bytes,
        "planned_expert_bytes": plan.planned_bytes,
        "total_expert_bytes": plan.total_expert_bytes,
        "weight_file_bytes": sum(f.size_bytes for f in engine.out_files),
        "base_tensor_bytes": sum(t.size_bytes for t in s.base.tensors.values()),
        "units_merged": engine.units_merged,
        "blocks_merged": engine.blocks_merged,
        "readahead": readahead,
        "kernel_pages": pages,
    }


def sweep_stats(mount: MountSession, served_by: dict[str, int], reload_state: dict[str, Any],
                common: dict[str, Any]) -> dict[str, Any]:
    """A sweep's mount (``kind: sweep``; besides the common keys, which count all variants):

    - ``variants[name]``: ``served_bytes`` (bytes of the variant's directory handed to the
      kernel: FUSE reads plus pages pushed into its page cache, as :func:`served_bytes`),
      ``units_merged`` / ``blocks_merged`` (by its own engine), ``units_shared`` (units it was
      served from another variant's merge), ``units_from_disk_cache``,
      ``requested_bytes_read[source]`` (source bytes its merges asked for, whether the shared
      source cache or the disk answered), its plan (``method``, ``plan_hash``,
      ``budget_bytes``, ``planned_expert_bytes``, ``total_expert_bytes``), ``removed``;
    - ``shared``: ``physical_bytes_read[source]`` (bytes pread from each source for all
      variants together; index building not counted), ``expert_bytes_read`` (their sum over
      experts), ``source_cache`` (:class:`~mergefs.sources.blockcache.SourceBlockCache`
      counters; null when disabled), ``cache`` (the merged-unit cache), ``units_merged``,
      ``units_shared``;
    - ``spec`` (the spec file), ``reload`` (``generation`` and the ``last`` outcome).
    """
    variants = {}
    for name, st in list(mount.variants.items()):
        totals = mount.variant_totals(st)
        plan = st.session.plan
        variants[name] = {
            "served_bytes": served_by.get(name, 0),
            "units_merged": totals["units_merged"], "blocks_merged": totals["blocks_merged"],
            "units_shared": totals["units_shared"],
            "units_from_disk_cache": totals["units_from_disk_cache"],
            "requested_bytes_read": totals["requested_bytes_read"],
            "method": st.spec.method, "plan_hash": plan.plan_hash,
            "budget_bytes": plan.budget_bytes,
            "planned_expert_bytes": totals["expert_bytes_planned"],
            "total_expert_bytes": totals["total_expert_bytes"], "removed": st.removed}
    return {"kind": "sweep", "spec": str(mount.spec_path), "variants": variants,
            "reload": dict(reload_state),
            "shared": {
                "physical_bytes_read": common["physical_bytes_read"],
                "expert_bytes_read": common["expert_bytes_read"],
                "source_cache": mount.source_cache.stats() if mount.source_cache else None,
                "cache": common["cache"],
                "units_merged": sum(v["units_merged"] for v in variants.values()),
                "units_shared": sum(v["units_shared"] for v in variants.values()),
            }}
