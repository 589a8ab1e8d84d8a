"""Reconstructing ``W_hat`` of a row block from its delta sidecar levels, in numpy, block by block.

The reference decoder: :mod:`mergefs.deltas.decode` decodes many blocks at once and equals this bit
for bit (the versions' arithmetic is described in :mod:`mergefs.deltas.sidecar`). Pure; any thread.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from mergefs.deltas.codes import (
    BLAS_VERSIONS, DELTA_VERSION, DeltaError, EXACT_LIMIT, EXACT_VERSIONS, INT8_LIMIT,
    INT8_VERSIONS, Level, bits16, dequant, from_bits16, lowrank_block_size, packed_size,
    quant_block_size, rows_block_size, unpack_bits, vq_block_size,
)


log = logging.getLogger(__name__)


# -- bit packing (little-endian bit order, value-major) -------------------------------------------


# -- the description of a sidecar ---------------------------------------------------------------


def _lowrank_v(shared: memoryview, k: int, cols: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(U column scales (k,), V (k, cols)) float32 from a lowrank level's shared range."""
    scales = np.frombuffer(shared, dtype="<f4", count=2 * k)
    body = shared[8 * k:]
    if bits == 16:
        v = np.frombuffer(body, dtype="<f2", count=k * cols).astype(np.float32)
    else:
        v = dequant(body, bits, k * cols)
    return scales[:k].copy(), v.reshape(k, cols) * scales[k:, None]


def shared_value(level: Level, shared: memoryview | bytes, cols: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A level's shared range, decoded: (U column scales, V) for ``lowrank``, (codebook,
    empty) for ``vq``."""
    if level.kind == "vq":
        return vq_codebook(shared, level), np.zeros(0, np.float32)
    return _lowrank_v(memoryview(shared), level.k, cols, level.bits)


def _u(level: Level, rows_b: int, block: memoryview, uscale: np.ndarray) -> np.ndarray:
    k = level.k
    if level.bits == 16:
        u = np.frombuffer(block, dtype="<f2", count=rows_b * k).astype(np.float32)
    else:
        u = dequant(block, level.bits, rows_b * k)
    return u.reshape(rows_b, k) * uscale[None, :]


def exact_level(level: Level, version: str) -> bool:
    """Whether ``level`` is part of version 4 or 5's exact low-rank product."""
    return version in EXACT_VERSIONS and level.kind == "lowrank" and level.bits != 16


def grid_of(levels: Sequence[Level], shared: Sequence[tuple[np.ndarray, np.ndarray] | None],
            version: str = "4") -> tuple[int, np.ndarray]:
    """``(G, W)`` of the exact low-rank product of these levels (their quantised low-rank
    levels, in order; see the module docstring): the largest grid at which every partial sum
    stays below ``2**24`` (at most 149: ``2**-149`` is the smallest float32) and, version 5,
    ``|W| <= 127`` (``<= 63`` on rows of 8-bit codes), and ``W`` (components x cols, float32
    integers).

    Deterministic on any machine: ``uscale * V`` is exact in float64, scaling by a power of two
    and ``rint`` are exact, the bound is summed exactly (``math.fsum``, Python integers).
    Raises :class:`DeltaError` when no grid holds these values (non-finite or out of range: a
    damaged sidecar)."""
    vs, us, tops = [], [], []
    for lv, sh in zip(levels, shared):
        if lv.kind == "lowrank" and lv.bits != 16:
            assert sh is not None
            us.append(sh[0])
            vs.append(sh[1])
            tops.append(np.full(lv.k, (1 << lv.bits) - 1, np.int64))
    if not vs:
        return 0, np.zeros((0, 0), np.float32)
    v = np.vstack(vs)
    u = np.concatenate(us).astype(np.float64)
    top = np.concatenate(tops)
    # x = uscale * V row by row, exact in float64 (24-bit by 24-bit products), is never
    # formed: its row peaks are max|V| * |u| (exact), and W is rint(V * (u * 2**(G-1))) (the
    # same exact products, scaled by a power of two first)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite: refused just below
        peak = (np.abs(v).max(axis=1).astype(np.float64) * np.abs(u) if v.shape[1]
                else np.zeros(len(v)))
    if not np.isfinite(peak).all() or int(top.sum()) >= EXACT_LIMIT // 2:
        raise DeltaError("low-rank values that no exact grid holds (non-finite, or too many "
                         "components): a damaged sidecar")
    total = math.fsum(float(t) * float(a) for t, a in zip(top, peak)) / 2.0
    grid = 0 if total == 0.0 else 23 - math.frexp(total)[1]  # total * 2**grid < 2**23
    # 2**-grid must be a float32 (normal or subnormal), not 0: tiny (subnormal) deltas, which
    # an honest publisher writes, take the finest grid there is (still exact: a coarser grid
    # only lowers the bound); 2**-grid overflowing is a damaged sidecar
    grid = min(grid, 149)
    if version in INT8_VERSIONS and len(peak) and float(peak.max()) > 0.0:
        # W' (2 W on rows of 8-bit codes, mergefs.deltas.intgemm) in int8: rint(p * 2**(grid-1)) <=
        # L iff p * 2**(grid-1) < L + 0.5 (exact in float64), L = 127, or 63 for 8-bit rows
        cap = np.where(top == 255, INT8_LIMIT // 2, INT8_LIMIT) + 0.5
        while bool((peak * math.ldexp(1.0, grid - 1) >= cap).any()):
            grid -= 1
    if grid < -100:
        raise DeltaError(f"low-rank values of magnitude {total:.3g}, outside what an exact "
                         "float32 grid holds: a damaged sidecar")
    w = v.astype(np.float64)
    w *= (u * math.ldexp(1.0, grid - 1))[:, None]  # ldexp: exact, not up to the libm's pow
    np.rint(w, out=w)
    # max |rint(y)| = rint(max |y|): rint is odd and monotone
    top_w = np.rint(peak * math.ldexp(1.0, grid - 1))
    bound = sum(int(t) * int(m) for t, m in zip(top.tolist(), top_w.tolist()))
    if bound >= EXACT_LIMIT:  # cannot happen for finite values (rint adds at most top / 2)
        raise DeltaError("the exact low-rank grid overflows float32 (a damaged sidecar)")
    return grid, w.astype(np.float32)


def _uq(level: Level, rows_b: int, block: memoryview) -> np.ndarray:
    """``2 * (code value)`` of a quantised low-rank level's block (rows_b, k), float32."""
    return dequant(block, level.bits, rows_b * level.k).reshape(rows_b, level.k) * 2


def rows_mask(block: memoryview, rows_b: int) -> np.ndarray:
    """The changed rows (bool, rows_b) of a ``rows`` level's block range."""
    return unpack_bits(block, 1, rows_b).astype(bool)


def _add_rows(acc: np.ndarray | None, level: Level, rows_b: int, cols: int,
              block: memoryview) -> np.ndarray:
    """``acc + fl32(code value * step)`` on the changed rows of a ``rows`` level."""
    out = np.zeros((rows_b, cols), np.float32) if acc is None else acc
    if len(block) == 0:
        return out
    mask = rows_mask(block, rows_b)
    changed = int(mask.sum())
    sub = _add_quant(None, Level("quant", level.bits), changed, cols,
                     block[packed_size(rows_b, 1):])
    out[mask] += sub
    return out


def vq_codebook(shared: memoryview | bytes, level: Level) -> np.ndarray:
    """The codebook (2**(bits*k), k) float32 of a ``vq`` level's shared range."""
    words = 1 << (level.bits * level.k)
    return np.frombuffer(shared, dtype="<f2", count=words * level.k).astype(
        np.float32).reshape(words, level.k)


def _add_vq(acc: np.ndarray | None, level: Level, rows_b: int, cols: int, block: memoryview,
            codebook: np.ndarray) -> np.ndarray:
    """``acc + fl32(codeword value * scale)`` per element of a ``vq`` level."""
    scale = np.frombuffer(block, dtype="<f4", count=rows_b)
    codes = np.frombuffer(block, dtype=np.uint8, offset=4 * rows_b,
                          count=rows_b * cols // level.k)
    q = codebook[codes].reshape(rows_b, cols) * scale[:, None]
    return q if acc is None else acc + q


def _quant(level: Level, rows_b: int, cols: int, block: memoryview) -> np.ndarray:
    step = np.frombuffer(block, dtype="<f4", count=rows_b)
    codes = dequant(block[4 * rows_b:], level.bits, rows_b * cols)
    return codes.reshape(rows_b, cols) * step[:, None]


def _add_quant(acc: np.ndarray | None, level: Level, rows_b: int, cols: int,
               block: memoryview) -> np.ndarray:
    """``acc + fl32(code value * step)`` per element (a new array when ``acc`` is None)."""
    quant_add = _compiled("_quant_add_nb")
    if quant_add is None:
        q = _quant(level, rows_b, cols, block)
        return q if acc is None else acc + q
    out = np.zeros((rows_b, cols), np.float32) if acc is None else acc
    step = np.frombuffer(block, dtype="<f4", count=rows_b)
    raw = np.frombuffer(block, dtype=np.uint8, offset=4 * rows_b)
    quant_add(out.reshape(-1), raw, level.bits, step, cols)
    return out


_LAZY: Any = object()
# optional compiled decode: one pass instead of four numpy passes (same float32 results);
# compiled (or loaded from numba's disk cache) at the first reconstruction, not at import
# (importing numba costs ~0.15 s, which a mount or merge without sidecars need not pay).
# None: numba is missing (tests set None to force the numpy path).
_quant_add_nb: Any = _LAZY
_ulp_bf16_nb: Any = _LAZY
_nb_lock = threading.Lock()


def _compiled(name: str) -> Any:
    """``_quant_add_nb`` or ``_ulp_bf16_nb``, defined on first use (None without numba)."""
    global _quant_add_nb, _ulp_bf16_nb
    if globals()[name] is _LAZY:
        with _nb_lock:
            if globals()[name] is _LAZY:
                quant, ulp = _define_compiled()
                if _quant_add_nb is _LAZY:
                    _quant_add_nb = quant
                if _ulp_bf16_nb is _LAZY:
                    _ulp_bf16_nb = ulp
    return globals()[name]


def _define_compiled() -> tuple[Any, Any]:
    try:
        from mergefs.deltas._numba_decode import quant_add, ulp_bf16  # module level: numba's disk cache
    except ImportError:  # numba is missing
        return None, None
    return quant_add, ulp_bf16


def _popcount(block: memoryview, n: int) -> int:
    """Set bits among the first ``n`` bits of ``block``."""
    raw = np.frombuffer(block, dtype=np.uint8, count=packed_size(n, 1))
    return int(np.unpackbits(raw, count=n, bitorder="little").sum())


def block_size_ok(level: Level, block: memoryview, rows_b: int, cols: int) -> bool:
    """Whether a block range has the size its level implies (and, ``sparse``, positions in the
    block): the rule of the compiled loop's ``sizes_ok``, checked before the unchecked loops
    here read it."""
    got, n = len(block), rows_b * cols
    if level.kind == "lowrank":
        return got == lowrank_block_size(rows_b, level.k, level.bits)
    if level.kind == "quant":
        return got == quant_block_size(rows_b, cols, level.bits)
    if level.kind == "rows":
        nm = packed_size(rows_b, 1)
        return got == 0 or (got >= nm and got == rows_block_size(_popcount(block, rows_b),
                                                                 rows_b, cols, level.bits))
    if level.kind == "vq":
        return cols % level.k == 0 and got == vq_block_size(rows_b, cols, level)
    if level.kind == "ulp":
        nm = packed_size(n, 1)
        return got >= nm and got == nm + packed_size(_popcount(block, n), level.bits)
    if got % 8:  # sparse
        return False
    return bool((np.frombuffer(block, dtype="<u4", count=got // 8) < n).all())


#: kinds added to ``acc`` before ``W_hat = w0 + acc`` (the others overwrite values of ``W_hat``)
ADDITIVE = ("lowrank", "quant", "rows", "vq")


def reconstruct(w0: np.ndarray, levels: Sequence[Level], blocks: Sequence[memoryview],
                shared: Sequence[tuple[np.ndarray, np.ndarray] | None], rows_b: int,
                cols: int, version: str = DELTA_VERSION) -> np.ndarray:
    """``W_hat`` (float32, flat) of one row block from its levels ``levels`` (a prefix).

    ``w0`` is the base block (float32, flat). The low-rank levels are one float32 product
    (version 3: in a fixed order, see the module docstring; 1 and 2: a BLAS product, with a
    float32 BLAS that rounds it as the publisher's did, another may differ by about 1e-7 of the
    low-rank contribution), quantised levels are added in level order, then
    ``W_hat = w0 + acc`` (float32), and ``ulp`` and ``sparse`` levels overwrite exact values.
    The publisher computes every residual norm with this decoder (version 3: with
    :func:`mergefs.deltas.decode.decode_into`, which gives the same bits), prefix by prefix, so
    they are exact for it.
    """
    for level, block in zip(levels, blocks):
        if not block_size_ok(level, block, rows_b, cols):
            raise DeltaError(f"a {level.kind} level range of {len(block)} bytes does not have "
                             "the size its level implies (a damaged level table)")
    if version in BLAS_VERSIONS:
        acc = _additive_blas(levels, blocks, shared, rows_b, cols)
    else:
        acc = _additive(levels, blocks, shared, rows_b, cols, version)
    w_hat = w0.copy() if acc is None else w0 + acc.reshape(-1)
    _overwrite(w_hat, w0, levels, blocks)
    return w_hat


def _additive(levels: Sequence[Level], blocks: Sequence[memoryview],
              shared: Sequence[tuple[np.ndarray, np.ndarray] | None], rows_b: int,
              cols: int, version: str) -> np.ndarray | None:
    """Versions 3 and 4's ``acc`` (None without additive levels): from +0 (so never -0),
    version 4's exact product, the (other) low-rank components one by one, then the other
    additive levels in order."""
    if not any(lv.kind in ADDITIVE for lv in levels):
        return None
    acc = np.zeros((rows_b, cols), np.float32)
    qs = [_uq(lv, rows_b, block) for lv, block in zip(levels, blocks)
          if exact_level(lv, version)]
    if qs:
        grid, w = grid_of(levels, shared, version)
        with one_blas_thread():
            p = np.hstack(qs) @ w  # exact: every partial sum is an integer below 2**24
        acc = p * np.float32(math.ldexp(1.0, -grid)) + np.float32(0.0)
    for level, block, sh in zip(levels, blocks, shared):
        if level.kind == "lowrank" and not exact_level(level, version):
            assert sh is not None
            u = _u(level, rows_b, block, sh[0])
            for c in range(level.k):
                acc += u[:, c, None] * sh[1][c]  # fl(acc + fl(u * v)), as the compiled loop
    return _add_rest(acc, levels, blocks, shared, rows_b, cols)


def _additive_blas(levels: Sequence[Level], blocks: Sequence[memoryview],
                   shared: Sequence[tuple[np.ndarray, np.ndarray] | None], rows_b: int,
                   cols: int) -> np.ndarray | None:
    """Versions 1 and 2's ``acc``: the low-rank product by BLAS."""
    us, vs = [], []
    acc: np.ndarray | None = None
    for level, block, sh in zip(levels, blocks, shared):
        if level.kind == "lowrank":
            assert sh is not None
            us.append(_u(level, rows_b, block, sh[0]))
            vs.append(sh[1])
    if us:
        acc = np.hstack(us) @ np.vstack(vs) if len(us) > 1 else us[0] @ vs[0]
    return _add_rest(acc, levels, blocks, shared, rows_b, cols)


def _add_rest(acc: np.ndarray | None, levels: Sequence[Level], blocks: Sequence[memoryview],
              shared: Sequence[tuple[np.ndarray, np.ndarray] | None], rows_b: int,
              cols: int) -> np.ndarray | None:
    for level, block, sh in zip(levels, blocks, shared):
        if level.kind == "quant":
            acc = _add_quant(acc, level, rows_b, cols, block)
        elif level.kind == "vq":
            assert sh is not None
            acc = _add_vq(acc, level, rows_b, cols, block, sh[0])
        elif level.kind == "rows":
            acc = _add_rows(acc, level, rows_b, cols, block)
    return acc


def _overwrite(w_hat: np.ndarray, w0: np.ndarray, levels: Sequence[Level],
               blocks: Sequence[memoryview]) -> None:
    """The ``ulp`` levels, then the ``sparse`` levels, in level order, written into ``w_hat``."""
    for level, block in zip(levels, blocks):
        ulp_bf16 = _compiled("_ulp_bf16_nb") if level.kind == "ulp" and level.k == 1 else None
        if ulp_bf16 is not None:
            ulp_bf16(w_hat.view(np.uint32), np.ascontiguousarray(w0).view(np.uint32),
                     np.frombuffer(block, dtype=np.uint8), level.bits)
        elif level.kind == "ulp":
            n = w0.size
            mask = unpack_bits(block, 1, n).astype(bool)
            half = 1 << (level.bits - 1)
            codes = unpack_bits(block[packed_size(n, 1):], level.bits, int(mask.sum()))
            moves = codes.astype(np.int32) - half + (codes >= half)
            w_hat[mask] = from_bits16(bits16(w0[mask], level.k) + moves, level.k)
    for level, block in zip(levels, blocks):
        if level.kind == "sparse":
            n = len(block) // 8
            idx = np.frombuffer(block, dtype="<u4", count=n)
            w_hat[idx] = np.frombuffer(block, dtype="<f4", count=n, offset=4 * n)


class OneBlasThread:
    """While any thread is inside, numpy's BLAS runs single-threaded (threadpoolctl, a dependency).

    Decoding runs in the engine's worker threads, which already use the cores; a BLAS that
    also spawns threads per product makes them spin against each other (measured: a 512 x 512
    product 16x slower on a busy 2-core machine). Nested and concurrent users share one limit,
    restored when the last leaves.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._ctx: Any = None
        try:
            from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]
            self._controller: Any = ThreadpoolController()
        except ImportError:
            self._controller = None

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0 and self._controller is not None:
                _free_blas_control()
                self._ctx = self._controller.limit(limits=1, user_api="blas")
                _free_blas_control()
            self._users += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._ctx is not None:
                _free_blas_control()
                self._ctx.restore_original_limits()
                _free_blas_control()
                self._ctx = None


def _free_blas_control() -> None:
    """Let the calling thread set OpenBLAS's thread count.

    threadpoolctl (>= 3.6, pthreads OpenBLAS) lets only a *controlling thread* (the first to set
    a limit, until it releases it) change the process-wide count; other threads' calls are
    silently ignored. OneBlasThread sets and restores from whichever thread enters first or
    leaves last, always under its own lock, so it releases control around each change: without
    that, after ``mergefs compress`` in the main thread the engine's decode workers ran a
    2-thread BLAS concurrently (2-5x slower), and a restore from a worker could leave BLAS at 1
    thread for good.
    """
    try:
        from threadpoolctl import OpenBLASController  # type: ignore[import-untyped]
    except ImportError:  # older threadpoolctl: no controlling thread
        return
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)


_ONE_BLAS: OneBlasThread | None = None


def one_blas_thread() -> OneBlasThread:
    global _ONE_BLAS
    if _ONE_BLAS is None:
        _ONE_BLAS = OneBlasThread()
    return _ONE_BLAS


# -- the file -----------------------------------------------------------------------------------


