"""The block index: per (expert, block) delta norms, hashes and zero flags, built once, reused.

A *block* is a contiguous range of whole rows of one floating-point tensor, about ``block_size``
bytes (a tensor smaller than that is one block). Blocks are numbered in the base's file order.
For every block the index holds the xxh3 of the base bytes and, per expert, the xxh3 of the
expert bytes, the delta L2 norm ``||W_i - W0||`` (float32 deltas, float64 accumulation), a zero
flag (bytes identical to the base) and the Gram matrix ``<D_i, D_j>`` of the experts' deltas, which
gives the exact norm of any additive combination (bounds relative to the merge update, and the
exact error of a plan).

The index is stored under ``index_dir`` as a safetensors file keyed by every source's identity,
so it is reused while sources are unchanged and rebuilt when one changed (or when a local
weight file's status-change time moved: rewritten in place with size and mtime kept). Building
reads each file once, in order, on two worker threads (or through a ``ChunkRunner``: Ray
tasks that compute the same per-chunk statistics, :mod:`mergefs.rayexec`). A remote expert with
a matching published sidecar (:mod:`mergefs.sidecar`) is not read at all: its statistics come
from the sidecar, and the index then has only the Gram diagonal (``has_gram`` False). Nothing
here runs on the trio thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from .checkpoint import Checkpoint, ReadRange, read_many
from .dtypes import NUMPY_DTYPES, decode_f32
from .errors import SourceError
from .format import DTYPES, FLOAT_DTYPES
from .memory import keep_freed_memory

log = logging.getLogger(__name__)

INDEX_VERSION = "1"
CHUNK_BYTES = 16 << 20  # read granularity while indexing, per source
PREFETCH_CHUNKS = 2  # chunks read ahead (posix_fadvise WILLNEED) while earlier ones compute
GRAM_COLS = 32768  # delta columns per Gram update (float64 rows of all experts stay in cache)


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Blocks of the mergeable (floating-point) tensors, in the base's file order.

    Block ``b`` covers elements ``[elem_start[b], elem_end[b])`` of tensor ``tensor_of[b]``;
    ``first_block[t]`` .. ``first_block[t + 1]`` are tensor ``t``'s blocks.
    """

    block_size: int
    tensors: tuple[str, ...]
    itemsize: tuple[int, ...]
    tensor_of: np.ndarray
    elem_start: np.ndarray
    elem_end: np.ndarray
    first_block: np.ndarray

    @property
    def n_blocks(self) -> int:
        return int(self.tensor_of.size)

    def tensor_index(self) -> dict[str, int]:
        return {name: t for t, name in enumerate(self.tensors)}

    def block_bytes(self) -> np.ndarray:
        items = np.asarray(self.itemsize, dtype=np.int64)[self.tensor_of]
        return (self.elem_end - self.elem_start) * items

    def blocks_of(self, t: int) -> range:
        return range(int(self.first_block[t]), int(self.first_block[t + 1]))


def build_layout(base: Checkpoint, block_size: int) -> BlockLayout:
    """Split every floating-point tensor of the base into row blocks of about block_size bytes."""
    file_rank = {f: k for k, f in enumerate(base.files)}
    locs = sorted(
        (loc for loc in base.tensors.values() if loc.dtype in FLOAT_DTYPES),
        key=lambda loc: (file_rank[loc.file], loc.start, loc.name),
    )
    names, items, tensor_of, starts, ends, first = [], [], [], [], [], [0]
    for t, loc in enumerate(locs):
        itemsize = loc.size_bytes // max(1, math.prod(loc.shape)) if loc.shape else loc.size_bytes
        numel = math.prod(loc.shape)
        if numel and itemsize == 0:
            itemsize = 1
        row = math.prod(loc.shape[1:]) if len(loc.shape) >= 2 else 1
        rows_per_block = max(1, block_size // max(1, row * max(1, itemsize)))
        step = max(1, rows_per_block * row)  # row is 0 for a (n, 0) tensor: one empty block
        names.append(loc.name)
        items.append(max(1, itemsize))
        for s in range(0, max(numel, 1), step):
            tensor_of.append(t)
            starts.append(s)
            ends.append(min(numel, s + step))
        first.append(len(tensor_of))
    return BlockLayout(
        block_size,
        tuple(names),
        tuple(items),
        np.asarray(tensor_of, dtype=np.int32),
        np.asarray(starts, dtype=np.int64),
        np.asarray(ends, dtype=np.int64),
        np.asarray(first, dtype=np.int64),
    )


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """Statistics of one family (base + experts in spec order) at one block size."""

    key: str
    layout: BlockLayout
    base_hash: np.ndarray  # (B,) uint64
    expert_hash: np.ndarray  # (N, B) uint64
    norms: np.ndarray  # (N, B) float64, ||D_ib||
    zero: np.ndarray  # (N, B) bool, expert bytes == base bytes
    gram: np.ndarray  # (B, N, N) float64, <D_ib, D_jb>
    has_gram: bool = True  # False: only the diagonal is known (statistics from sidecars)
    #: (N, T) bytes per element of each expert's tensors; None: the base's (``layout.itemsize``)
    expert_itemsize: np.ndarray | None = None

    @property
    def n_experts(self) -> int:
        return int(self.norms.shape[0])

    def expert_block_bytes(self) -> np.ndarray:
        """(N, B) bytes of each expert's blocks: what reading them costs."""
        if self.expert_itemsize is None:
            return np.broadcast_to(self.layout.block_bytes(), self.norms.shape)
        elems = self.layout.elem_end - self.layout.elem_start
        return elems[None, :] * self.expert_itemsize[:, self.layout.tensor_of]

    def tensor_norms(self) -> np.ndarray:
        """(N, T) per-tensor delta norms."""
        sq = self.norms**2
        out = np.zeros((self.n_experts, len(self.layout.tensors)))
        np.add.at(out.T, self.layout.tensor_of, sq.T)
        return np.sqrt(out)


def family_key(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int) -> str:
    blob = json.dumps(
        {
            "v": INDEX_VERSION,
            "block_size": block_size,
            "base": base.identity_json(),
            "experts": [e.identity_json() for e in experts],
        },
        sort_keys=True,
    ).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def _pointer_key(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int) -> str:
    blob = json.dumps([str(base.root), [str(e.root) for e in experts], block_size]).encode()
    return xxhash.xxh3_64_hexdigest(blob)


def _source_ranges(src: Checkpoint, layout: BlockLayout, b0: int, b1: int) -> ReadRange:
    t = int(layout.tensor_of[b0])
    loc = src.tensors[layout.tensors[t]]
    item = DTYPES[loc.dtype][0]  # the source's own dtype: experts may differ from the base
    return ReadRange(loc.file, loc.start + int(layout.elem_start[b0]) * item,
                     loc.start + int(layout.elem_end[b1 - 1]) * item)


def _chunks(layout: BlockLayout) -> list[tuple[int, int]]:
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


@dataclass(frozen=True, eq=False)
class BlockStats:
    """The statistics of blocks ``[lo, lo + len(base_hash))`` (one builder's arrays): what a
    chunk runner hands back, and what :func:`build_index` assembles into the index."""

    lo: int
    base_hash: np.ndarray  # (b,) uint64
    expert_hash: np.ndarray  # (N, b) uint64
    norms: np.ndarray  # (N, b) float64
    zero: np.ndarray  # (N, b) bool
    gram: np.ndarray  # (b, N, N) float64
    bytes_read: int = 0


#: Runs the chunks of an index build elsewhere (e.g. as Ray tasks, :mod:`mergefs.rayexec`):
#: given the family, its layout and every chunk ``(b0, b1)`` in order, yields BlockStats
#: covering every chunk's blocks exactly once, in any order.
ChunkRunner = Callable[[Checkpoint, Sequence[Checkpoint], BlockLayout, list[tuple[int, int]]],
                       Iterable[BlockStats]]


class _Builder:
    def __init__(self, base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                 on_bytes: Callable[[int], None] | None, blocks: range | None = None) -> None:
        """``blocks``: the blocks this builder holds (default: all)."""
        self.base, self.experts, self.layout = base, experts, layout
        blocks = blocks if blocks is not None else range(layout.n_blocks)
        self.lo = blocks.start
        n, b = len(experts), len(blocks)
        self.base_hash = np.zeros(b, dtype=np.uint64)
        self.expert_hash = np.zeros((n, b), dtype=np.uint64)
        self.norms = np.zeros((n, b), dtype=np.float64)
        self.zero = np.zeros((n, b), dtype=bool)
        self.gram = np.zeros((b, n, n), dtype=np.float64)
        self.on_bytes = on_bytes
        self.lock = threading.Lock()

    def stats(self) -> BlockStats:
        return BlockStats(self.lo, self.base_hash, self.expert_hash, self.norms, self.zero,
                          self.gram)

    def put(self, part: BlockStats) -> None:
        """Take the statistics of blocks built elsewhere (a chunk runner's)."""
        s = slice(part.lo - self.lo, part.lo - self.lo + part.base_hash.size)
        self.base_hash[s], self.expert_hash[:, s] = part.base_hash, part.expert_hash
        self.norms[:, s], self.zero[:, s], self.gram[s] = part.norms, part.zero, part.gram

    def prefetch(self, b0: int, b1: int) -> None:
        """Ask the kernel to start reading blocks [b0, b1) of every local source (no wait)."""
        for src in [self.base, *self.experts]:
            if src.is_remote:
                continue
            r = _source_ranges(src, self.layout, b0, b1)
            os.posix_fadvise(src.fds()[r.file], r.start, r.end - r.start,
                             os.POSIX_FADV_WILLNEED)

    def chunk(self, b0: int, b1: int) -> None:
        lay = self.layout
        t = int(lay.tensor_of[b0])
        dtype = self.base.tensors[lay.tensors[t]].dtype
        item = lay.itemsize[t]
        origin = int(lay.elem_start[b0])
        got = read_many([(src, [_source_ranges(src, lay, b0, b1)])
                         for src in [self.base, *self.experts]])
        base_buf, bufs = got[0][0], [g[0] for g in got[1:]]
        dtypes = [e.tensors[lay.tensors[t]].dtype for e in self.experts]  # may differ from base
        scratch = np.empty((len(self.experts), GRAM_COLS), dtype=np.float64)
        for b in range(b0, b1):
            e0, e1 = int(lay.elem_start[b]) - origin, int(lay.elem_end[b]) - origin
            bb = base_buf[e0 * item:e1 * item]
            base_hash = xxhash.xxh3_64_intdigest(bb)
            k = b - self.lo  # where block b lives in this builder's arrays
            self.base_hash[k] = base_hash
            base_u8 = np.frombuffer(bb, dtype=np.uint8)
            live: list[tuple[int, memoryview, str]] = []  # experts whose block differs
            for i, buf in enumerate(bufs):
                ei = DTYPES[dtypes[i]][0]
                eb = buf[e0 * ei:e1 * ei]
                h = xxhash.xxh3_64_intdigest(eb)
                self.expert_hash[i, k] = h
                if dtypes[i] == dtype and h == base_hash and np.array_equal(
                        np.frombuffer(eb, dtype=np.uint8), base_u8):
                    self.zero[i, k] = True
                else:
                    live.append((i, eb, dtypes[i]))
            if live:
                self._gram(k, live, decode_f32(bb, dtype), scratch)
        if self.on_bytes is not None:
            with self.lock:
                self.on_bytes(len(base_buf) + sum(len(x) for x in bufs))

    def _gram(self, k: int, live: list[tuple[int, memoryview, str]], w0: np.ndarray,
              scratch: np.ndarray) -> None:
        """Gram matrix and norms of the non-zero deltas of the block at ``k`` of this
        builder's arrays (zero-delta rows stay 0).

        Deltas are float32 ``W_i - W0`` widened to float64 and accumulated in float64, as
        always; they are made GRAM_COLS columns at a time so that they stay in the CPU cache.
        """
        rows = [i for i, _, _ in live]
        g = np.zeros((len(rows), len(rows)), dtype=np.float64)
        values = {dt: np.zeros(GRAM_COLS, dtype=np.float32) for _, _, dt in live}  # per dtype
        for s in range(0, w0.size, GRAM_COLS):
            e = min(w0.size, s + GRAM_COLS)
            d = scratch[: len(rows), : e - s]
            for r, (_, eb, dt) in enumerate(live):
                item = DTYPES[dt][0]
                wi = _decode_into(eb[s * item : e * item], dt, values[dt][: e - s])
                np.subtract(wi, w0[s:e], out=d[r])  # float32 difference, stored as float64
            g += d @ d.T
        self.gram[k][np.ix_(rows, rows)] = g
        self.norms[rows, k] = np.sqrt(np.diag(g))


def _decode_into(raw: memoryview, dtype: str, out: np.ndarray) -> np.ndarray:
    """The float32 values of ``raw`` (exactly ``decode_f32``), in ``out`` unless no copy is
    needed. For BF16, ``out`` must be all zero bits on the first call and only ever used
    here for BF16."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4")
    if dtype == "BF16":  # bf16 is the top half of a float32; the low halves of out stay 0
        out.view("<u2")[1::2] = np.frombuffer(raw, dtype="<u2")
        return out
    np.copyto(out, np.frombuffer(raw, dtype=NUMPY_DTYPES[dtype]), casting="unsafe")
    return out


def chunk_stats(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                chunks: Sequence[tuple[int, int]]) -> BlockStats:
    """The statistics of consecutive chunks (blocks ``chunks[0][0]`` to ``chunks[-1][1]``),
    computed by the code of the local build: what a chunk runner's task returns."""
    keep_freed_memory()
    read = [0]

    def count(n: int) -> None:
        read[0] += n

    builder = _Builder(base, experts, layout, count, range(chunks[0][0], chunks[-1][1]))
    for k, (b0, b1) in enumerate(chunks):
        if k + PREFETCH_CHUNKS < len(chunks):
            builder.prefetch(*chunks[k + PREFETCH_CHUNKS])
        builder.chunk(b0, b1)
    return replace(builder.stats(), bytes_read=read[0])


def build_index(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                on_bytes: Callable[[int], None] | None = None, threads: int = 2,
                runner: ChunkRunner | None = None) -> BlockIndex:
    """Read every base and expert block once and compute the statistics.

    While a worker computes, the kernel is already reading the chunks PREFETCH_CHUNKS ahead
    (``POSIX_FADV_WILLNEED``), so the disk never waits for the CPU. ``runner``: compute the
    chunks elsewhere (each part's bytes go to ``on_bytes`` when it arrives).
    """
    keep_freed_memory()  # reuse the freed chunk buffers: no page faults per chunk
    builder = _Builder(base, experts, layout, on_bytes)
    chunks = _chunks(layout)
    if runner is not None:
        for part in runner(base, experts, layout, chunks):
            builder.put(part)
            if on_bytes is not None:
                on_bytes(part.bytes_read)
        return BlockIndex(family_key(base, experts, layout.block_size), layout,
                          builder.base_hash, builder.expert_hash, builder.norms, builder.zero,
                          builder.gram)

    def task(k: int) -> None:
        if k + PREFETCH_CHUNKS < len(chunks):
            builder.prefetch(*chunks[k + PREFETCH_CHUNKS])
        builder.chunk(*chunks[k])

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mergefs-index") as pool:
        for k in range(min(PREFETCH_CHUNKS, len(chunks))):
            builder.prefetch(*chunks[k])
        for fut in [pool.submit(task, k) for k in range(len(chunks))]:
            fut.result()
    return BlockIndex(family_key(base, experts, layout.block_size), layout, builder.base_hash,
                      builder.expert_hash, builder.norms, builder.zero, builder.gram)


def index_bytes_total(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout) -> int:
    elems = np.bincount(layout.tensor_of, layout.elem_end - layout.elem_start,
                        len(layout.tensors))
    items = [[DTYPES[e.tensors[name].dtype][0] for name in layout.tensors] for e in experts]
    per_elem = np.asarray(items, np.int64).reshape(len(experts), len(layout.tensors))
    return int(layout.block_bytes().sum()) + int((per_elem @ elems).sum())  # 0 experts: 0


def _expert_itemsize(experts: Sequence[Checkpoint], layout: BlockLayout) -> np.ndarray:
    """(N, T) bytes each expert reads per element of its tensors (their dtypes may differ from
    the base's; a LoRA expert computes its adapted tensors from the base's bytes: 0)."""
    out = np.zeros((len(experts), len(layout.tensors)), dtype=np.int64)
    for i, e in enumerate(experts):
        out[i] = [e.read_itemsize(name) for name in layout.tensors]
    return out


def _save(index: BlockIndex, path: Path, meta: dict[str, str]) -> None:
    lay = index.layout
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(
        {
            "base_hash": index.base_hash,
            "expert_hash": index.expert_hash,
            "norms": index.norms,
            "zero": index.zero,
            "gram": index.gram,
            "tensor_of": lay.tensor_of,
            "elem_start": lay.elem_start,
            "elem_end": lay.elem_end,
        },
        str(tmp),
        metadata=meta,
    )
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, key: str, layout: BlockLayout) -> BlockIndex | None:
    try:
        arrays = load_file(str(path))
        with safe_open(str(path), "np") as f:
            has_gram = (f.metadata() or {}).get("gram", "full") == "full"
    except Exception as exc:  # a corrupt index is rebuilt, never trusted
        log.warning("ignoring unreadable index %s: %s", path, exc)
        return None
    if not (
        np.array_equal(arrays["tensor_of"], layout.tensor_of)
        and np.array_equal(arrays["elem_start"], layout.elem_start)
        and np.array_equal(arrays["elem_end"], layout.elem_end)
    ):
        log.warning("ignoring index %s: block layout differs", path)
        return None
    return BlockIndex(key, layout, arrays["base_hash"], arrays["expert_hash"], arrays["norms"],
                      arrays["zero"], arrays["gram"], has_gram)


def _why_rebuilt(pointer: Path, base: Checkpoint, experts: Sequence[Checkpoint]) -> str:
    try:
        old = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return "no index yet for this family and block size"
    for src in [base, *experts]:
        before = old.get("sources", {}).get(str(src.root))
        now = src.identity_json()
        if before != now:
            return f"{src.root} changed since the last index (size, mtime or header differ)"
    return "the previous index file is missing"


def _ctimes(sources: Sequence[Checkpoint]) -> dict[str, int]:
    """Status-change time of every local weight file. ``utime`` cannot set it back, so a file
    rewritten in place with its size, header and mtime kept still shows as changed."""
    out: dict[str, int] = {}
    for src in sources:
        if src.is_remote:
            continue
        for f in src.files:
            try:
                out[str(src.path_of(f))] = os.stat(src.path_of(f)).st_ctime_ns
            except OSError:
                pass  # opening it will say what is wrong
    return out


def _ctime_moved(pointer: Path, key: str, ctimes: dict[str, int]) -> str | None:
    """Why the stored index of ``key`` may be stale although every identity matches, or None.

    No evidence (no pointer, another key, an index written before ctimes were recorded) is
    not a reason: the identity check stands as before."""
    try:
        old = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or old.get("key") != key:
        return None
    recorded = old.get("ctime_ns")
    if not isinstance(recorded, dict):
        return None
    for path, now in ctimes.items():
        if recorded.get(path, now) != now:
            return (f"{path} was modified since the last index (its status-change time moved "
                    "while size, mtime and header stayed the same)")
    return None


def _build_with_sidecars(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                         on_bytes: Callable[[int], None] | None,
                         runner: ChunkRunner | None = None) -> BlockIndex:
    """Read the base and the experts without a usable sidecar; take the rest from sidecars."""
    from . import sidecar

    found = sidecar.find(base, experts, layout)
    rest = [i for i in range(len(experts)) if i not in found]
    index = build_index(base, [experts[i] for i in rest], layout, on_bytes, runner=runner)
    for i, stats in list(found.items()):
        if not np.array_equal(stats.base_hash, index.base_hash):
            log.warning("ignoring index sidecar of %s: published against a base whose bytes "
                        "differ from %s", experts[i].root, base.root)
            del found[i]
    if not found:
        if rest != list(range(len(experts))):  # every sidecar was stale: read all
            return build_index(base, experts, layout, on_bytes, runner=runner)
        return index
    log.info("block index: %d of %d experts from published sidecars (not read)", len(found),
             len(experts))
    late = [i for i in range(len(experts)) if i not in found and i not in rest]
    extra = build_index(base, [experts[i] for i in late], layout, on_bytes,
                        runner=runner) if late else None
    n, nb = len(experts), layout.n_blocks
    expert_hash = np.zeros((n, nb), np.uint64)
    norms = np.zeros((n, nb))
    zero = np.zeros((n, nb), bool)
    gram = np.zeros((nb, n, n))
    for group, src in ((rest, index), (late, extra)):
        if src is None:
            continue
        for k, i in enumerate(group):
            expert_hash[i], norms[i], zero[i] = src.expert_hash[k], src.norms[k], src.zero[k]
        sel = np.asarray(group, dtype=np.intp)
        gram[:, sel[:, None], sel[None, :]] = src.gram  # cross terms within one read group
    for i, stats in found.items():
        expert_hash[i], norms[i], zero[i] = stats.expert_hash, stats.norms, stats.zero
        gram[:, i, i] = stats.norms**2
    return BlockIndex(family_key(base, experts, layout.block_size), layout, index.base_hash,
                      expert_hash, norms, zero, gram, has_gram=False)


def load_or_build(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int,
                  index_dir: str | Path, on_bytes: Callable[[int], None] | None = None,
                  rebuild: bool = False, sidecars: bool = True,
                  runner: ChunkRunner | None = None) -> tuple[BlockIndex, bool]:
    """Return (index, built_now). Reuses a stored index while every source is unchanged.

    With ``sidecars`` (the default), remote experts with a matching published sidecar are not
    read; without, only an index read from every source (with the full Gram) is accepted.
    ``runner``: where a build computes its chunks (default: two local threads).
    """
    layout = build_layout(base, block_size)
    key = family_key(base, experts, block_size)
    folder = Path(index_dir)
    path = folder / f"{key}.safetensors"
    pointer = folder / f"family-{_pointer_key(base, experts, block_size)}.json"
    ctimes = _ctimes([base, *experts])  # before reading: a change during the build shows later
    stale = None if rebuild else _ctime_moved(pointer, key, ctimes)
    if path.is_file() and not rebuild and stale is None:
        index = _load(path, key, layout)
        if index is not None and index.n_experts == len(experts) and (index.has_gram or sidecars):
            return replace(index, expert_itemsize=_expert_itemsize(experts, layout)), False
    log.info("building block index: %s", "rebuild requested" if rebuild
             else stale or _why_rebuilt(pointer, base, experts))
    if sidecars and any(e.is_remote for e in experts):
        index = _build_with_sidecars(base, experts, layout, on_bytes, runner)
    else:
        index = build_index(base, experts, layout, on_bytes, runner=runner)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _save(index, path, {"mergefs_index_version": INDEX_VERSION, "key": key,
                            "block_size": str(block_size),
                            "gram": "full" if index.has_gram else "diagonal"})
        sources = {str(s.root): s.identity_json() for s in [base, *experts]}
        tmp = pointer.with_name(pointer.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "sources": sources, "ctime_ns": ctimes},
                                  indent=1))
        os.replace(tmp, pointer)
    except OSError as exc:
        raise SourceError(f"{folder}: cannot write the index: {exc.strerror}") from None
    return replace(index, expert_itemsize=_expert_itemsize(experts, layout)), True
