"""The source-block cache of a sweep mount: source bytes shared by its variants.

Thread-safe; its reads block on disk: worker threads only, never the trio thread.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

import numpy as np


class SourceBlockCache:
    """Source bytes shared by the variants of a sweep mount: a byte-bounded LRU of source blocks.

    Installed as the ``range_cache`` of each (local) source, it answers
    :meth:`Checkpoint.read_ranges`. A requested range is cut at the block boundaries registered
    for its file (:meth:`add_boundaries`: the index layout's blocks, in that source's bytes), so
    a run of blocks read for one variant serves any run or single block another variant asks for
    later; each piece is keyed by ``(source, file, start, end)``. The pieces missing from one
    range are read as contiguous runs (one counted pread each, ``read_physical``), copied, cached.

    Memory bound: the bytes held (``bytes_cached``, copies, never views of larger buffers) never
    exceed ``capacity_bytes``; least recently used pieces go first; a piece larger than the
    capacity is served and not kept. Counters, each with one meaning: ``requested_bytes`` (bytes
    asked for), ``hit_bytes`` (served from memory), ``miss_bytes`` (read from the files through
    this cache; equal to the physical bytes read for these requests), ``evictions``. Two threads
    missing the same piece at once may both read it (no single flight; both count as misses).
    Thread-safe; blocks on disk: worker threads only.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, str, int, int], bytes] = OrderedDict()
        self._bounds: dict[tuple[str, str], Any] = {}
        self._bytes = 0
        self.requested_bytes = self.hit_bytes = self.miss_bytes = self.evictions = 0

    def add_boundaries(self, source: str, file: str, offsets: Any) -> None:
        """Register block boundaries (absolute byte offsets) of ``file`` of ``source``."""
        old = self._bounds.get((source, file))
        merged = offsets if old is None else np.concatenate([old, offsets])
        self._bounds[(source, file)] = np.unique(np.asarray(merged, dtype=np.int64))

    def _pieces(self, source: str, file: str, start: int, end: int) -> list[tuple[int, int]]:
        bounds = self._bounds.get((source, file))
        if bounds is None or end <= start:
            return [(start, end)]
        lo = int(np.searchsorted(bounds, start, side="right"))
        hi = int(np.searchsorted(bounds, end, side="left"))
        cuts = [start, *(int(x) for x in bounds[lo:hi]), end]
        return list(itertools.pairwise(cuts))

    def read(self, src: Any, ranges: Any) -> list[memoryview]:
        from .checkpoint import ReadRange

        source = src.name
        out: list[memoryview] = []
        for r in ranges:
            pieces = self._pieces(source, r.file, r.start, r.end)
            with self._lock:
                got: list[bytes | None] = []
                for a, b in pieces:
                    value = self._lru.get((source, r.file, a, b))
                    if value is not None:
                        self._lru.move_to_end((source, r.file, a, b))
                    got.append(value)
                self.requested_bytes += r.end - r.start
            runs: list[list[int]] = []  # runs of adjacent missing pieces (indices)
            for k, value in enumerate(got):
                if value is None:
                    if runs and runs[-1][-1] == k - 1:
                        runs[-1].append(k)
                    else:
                        runs.append([k])
            if runs:
                bufs = src.read_physical([ReadRange(r.file, pieces[run[0]][0], pieces[run[-1]][1])
                                          for run in runs])
                for run, buf in zip(runs, bufs):
                    origin = pieces[run[0]][0]
                    for k in run:
                        a, b = pieces[k]
                        got[k] = bytes(buf[a - origin:b - origin])
            missed = sum(pieces[k][1] - pieces[k][0] for run in runs for k in run)
            with self._lock:
                self.miss_bytes += missed
                self.hit_bytes += r.end - r.start - missed
                for run in runs:
                    for k in run:
                        a, b = pieces[k]
                        value = got[k]
                        assert value is not None
                        self._insert((source, r.file, a, b), value)
            if len(got) == 1:
                assert got[0] is not None
                out.append(memoryview(got[0]))
            else:
                out.append(memoryview(b"".join(g for g in got if g is not None)))
            if len(out[-1]) != r.end - r.start:
                raise RuntimeError(f"source cache assembled {len(out[-1])} bytes for "
                                   f"[{r.start}, {r.end})")
        return out

    def _insert(self, key: tuple[str, str, int, int], value: bytes) -> None:
        """Caller holds the lock."""
        if len(value) > self.capacity_bytes or key in self._lru:
            return
        self._lru[key] = value
        self._bytes += len(value)
        while self._bytes > self.capacity_bytes:
            _, old = self._lru.popitem(last=False)
            self._bytes -= len(old)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "bytes_cached": self._bytes,
                    "entries": len(self._lru), "requested_bytes": self.requested_bytes,
                    "hit_bytes": self.hit_bytes, "miss_bytes": self.miss_bytes,
                    "evictions": self.evictions}
