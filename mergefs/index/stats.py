"""Pure block statistics: hashes, zero flags and Gram terms of delta blocks, from bytes.

No I/O, no state: each function takes the raw little-endian bytes of some blocks and returns
arrays, so the same code runs in the index builder's threads or in a remote task (Ray: one task
per expert and range of blocks). ``spans`` are the blocks' element ranges ``[start, end)``
relative to the first element of the buffers they index. Nothing here runs on the trio thread.

**The summation order** (the index's reference; :data:`ORDER_VERSION` names it). Every Gram
term ``<X_b, Y_b>`` of a block of ``n`` elements, where ``X`` and ``Y`` are deltas
``D_i = fl32(W_i - W0)`` (each side decoded to float32 and subtracted in float32) or the base's
values ``W0`` (side :data:`BASE`: the base norms), is

1. the products ``float64(x_j) * float64(y_j)`` (each exact widening, one rounding), with the
   block padded with zeros to a multiple of :data:`LANES` elements;
2. summed in ``LANES`` lanes: element ``j`` goes to lane ``j mod LANES``, each lane a
   sequential float64 sum from ``+0.0`` in increasing ``j`` (no FMA; padding adds ``+0.0``,
   which changes no lane: a lane is never ``-0.0``);
3. the lanes combined by a fixed tree: ``v = v[0::2] + v[1::2]`` until one is left;
4. a NaN result stored as numpy's ``nan`` (payloads depend on operand order; infinities and
   every other value are kept as they are).

A term depends only on its two sides' bytes and dtypes, not on which other experts are indexed
with it or in what order: an index assembled from pieces equals, bit for bit, one built at
once.

**Sketches** (:data:`SKETCH_VERSION`). Each expert piece also holds, per block, a CountSketch
of the block's delta: ``k`` = :func:`sketch_buckets` buckets; element ``j`` of block ``b``
(position in the block, blocks numbered as in the layout) adds ``s_bj * x_j`` to bucket
``h_bj mod k``, with ``h_bj`` splitmix64's finaliser of ``key_b + j`` (``key_b`` from the
block number and :data:`SKETCH_SEED`, :func:`sketch_key`) and the sign ``s_bj`` its top bit.
Every expert uses the same hash, so ``<S D_ib, S D_jb>`` estimates the Gram cross term
``<D_ib, D_jb>`` from two pieces, without reading either expert again
(:mod:`mergefs.plan.planner` states the error bar). Each bucket is a float64 sequential sum in
increasing ``j`` per column tile (tiles added in order), stored as float32. A block of at most
``k`` elements is stored whole instead (bucket ``j``, sign +): its estimates are exact.

The compiled kernels (:mod:`mergefs.methods.kernels`, numba) compute steps 1-2 vectorised across
lanes; without numba the numpy path here computes them (sequential reductions over the lane
axis) with the same bits, slower.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from mergefs.methods import kernels
from mergefs.core.dtypes import decode_f32
from mergefs.core.format import DTYPES

LANES = 64  # the summation order's lane count (a power of two)
GRAM_ROWS = 512  # (GRAM_ROWS, LANES) products at a time in the numpy path
GRAM_COLS = 32768  # columns of a block decoded at a time (a multiple of LANES)
BASE = -1  # a Gram side that is the base's values W0 rather than a delta
#: names the summation order above: written into index pieces (mergefs.index.store) and
#: published sidecars (mergefs.index.published), which are ignored, with a log line, where it differs
ORDER_VERSION = "lanes64-tree"

#: the sketch's hash and bucket rule (above); written into expert pieces
SKETCH_VERSION = "countsketch-splitmix64-1"
SKETCH_SEED = 0x6D65726765667331  # any fixed value: all that matters is that it is shared
SKETCH_SHARE = 1024  # block_size // SKETCH_SHARE buckets: float32 sketches ~0.4% of bf16 blocks
MIN_SKETCH_BUCKETS = 16
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)

Buffer = memoryview | bytes
Spans = Sequence[tuple[int, int]]


def sketch_buckets(block_size: int) -> int:
    """``k``, the buckets of every block's sketch at this block size (1 MiB: 1024, 4 KiB of
    float32 per block of 512 Ki bf16 elements)."""
    return max(MIN_SKETCH_BUCKETS, block_size // SKETCH_SHARE)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sketch_key(block: int) -> np.uint64:
    """The hash key of one block (its number in the layout)."""
    with np.errstate(over="ignore"):
        return np.uint64(_mix(np.asarray([SKETCH_SEED ^ block], dtype=np.uint64))[0])


def sketch_hash(key: np.uint64, c0: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(buckets (n,) int64, negative (n,) bool) of positions ``[c0, c0 + n)`` of a block."""
    with np.errstate(over="ignore"):
        z = _mix(np.arange(c0, c0 + n, dtype=np.uint64) + key)
    return (z % np.uint64(k)).astype(np.int64), (z >> np.uint64(63)) != 0


def _sketch_tile(kern: Any, d: np.ndarray, rows: np.ndarray, key: np.uint64, c0: int, n: int,
                 k: int) -> np.ndarray:
    """(len(rows), k) float64: the sketch of columns ``[0, n)`` of ``d``'s ``rows``."""
    out = np.zeros((len(rows), k), dtype=np.float64)
    if kern is not None:
        kern.sketch_tile(d, rows, key, c0, n, out)
        return out
    buckets, neg = sketch_hash(key, c0, n, k)
    for q, r in enumerate(rows):
        v = d[r, :n].astype(np.float64)
        out[q] = np.bincount(buckets, weights=np.where(neg, -v, v), minlength=k)
    return out


def hash_blocks(spans: Spans, buf: Buffer, dtype: str) -> np.ndarray:
    """(n,) uint64: the xxh3 of each block's bytes in ``buf`` (one tensor's run of blocks)."""
    item = DTYPES[dtype][0]
    return np.asarray([xxhash.xxh3_64_intdigest(buf[s * item:e * item]) for s, e in spans],
                      dtype=np.uint64)


def zero_blocks(spans: Spans, base: Buffer, base_dtype: str, base_hash: np.ndarray,
                expert: Buffer, expert_dtype: str, expert_hash: np.ndarray) -> np.ndarray:
    """(n,) bool: the expert's block is byte-identical to the base's (hash, then compare)."""
    out = np.zeros(len(spans), dtype=bool)
    if expert_dtype != base_dtype:
        return out
    item = DTYPES[base_dtype][0]
    for k, (s, e) in enumerate(spans):
        if expert_hash[k] == base_hash[k]:
            out[k] = _same(base[s * item:e * item], expert[s * item:e * item])
    return out


def _same(a: Buffer, b: Buffer) -> bool:
    """``a == b`` as bytes, without a copy (a memoryview compares item by item, ~1 GB/s)."""
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    return x.size == y.size and bool(np.array_equal(x, y))


def block_views(spans: Spans, buf: Buffer, dtype: str) -> list[memoryview]:
    """The bytes of each block of ``buf``."""
    item = DTYPES[dtype][0]
    view = memoryview(buf)
    return [view[s * item:e * item] for s, e in spans]


def gram_terms(sizes: Sequence[int], base: Sequence[Buffer | None], base_dtype: str,
               experts: Sequence[Sequence[Buffer | None]], dtypes: Sequence[str],
               pairs: Sequence[tuple[int, int]],
               sketch: dict[int, np.ndarray] | None = None, first_block: int = 0
               ) -> np.ndarray:
    """(P, n) float64: ``<X_rb, X_sb>`` for each pair ``(r, s)`` of ``pairs`` and each block
    ``b`` of ``n`` blocks of ``sizes`` elements, in the module's summation order. ``X_r`` is
    expert r's delta ``D_r`` (``r == s``: its squared norm), or the base's values where r is
    :data:`BASE` (``(BASE, BASE)``: ``||W0_b||^2``).

    ``experts[r][b]`` is expert r's bytes of block b, or None where its delta is known to be zero
    or is not wanted: a term with a None side is 0. ``base[b]`` may be None only where no pair
    has both sides.

    ``sketch``: expert row r -> (n, k) float64, zeroed, into which each block's sketch of
    ``D_r`` is written (the module docstring; ``first_block``: the layout's number of block 0
    here); r must have its pair ``(r, r)`` so that its delta is decoded.
    """
    out = np.zeros((len(pairs), len(sizes)), dtype=np.float64)
    sketch = sketch or {}
    k = kernels.index_kernels()
    with np.errstate(all="ignore"):  # infinities and NaNs are values here
        for b, n in enumerate(sizes):
            have = {BASE: base[b] is not None} | {r: e[b] is not None
                                                  for r, e in enumerate(experts)}
            want = [p for p, (r, s) in enumerate(pairs) if have[r] and have[s]]
            if not want:
                continue
            rows = sorted({x for p in want for x in pairs[p]})
            slot = {r: q for q, r in enumerate(rows)}
            idx = np.asarray([(slot[pairs[p][0]], slot[pairs[p][1]]) for p in want],
                             dtype=np.int64)
            acc = np.zeros((len(want), LANES), dtype=np.float64)
            sk = [r for r in sketch if r in slot]
            sk_rows = np.asarray([slot[r] for r in sk], dtype=np.int64)
            sk_k = sketch[sk[0]].shape[1] if sk else 0
            whole = n <= sk_k  # a block no larger than the sketch is stored as it is
            key = sketch_key(first_block + b)
            # column tiles of GRAM_COLS (a multiple of LANES): each lane still sums its
            # elements in increasing j, tile after tile, so the bits equal one pass over the
            # block; the working set is rows x GRAM_COLS float32 whatever the block size
            for c0 in range(0, n, GRAM_COLS):
                c1 = min(n, c0 + GRAM_COLS)
                d = _scratch(len(rows), -(-(c1 - c0) // LANES) * LANES)
                w0 = _decode(k, _cols(base[b], base_dtype, c0, c1),  # type: ignore[arg-type]
                             base_dtype, c1 - c0)
                for r in rows:
                    if r == BASE:
                        d[slot[r], :c1 - c0] = w0
                    else:
                        _delta(k, _cols(experts[r][b], dtypes[r], c0, c1),  # type: ignore
                               dtypes[r], w0, d[slot[r], :c1 - c0])
                if k is not None:
                    k.gram_lanes(d, idx, acc)
                else:
                    _lanes_numpy(d, idx, acc)
                if sk and whole:
                    for q, r in enumerate(sk):
                        sketch[r][b, c0:c1] = d[sk_rows[q], :c1 - c0]
                elif sk:
                    got = _sketch_tile(k, d, sk_rows, key, c0, c1 - c0, sk_k)
                    for q, r in enumerate(sk):
                        sketch[r][b] += got[q]
            out[want, b] = combine_lanes(acc)
    return out


def _cols(raw: Buffer, dtype: str, c0: int, c1: int) -> memoryview:
    """The bytes of elements ``[c0, c1)`` of ``raw`` (a view, no copy)."""
    item = DTYPES[dtype][0]
    return memoryview(raw)[c0 * item:c1 * item]


def combine_lanes(acc: np.ndarray) -> np.ndarray:
    """(P,) the lanes of each row of ``acc`` (P, LANES) summed by the fixed tree; NaN as
    numpy's ``nan``."""
    v = acc
    while v.shape[1] > 1:
        v = v[:, 0::2] + v[:, 1::2]
    v = v[:, 0].copy()
    v[np.isnan(v)] = np.nan
    return v


_local = threading.local()


def _scratch(rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float32 of this thread, reused from block to block; columns from the
    caller's ``n`` on are zero (the padding)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < rows * cols:
        buf = _local.buf = np.empty(max(rows * cols, 1 << 20), dtype=np.float32)
    d = buf[: rows * cols].reshape(rows, cols)
    d[:, cols - LANES:] = 0  # the padding lies in the last LANES columns
    return d


def _decode(k: Any, raw: Buffer, dtype: str, n: int) -> np.ndarray:
    """The float32 values of ``n`` elements of ``raw`` (exactly ``decode_f32``)."""
    if k is None or dtype not in ("BF16", "F16"):
        return decode_f32(raw, dtype)
    src = _ro(raw, "<u2")
    out = np.empty(n, dtype=np.float32)
    if dtype == "BF16":
        k.dec_bf16(src, out)
    else:
        k.dec_f16(src, out, kernels.F16_TABLE)
    return out


def _delta(k: Any, raw: Buffer, dtype: str, w0: np.ndarray, out: np.ndarray) -> None:
    """``out = fl32(decode(raw) - w0)``."""
    if k is not None and dtype == "BF16":
        k.idx_delta_bf16(_ro(raw, "<u2"), w0, out)
    elif k is not None and dtype == "F16":
        k.idx_delta_f16(_ro(raw, "<u2"), w0, out, kernels.F16_TABLE)
    elif k is not None and dtype == "F32":
        k.idx_delta_f32(_ro(raw, "<f4"), w0, out)
    else:
        np.subtract(decode_f32(raw, dtype), w0, out=out)


def _ro(raw: Buffer, dtype: str) -> np.ndarray:
    a = np.frombuffer(raw, dtype=dtype)
    a.flags.writeable = False  # one array type whatever the buffer: fewer signatures to compile
    return a


def _lanes_numpy(d: np.ndarray, idx: np.ndarray, acc: np.ndarray) -> None:
    """``gram_lanes`` in numpy: per pair, the (m, LANES) products reduced over axis 0 (numpy
    adds the rows of a C-ordered array one after another: a sequential sum per lane), GRAM_ROWS
    rows at a time, each slice starting from the lanes so far."""
    m = d.shape[1] // LANES
    for p, (r, s) in enumerate(idx):
        x, y = d[r].reshape(m, LANES), d[s].reshape(m, LANES)
        for k0 in range(0, m, GRAM_ROWS):
            prod = x[k0:k0 + GRAM_ROWS].astype(np.float64) * y[k0:k0 + GRAM_ROWS]
            prod[0] += acc[p]
            acc[p] = np.add.reduce(prod, axis=0)


@dataclass(frozen=True, eq=False)
class RangeStats:
    """Statistics of one expert over one run of blocks of one tensor (n blocks)."""

    base_hash: np.ndarray  # (n,) uint64
    expert_hash: np.ndarray  # (n,) uint64
    zero: np.ndarray  # (n,) bool
    sq_norms: np.ndarray  # (n,) float64, ||D_b||^2


def expert_range_stats(spans: Spans, base: Buffer, base_dtype: str, expert: Buffer,
                       expert_dtype: str) -> RangeStats:
    """One expert's piece over one run of blocks: the unit of work of a distributed build.

    ``base`` and ``expert`` hold the run's bytes of one tensor (each in its own dtype); the
    result equals the builder's for those blocks, bit for bit.
    """
    bh = hash_blocks(spans, base, base_dtype)
    eh = hash_blocks(spans, expert, expert_dtype)
    zero = zero_blocks(spans, base, base_dtype, bh, expert, expert_dtype, eh)
    views = block_views(spans, expert, expert_dtype)
    sq = gram_terms([e - s for s, e in spans], block_views(spans, base, base_dtype), base_dtype,
                    [[None if z else v for z, v in zip(zero, views)]], [expert_dtype], [(0, 0)])
    return RangeStats(bh, eh, zero, sq[0])
