"""The source-block cache of a sweep mount: source bytes shared by its variants.

Thread-safe; its reads block on disk: worker threads only, never the trio thread.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from mergefs.core.cache import Flight
from mergefs.sources.base import ReadRange


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
    capacity is served and not kept. Single flight: a piece another call is reading right now is
    waited for, not read again (a call first reads its own pieces, then waits, so waits never
    form a cycle). Counters, each with one meaning: ``requested_bytes`` (bytes asked for),
    ``miss_bytes`` (read from the files through this cache: the physical bytes read for these
    requests), ``hit_bytes`` (``requested - miss``: served from memory or from another call's
    read), ``evictions``. Thread-safe; blocks on disk: worker threads only.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, str, int, int], bytes] = OrderedDict()
        self._bounds: dict[tuple[str, str], Any] = {}
        self._bytes = 0
        self._flights: dict[tuple[str, str, int, int], Flight] = {}
        self.requested_bytes = self.miss_bytes = self.evictions = 0

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
        """One view per range, in order (as ``Checkpoint.read_ranges``)."""
        out: list[memoryview] = []
        for r in ranges:
            data = self._read_one(src, r)
            if len(data) != r.end - r.start:  # never serve a short or long range
                raise RuntimeError(f"source cache assembled {len(data)} bytes for "
                                   f"[{r.start}, {r.end})")
            out.append(data)
        return out

    def _read_one(self, src: Any, r: Any) -> memoryview:

        source = src.name
        pieces = self._pieces(source, r.file, r.start, r.end)
        keys = [(source, r.file, a, b) for a, b in pieces]
        got: list[bytes | None] = [None] * len(pieces)
        mine: list[int] = []  # pieces this call reads (it leads their flights)
        waiting: list[tuple[int, Flight]] = []  # pieces another call is reading now
        with self._lock:
            self.requested_bytes += r.end - r.start
            for k, key in enumerate(keys):
                value = self._lru.get(key)
                if value is not None:
                    self._lru.move_to_end(key)
                    got[k] = value
                elif key in self._flights:
                    waiting.append((k, self._flights[key]))
                else:
                    self._flights[key] = Flight()
                    mine.append(k)
        runs: list[list[int]] = []  # runs of adjacent pieces of ours (indices)
        for k in mine:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        try:
            if runs:
                bufs = src.read_physical([ReadRange(r.file, pieces[run[0]][0],
                                                    pieces[run[-1]][1]) for run in runs])
                for run, buf in zip(runs, bufs):
                    origin = pieces[run[0]][0]
                    for k in run:
                        a, b = pieces[k]
                        got[k] = bytes(buf[a - origin:b - origin])
        except BaseException as exc:
            self._land(keys, mine, got, exc)
            raise
        self._land(keys, mine, got, None)
        for k, flight in waiting:  # only after our own flights landed: no cycle of waits
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            got[k] = flight.value
        if len(got) == 1 and got[0] is not None:
            return memoryview(got[0])
        return memoryview(b"".join(g for g in got if g is not None))

    def _land(self, keys: list[tuple[str, str, int, int]], mine: list[int],
              got: list[bytes | None], error: BaseException | None) -> None:
        """Cache what this call read, count it, and release the calls waiting for it."""
        with self._lock:
            if error is None:
                self.miss_bytes += sum(keys[k][3] - keys[k][2] for k in mine)
            for k in mine:
                flight = self._flights.pop(keys[k])
                value = got[k]
                if error is None and value is not None:
                    self._insert(keys[k], value)
                    flight.value = value
                else:
                    flight.error = error or RuntimeError("source read failed")
                flight.done.set()

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

    def clear(self) -> None:
        """Drop every cached block (reads in flight finish and are not cached twice)."""
        with self._lock:
            self._lru.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity_bytes": self.capacity_bytes, "bytes_cached": self._bytes,
                    "entries": len(self._lru), "requested_bytes": self.requested_bytes,
                    "hit_bytes": self.requested_bytes - self.miss_bytes,
                    "miss_bytes": self.miss_bytes,
                    "evictions": self.evictions}
