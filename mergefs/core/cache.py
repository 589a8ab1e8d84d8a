"""The cache of merged units: a byte-bounded LRU in memory, single flight, optional disk tier.

:class:`UnitCache` maps a unit key (a string the view makes from a tensor name and a block run)
to the unit's merged output bytes. ``get(key, produce)`` returns the cached bytes or calls
``produce()`` once, however many threads ask for the same key at the same time (the others wait
for that one merge and share its result or its error).

Memory bound: the bytes held by the LRU (``bytes_cached``, the sum of ``len(value)`` over its
entries) never exceed ``capacity_bytes``; the least recently used entries are evicted first and a
value larger than the capacity is returned without being cached. Beyond that bound, each unit
being merged or loaded right now is held once more by the thread producing it (at most
``merges_in_flight`` + disk loads in flight units), entries queued for the disk tier hold at most
``write_queue_bytes``, and callers hold the values they were given.

Persistent tier (optional): ``<cache_dir>/<plan_hash>/<xxh3-128 of the unit key>.bin``. Each
entry carries a small header (format magic, mergefs version, the unit key, payload length and
the xxh3-128 of key and payload); an entry is served only when all of them verify. A corrupt or
truncated entry is deleted and the unit merged again, never served. Entries are written to a
temporary name, fsynced and renamed, so a crash or a full disk leaves no partial entry under a
final name; a failed write only logs a warning (the cache is an optimisation). Writes happen on
one background thread, so a reader never waits for an fsync; when more than
``write_queue_bytes`` are queued, further entries are not written (``disk_writes_dropped``).

Everything here blocks (locks, waits for other threads' merges, disk I/O): call it from worker
threads, never from the trio thread; except ``peek`` and ``contains``, which take no lock and
never block (the trio thread's in-memory hit path).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from mergefs.core.version import __version__

log = logging.getLogger(__name__)

_MAGIC = b"MFSUNIT1"
# magic, version length, key length, payload length, xxh3-128 digest (16 bytes)
_HEAD = struct.Struct("<8sHIQ16s")


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache counters; each has exactly one meaning.

    - ``hits``: ``get`` calls answered from memory.
    - ``waits``: ``get`` calls that found the unit being produced by another thread and waited
      for that result instead of merging again (single flight).
    - ``misses``: ``get`` calls that produced the unit (from disk or by merging).
    - ``disk_hits``: misses answered by a verified persistent entry.
    - ``merges``: calls of ``produce`` (merges started); ``misses - disk_hits``.
    - ``merges_in_flight``: merges running right now.
    - ``evictions``: entries dropped from memory to keep ``bytes_cached <= capacity_bytes``.
    - ``entries``, ``bytes_cached``: what the memory LRU holds now.
    - ``disk_writes``: persistent entries written; ``disk_corrupt``: entries that failed
      verification and were deleted; ``disk_write_errors``: entries that could not be written;
      ``disk_writes_dropped``: entries not written because the write queue was full.
    """

    capacity_bytes: int
    hits: int
    waits: int
    misses: int
    disk_hits: int
    merges: int
    merges_in_flight: int
    evictions: int
    entries: int
    bytes_cached: int
    disk_writes: int
    disk_corrupt: int
    disk_write_errors: int
    disk_writes_dropped: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Flight:
    """One value being produced (a merged unit, a source block): waiters block on ``done``."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: bytes | None = None
        self.error: BaseException | None = None


class UnitCache:
    """Byte-bounded LRU of merged units with single flight and an optional verified disk tier."""

    def __init__(self, capacity_bytes: int, cache_dir: str | Path | None = None,
                 plan_hash: str | None = None, write_queue_bytes: int = 64 << 20) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self._flights: dict[str, Flight] = {}
        self._bytes = 0
        self._hits = self._waits = self._misses = self._disk_hits = 0
        self._peek_hits = 0  # incremented by peek only, without the lock (see peek)
        self._merges = self._in_flight = self._evictions = 0
        self._disk_writes = self._disk_corrupt = self._disk_write_errors = 0
        self._disk_writes_dropped = 0
        self._write_queue_max = write_queue_bytes
        self._queued_bytes = 0
        self._writer: ThreadPoolExecutor | None = None
        self.dir: Path | None = None
        if cache_dir is not None:
            if not plan_hash or not all(c in "0123456789abcdef" for c in plan_hash):
                raise ValueError("a persistent cache needs the plan hash (hex) as its key")
            self.dir = Path(cache_dir) / plan_hash
            self.dir.mkdir(parents=True, exist_ok=True)
            self._writer = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix="mergefs-cache-writer")

    # -- public --------------------------------------------------------------------------
    def get(self, key: str, produce: Callable[[], bytes], persist: bool = True) -> bytes:
        """The unit's bytes: from memory, from a verified disk entry, or ``produce()`` once."""
        with self._lock:
            value = self._hit_locked(key)
            if value is not None:
                return value
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = Flight()
                self._misses += 1
            else:
                self._waits += 1
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.value is not None
            return flight.value
        try:
            value = self._produce(key, produce, persist)
        except BaseException as exc:
            flight.error = exc
            with self._lock:
                del self._flights[key]
            flight.done.set()
            raise
        flight.value = value
        with self._lock:
            self._insert(key, value)
            del self._flights[key]
        flight.done.set()
        return value

    def peek(self, key: str) -> bytes | None:
        """The unit's bytes if they are in memory (a hit, counted), else None (nothing counted).

        Lock-free, so it never waits for a thread that holds the lock (and then for the GIL):
        safe and cheap on the trio thread. Under the GIL, ``OrderedDict.get`` and
        ``move_to_end`` are each one atomic C call, and every other mutation of ``_lru`` happens
        in such calls too (under ``_lock``), so a racing eviction can only make this a miss;
        the bytes returned are always the value stored for ``key``. Its hits are counted in a
        counter of their own that only peek increments: call peek from one thread at a time
        (the FUSE adapter calls it on the trio thread only), or the count may miss a hit.
        """
        value = self._lru.get(key)
        if value is not None:
            try:
                self._lru.move_to_end(key)
            except KeyError:  # evicted meanwhile: still the right bytes, served once more
                pass
            self._peek_hits += 1
        return value

    def cached(self, key: str) -> bytes | None:
        """The unit's bytes if they are in memory, else None: no counting, no recency change,
        no lock (one atomic dict lookup). For code that re-reads units it just produced."""
        return self._lru.get(key)

    def _hit_locked(self, key: str) -> bytes | None:
        """A memory hit (counted, moved to most recent), or None. Caller holds the lock."""
        value = self._lru.get(key)
        if value is not None:
            self._lru.move_to_end(key)
            self._hits += 1
        return value

    def contains(self, key: str) -> bool:
        """Whether the unit is in memory or being produced (no counter changes).

        Lock-free (two atomic dict lookups under the GIL): a hint that may be stale by the
        time it returns, which is all readahead needs."""
        return key in self._lru or key in self._flights

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.capacity_bytes, self._hits + self._peek_hits, self._waits, self._misses,
                              self._disk_hits, self._merges, self._in_flight, self._evictions,
                              len(self._lru), self._bytes, self._disk_writes, self._disk_corrupt,
                              self._disk_write_errors, self._disk_writes_dropped)

    def flush(self) -> None:
        """Wait until every queued disk write is done."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish queued disk writes and stop the writer thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def clear(self) -> None:
        """Drop every memory entry (not counted as evictions)."""
        with self._lock:
            self._lru.clear()
            self._bytes = 0

    # -- internals -----------------------------------------------------------------------
    def _produce(self, key: str, produce: Callable[[], bytes], persist: bool) -> bytes:
        use_disk = persist and self.dir is not None
        if use_disk:
            value = self._load(key)
            if value is not None:
                with self._lock:
                    self._disk_hits += 1
                return value
        with self._lock:
            self._merges += 1
            self._in_flight += 1
        try:
            value = produce()
        finally:
            with self._lock:
                self._in_flight -= 1
        if use_disk:
            self._queue_store(key, value)
        return value

    def _queue_store(self, key: str, value: bytes) -> None:
        assert self._writer is not None
        with self._lock:
            if self._queued_bytes + len(value) > self._write_queue_max:
                self._disk_writes_dropped += 1
                return
            self._queued_bytes += len(value)
        try:
            self._writer.submit(self._store_queued, key, value)
        except RuntimeError:  # closed
            with self._lock:
                self._queued_bytes -= len(value)
                self._disk_writes_dropped += 1

    def _store_queued(self, key: str, value: bytes) -> None:
        try:
            self._store(key, value)
        finally:
            with self._lock:
                self._queued_bytes -= len(value)

    def _insert(self, key: str, value: bytes) -> None:
        """Caller holds the lock."""
        if len(value) > self.capacity_bytes:
            return
        self._lru[key] = value
        self._bytes += len(value)
        while self._bytes > self.capacity_bytes:
            _, old = self._lru.popitem(last=False)
            self._bytes -= len(old)
            self._evictions += 1

    def entry_path(self, key: str) -> Path:
        """Where the persistent entry of ``key`` lives (the key itself never names a path)."""
        if self.dir is None:
            raise ValueError("no persistent cache directory")
        return self.dir / f"{xxhash.xxh3_128_hexdigest(key.encode())}.bin"

    def _load(self, key: str) -> bytes | None:
        path = self.entry_path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cache entry %s unreadable (%s); merging again", path, exc.strerror)
            return None
        value, why = _decode(blob, key)
        if value is None:
            if why != "version":
                log.warning("cache entry %s failed verification (%s); discarded, merging again",
                            path, why)
                with self._lock:
                    self._disk_corrupt += 1
            try:
                path.unlink()
            except OSError:
                pass
        return value

    def _store(self, key: str, value: bytes) -> None:
        path = self.entry_path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_encode(key, value))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write cache entry %s (%s); serving from memory only", path,
                        exc.strerror)
            with self._lock:
                self._disk_write_errors += 1
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        with self._lock:
            self._disk_writes += 1


def _digest(version: bytes, key: bytes, value: bytes) -> bytes:
    h = xxhash.xxh3_128()
    for part in (version, key, value):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.digest()


def _encode(key: str, value: bytes) -> bytes:
    version = __version__.encode()
    kb = key.encode()
    head = _HEAD.pack(_MAGIC, len(version), len(kb), len(value), _digest(version, kb, value))
    return b"".join((head, version, kb, value))


def _decode(blob: bytes, key: str) -> tuple[bytes | None, str]:
    """(payload, "") when the entry verifies for ``key``; (None, reason) otherwise."""
    if len(blob) < _HEAD.size:
        return None, "truncated header"
    magic, vlen, klen, plen, digest = _HEAD.unpack_from(blob)
    if magic != _MAGIC:
        return None, "bad magic"
    if len(blob) != _HEAD.size + vlen + klen + plen:
        return None, "length mismatch"
    pos = _HEAD.size
    version, kb = blob[pos:pos + vlen], blob[pos + vlen:pos + vlen + klen]
    value = blob[pos + vlen + klen:]
    if _digest(version, kb, value) != digest:
        return None, "hash mismatch"
    if kb != key.encode():
        return None, "key mismatch"
    if version != __version__.encode():
        return None, "version"
    return value, ""
