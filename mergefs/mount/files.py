"""Virtual weight files as a header plus merge units: byte ranges -> units -> bytes.

A :class:`WeightFile` tiles one output file (``Engine.out_files``) into segments: the
synthesized header, then each tensor's merge units in file order (block runs from
``Engine.units``, one unit per tensor for whole-tensor operators) and the tensors that pass
through from the base. A :class:`UnitReader` serves ``[start, end)`` of one variant's files
(:mod:`mergefs.mount.session`; a plain spec is a mount of one variant): it fetches exactly the
units that range overlaps through the :class:`~mergefs.core.cache.UnitCache` (a miss merges the
unit once, however many readers wait), reads pass-through tensors' bytes from the base as needed
(checked against chunk hashes taken when the variant opened: they have no index hashes), and,
when a :class:`Stream` continues, merges the next units in the background. A stream that began
inside a tensor reads ahead only within that tensor, so reading one tensor never reads another
tensor's sources. The reader tells its owner how far reads have reached and which units it
merged ahead (``reached``, ``merged_ahead``: the view hands it the page pusher's,
:mod:`mergefs.mount.pages`, which imports this module, not the other way round).

A sweep variant's reader also records, for its manifest, the units served to it from another
variant's merge (:class:`~mergefs.mount.session.VariantRecorder`), so its in-memory fast path
serves only units already recorded for it (the first serving of a shared unit takes the worker
path); a plain spec's session records its own merges, and every cached unit is served fast.

The per-request cost is O(1): a bisect to the first segment, a slice of the unit's bytes (no
copy when the range lies in one unit), and a readahead decision only when a sequential reader
enters a unit it has not entered before; nothing on the in-memory path takes a lock.

Everything here blocks (merges, disk reads, waits for other threads): worker threads only,
except :func:`assemble` and :meth:`UnitReader.read_cached`, which never block: the trio thread's
fast path.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from mergefs.core.cache import UnitCache
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.engine.layout import OutFile
from mergefs.engine.merger import Engine
from mergefs.mount.session import PASSTHROUGH_CHUNK, KeyFn, VariantState
from mergefs.sources.base import ReadRange
from mergefs.sources.blockcache import SourceBlockCache

log = logging.getLogger(__name__)

PAGE = 4096
STREAM_SLACK = 1 << 20  # reads this close to a stream's run continue it


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
    #: a key naming the unit's content (set by a sweep mount, whose variants share one cache)
    content_key: str | None = None

    @functools.cached_property
    def key(self) -> str:
        """The unit's cache key (made once: the read path looks it up on every request)."""
        if self.content_key is not None:
            return self.content_key
        return f"unit\x00{self.tensor}\x00{self.b0}\x00{self.b1}"

    @functools.cached_property
    def merged(self) -> bool:
        return self.tensor is not None and self.b0 >= 0


@dataclass(frozen=True)
class WeightFile:
    out: OutFile
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]

    @property
    def size_bytes(self) -> int:
        return self.out.size_bytes

    def index_at(self, offset: int) -> int:
        """Index of the segment holding byte ``offset``."""
        return bisect.bisect_right(self.starts, offset) - 1


def weight_file(engine: Engine, f: OutFile, key_of: KeyFn | None = None) -> WeightFile:
    """The header and every merge unit of an output file, in file order, tiling it exactly;
    ``key_of(tensor, b0, b1)``: the units' cache keys (default: by tensor and blocks)."""
    segs = [Segment(0, len(f.header), None, -1, -1, 0, len(f.header))]
    for t in f.tensors:
        if t.end == t.start:
            continue
        unit = engine.unit_of.get(t.name, t.name)  # a repeated unit (self-stack): one cache key
        if t.layout_index is None and unit not in engine.derived:  # derived: vocabulary rows
            segs.append(Segment(t.start, t.end, t.name, -1, -1, t.start, t.end))
            continue
        for b0, b1 in engine.units(unit):
            u0, u1 = engine.unit_out_range(unit, b0, b1)
            if u1 > u0:
                segs.append(Segment(t.start + u0, t.start + u1, unit, b0, b1, t.start, t.end,
                                    key_of(unit, b0, b1) if key_of is not None else None))
    pos = 0
    for s in segs:
        if s.start != pos:
            raise MergefsError(f"{f.name}: internal error: units do not tile the file at {pos}")
        pos = s.end
    if pos != f.size_bytes:
        raise MergefsError(f"{f.name}: internal error: units end at {pos}, file is "
                           f"{f.size_bytes} bytes")
    return WeightFile(f, tuple(segs), tuple(s.start for s in segs))


@dataclass
class Stream:
    """Where one reader (an open handle) has been reading: its current run of nearby reads.

    No lock: the fields are plain ints that the trio thread and worker threads may update at
    the same time. A race can only make one readahead decision early, late or twice (a unit
    merged ahead twice is merged once: the cache's single flight); it never changes a byte
    served. ``decided`` is the last segment whose readahead was decided, ``ahead`` the last
    segment readahead has handled for the current run: a sequential reader costs one
    readahead decision per unit it enters, and each unit is considered once per run.
    """

    run_start: int = -1  # where the current run of reads began
    max_end: int = -1  # furthest byte the run has reached
    decided: int = -1
    ahead: int = -1

    def note(self, start: int, end: int) -> tuple[bool, int]:
        """Record a read; (whether it continues the run, the run's start). The kernel's
        concurrent readahead requests may arrive out of order, hence the slack."""
        run_start, max_end = self.run_start, self.max_end
        if max_end >= 0 and run_start - STREAM_SLACK <= start <= max_end + STREAM_SLACK:
            if start < run_start:
                self.run_start = run_start = start
            if end > max_end:
                self.max_end = end
            return True, run_start
        self.run_start, self.max_end = start, end
        self.decided = self.ahead = -1
        return False, start


def assemble(wf: WeightFile, start: int, end: int, lookup: Callable[[str], bytes | None]
             ) -> bytes | memoryview | None:
    """Bytes ``[start, min(end, size))`` of ``wf`` from its header and the units ``lookup``
    finds in memory, or None if one is missing (or a pass-through tensor is in the range). A
    range inside one unit is a memoryview slice of its bytes. Never blocks if ``lookup`` does
    not: the read path's fast path and the page pusher share it."""
    end = min(end, wf.size_bytes)
    if start >= end:
        return b""
    segs = wf.segments
    i = wf.index_at(start)
    parts: list[memoryview] = []
    while i < len(segs) and segs[i].start < end:
        seg = segs[i]
        if seg.tensor is None:
            data = wf.out.header
        elif not seg.merged:
            return None
        else:
            got = lookup(seg.key)
            if got is None or len(got) != seg.end - seg.start:
                return None
            data = got
        parts.append(memoryview(data)[max(start, seg.start) - seg.start:
                                      min(end, seg.end) - seg.start])
        i += 1
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _ignore(wf: WeightFile, n: int) -> None:
    """The default of a reader's ``reached`` and ``merged_ahead``."""


class UnitReader:
    """Serves byte ranges of one variant's weight files from merge units; reads ahead for
    streams. ``source_cache``: the mount's shared source blocks, dropped when a source changed
    (so that a source restored to its indexed bytes is served again). ``reached(wf, end)``: a
    read of ``wf`` reached byte ``end`` (any thread, the trio thread included: must not
    block). ``merged_ahead(wf, k)``: segment ``k`` was merged ahead of readers and is in the
    cache (a readahead thread)."""

    def __init__(self, variant: VariantState, cache: UnitCache, *,
                 source_cache: SourceBlockCache | None = None,
                 reached: Callable[[WeightFile, int], None] = _ignore,
                 merged_ahead: Callable[[WeightFile, int], None] = _ignore,
                 readahead_units: int = 4, readahead_threads: int = 2,
                 readahead_pending: int = 16) -> None:
        self.session = variant.session
        self.engine = variant.session.engine
        self.recorder = variant.recorder
        self.cache = cache
        self.source_cache = source_cache
        self._reached = reached
        self._merged_ahead = merged_ahead
        self.readahead_units = readahead_units
        self.readahead_threads = max(1, readahead_threads)
        self._pending_max = readahead_pending
        self._pool = ThreadPoolExecutor(max_workers=max(1, readahead_threads),
                                        thread_name_prefix="mergefs-readahead")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self.readahead_scheduled = 0
        self.readahead_errors = 0
        recorded = None if self.recorder is None else self.recorder.recorded
        #: the fast path's cache lookup: a sweep variant's only finds units recorded for it
        self._fast_lookup: Callable[[str], bytes | None] = cache.peek if recorded is None \
            else (lambda key: cache.peek(key) if key in recorded else None)
        self._passthrough_hashes = variant.passthrough  # taken when the variant opened

    def read(self, wf: WeightFile, start: int, end: int, stream: Stream | None = None
             ) -> bytes | memoryview:
        """Exactly bytes ``[start, min(end, size))`` of ``wf``: a slice of the unit's bytes (no
        copy) when the range lies in one unit, else the pieces joined."""
        end = min(end, wf.size_bytes)
        if start >= end:
            return b""
        segs = wf.segments
        i = last = wf.index_at(start)
        seg = segs[i]
        if end <= seg.end:
            out: bytes | memoryview = self._piece(wf, seg, start, end)
        else:
            parts: list[memoryview] = []
            while last < len(segs) and segs[last].start < end:
                parts.append(self._piece(wf, segs[last], start, end))
                last += 1
            last -= 1
            out = b"".join(parts)
        if len(out) != end - start:  # tiling is checked at build time; never serve a short read
            raise MergefsError(f"{wf.out.name}: internal error: assembled {len(out)} bytes for "
                               f"[{start}, {end})")
        if stream is not None:
            self._noted(wf, stream, start, end, last)
        return out

    def _piece(self, wf: WeightFile, seg: Segment, start: int, end: int) -> memoryview:
        lo, hi = max(start, seg.start) - seg.start, min(end, seg.end) - seg.start
        if seg.tensor is not None and not seg.merged:
            return self._passthrough(seg.tensor, lo, hi)
        return memoryview(self.segment_bytes(wf, seg))[lo:hi]

    def read_cached(self, wf: WeightFile, start: int, end: int, stream: Stream | None = None
                    ) -> bytes | memoryview | None:
        """Like :meth:`read` when every byte is already in memory (header and cached units),
        else None. No disk, no merge, no lock, no waiting: the FUSE adapter calls it on the trio
        thread (and only there: see :meth:`UnitCache.peek`) and falls back to :meth:`read` on a
        worker thread. A range inside one unit is a memoryview slice of the cached bytes."""
        out = assemble(wf, start, end, self._fast_lookup)
        if out is not None and stream is not None and len(out):
            self._noted(wf, stream, start, start + len(out), wf.index_at(start + len(out) - 1))
        return out

    def _noted(self, wf: WeightFile, stream: Stream, start: int, end: int, last: int) -> None:
        """After a read that ended in segment ``last``: readahead, once per unit entered."""
        self._reached(wf, end)
        continues, run_start = stream.note(start, end)
        if (continues and last != stream.decided and self.readahead_units > 0
                and end < wf.size_bytes):
            stream.decided = last
            self._readahead(wf, stream, last, run_start)

    def segment_bytes(self, wf: WeightFile, seg: Segment) -> bytes:
        """The bytes of the header or of a merge unit (through the cache)."""
        if seg.tensor is None:
            return wf.out.header
        name, b0, b1 = seg.tensor, seg.b0, seg.b1
        try:
            data = self.cache.get(seg.key, lambda: self.engine.merge_unit(name, b0, b1))
        except SourceChanged:
            self._source_changed()
            raise
        if len(data) != seg.end - seg.start:
            raise MergefsError(f"{wf.out.name}: unit {name!r} [{b0}, {b1}) has {len(data)} "
                               f"bytes, expected {seg.end - seg.start}")
        if self.recorder is not None:
            self.recorder.note_served(seg.key, name, b0, b1, seg.start - seg.tensor_start,
                                      seg.end - seg.tensor_start, data)
        return data

    def _source_changed(self) -> None:
        """The shared source blocks may hold changed bytes: dropped, so that a source restored
        to its indexed bytes is served again (as the unit cache never kept a failed merge)."""
        if self.source_cache is not None:
            self.source_cache.clear()

    def _passthrough(self, name: str, lo: int, hi: int) -> memoryview:
        """Bytes ``[lo, hi)`` of a tensor that is not merged: the base's, read as needed (whole
        chunks, each checked against its hash from when the mount started)."""
        base = self.session.base
        loc = base.tensors[name]
        k0, k1 = lo // PASSTHROUGH_CHUNK, (hi - 1) // PASSTHROUGH_CHUNK + 1
        c0, c1 = k0 * PASSTHROUGH_CHUNK, min(loc.size_bytes, k1 * PASSTHROUGH_CHUNK)
        data = base.read_ranges([ReadRange(loc.file, loc.start + c0, loc.start + c1)])[0]
        hashes = self._passthrough_hashes[name]
        for k in range(k0, k1):
            a = (k - k0) * PASSTHROUGH_CHUNK
            if xxhash.xxh3_64_intdigest(data[a:a + PASSTHROUGH_CHUNK]) != hashes[k]:
                self._source_changed()
                raise SourceChanged(f"{base.path_of(loc.file)}: bytes of {name!r} changed since "
                                    "the mount started")
        base.check_unchanged()
        return data[lo - c0:hi - c0]

    def _readahead(self, wf: WeightFile, stream: Stream, cur_index: int, run_start: int
                   ) -> None:
        """Merge the ``readahead_units`` units after segment ``cur_index`` in the background.

        A run that began inside the current tensor stays within it; a run that crossed into
        this tensor from before may continue into the following tensors. At most
        ``readahead_pending`` units are queued or running at once (more are not scheduled now;
        a later decision of the run schedules them). Units the run handled already are skipped
        without a look, so a decision costs O(1) amortised.
        """
        segs = wf.segments
        cur = segs[cur_index]
        # page-aligned readers (mmap) touch the page before a tensor: only a run that began in
        # an earlier page has really crossed into this tensor
        crossed = run_start < (cur.tensor_start & ~(PAGE - 1))
        limit = wf.size_bytes if crossed else cur.tensor_end
        k = max(cur_index, stream.ahead) + 1
        stop = min(len(segs), cur_index + 1 + self.readahead_units)
        while k < stop:
            seg = segs[k]
            if seg.start >= limit:
                break
            # (a unit larger than the cache is dropped once merged: the reader would merge it
            # again, so it is not merged ahead)
            if (seg.merged and not self.cache.contains(seg.key)
                    and seg.end - seg.start <= self.cache.capacity_bytes
                    and not self._schedule(wf, k, limit)):
                break  # too many pending: a later decision takes it from here
            stream.ahead = k
            k += 1

    def _schedule(self, wf: WeightFile, k: int, limit: int) -> bool:
        """Queue segment ``k`` for merging ahead (and prefetching the sources of a later unit
        before ``limit``); False when ``readahead_pending`` are queued."""
        seg = wf.segments[k]
        with self._lock:
            if seg.key in self._pending:
                return True
            if len(self._pending) >= self._pending_max:
                return False
            self._pending.add(seg.key)
            self.readahead_scheduled += 1
        try:
            self._pool.submit(self._readahead_one, wf, k, limit)
        except RuntimeError:  # pool shut down: closing
            with self._lock:
                self._pending.discard(seg.key)
            return False
        return True

    def _readahead_one(self, wf: WeightFile, k: int, limit: int) -> None:
        seg = wf.segments[k]
        self.prefetch(wf, k + self.readahead_units, limit)
        try:
            data = self.segment_bytes(wf, seg)
        except Exception as exc:  # noqa: BLE001 - the reader's own read reports it
            log.debug("readahead of %s [%d, %d) failed: %s", seg.tensor, seg.b0, seg.b1, exc)
            with self._lock:
                self.readahead_errors += 1
            return
        finally:
            with self._lock:
                self._pending.discard(seg.key)
        del data
        self._merged_ahead(wf, k)

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the readahead threads (the warm-up's merges); False once the
        reader is closing."""
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # pool shut down: closing
            return False
        return True

    def prefetch(self, wf: WeightFile, k: int, limit: int) -> None:
        """Ask the kernel to start reading the sources of segment ``k`` if it starts before
        ``limit`` (the readahead's bound: the planned ranges only, ``POSIX_FADV_WILLNEED``, no
        wait), so that disk reads run ahead of the merges."""
        if k >= len(wf.segments):
            return
        seg = wf.segments[k]
        if seg.start >= limit or not seg.merged or self.cache.contains(seg.key):
            return
        assert seg.tensor is not None
        try:
            self.engine.prefetch(seg.tensor, seg.b0, seg.b1)
        except OSError as exc:  # only a hint
            log.debug("prefetch of %s failed: %s", seg.tensor, exc)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"units_scheduled": self.readahead_scheduled,
                    "units_pending": len(self._pending), "errors": self.readahead_errors}

    def close(self) -> None:
        """Stop readahead (stop the warm-up first: :meth:`PagePusher.stop`): running merges
        finish, queued ones are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
