"""Pure block statistics: hashes, zero flags and Gram terms of delta blocks, from bytes.

No I/O, no state: each function takes the raw little-endian bytes of some blocks and returns
arrays, so the same code runs in the index builder's threads or in a remote task (Ray: one task
per expert and range of blocks). ``spans`` are the blocks' element ranges ``[start, end)``
relative to the first element of the buffers they index. Nothing here runs on the trio thread.

Every Gram term ``<D_ib, D_jb>`` is computed from the two deltas alone (float32 ``W - W0``
widened to float64, GRAM_COLS columns at a time, a product and numpy's pairwise sum per slice,
accumulated in float64 in slice order), so its value does not depend on which other experts are indexed with
it or in what order: an index assembled from pieces equals, bit for bit, one built at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from .dtypes import NUMPY_DTYPES, decode_f32
from .format import DTYPES

GRAM_COLS = 32768  # delta columns per Gram update (float64 rows of the experts stay in cache)

Buffer = memoryview | bytes
Spans = Sequence[tuple[int, int]]


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
            out[k] = base[s * item:e * item] == expert[s * item:e * item]
    return out


def block_views(spans: Spans, buf: Buffer, dtype: str) -> list[memoryview]:
    """The bytes of each block of ``buf``."""
    item = DTYPES[dtype][0]
    view = memoryview(buf)
    return [view[s * item:e * item] for s, e in spans]


def gram_terms(sizes: Sequence[int], base: Sequence[Buffer | None], base_dtype: str,
               experts: Sequence[Sequence[Buffer | None]], dtypes: Sequence[str],
               pairs: Sequence[tuple[int, int]]) -> np.ndarray:
    """(P, n) float64: ``<D_rb, D_sb>`` for each pair ``(r, s)`` of ``pairs`` (``r == s``: the
    squared norm) and each block ``b`` of ``n`` blocks of ``sizes`` elements.

    ``experts[r][b]`` is expert r's bytes of block b, or None where its delta is known to be zero
    or is not wanted: a term with a None side is 0. ``base[b]`` may be None only where no pair
    has both sides.
    """
    out = np.zeros((len(pairs), len(sizes)), dtype=np.float64)
    for b, n in enumerate(sizes):
        want = [p for p, (r, s) in enumerate(pairs)
                if experts[r][b] is not None and experts[s][b] is not None]
        if not want:
            continue
        rows = sorted({x for p in want for x in pairs[p]})
        slot = {r: q for q, r in enumerate(rows)}
        w0 = decode_f32(base[b], base_dtype)  # type: ignore[arg-type]
        scratch = np.empty((len(rows), min(GRAM_COLS, n)), dtype=np.float64)
        values = {dtypes[r]: np.zeros(GRAM_COLS, dtype=np.float32) for r in rows}  # per dtype
        acc = np.zeros(len(want), dtype=np.float64)
        prod = np.empty(min(GRAM_COLS, n), dtype=np.float64)
        for s0 in range(0, n, GRAM_COLS):
            s1 = min(n, s0 + GRAM_COLS)
            d = scratch[:, : s1 - s0]
            for r in rows:
                item = DTYPES[dtypes[r]][0]
                raw = memoryview(experts[r][b])[s0 * item:s1 * item]  # type: ignore[arg-type]
                wi = _decode_into(raw, dtypes[r], values[dtypes[r]][: s1 - s0])
                np.subtract(wi, w0[s0:s1], out=d[slot[r]])  # float32 difference, as float64
            t = prod[: s1 - s0]
            for a, p in enumerate(want):  # not BLAS: a dot's rounding must not depend on
                r, s = pairs[p]           # which other rows are computed with it
                acc[a] += np.multiply(d[slot[r]], d[slot[s]], out=t).sum()
        out[want, b] = acc
    return out


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
