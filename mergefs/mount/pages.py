"""Merged units pushed into the kernel's page cache ahead of readers, and the mount's warm-up.

A mount has one :class:`PagePusher` over its unit cache; the view tells it the inode of each
weight file (of every variant) and hands its ``note_reached`` and ``push`` to every
:class:`~mergefs.mount.files.UnitReader`. Once the mount is up, the FUSE layer hands it a
*store* function (``pyfuse3.notify_store`` behind it; this module never imports pyfuse3). From
then on every unit merged *ahead* of a reader (readahead, warm-up) is pushed into the kernel's
page cache of its file, so the reader's next reads are page-cache hits that never reach the
mount process.

What is pushed is exactly what a read of the same range returns: the bytes are assembled from
the header and the units in memory by the same code that serves reads
(:func:`~mergefs.mount.files.assemble`), at their offsets in the file. Only whole pages are pushed, plus the
file's last partial page (the kernel marks a page up to date only when a store covers all of
it, or ends at the end of the file): a page that straddles a unit boundary is pushed when the
units on both sides are in memory. Nothing beyond the file's size is pushed (a store there
would extend the file).

Why worker threads only: the kernel locks pages while a FUSE read of them is in flight, and a
store into a locked page waits for that read's reply. A read is answered by the trio thread
(possibly after waiting for a merge in flight), and a merge never waits for a store, so a store
from a worker thread waits a little at worst; a store from the trio thread, or from the thread
that serves the read of those pages, could wait for itself. Demand-read units are therefore
never pushed (the kernel reads them).

Warm-up (``mergefs mount --warm``): a thread per reader (one per variant) merges every unit of
its weight files in file order, at most ``readahead_threads + 1`` at a time on that reader's
readahead pool, and pushes each one; it stops once it has merged its budget (the view gives each
variant an equal share of the unit cache: warming more would evict what it warmed first), and at
unmount.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mergefs.core.cache import UnitCache
from mergefs.mount.files import UnitReader, WeightFile, assemble

log = logging.getLogger(__name__)

PAGE = 4096
QUEUE_UNITS = 256  # pushes queued for the store thread (references only: units stay cached)
StoreFn = Callable[[int, int, "bytes | memoryview"], None]  # (inode, offset, data)


def _ceil_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


class PagePusher:
    """Pushes units merged ahead of readers into the kernel page cache (see the module doc)."""

    def __init__(self, cache: UnitCache) -> None:
        self.cache = cache
        self._lock = threading.Condition()
        self._store: StoreFn | None = None
        self._inodes: dict[int, int] = {}  # id(WeightFile) -> inode
        self._variants: dict[int, str] = {}  # id(WeightFile) -> the variant it belongs to
        self._frontier: dict[int, int] = {}  # id(WeightFile) -> furthest byte a read reached
        self._active = 0  # store calls running now
        self._stopping = threading.Event()
        self._warm_threads: list[threading.Thread] = []
        self._warm_t0: float | None = None
        self.stored_bytes = 0
        self._stored_by_variant: dict[str, int] = {}
        self.store_calls = 0
        self.store_errors = 0
        self.warm_units = 0
        self.warm_bytes = 0
        self.warm_errors = 0
        self.warm_seconds: float | None = None
        self.store_dropped = 0
        self.store_skipped = 0
        self._queue: queue.Queue[tuple[WeightFile, int] | None] = queue.Queue(QUEUE_UNITS)
        self._thread: threading.Thread | None = None

    # -- enabling ----------------------------------------------------------------------------
    def add_inodes(self, inodes: dict[int, int], variant: str | None = None) -> None:
        """The inodes of weight files (``id(WeightFile) -> inode``): only files known here are
        pushed (a reload adds its variants' files). ``variant``: the one they belong to, for
        :meth:`stored_by_variant`."""
        with self._lock:
            self._inodes.update(inodes)
            if variant is not None:
                self._variants.update(dict.fromkeys(inodes, variant))

    def enable(self, store: StoreFn) -> None:
        """Start pushing through ``store(inode, offset, data)``."""
        with self._lock:
            self._store = store
            if self._thread is None:
                self._thread = threading.Thread(target=self._store_loop, daemon=True,
                                                name="mergefs-store")
                self._thread.start()

    def disable(self, timeout_seconds: float = 5.0) -> bool:
        """Stop pushing; wait until no store call runs. False if one still runs at the timeout
        (it is waiting for a read the kernel will not send us any more)."""
        deadline = time.monotonic() + timeout_seconds
        with self._lock:
            self._store = None
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    @property
    def enabled(self) -> bool:
        return self._store is not None

    # -- pushing -----------------------------------------------------------------------------
    def note_reached(self, wf: WeightFile, end: int) -> None:
        """A read of ``wf`` reached byte ``end`` (a reader's ``reached``; the trio thread too:
        no lock, a racy max that is only a hint: pushes of units a reader passed are skipped)."""
        if end > self._frontier.get(id(wf), 0):
            self._frontier[id(wf)] = end

    def frontier(self, wf: WeightFile) -> int:
        """The furthest byte of ``wf`` any read has reached so far (0 if none)."""
        return self._frontier.get(id(wf), 0)

    def span(self, wf: WeightFile, k: int, data: bytes) -> tuple[int, bytes | memoryview] | None:
        """(offset, bytes) to push for segment ``k`` whose bytes are ``data``: its whole pages,
        widened over a boundary page when the neighbour's bytes are in memory; None if the unit
        covers no whole page."""
        seg = wf.segments[k]
        quiet = self.cache.cached
        a = seg.start & ~(PAGE - 1)
        b = min(wf.size_bytes, _ceil_page(seg.end))
        head: bytes | memoryview = b""
        tail: bytes | memoryview = b""
        if a < seg.start:
            got = assemble(wf, a, seg.start, quiet)
            if got is None:
                a = _ceil_page(seg.start)
            else:
                head = got
        if b > seg.end:
            got = assemble(wf, seg.end, b, quiet)
            if got is None:
                b = seg.end & ~(PAGE - 1)
            else:
                tail = got
        if b <= a:
            return None
        mid = memoryview(data)[max(a, seg.start) - seg.start:min(b, seg.end) - seg.start]
        if not head and not tail:
            return a, mid
        return a, b"".join((head, mid, tail))

    def push(self, wf: WeightFile, k: int) -> None:
        """Queue segment ``k`` (just merged ahead of a reader, in the unit cache) for pushing.
        Never blocks: the store thread does the pushing (a store can wait for a read in flight,
        and merges ahead should not wait with it). Dropped when the queue is full."""
        if self._store is None:
            return
        try:
            self._queue.put_nowait((wf, k))
        except queue.Full:
            with self._lock:
                self.store_dropped += 1

    def _store_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                wf, k = item
                seg = wf.segments[k]
                if seg.end <= self.frontier(wf):  # the reader got there first
                    with self._lock:
                        self.store_skipped += 1
                    continue
                data = self.cache.cached(seg.key)
                if data is not None:
                    self._store_now(wf, k, data)
            finally:
                self._queue.task_done()

    def _store_now(self, wf: WeightFile, k: int, data: bytes) -> None:
        with self._lock:
            store = self._store
            inode = self._inodes.get(id(wf))
            variant = self._variants.get(id(wf))
            if store is None or inode is None:
                return
            self._active += 1
        try:
            piece = self.span(wf, k, data)
            if piece is not None:
                store(inode, piece[0], piece[1])
                with self._lock:
                    self.store_calls += 1
                    self.stored_bytes += len(piece[1])
                    if variant is not None:
                        self._stored_by_variant[variant] = \
                            self._stored_by_variant.get(variant, 0) + len(piece[1])
        except OSError as exc:
            with self._lock:
                self.store_errors += 1
                if exc.errno == errno.ENOSYS and self._store is not None:
                    self._store = None
                    log.warning("the kernel does not support FUSE notify_store; merged units "
                                "are not pushed into the page cache")
            log.debug("notify_store of %s segment %d failed: %s", wf.out.name, k, exc)
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def drain(self, timeout_seconds: float = 30.0) -> bool:
        """Wait until every queued push is done (tests, tools); True if the queue emptied."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            with self._lock:
                if self._queue.unfinished_tasks == 0 and not self._active:
                    return True
            time.sleep(0.01)
        return False

    # -- warm-up -----------------------------------------------------------------------------
    def start_warm(self, reader: UnitReader, files: list[WeightFile], budget_bytes: int,
                   lookup: Callable[[WeightFile], None]) -> None:
        """Merge (through ``reader``, on its threads) and push every unit of ``files`` in file
        order, in a background thread, up to ``budget_bytes`` of merged units. ``lookup(wf)``
        makes the kernel know the file's inode (a stat through the mount) before its units are
        pushed. Called once per reader (variant); the threads run side by side."""
        t = threading.Thread(target=self._warm, args=(reader, files, budget_bytes, lookup),
                             name="mergefs-warm", daemon=True)
        with self._lock:
            if self._warm_t0 is None:
                self._warm_t0 = time.monotonic()
            self._warm_threads.append(t)
        t.start()

    def _warm(self, reader: UnitReader, files: list[WeightFile], budget_bytes: int,
              lookup: Callable[[WeightFile], None]) -> None:
        in_flight = reader.readahead_threads + 1
        slots = threading.Semaphore(in_flight)
        total = 0
        stopped = "done"
        try:
            for wf in files:
                if self._stopping.is_set():
                    stopped = "stopped by unmount"
                    return
                try:
                    lookup(wf)
                except OSError as exc:
                    log.warning("warm-up: cannot look up %s (%s); not warmed", wf.out.name, exc)
                    continue
                for k, seg in enumerate(wf.segments):
                    if not seg.merged:
                        continue
                    size = seg.end - seg.start
                    if total + size > budget_bytes:
                        stopped = f"stopped at the cache size ({budget_bytes} bytes)"
                        return
                    while not slots.acquire(timeout=0.2):
                        if self._stopping.is_set():
                            stopped = "stopped by unmount"
                            return
                    if self._stopping.is_set():
                        slots.release()
                        stopped = "stopped by unmount"
                        return
                    total += size
                    if not reader.submit(self._warm_one, reader, wf, k, slots):  # closing
                        slots.release()
                        stopped = "stopped by unmount"
                        return
        finally:
            for _ in range(in_flight):  # wait for the last merges
                slots.acquire()
            with self._lock:  # since the first warm-up thread started (all of them)
                self.warm_seconds = round(time.monotonic() - (self._warm_t0 or 0.0), 3)
            log.info("warm-up %s: %d units, %d bytes merged and pushed in %.1f s", stopped,
                     self.warm_units, self.warm_bytes, self.warm_seconds)

    def _warm_one(self, reader: UnitReader, wf: WeightFile, k: int,
                  slots: threading.Semaphore) -> None:
        seg = wf.segments[k]
        try:  # the slot is released whatever fails (else the warm-up waits for it forever)
            reader.prefetch(wf, k + 2 * (reader.readahead_threads + 1), wf.size_bytes)
            data = reader.segment_bytes(wf, seg)
            self.push(wf, k)
            with self._lock:
                self.warm_units += 1
                self.warm_bytes += len(data)
        except Exception as exc:  # noqa: BLE001 - a reader's own read reports it
            log.warning("warm-up of %s [%d, %d) failed: %s", seg.tensor, seg.b0, seg.b1, exc)
            with self._lock:
                self.warm_errors += 1
        finally:
            slots.release()

    def wait_warm(self, timeout_seconds: float | None = None) -> bool:
        """Wait for the warm-up threads (tests, tools); True when they have finished."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        for t in list(self._warm_threads):
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._warming()

    def _warming(self) -> bool:
        return any(t.is_alive() for t in list(self._warm_threads))

    def stop_warm(self, timeout_seconds: float | None = None) -> bool:
        """Stop the warm-up and wait for it (its running merges finish); True once it has
        ended. Called while the mount still answers requests: a warm-up thread may be inside a
        stat through the mount, which only an answer ends."""
        self._stopping.set()
        return self.wait_warm(timeout_seconds)

    def stop(self) -> None:
        """Stop the warm-up (merges running finish) and pushing."""
        self._stopping.set()
        self.wait_warm()
        with self._lock:
            self._store = None
        if self._thread is not None:
            self._queue.put(None)  # after what is queued; each is skipped now (disabled)
            self._thread.join()
            self._thread = None

    def stored_by_variant(self) -> dict[str, int]:
        """``stored_bytes`` by the variant whose weight files they were pushed into."""
        with self._lock:
            return dict(self._stored_by_variant)

    def stats(self) -> dict[str, Any]:
        """``stored_bytes``/``store_calls``: bytes and calls pushed into the kernel page cache
        (readers get those bytes without a FUSE read; a page on a unit boundary may be pushed
        with each of its two units, and counts each time);
        ``store_errors``: failed pushes; ``store_dropped``: pushes not queued (queue full);
        ``store_skipped``: queued pushes of units a reader had read past by then; ``warm``:
        units and bytes the warm-up merged, failures, and its duration (None while running or
        when not asked for)."""
        running = self._warming()
        with self._lock:
            return {"enabled": self._store is not None, "stored_bytes": self.stored_bytes,
                    "store_calls": self.store_calls, "store_errors": self.store_errors,
                    "store_dropped": self.store_dropped, "store_skipped": self.store_skipped,
                    "warm": {"units": self.warm_units, "bytes": self.warm_bytes,
                             "errors": self.warm_errors,
                             "seconds": None if running else self.warm_seconds,
                             "running": running}}
