"""The numba code behind :mod:`mergefs.methods.kernels` (imported on first use: numba takes ~0.5 s to
import, which a command that merges nothing should not pay). See that module for what the
kernels compute and why they equal the method registry's numpy arithmetic bit for bit.

One loop per source dtype and per output dtype, without branches LLVM cannot turn into selects,
so that each vectorises (a runtime dtype switch inside one loop did not). No ``fastmath``: it
would allow reassociation and FMA contraction, which change bits. Pure; ``nogil``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


def _fma_intrinsic(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """float32 ``a * b + c`` rounded once (LLVM's ``llvm.fma.f32``: the FMA instruction, or
    libm's ``fmaf`` on a CPU without one: correctly rounded either way)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(args[0], args[1], args[2])

    return sig, codegen


_fma: Any = intrinsic(_fma_intrinsic)  # called as _fma(a, b, c) in compiled code


@_jit
def _quiet(a: Any) -> Any:
    return np.uint32(np.float32(a).view(np.uint32) | np.uint32(0x00400000)).view(np.float32)


@_jit
def _add(a: Any, b: Any) -> Any:
    """``a + b`` in float32; when both are NaN, ``a`` quietened (x86's rule for the first
    operand, which numpy's vector loops follow; LLVM may swap an fadd's operands)."""
    r = a + b
    return _quiet(a) if np.isnan(r) and np.isnan(a) else r


@_jit
def _bf16(u: Any) -> Any:
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)


# -- decoding the reference ----------------------------------------------------------------------

@_jit
def dec_bf16(raw: Any, out: Any) -> None:
    for j in range(raw.size):
        out[j] = _bf16(raw[j])


@_jit
def dec_f16(raw: Any, out: Any, table: Any) -> None:
    for j in range(raw.size):
        out[j] = table[raw[j]]


# -- "delta" form (task arithmetic): acc += (X - W0) * c ------------------------------------------

@_jit
def delta_f32(acc: Any, w0: Any, x: Any, c: Any) -> None:
    for j in range(acc.size):
        acc[j] = _add(acc[j], (x[j] - w0[j]) * c)


@_jit
def delta_bf16(acc: Any, w0: Any, raw: Any, c: Any) -> None:
    for j in range(acc.size):
        acc[j] = _add(acc[j], (_bf16(raw[j]) - w0[j]) * c)


@_jit
def delta_f16(acc: Any, w0: Any, raw: Any, c: Any, table: Any) -> None:
    for j in range(acc.size):
        acc[j] = _add(acc[j], (table[raw[j]] - w0[j]) * c)


# -- "fma" form (linear): acc = fma(X, c, acc) ----------------------------------------------------

@_jit
def fma_f32(acc: Any, x: Any, c: Any) -> None:
    for j in range(acc.size):
        acc[j] = _fma(np.float32(x[j]), c, np.float32(acc[j]))


@_jit
def fma_bf16(acc: Any, raw: Any, c: Any) -> None:
    for j in range(acc.size):
        acc[j] = _fma(_bf16(raw[j]), c, np.float32(acc[j]))


@_jit
def fma_f16(acc: Any, raw: Any, c: Any, table: Any) -> None:
    for j in range(acc.size):
        acc[j] = _fma(np.float32(table[raw[j]]), c, np.float32(acc[j]))


# -- torch's cascade levels (order "torch", 17 or more inputs) ------------------------------------

@_jit
def add_into(acc: Any, x: Any) -> None:
    """``acc = acc + x`` (a level of torch's ``multi_row_sum`` carried into the next)."""
    for j in range(acc.size):
        acc[j] = _add(acc[j], x[j])


# -- finishing: divide, scale, add the base, encode -----------------------------------------------

@_jit
def _value(w0: Any, acc: Any, j: int, div: Any, has_div: bool, lam: Any, has_lam: bool,
           add_base: bool) -> Any:
    v = acc[j]
    if has_div:
        v = np.float32(v / div)
    if has_lam:
        v = np.float32(v * lam)
    return _add(w0[j], v) if add_base else v


@_jit
def _to_bf16(v: Any) -> Any:
    """float32 -> bfloat16 bits as ml_dtypes casts: round to nearest even, NaN -> 0x7fc0|sign."""
    u = np.float32(v).view(np.uint32)
    bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    r = np.uint16((u + bias) >> np.uint32(16))
    nan = np.uint16(0xFFC0) if u >> np.uint32(31) else np.uint16(0x7FC0)
    return nan if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r


@_jit
def _to_f16(v: Any) -> Any:
    """float32 -> float16 bits as numpy casts (``npy_floatbits_to_halfbits``)."""
    f = np.float32(v).view(np.uint32)
    h_sgn = np.uint32((f & np.uint32(0x80000000)) >> np.uint32(16))
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
        if f_exp == np.uint32(0x7F800000):
            f_sig = f & np.uint32(0x007FFFFF)
            if f_sig != 0:
                ret = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
                if ret == np.uint32(0x7C00):
                    ret += np.uint32(1)
                return np.uint16(h_sgn + ret)
            return np.uint16(h_sgn + np.uint32(0x7C00))
        return np.uint16(h_sgn + np.uint32(0x7C00))
    if f_exp <= np.uint32(0x38000000):
        if f_exp < np.uint32(0x33000000):
            return np.uint16(h_sgn)
        e = f_exp >> np.uint32(23)
        f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        f_sig = f_sig >> (np.uint32(113) - e)
        if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)):
            f_sig += np.uint32(0x1000)
        return np.uint16(h_sgn + (f_sig >> np.uint32(13)))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        f_sig += np.uint32(0x1000)
    h_sig = ((f_sig >> np.uint32(13)) + h_exp) & np.uint32(0xFFFF)
    return np.uint16((h_sgn + h_sig) & np.uint32(0xFFFF))


@_jit
def fin_f32(w0: Any, acc: Any, div: Any, has_div: bool, lam: Any, has_lam: bool,
            add_base: bool, out: Any) -> None:
    for j in range(acc.size):
        out[j] = _value(w0, acc, j, div, has_div, lam, has_lam, add_base)


@_jit
def fin_bf16(w0: Any, acc: Any, div: Any, has_div: bool, lam: Any, has_lam: bool,
             add_base: bool, out: Any) -> None:
    for j in range(acc.size):
        out[j] = _to_bf16(_value(w0, acc, j, div, has_div, lam, has_lam, add_base))


@_jit
def fin_f16(w0: Any, acc: Any, div: Any, has_div: bool, lam: Any, has_lam: bool,
            add_base: bool, out: Any) -> None:
    for j in range(acc.size):
        out[j] = _to_f16(_value(w0, acc, j, div, has_div, lam, has_lam, add_base))


@_jit
def encode_bf16(values: Any, out: Any) -> None:
    for j in range(values.size):
        out[j] = _to_bf16(values[j])


@_jit
def encode_f16(values: Any, out: Any) -> None:
    for j in range(values.size):
        out[j] = _to_f16(values[j])


# -- index: float32 deltas, then Gram terms in interleaved lanes ---------------------------------
# (mergefs.index.stats documents the order; its numpy path reproduces it bit for bit)

TILE = 4096  # elements per tile: the rows' tiles stay in cache while every pair reads them


@_jit
def idx_delta_f32(x: Any, w0: Any, out: Any) -> None:
    for j in range(out.size):
        out[j] = x[j] - w0[j]


@_jit
def idx_delta_bf16(raw: Any, w0: Any, out: Any) -> None:
    for j in range(out.size):
        out[j] = _bf16(raw[j]) - w0[j]


@_jit
def idx_delta_f16(raw: Any, w0: Any, out: Any, table: Any) -> None:
    for j in range(out.size):
        out[j] = table[raw[j]] - w0[j]


@_jit
def gram_lanes(d: Any, pairs: Any, acc: Any) -> None:
    """``acc[p, l] += float64(d[r, j]) * float64(d[s, j])`` (a rounded product, then a rounded
    sum) for every ``j = l (mod L)`` in increasing ``j``, for each pair ``p = (r, s)``;
    ``acc``: (P, L), ``d``: (R, n) float32 with ``n`` a multiple of L and of nothing else.
    No FMA, no reassociation: each lane is a sequential sum, vectorised across lanes."""
    n = d.shape[1]
    lanes = acc.shape[1]
    for t0 in range(0, n, TILE):
        t1 = min(n, t0 + TILE)
        for p in range(pairs.shape[0]):
            x = d[pairs[p, 0]]
            y = d[pairs[p, 1]]
            a = acc[p]
            for j0 in range(t0, t1, lanes):
                xs = x[j0:j0 + lanes]
                ys = y[j0:j0 + lanes]
                for k in range(lanes):
                    a[k] += np.float64(xs[k]) * np.float64(ys[k])


@_jit
def sketch_tile(d: Any, rows: Any, key: Any, c0: Any, n: Any, out: Any) -> None:
    """CountSketch of columns ``[0, n)`` of each row ``rows[q]`` of ``d`` (float32) into a fresh
    ``out[q]`` (float64, (Q, k), zeroed by the caller): element ``j`` (position ``c0 + j`` in
    its block) adds ``sign * float64(d[r, j])`` to bucket ``h % k``, sequentially in
    increasing ``j`` (numpy's ``bincount`` order), where ``h`` is splitmix64's finaliser of
    ``key + c0 + j`` and the sign its top bit. What :func:`mergefs.index.stats.sketch_hash`
    computes."""
    k = np.uint64(out.shape[1])
    for j in range(n):
        z = key + np.uint64(c0 + j)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        b = np.int64(z % k)
        neg = (z >> np.uint64(63)) != np.uint64(0)
        for q in range(rows.size):
            v = np.float64(d[rows[q], j])
            out[q, b] += -v if neg else v
