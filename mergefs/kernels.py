"""Compiled merge kernels (numba): decode, subtract, scale, accumulate and encode in one pass.

``fused_additive`` computes the additive merge of one unit (linear, task arithmetic)
``M = s * W0 + sum_i c_i (W_i - W0)`` exactly as the numpy code in ``Engine.merge_unit`` does,
bit for bit: the same float32 operations on every element, in the same order and with the same
operand order: ``acc = 0``; per expert run, in expert order, ``acc = acc + (W_i - W0) * c_i``;
then ``W0 + acc`` (or ``s * W0 + acc``), rounded to the output dtype.

NaN payloads: IEEE 754 leaves open which payload ``a + b`` carries when both are NaN, and numpy
is not consistent about it: its vector loop returns ``a``'s (x86's rule), its scalar tail loop
(the last elements of an array, a length-dependent set) ``b``'s. The kernels always return
``a``'s, quietened. So the output equals numpy's bit for bit except where two *different* NaN
payloads meet in one addition (two experts with NaN at the same element, differing from each
other), where both are a NaN carrying one of the two payloads. NaNs copied from the base, +-0.0,
+-inf, subnormals and every finite value are bit-identical. Decoding and encoding reproduce
numpy's and ml_dtypes' conversions bit for bit:

- bf16 -> f32 is exact (a shift); f16 -> f32 uses numpy's own table of all 65536 values;
- f32 -> bf16 rounds to nearest even and turns every NaN into ``0x7fc0`` with its sign
  (ml_dtypes/Eigen); f32 -> f16 is numpy's ``npy_floatbits_to_halfbits`` (round to nearest
  even, overflow to inf, NaN payload shifted with the quiet-making rule).

Compared with numpy (per element: decode, subtract, multiply and add in separate passes, each
writing a temporary, then add and cast), each expert run is one pass over its bytes and the
accumulator, and the base is decoded once and encoded once. No ``fastmath`` (it would allow
reassociation and FMA contraction, which change bits).

numba is a dependency of mergefs (wheels on PyPI, nothing to compile at install time); kernels
compile on first use and are cached on disk (``cache=True``: numba writes beside this module
when that is writable, else in its per-user cache directory). When numba cannot be imported,
:func:`available` is False, the reason is in :data:`UNAVAILABLE_REASON`, and the engine uses its
numpy path (the same bytes, slower) after logging that once.

Pure functions without shared state; numba releases the GIL inside the kernels (``nogil``), so
worker threads merge in parallel. Never call them on the trio thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

try:  # pragma: no cover - exercised by whether numba is installed
    import numba

    UNAVAILABLE_REASON = ""
except ImportError as exc:  # pragma: no cover
    numba = None
    UNAVAILABLE_REASON = (f"numba is not installed ({exc}); `pip install numba` for the fused "
                          "kernels (mergefs merges with numpy meanwhile: same bytes, slower)")

# dtype codes shared by the kernels
F32, BF16, F16 = 0, 1, 2
CODES = {"F32": F32, "BF16": BF16, "F16": F16}
# raw element types the kernels read (integers in every case, so that every branch of
# ``_decode`` types for every source; f32 bits are reinterpreted, never converted)
_RAW = {F32: np.dtype("<u4"), BF16: np.dtype("<u2"), F16: np.dtype("<u2")}
# numpy's own f16 -> f32 conversion of every half bit pattern (exact, payloads kept)
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)


def available() -> bool:
    return numba is not None


def supports(src_dtype: str, out_dtype: str) -> bool:
    """Whether the kernels handle this source and output dtype (else: the numpy path)."""
    return numba is not None and src_dtype in CODES and out_dtype in CODES


if numba is not None:
    _jit = numba.njit(cache=True, nogil=True, error_model="numpy")

    @_jit
    def _decode(raw: Any, j: int, kind: int, table: Any) -> Any:
        if kind == 0:
            return np.uint32(raw[j]).view(np.float32)
        if kind == 1:
            return np.uint32(np.uint32(raw[j]) << np.uint32(16)).view(np.float32)
        return table[raw[j]]

    @_jit
    def _f32_to_bf16(v: Any) -> Any:
        u = np.float32(v).view(np.uint32)
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN
            return np.uint16(0xFFC0) if u >> np.uint32(31) else np.uint16(0x7FC0)
        bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
        return np.uint16((u + bias) >> np.uint32(16))

    @_jit
    def _f32_to_f16(v: Any) -> Any:
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
    def _add(a: Any, b: Any) -> Any:
        """``a + b`` in float32; when both are NaN, ``a`` quietened (x86's rule for the first
        operand, which numpy's vector loops follow; LLVM may swap an fadd's operands)."""
        r = a + b
        if r != r and a != a:
            r = np.uint32(np.float32(a).view(np.uint32) | np.uint32(0x00400000)).view(np.float32)
        return r

    @_jit
    def _decode_into(raw: Any, kind: int, table: Any, out: Any) -> None:
        for j in range(out.size):
            out[j] = _decode(raw, j, kind, table)

    @_jit
    def _accumulate(acc: Any, w0: Any, lo: int, raw: Any, kind: int, table: Any,
                    c: Any) -> None:
        """acc[lo + j] = acc[lo + j] + (decode(raw[j]) - w0[lo + j]) * c, one pass."""
        for j in range(raw.size):
            acc[lo + j] = _add(acc[lo + j], (_decode(raw, j, kind, table) - w0[lo + j]) * c)

    @_jit
    def _finish(w0: Any, acc: Any, scale: Any, scale_is_one: bool, out_kind: int,
                out16: Any, out32: Any) -> None:
        for j in range(w0.size):
            if scale_is_one:
                m = _add(w0[j], acc[j])
            else:
                m = _add(scale * w0[j], acc[j])
            if out_kind == 0:
                out32[j] = m
            elif out_kind == 1:
                out16[j] = _f32_to_bf16(m)
            else:
                out16[j] = _f32_to_f16(m)

    @_jit
    def encode_f16(values: Any, out: Any) -> None:
        for j in range(values.size):
            out[j] = _f32_to_f16(values[j])

    @_jit
    def encode_bf16(values: Any, out: Any) -> None:
        for j in range(values.size):
            out[j] = _f32_to_bf16(values[j])


def _raw(buf: Any, kind: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=_RAW[kind])


def fused_additive(base_buf: Any, expert_runs: Sequence[Sequence[tuple[int, Any]]],
                   coeffs: Sequence[float], base_scale: float, src_dtype: str,
                   out_dtype: str) -> bytes:
    """The merged bytes of one unit of an additive merge.

    ``base_buf``: the base's bytes of the unit; ``expert_runs[i]``: expert ``i``'s planned
    runs as ``(offset in elements from the unit's start, bytes)``, in order; ``coeffs[i]``:
    ``c_i``; ``base_scale``: ``s``. Bit-identical to ``Engine.merge_unit``'s numpy path.
    Requires :func:`supports` (src_dtype, out_dtype).
    """
    if numba is None:
        raise RuntimeError(UNAVAILABLE_REASON)
    kind, out_kind = CODES[src_dtype], CODES[out_dtype]
    braw = _raw(base_buf, kind)
    n = braw.size
    w0 = np.empty(n, np.float32)
    _decode_into(braw, kind, F16_TABLE, w0)
    acc = np.zeros(n, np.float32)  # +0.0, as numpy's np.zeros_like
    for i, runs in enumerate(expert_runs):
        c = np.float32(coeffs[i])
        for lo, buf in runs:
            _accumulate(acc, w0, int(lo), _raw(buf, kind), kind, F16_TABLE, c)
    out16 = np.empty(n if out_kind else 0, np.uint16)
    out32 = np.empty(0 if out_kind else n, np.float32)
    scale = np.float32(base_scale)
    _finish(w0, acc, scale, bool(scale == 1), out_kind, out16, out32)
    return (out16 if out_kind else out32).tobytes()


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel signature now, so that the first
    unit merged does not wait for the compiler."""
    if numba is None:
        return
    for src in CODES:
        for out in CODES:
            b = np.zeros(4, _RAW[CODES[src]]).tobytes()
            fused_additive(b, [[(0, b)]], [0.5], 1.0, src, out)
            fused_additive(b, [[(0, b)]], [0.5], 0.5, src, out)
