"""Delta sidecars: compressed refinement levels of one expert's delta, and their decoding.

``mergefs compress SPEC`` (:mod:`mergefs.deltas.publish`) writes, beside every expert, a safetensors file
``mergefs-delta.<base-key>.<block_size>.safetensors`` (beside a bare ``x.safetensors``:
``x.mergefs-delta....``). It holds one ``U8`` tensor ``data`` with every payload and a *range
table* (``range_start``, ``range_end`` relative to ``data``, ``range_xxh3``, ``range_resid``);
its metadata key ``mergefs_delta`` (JSON) ties it to the base key, block size and layout, the base
blocks' content hash and the expert's identity, and lists per tensor its *levels*, each a
refinement of the previous ones:

``lowrank`` (``k`` components at ``bits``: 2/3/4/8, or 16 for float16)
    ``D ~ U V``; a *shared* range per tensor holds the scales and the packed ``V`` (``k x cols``),
    and each row block's range the packed rows of ``U`` (``rows_b x k``).
``quant`` (``bits``: 1, 2 or 3)
    the residual quantised per element; a block's range holds one float32 step per row, then
    the packed codes.
``rows`` (``bits``: 1, 2 or 3)
    ``quant`` on the changed rows only (a fine-tune's word embeddings change only the rows of
    tokens it saw): a block's range holds a bitmap of the block's rows (1: changed), then one
    float32 step per changed row, then the packed codes of the changed rows; the other rows'
    residual is exactly zero.
``vq`` (``bits``: 1, ``k``: 8, the dimension; ``bits * k`` is 8: one byte per code)
    the residual vector-quantised, ``k`` consecutive elements of a row per code: a *shared*
    range (one per sidecar, used by every ``vq`` level) holds the codebook, ``2**(bits * k)``
    float16 words of ``k`` values; a block's range holds one float32 scale per row, then one
    ``bits * k``-bit code per ``k`` elements (``cols`` a multiple of ``k``).
``ulp`` (``k``: 1 for bfloat16, 2 for float16 experts over a base of the same dtype)
    the delta in units in the last place: a block's range holds a bitmap of the elements whose
    16-bit pattern moved by at most ``2**(bits-1)`` (same sign), then a code of ``bits`` bits
    per such element;
    the reconstruction there is the base's bit pattern plus that move, exactly the expert's.
``sparse``
    exact values: a block's range holds uint32 positions and the expert's float32 values there,
    which overwrite the reconstruction.

For row block ``b`` the range of level ``l`` is ``first_range[l] + (b - first_block[t])``: the
bytes of one level of one row block are one contiguous range, and the ranges of consecutive
blocks are adjacent. ``range_resid`` of a block range is ``||D_b - D_hat_b||`` after levels
``0..l``, computed by the publisher with the engine's decoder itself (``D = fl(W_i - W_0)`` as
the index computes it; ``D_hat = fl(W_hat - W_0)`` with ``W_hat`` what the engine merges), so it
is the exact error of that block, not an estimate. Shared ranges have ``range_resid`` NaN.

Versions: 1 has no ``rows`` or ``vq`` levels; 1 and 2 define the low-rank product as a float32
BLAS product ``[U_1 .. U_j] [V_1; ..; V_j]`` (their residuals are exact for a BLAS that rounds
as the publisher's did). Version 3 (same layout and kinds as 2) fixes the product's summation
order, so that a compiled decoder of many blocks at once (:mod:`mergefs.deltas.decode`) and the
numpy one here give the same bits on any machine: per element, starting from +0,
``acc += fl(u_k * v_kj)`` for the components ``k`` of every low-rank level in order, float32,
each product and sum rounded (no fused multiply-add). Version 4 (same layout and kinds) makes
the product of the quantised low-rank levels (2-8 bits) *exact*, so that any float32 matrix
product (BLAS, fused multiply-adds, any order or blocking, any thread count) gives the same
bits, at BLAS speed: with the block's ``n`` quantised components, ``Q[r, c] = 2 * (code value)``
(odd integers, at most ``2**bits - 1``) and, on a power-of-two grid ``G`` (:func:`grid_of`, a
function of those components' shared ranges only), ``W[c, e] = rint(uscale_c * V[c, e] *
2**(G-1))`` (float64, then integers in float32), chosen so that ``sum_c (2**bits_c - 1) *
max_e |W[c, e]| < 2**24``: every partial sum of ``Q W`` is an integer that float32 holds
exactly. Then ``acc = fl(fl(Q W) * 2**-G) + 0`` (never -0), float16 low-rank levels are added
component by component as in version 3, and the rest as before. Version 5 (same layout and
kinds) takes the grid coarser where needed so that also ``|W| <= 127`` (``<= 63`` on rows of
8-bit codes, which the int8 route multiplies by ``2 W``): ``W`` is int8, so the product is one
int8 matrix product with int32 sums (oneDNN's AMX/VNNI route,
:mod:`mergefs.deltas.intgemm`, one call instead of a call per base-256 digit of ``W``), still the same
float32 bits as any float32 product. :func:`reconstruct` decodes all five.

Pure decoding and a blocking reader (pread, xxh3 checked per range); never on the trio thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mergefs.core import format as fmt
from mergefs.sources.base import GapAllowance
from mergefs.core.errors import MergefsError, SourceChanged

log = logging.getLogger(__name__)

DELTA_VERSION = "5"
#: versions this reader opens: 1 has the same layout without the ``rows`` and ``vq`` kinds; 1
#: and 2 have a BLAS low-rank product, 3 a fixed-order one, 4 an exact one, 5 an exact one of
#: int8 ``W`` (module docstring)
READABLE_VERSIONS = ("1", "2", "3", "4", "5")
#: versions whose low-rank product is a BLAS sgemm (decoded block by block)
BLAS_VERSIONS = ("1", "2")
#: versions whose quantised low-rank levels are one exact integer product (:func:`grid_of`)
EXACT_VERSIONS = ("4", "5")
#: exact versions whose ``W`` is at most this in magnitude (int8)
INT8_VERSIONS = ("5",)
INT8_LIMIT = 127
#: every integer of smaller magnitude is exact in float32
EXACT_LIMIT = 1 << 24
META_KEY = "mergefs_delta"
#: uniform quantiser step per bit width, in units of the RMS (near-optimal for Gaussian values)
GAUSS_STEP = {1: 0.0, 2: 0.996, 3: 0.586, 4: 0.335}


class DeltaError(MergefsError):
    """A delta sidecar is malformed or does not belong to this base and expert."""


# -- bit packing (little-endian bit order, value-major) -------------------------------------------


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack unsigned ``codes`` (< 2**bits) into ``ceil(n * bits / 8)`` bytes."""
    c = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return c.tobytes()
    planes = (c[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(buf: bytes | memoryview, bits: int, n: int) -> np.ndarray:
    """The ``n`` codes packed by :func:`pack_bits`, as uint8."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw[:n]
    if bits in (1, 2, 4):  # whole codes per byte: shifts instead of a bit matrix
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        out = (raw[:, None] >> shifts) & np.uint8((1 << bits) - 1)
        return out.reshape(-1)[:n]
    planes = np.unpackbits(raw, count=n * bits, bitorder="little").reshape(n, bits)
    return planes @ (np.uint8(1) << np.arange(bits, dtype=np.uint8))


def packed_size(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def quant_levels(codes: np.ndarray, bits: int) -> np.ndarray:
    """Code -> value in units of the step: midrise ``q - (2**bits - 1) / 2`` (1 bit: +-1)."""
    if bits == 1:
        return codes.astype(np.float64) * 2.0 - 1.0
    return codes.astype(np.float64) - ((1 << bits) - 1) / 2.0


def _table(bits: int) -> np.ndarray:
    """(256, 8 // bits) float64: the values (in steps) of the codes packed in each byte."""
    per = 8 // bits
    byte = np.arange(256, dtype=np.uint16)[:, None]
    codes = (byte >> (np.arange(per, dtype=np.uint16) * bits)) & ((1 << bits) - 1)
    return quant_levels(codes.astype(np.uint8), bits)


_TABLES = {b: _table(b).astype(np.float32) for b in (1, 2, 4, 8)}  # exact in float32


def dequant(buf: bytes | memoryview, bits: int, n: int) -> np.ndarray:
    """Values (in steps, float32: exact) of the ``n`` codes packed by :func:`pack_bits`."""
    table = _TABLES.get(bits)
    if table is None:
        return quant_levels(unpack_bits(buf, bits, n), bits).astype(np.float32)
    raw = np.frombuffer(buf, dtype=np.uint8, count=packed_size(n, bits))
    return table[raw].reshape(-1)[:n]


def quantise(x: np.ndarray, bits: int, step: np.ndarray | float) -> np.ndarray:
    """Codes of ``x`` for a uniform midrise quantiser of ``step`` (broadcast), clipped."""
    top = (1 << bits) - 1
    if bits == 1:
        return (x >= 0).astype(np.uint8)
    s = np.where(np.asarray(step) > 0, step, 1.0)
    q = np.floor(x / s + (top + 1) / 2.0)
    return np.clip(q, 0, top).astype(np.uint8)


# -- the description of a sidecar ---------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    kind: str  # "lowrank" | "quant" | "ulp" | "sparse"
    bits: int = 0
    k: int = 0
    shared: int = -1  # range id of the shared part (lowrank), else -1
    first_range: int = 0  # range id of the tensor's first block

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "bits": self.bits, "k": self.k, "shared": self.shared,
                "first_range": self.first_range}


@dataclass(frozen=True)
class TensorLevels:
    name: str
    t: int  # index in the block layout
    rows: int
    cols: int
    levels: tuple[Level, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "t": self.t, "rows": self.rows, "cols": self.cols,
                "levels": [lv.to_json() for lv in self.levels]}


ULP_DTYPES = {"BF16": 1, "F16": 2}


def bits16(w: np.ndarray, k: int) -> np.ndarray:
    """16-bit patterns (int32) of float32 values exactly representable in bf16 (k=1) or f16."""
    if k == 1:
        return (np.ascontiguousarray(w, dtype=np.float32).view(np.uint32) >> 16).astype(np.int32)
    return w.astype(np.float16).view(np.uint16).astype(np.int32)


def from_bits16(bits: np.ndarray, k: int) -> np.ndarray:
    if k == 1:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def lowrank_shared_size(k: int, cols: int, bits: int) -> int:
    return 8 * k + (2 * k * cols if bits == 16 else packed_size(k * cols, bits))


def lowrank_block_size(rows_b: int, k: int, bits: int) -> int:
    return 2 * rows_b * k if bits == 16 else packed_size(rows_b * k, bits)


def quant_block_size(rows_b: int, cols: int, bits: int) -> int:
    return 4 * rows_b + packed_size(rows_b * cols, bits)


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


def rows_block_size(changed: int, rows_b: int, cols: int, bits: int) -> int:
    return packed_size(rows_b, 1) + 4 * changed + packed_size(changed * cols, bits)


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


def vq_block_size(rows_b: int, cols: int, level: Level) -> int:
    return 4 * rows_b + rows_b * cols // level.k  # one byte per code: bits * k == 8


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


def delta_name(sidecar_name: str) -> str:
    """The delta sidecar's name from the index sidecar's (``mergefs-index.`` ->
    ``mergefs-delta.``)."""
    return sidecar_name.replace("mergefs-index.", "mergefs-delta.")


@dataclass(eq=False)
class DeltaSidecar:
    """One expert's delta sidecar, opened: the range table in memory, payloads read on demand.

    ``bytes_read`` counts payload bytes fetched (pread or ranged GET; the range table and header
    are read once at open and counted in ``header_bytes``), ``reads`` the fetches, and
    ``gap_bytes`` the part of ``bytes_read`` between the ranges :meth:`read_spans` coalesced
    (fetched and dropped). Shared ranges are cached after the first read (a few KiB per
    tensor), so each is read and counted once (a thread reading one makes the others wait,
    :meth:`claim_shared`). Thread-safe.
    """

    path: Path | str  # a local path, or the URL of a sidecar beside a remote expert
    meta: dict[str, Any]
    tensors: dict[str, TensorLevels]  # by tensor name
    data_offset: int  # absolute offset of ``data`` in the file
    range_start: np.ndarray
    range_end: np.ndarray
    range_xxh3: np.ndarray
    range_resid: np.ndarray
    header_bytes: int
    bytes_read: int = 0
    reads: int = 0
    gap_bytes: int = 0
    #: :meth:`read_spans`: spans at most this many bytes apart share one fetch (a remote
    #: sidecar: its source's ``coalesce_gap``); local sidecars read each span by one pread
    coalesce_gap_bytes: int = 0
    #: where :meth:`read_spans` takes the gaps it fetches from (the engine's, shared with the
    #: experts' exact reads: :class:`mergefs.sources.base.GapAllowance`); None: no limit
    gap_allowance: GapAllowance | None = None
    #: called as ``recorder(tensor, start, end, buf)`` for every span read (absolute file
    #: offsets), after its checksums: the engine's manifest hook. A fetch that coalesced
    #: spans records each span, not the gaps between them (as the exact path records the
    #: ranges it asked for), so the records do not depend on ``coalesce_gap_bytes``
    recorder: Any = None
    #: ``fetch(start, end)``: bytes of the file (a remote sidecar: ranged GETs); None: pread
    fetch: Callable[[int, int], bytes] | None = None
    _fd: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _shared: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _shared_lock: threading.Lock = field(default_factory=threading.Lock)
    #: shared range ids a thread is reading (:meth:`claim_shared`); others wait on _shared_cv
    _shared_pending: set[int] = field(default_factory=set)
    _shared_cv: threading.Condition = field(init=False)
    #: :mod:`mergefs.deltas.decode`'s packed shared values, by (tensor, depth), and (tensor, -1): the
    #: tensor's exact grids; under _shared_lock
    _packed: dict[tuple[str, int], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._shared_cv = threading.Condition(self._shared_lock)

    @property
    def name(self) -> str:
        return str(self.path).rsplit("/", 1)[-1]

    def range_bytes(self) -> np.ndarray:
        return self.range_end - self.range_start

    def read(self, r0: int, r1: int, tensor: str = "") -> memoryview:
        """Bytes of the adjacent ranges ``r0 .. r1 - 1`` (one pread), checksums verified."""
        start, end = int(self.range_start[r0]), int(self.range_end[r1 - 1])
        if end == start:
            return memoryview(b"")
        view = self._fetch(start, end)
        self._verify(r0, r1, view, start, tensor)
        return view

    def read_spans(self, spans: Sequence[tuple[int, int]], tensor: str = ""
                   ) -> list[memoryview]:
        """:meth:`read` of each span ``(r0, r1)`` of adjacent ranges (range ids), each
        verified and recorded as :meth:`read` does; for a remote sidecar, spans whose bytes lie
        at most ``coalesce_gap_bytes`` apart share one fetch while the gap can be taken from
        ``gap_allowance`` (the bytes between them are fetched, counted in ``bytes_read`` and
        ``gap_bytes``, and dropped, as :mod:`mergefs.sources.remote` does for exact blocks). A local
        sidecar reads span by span."""
        if self.fetch is None:
            return [self.read(r0, r1, tensor) for r0, r1 in spans]
        out: list[memoryview] = [memoryview(b"")] * len(spans)
        byte_spans = [(int(self.range_start[r0]), int(self.range_end[r1 - 1]))
                      for r0, r1 in spans]
        todo = sorted((k for k, (a, b) in enumerate(byte_spans) if b > a),
                      key=lambda k: byte_spans[k][0])
        g = 0
        while g < len(todo):
            e, end = g, byte_spans[todo[g]][1]
            while e + 1 < len(todo) and self._may_join(byte_spans[todo[e + 1]][0] - end):
                e += 1
                end = max(end, byte_spans[todo[e]][1])
            start = byte_spans[todo[g]][0]
            view = self._fetch(start, end)
            used = 0
            for k in todo[g:e + 1]:
                a, b = byte_spans[k]
                out[k] = view[a - start:b - start]
                self._verify(spans[k][0], spans[k][1], out[k], a, tensor)
                used += b - a
            if used < end - start:
                with self._lock:
                    self.gap_bytes += end - start - used
            g = e + 1
        return out

    def _may_join(self, gap: int) -> bool:
        """Whether a span ``gap`` bytes past the current fetch's end joins it (taking a
        positive gap from the allowance)."""
        if gap > self.coalesce_gap_bytes:
            return False
        return gap <= 0 or self.gap_allowance is None or self.gap_allowance.take(gap)

    def _fetch(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of ``data`` by one fetch or pread, counted."""
        if self.fetch is not None:
            buf = self.fetch(self.data_offset + start, self.data_offset + end)
        else:
            with self._lock:
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_RDONLY)
                fd = self._fd
            buf = os.pread(fd, end - start, self.data_offset + start)
        if len(buf) != end - start:
            raise SourceChanged(f"{self.path}: truncated (delta sidecar changed while open)")
        with self._lock:
            self.bytes_read += len(buf)
            self.reads += 1
        return memoryview(buf)

    def _verify(self, r0: int, r1: int, view: memoryview, start: int, tensor: str) -> None:
        """Check the checksums of ranges ``r0 .. r1 - 1`` in ``view`` (which starts at byte
        ``start`` of ``data``) and record the span."""
        for r in range(r0, r1):
            lo, hi = int(self.range_start[r]) - start, int(self.range_end[r]) - start
            if xxhash.xxh3_64_intdigest(view[lo:hi]) != int(self.range_xxh3[r]):
                raise SourceChanged(f"{self.path}: checksum of range {r} differs (delta sidecar "
                                    "corrupt or changed since it was published)")
        if self.recorder is not None:
            self.recorder(tensor, self.data_offset + start, self.data_offset + start + len(view),
                          view)

    def read_runs(self, first: int, js: Sequence[int], tensor: str = "") -> dict[int, memoryview]:
        """Block ranges ``first + j`` for ``j`` in ``js`` (ascending), one pread per adjacent
        run; returns {j: bytes}."""
        out: dict[int, memoryview] = {}
        k = 0
        while k < len(js):
            e = k
            while e + 1 < len(js) and js[e + 1] == js[e] + 1:
                e += 1
            buf = self.read(first + js[k], first + js[e] + 1, tensor)
            base = int(self.range_start[first + js[k]])
            for j in js[k:e + 1]:
                r = first + j
                out[j] = buf[int(self.range_start[r]) - base:int(self.range_end[r]) - base]
            k = e + 1
        return out

    def abs_range(self, r0: int, r1: int) -> tuple[int, int]:
        """Absolute file offsets ``[start, end)`` of ranges ``r0 .. r1 - 1``."""
        return (self.data_offset + int(self.range_start[r0]),
                self.data_offset + int(self.range_end[r1 - 1]))

    def shared(self, level: Level, cols: int, tensor: str = ""
               ) -> tuple[np.ndarray, np.ndarray] | None:
        if level.shared < 0:
            return None
        with self._shared_cv:  # read (and counted, and recorded) once
            while level.shared in self._shared_pending:  # another thread's claim
                self._shared_cv.wait()
            got = self._shared.get(level.shared)
            if got is None:
                got = shared_value(level, self.read(level.shared, level.shared + 1, tensor),
                                   cols)
                self._shared[level.shared] = got
        return got

    def claim_shared(self, levels: Sequence[Level]) -> list[int]:
        """The shared range ids of ``levels`` neither cached nor claimed yet (ascending), now
        claimed by the caller, who reads them (:meth:`read_spans`: verified, counted,
        recorded), then passes each to :meth:`keep_shared` and finally all to
        :meth:`release_shared`; meanwhile :meth:`shared` of them waits."""
        with self._shared_cv:
            ids = sorted({lv.shared for lv in levels if lv.shared >= 0
                          and lv.shared not in self._shared
                          and lv.shared not in self._shared_pending})
            self._shared_pending.update(ids)
        return ids

    def keep_shared(self, level: Level, cols: int, buf: memoryview) -> None:
        """Cache the shared value of ``level`` from its range's bytes (claimed and read)."""
        value = shared_value(level, buf, cols)
        with self._shared_cv:
            self._shared[level.shared] = value

    def release_shared(self, ids: Sequence[int]) -> None:
        with self._shared_cv:
            self._shared_pending.difference_update(ids)
            self._shared_cv.notify_all()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def open_sidecar(path: Path) -> DeltaSidecar:
    """Parse a delta sidecar's header and range table (payloads stay on disk)."""
    with open(path, "rb") as f:
        def fetch(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start)

        return _parse(path, fetch)


def open_remote_sidecar(url: str, fetch: Callable[[int, int], bytes],
                        coalesce_gap_bytes: int) -> DeltaSidecar:
    """A sidecar beside a remote expert: header and range table fetched by two or three
    ranged reads, payload ranges on demand through ``fetch(start, end)``; ranges at most
    ``coalesce_gap_bytes`` apart share one fetch (:meth:`DeltaSidecar.read_spans`)."""
    sc = _parse(url, fetch)
    sc.fetch = fetch
    sc.coalesce_gap_bytes = coalesce_gap_bytes
    return sc


def _parse(path: Path | str, fetch: Callable[[int, int], bytes]) -> DeltaSidecar:
    head = fetch(0, 8)
    if len(head) != 8:
        raise DeltaError(f"{path}: not a safetensors file")
    n = int.from_bytes(head, "little")
    if n > fmt.HEADER_SIZE_CAP:
        raise DeltaError(f"{path}: header too large")
    try:
        hdr = json.loads(fetch(8, 8 + n))
    except ValueError:
        raise DeltaError(f"{path}: header is not JSON") from None
    if not isinstance(hdr, dict):
        raise DeltaError(f"{path}: header is not a JSON object")
    meta = json.loads(hdr.get("__metadata__", {}).get(META_KEY, "null") or "null")
    if not isinstance(meta, dict) or "version" not in meta:
        raise DeltaError(f"{path}: not a mergefs delta sidecar")
    if meta["version"] not in READABLE_VERSIONS:
        raise DeltaError(f"{path}: delta sidecar of version {meta['version']}, this mergefs reads "
                         f"versions {', '.join(READABLE_VERSIONS)}: re-run `mergefs compress`")
    table: dict[str, np.ndarray] = {}
    kinds = {"range_start": "<i8", "range_end": "<i8", "range_xxh3": "<u8",
             "range_resid": "<f8"}
    spans = {key: hdr[key]["data_offsets"] for key in kinds}
    lo, hi = min(v[0] for v in spans.values()), max(v[1] for v in spans.values())
    blob = fetch(8 + n + lo, 8 + n + hi)  # the tables are adjacent: one read
    if len(blob) != hi - lo:
        raise DeltaError(f"{path}: truncated range table")
    for key, dt in kinds.items():
        s, e = spans[key]
        table[key] = np.frombuffer(blob[s - lo:e - lo], dtype=dt).copy()
    data_offset = 8 + n + int(hdr["data"]["data_offsets"][0])
    why = _table_problem(table, int(hdr["data"]["data_offsets"][1])
                         - int(hdr["data"]["data_offsets"][0]))
    if why:
        raise DeltaError(f"{path}: range table: {why}")
    tensors = {}
    n_ranges = len(table["range_start"])
    for tj in meta["tensors"]:
        if not isinstance(tj.get("name"), str) or not all(
                type(tj.get(key)) is int for key in ("t", "rows", "cols")):
            raise DeltaError(f"{path}: tensor entry {str(tj)[:80]}: name, t, rows or cols "
                             "missing or not of its type")
        levels = tuple(Level(lv["kind"], lv["bits"], lv["k"], lv["shared"], lv["first_range"])
                       for lv in tj["levels"])
        for level in levels:
            why = _level_problem(level, meta["version"], n_ranges)
            if why:
                raise DeltaError(f"{path}: tensor {tj['name']}: level {level.to_json()}: {why}")
        tensors[tj["name"]] = TensorLevels(tj["name"], tj["t"], tj["rows"], tj["cols"], levels)
    table_bytes = sum(a.nbytes for a in table.values())
    return DeltaSidecar(path, meta, tensors, data_offset, table["range_start"],
                        table["range_end"], table["range_xxh3"], table["range_resid"],
                        8 + n + table_bytes)


def _table_problem(table: dict[str, np.ndarray], data_bytes: int) -> str:
    """Why the range table does not describe ranges of the data tensor ("" if it does): the
    ranges must lie in it, in order, without overlap (a run is read as one span, and the
    compiled decoder trusts the offsets)."""
    start, end = table["range_start"], table["range_end"]
    if len({len(a) for a in table.values()}) != 1:
        return "its columns have different lengths"
    if len(start) and (int(start[0]) < 0 or int(end[-1]) > data_bytes):
        return f"a range lies outside the data tensor ({data_bytes} bytes)"
    if np.any(end < start) or np.any(start[1:] < end[:-1]):
        return "ranges out of order or overlapping"
    return ""


#: level kinds each sidecar version may hold, and the (bits, k) each kind decodes
KINDS_BY_VERSION = {"1": ("lowrank", "quant", "ulp", "sparse"),
                    "2": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "3": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "4": ("lowrank", "quant", "ulp", "sparse", "rows", "vq"),
                    "5": ("lowrank", "quant", "ulp", "sparse", "rows", "vq")}


def _level_problem(level: Level, version: str, n_ranges: int) -> str:
    """Why this level cannot be decoded by this reader ("" if it can)."""
    if not all(type(v) is int for v in (level.bits, level.k, level.shared, level.first_range)):
        return "bits, k, shared and first_range must be integers"
    if level.kind not in KINDS_BY_VERSION.get(version, ()):
        return (f"kind {level.kind!r} is not one of a version-{version} sidecar "
                f"({', '.join(KINDS_BY_VERSION.get(version, ()))}): re-run `mergefs compress`")
    ok = {"lowrank": level.bits in (2, 3, 4, 8, 16) and level.k >= 1,
          "quant": level.bits in (1, 2, 3, 4),
          "rows": level.bits in (1, 2, 3, 4),
          "vq": level.bits >= 1 and level.k >= 1 and level.bits * level.k == 8,
          "ulp": level.k in (1, 2) and 1 <= level.bits <= 8,
          "sparse": True}[level.kind]
    if not ok:
        return f"bits {level.bits} and k {level.k} are not valid for a {level.kind} level"
    needs_shared = level.kind in ("lowrank", "vq")
    if needs_shared and not 0 <= level.shared < n_ranges:
        return f"shared range {level.shared} is not in the range table ({n_ranges} ranges)"
    if not 0 <= level.first_range < n_ranges:
        return f"first range {level.first_range} is not in the range table ({n_ranges} ranges)"
    return ""


def _digest(arr: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arr, dtype="<u8").tobytes())


def find(base: Any, experts: Sequence[Any], index: Any) -> dict[int, DeltaSidecar]:
    """Delta sidecars beside the (local) experts that match this base, layout and expert bytes.

    A sidecar matches when its base key, block size, layout hash and expert identity match and
    the content hashes of the base blocks and of the expert's blocks equal the index's (so it
    was computed from exactly these bytes). Anything else is ignored with a log line saying why.
    """
    from mergefs.index import published as sidecar

    key = sidecar.base_key(base)
    lay = index.layout
    found: dict[int, DeltaSidecar] = {}
    from mergefs.sources.lora import LoraCheckpoint

    for i, e in enumerate(experts):
        if isinstance(e, LoraCheckpoint):
            continue  # adapters are read as exact factors
        name = delta_name(sidecar.sidecar_name(e, key, lay.block_size))
        path: Path | str
        try:
            if e.is_remote:
                if not hasattr(e, "aux_reader"):
                    continue  # a recipe role over several models: no sidecar of its own
                got = e.aux_reader(name)
                if got is None:
                    continue
                url, fetch = got
                path = url
                sc = open_remote_sidecar(url, fetch, e.options.gap_bytes)
            else:
                path = sidecar._local_path(e, name)
                if not path.is_file():
                    continue
                sc = open_sidecar(path)
        except (DeltaError, OSError, KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring delta sidecar %s: unreadable: %s", name, exc)
            continue
        m = sc.meta
        why = None
        if m.get("base_key") != key or m.get("block_size") != lay.block_size:
            why = "published for another base or block size"
        elif m.get("layout_xxh3") != sidecar.layout_hash(lay):
            why = "block layout differs"
        elif [r[:3] for r in m.get("expert", [])] != [r[:3] for r in sidecar.expert_identity(e)]:
            why = "the expert changed since it was published"
        elif m.get("base_content") != _digest(index.base_hash):
            why = "published against a base whose bytes differ"
        elif m.get("expert_content") != _digest(index.expert_hash[i]):
            why = "published from expert bytes that differ from the indexed ones"
        elif any(tl.t >= len(lay.tensors) or lay.tensors[tl.t] != tl.name
                 for tl in sc.tensors.values()):
            why = "tensor table does not match the layout"
        elif any(_shape_problem(base, lay, sc, tl) for tl in sc.tensors.values()):
            why = "tensor shapes or range counts do not match the base"
        if why is not None:
            log.warning("ignoring delta sidecar %s: %s", path, why)
            continue
        if m["version"] not in EXACT_VERSIONS:
            log.info("delta sidecar %s is of version %s: it decodes with the slower product of "
                     "that version; `mergefs compress` writes version %s", path, m["version"],
                     DELTA_VERSION)
        found[i] = sc
    return found


def _shape_problem(base: Any, lay: Any, sc: DeltaSidecar, tl: TensorLevels) -> bool:
    """Whether ``tl`` disagrees with the base tensor's (rows, cols), or a level's block ranges
    run past the range table (the decoder sizes blocks by ``tl.cols``)."""
    shape = base.tensors[tl.name].shape
    if len(shape) < 2 or tl.rows != shape[0] or tl.cols != math.prod(shape[1:]):
        return True
    n_blocks = len(lay.blocks_of(tl.t))
    return any(lv.first_range + n_blocks > len(sc.range_start) for lv in tl.levels)
