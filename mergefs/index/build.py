"""Reading sources to build index pieces: one pass over the layout's chunks on worker threads.

A pass (:class:`Pass`) reads, per chunk of blocks of one tensor, the base and the experts to
describe in full, then the other experts' blocks that a wanted Gram pair needs (both deltas
non-zero), and hands the bytes to the pure functions of :mod:`mergefs.index.stats`. Each chunk
writes only its own columns of the results, so chunks are independent tasks (threads here; a
``ChunkRunner`` runs them elsewhere: :mod:`mergefs.engine.ray_index` as Ray tasks, each a pass over a
run of chunks whose columns the driver's pass takes with :meth:`Pass.put`).
Blocking I/O; never on the trio thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mergefs.index.stats import (
    BASE, block_views, gram_terms, hash_blocks, sketch_buckets, zero_blocks,
)
from mergefs.sources.local import Checkpoint
from mergefs.sources.base import ReadRange
from mergefs.sources import read_many
from mergefs.core.format import DTYPES
from mergefs.index.read import Reader
from mergefs.core.memory import keep_freed_memory
from mergefs.index.layout import BlockLayout


CHUNK_BYTES = 4 << 20  # read granularity while indexing, per source
PREFETCH_CHUNKS = 2  # chunks read ahead (posix_fadvise WILLNEED) while earlier ones compute
READ_SETS = 6  # buffer sets of the reader: one being read, READ_SETS - 2 queued, one computed
READ_STREAMS = 3  # a chunk's sources are read this many at a time (a deeper disk queue)


def source_ranges(src: Checkpoint, layout: BlockLayout, b0: int, b1: int) -> ReadRange:
    t = int(layout.tensor_of[b0])
    loc = src.tensors[layout.tensors[t]]
    item = DTYPES[loc.dtype][0]  # the source's own dtype: experts may differ from the base
    return ReadRange(loc.file, loc.start + int(layout.elem_start[b0]) * item,
                     loc.start + int(layout.elem_end[b1 - 1]) * item)


def _plain(src: Checkpoint) -> bool:
    """A local checkpoint read straight from its files (not remote, LoRA or range-cached)."""
    return type(src) is Checkpoint and src.range_cache is None


def chunks(layout: BlockLayout) -> list[tuple[int, int]]:
    """Runs of consecutive blocks of one tensor, each at most about CHUNK_BYTES."""
    out = []
    sizes = layout.block_bytes()
    for t in range(len(layout.tensors)):
        blocks = layout.blocks_of(t)
        b0 = blocks.start
        acc = 0
        for b in blocks:
            if acc and acc + sizes[b] > CHUNK_BYTES:
                out.append((b0, b))
                b0, acc = b, 0
            acc += int(sizes[b])
        if blocks.stop > b0:
            out.append((b0, blocks.stop))
    return out


@dataclass
class BuildReport:
    """What one :func:`load_or_build` did; each counter has one meaning.

    ``bytes_read``: bytes read from each source (by root) while indexing; ``experts_built``: the
    roots whose expert piece was built now (read, or taken from a published sidecar);
    ``pairs_built``: Gram pair pieces computed now; ``base_built``: the base piece was built;
    ``verified``: the roots whose bytes were hashed and found equal to stored pieces (touched,
    copied: reused); ``verify_bytes``: of ``bytes_read``, those read to compare (by root).
    """

    bytes_read: dict[str, int] = field(default_factory=dict)
    experts_built: list[str] = field(default_factory=list)
    pairs_built: int = 0
    base_built: bool = False
    verified: list[str] = field(default_factory=list)
    verify_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class PassPart:
    """The columns ``[lo, lo + len(base_hash))`` of a pass that a runner's task computed, and
    the bytes it read per source (by root)."""

    lo: int
    base_hash: np.ndarray
    expert_hash: np.ndarray
    zero: np.ndarray
    gram: np.ndarray
    bytes_read: dict[str, int]
    base_sq: np.ndarray | None = None  # ||W0_b||^2 where the pass reads the base in full
    sketch: np.ndarray | None = None  # (own, n, k) float32: the own experts' block sketches


#: Runs a pass's chunks elsewhere: given the pass (its ``own``, ``pairs``, ``zero_known`` and
#: ``full`` say what to compute) and every chunk ``(b0, b1)`` in order, yields PassParts that
#: cover every chunk exactly once, in any order.
ChunkRunner = Callable[["Pass", list[tuple[int, int]]], Iterable[PassPart]]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Half-open runs [q0, q1) of True in a bool vector."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


class Pass:
    """One pass over the layout's chunks, on worker threads.

    ``own`` experts are read in full and described (block hashes, zero flags); the Gram terms
    of ``pairs`` (``(i, i)``: expert i's squared norms) are computed, and with the base read
    in full its squared block norms ``base_sq`` (``||W0_b||^2``, in the same order), and the
    ``own`` experts' block sketches ``sketch`` (:mod:`mergefs.index.stats`). The base is read in full
    with ``own`` experts or when ``describe_base``; otherwise, like experts outside ``own``
    (whose zero flags ``zero_known`` holds), only the blocks where some pair has two non-zero
    deltas are read.
    """

    def __init__(self, base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                 own: Sequence[int], pairs: Sequence[tuple[int, int]],
                 zero_known: dict[int, np.ndarray], describe_base: bool,
                 on_bytes: Callable[[int], None] | None, report: BuildReport) -> None:
        self.base, self.experts, self.layout = base, experts, layout
        self.own, self.pairs, self.zero_known = list(own), list(pairs), zero_known
        self.full = bool(own) or describe_base
        self.others = sorted({x for p in pairs for x in p} - set(own))
        self.rows = {i: r for r, i in enumerate([*self.own, *self.others])}
        nb = layout.n_blocks
        self.base_hash = np.zeros(nb, dtype=np.uint64)
        self.base_sq = np.zeros(nb, dtype=np.float64)  # ||W0_b||^2, when full
        self.expert_hash = np.zeros((len(own), nb), dtype=np.uint64)
        self.zero = np.zeros((len(own), nb), dtype=bool)
        self.gram = np.zeros((len(pairs), nb), dtype=np.float64)
        self.buckets = sketch_buckets(layout.block_size)
        self.sketch = np.zeros((len(own), nb, self.buckets), dtype=np.float32)
        self.on_bytes, self.report = on_bytes, report
        self.lock = threading.Lock()
        #: bytes read already (a verifying read, :mod:`mergefs.index.verify`), not read again:
        #: chunk (b0, b1) -> {position in :meth:`_full_sources`: its bytes there}
        self.handed: dict[tuple[int, int], dict[int, memoryview]] = {}

    def run(self, threads: int, runner: ChunkRunner | None = None) -> None:
        """Compute every chunk. A pass that reads its sources in full from plain local files
        runs as a pipeline (:meth:`_pipeline`): one reader thread reads the chunks in order into
        reused buffers while this thread computes. Otherwise ``threads`` workers each read and
        compute chunks, the kernel reading PREFETCH_CHUNKS ahead (``POSIX_FADV_WILLNEED``).
        ``runner``: compute the chunks elsewhere (e.g. Ray tasks, :mod:`mergefs.engine.ray_index`) and
        take their columns."""
        keep_freed_memory()  # reuse the freed chunk buffers: no page faults per chunk
        runs = chunks(self.layout)
        if runner is not None:
            for part in runner(self, runs):
                self.put(part)
            return
        if self.full and all(_plain(src) for src in self._full_sources()):
            self._pipeline(runs)
            return

        def task(k: int) -> None:
            if k + PREFETCH_CHUNKS < len(runs):
                self.prefetch(*runs[k + PREFETCH_CHUNKS])
            self.chunk(*runs[k])

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mergefs-index") as pool:
            for k in range(min(PREFETCH_CHUNKS, len(runs))):
                self.prefetch(*runs[k])
            for fut in [pool.submit(task, k) for k in range(len(runs))]:
                fut.result()

    def _pipeline(self, runs: list[tuple[int, int]]) -> None:
        """The reader thread reads chunks ahead (:class:`Reader`) while this thread computes
        them in order: the disk is kept busy, the reads' CPU runs on the other core, and up to
        READ_SETS - 2 chunks queue up while the computing thread waits for a core. Chunk k's
        bytes go into buffer set ``k % READ_SETS``: the sets being read, queued and computed
        are always distinct (at most READ_SETS - 2 queued, one read, one computed). A chunk
        above CHUNK_BYTES (one block larger than a chunk) is read by the computing thread
        itself, into buffers freed after it: the reader's sets never grow past about
        CHUNK_BYTES per source."""
        srcs = self._full_sources()
        sizes = self.layout.block_bytes()
        rd = Reader()
        ready: queue.Queue[tuple[int, list[list[memoryview]] | None] | BaseException | None] = \
            queue.Queue(maxsize=READ_SETS - 2)
        stop = threading.Event()

        def reader() -> None:
            try:
                with ThreadPoolExecutor(max_workers=READ_STREAMS,
                                        thread_name_prefix="mergefs-index-read") as pool:
                    for k, (b0, b1) in enumerate(runs):
                        if stop.is_set():
                            return
                        if int(sizes[b0:b1].sum()) > CHUNK_BYTES:  # one block above a chunk
                            ready.put((k, None))  # read where computed: buffers stay bounded
                            continue
                        hand = self.handed.pop((b0, b1), {})
                        want = [q for q in range(len(srcs)) if q not in hand]
                        views = dict(zip(want, pool.map(
                            lambda q: rd.read(srcs[q], source_ranges(srcs[q], self.layout,
                                                                     b0, b1),  # noqa: B023
                                              (k % READ_SETS) * len(srcs) + q),  # noqa: B023
                            want)))
                        self._count([srcs[q] for q in want], [[views[q]] for q in want])
                        ready.put((k, [[hand[q] if q in hand else views[q]]
                                       for q in range(len(srcs))]))
                ready.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the computing thread
                ready.put(exc)

        thread = threading.Thread(target=reader, name="mergefs-index-read", daemon=True)
        thread.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                k, got = item
                self.chunk(*runs[k], full=got)
        finally:
            stop.set()
            while thread.is_alive():  # unblock a reader waiting to queue, then let it end
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
            rd.close()

    def run_chunks(self, runs: Sequence[tuple[int, int]]) -> PassPart:
        """Compute the given consecutive chunks here, one after the other (a runner's task),
        and return their columns."""
        keep_freed_memory()
        for k, (b0, b1) in enumerate(runs):
            if k + PREFETCH_CHUNKS < len(runs):
                self.prefetch(*runs[k + PREFETCH_CHUNKS])
            self.chunk(b0, b1)
        lo, hi = runs[0][0], runs[-1][1]
        return PassPart(lo, self.base_hash[lo:hi].copy(), self.expert_hash[:, lo:hi].copy(),
                        self.zero[:, lo:hi].copy(), self.gram[:, lo:hi].copy(),
                        dict(self.report.bytes_read), self.base_sq[lo:hi].copy(),
                        self.sketch[:, lo:hi].copy())

    def put(self, part: PassPart) -> None:
        """Take the columns a runner's task computed (as :meth:`chunk` writes them)."""
        lo, hi = part.lo, part.lo + part.base_hash.size
        self.base_hash[lo:hi], self.expert_hash[:, lo:hi] = part.base_hash, part.expert_hash
        self.zero[:, lo:hi], self.gram[:, lo:hi] = part.zero, part.gram
        if part.base_sq is not None:
            self.base_sq[lo:hi] = part.base_sq
        if part.sketch is not None:
            self.sketch[:, lo:hi] = part.sketch
        n = 0
        with self.lock:
            for root, k in part.bytes_read.items():
                self.report.bytes_read[root] = self.report.bytes_read.get(root, 0) + k
                n += k
            if self.on_bytes is not None and n:
                self.on_bytes(n)

    def prefetch(self, b0: int, b1: int) -> None:
        """Ask the kernel to start reading blocks [b0, b1) of the sources read in full."""
        if not self.full:
            return
        for src in [self.base, *(self.experts[i] for i in self.own)]:
            src.will_need([source_ranges(src, self.layout, b0, b1)])

    def _read(self, requests: list[tuple[Checkpoint, list[ReadRange]]]
              ) -> list[list[memoryview]]:
        got = read_many(requests) if requests else []
        self._count([src for src, _ in requests], got)
        return got

    def _read_full(self, b0: int, b1: int) -> list[list[memoryview]]:
        """The bytes of :meth:`_full_sources` in chunk [b0, b1): those handed over, the rest
        read here."""
        srcs = self._full_sources()
        hand = self.handed.pop((b0, b1), {})
        want = [q for q in range(len(srcs)) if q not in hand]
        got = dict(zip(want, self._read([(srcs[q], [source_ranges(srcs[q], self.layout, b0,
                                                                  b1)]) for q in want])))
        return [hand[q] if q in hand else got[q] for q in range(len(srcs))]

    def _full_sources(self) -> list[Checkpoint]:
        return [self.base, *(self.experts[i] for i in self.own)]

    def _count(self, srcs: Sequence[Checkpoint], got: list[list[memoryview]]) -> None:
        n = 0
        with self.lock:
            for src, views in zip(srcs, got):
                k = sum(len(v) for v in views)
                self.report.bytes_read[str(src.root)] = \
                    self.report.bytes_read.get(str(src.root), 0) + k
                n += k
            if self.on_bytes is not None and n:
                self.on_bytes(n)

    def chunk(self, b0: int, b1: int, full: list[list[memoryview]] | None = None) -> None:
        """Compute chunk [b0, b1); ``full``: the bytes of :meth:`_full_sources` there, read
        already (else read here)."""
        lay = self.layout
        name = lay.tensors[int(lay.tensor_of[b0])]
        origin = int(lay.elem_start[b0])
        spans = [(int(lay.elem_start[b]) - origin, int(lay.elem_end[b]) - origin)
                 for b in range(b0, b1)]
        nb = b1 - b0
        bdt = self.base.tensors[name].dtype
        dtypes = {i: self.experts[i].tensors[name].dtype for i in self.rows}
        blocks: dict[int, list[memoryview | None]] = {}
        zero = {i: z[b0:b1] for i, z in self.zero_known.items()}
        base_blocks: list[memoryview | None] = [None] * nb
        if self.full:
            got = full if full is not None else self._read_full(b0, b1)
            base_buf = got[0][0]
            base_blocks = list(block_views(spans, base_buf, bdt))
            bh = hash_blocks(spans, base_buf, bdt)
            self.base_hash[b0:b1] = bh
            for k, i in enumerate(self.own):
                buf = got[1 + k][0]
                h = hash_blocks(spans, buf, dtypes[i])
                z = zero_blocks(spans, base_buf, bdt, bh, buf, dtypes[i], h)
                self.expert_hash[k, b0:b1], self.zero[k, b0:b1], zero[i] = h, z, z
                views = block_views(spans, buf, dtypes[i])
                blocks[i] = [None if z[q] else views[q] for q in range(nb)]
        need = {i: np.zeros(nb, dtype=bool) for i in self.others}
        for r, s in self.pairs:
            both = ~zero[r] & ~zero[s]
            for x in (r, s):
                if x in need:
                    need[x] |= both
        sparse = [(i, need[i]) for i in self.others]
        if not self.full:
            sparse.insert(0, (-1, np.logical_or.reduce([m for _, m in sparse] or
                                                        [np.zeros(nb, dtype=bool)])))
        runs = [(i, _runs(mask)) for i, mask in sparse]
        srcs = [self.base if i < 0 else self.experts[i] for i, _ in runs]
        got = self._read([(src, [source_ranges(src, lay, b0 + q0, b0 + q1) for q0, q1 in rr])
                          for src, (_, rr) in zip(srcs, runs) if rr])
        views_of = iter(got)
        for i, rr in runs:
            out: list[memoryview | None] = [None] * nb
            if rr:
                for (q0, q1), buf in zip(rr, next(views_of)):
                    local = [(s - spans[q0][0], e - spans[q0][0]) for s, e in spans[q0:q1]]
                    out[q0:q1] = block_views(local, buf, bdt if i < 0 else dtypes[i])
            if i < 0:
                base_blocks = out
            else:
                blocks[i] = out
        order = [*self.own, *self.others]
        pairs = [(self.rows[r], self.rows[s]) for r, s in self.pairs]
        sk = {k: np.zeros((nb, self.buckets)) for k in range(len(self.own))}
        terms = gram_terms([e - s for s, e in spans], base_blocks, bdt,
                           [blocks[i] for i in order], [dtypes[i] for i in order],
                           pairs + [(BASE, BASE)] * self.full,  # the base norms: same order
                           sk, b0)
        for k, v in sk.items():
            self.sketch[k, b0:b1] = v
        self.gram[:, b0:b1] = terms[:len(pairs)]
        if self.full:
            self.base_sq[b0:b1] = terms[-1]
