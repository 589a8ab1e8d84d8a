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

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

UNAVAILABLE_REASON = "" if importlib.util.find_spec("numba") is not None else (
    "numba is not installed; `pip install numba` for the fused kernels (mergefs merges with "
    "numpy meanwhile: same bytes, slower)")
_nb: Any = None  # mergefs._numba_kernels, imported on first use


def _kernels() -> Any:
    global _nb
    if _nb is None:
        if UNAVAILABLE_REASON:
            raise RuntimeError(UNAVAILABLE_REASON)
        from . import _numba_kernels

        _nb = _numba_kernels
    return _nb


# dtype codes shared by the kernels
F32, BF16, F16 = 0, 1, 2
CODES = {"F32": F32, "BF16": BF16, "F16": F16}
# raw element types the kernels read (integers in every case, so that every branch of
# ``_decode`` types for every source; f32 bits are reinterpreted, never converted)
_RAW: dict[int, np.dtype[Any]] = {F32: np.dtype("<u4"), BF16: np.dtype("<u2"), F16: np.dtype("<u2")}
# numpy's own f16 -> f32 conversion of every half bit pattern (exact, payloads kept)
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)


_noted = False


def note_unavailable() -> None:
    """Log once per process that the numpy path is used, and why."""
    global _noted
    if UNAVAILABLE_REASON and not _noted:
        _noted = True
        log.warning("%s", UNAVAILABLE_REASON)


def available() -> bool:
    """Whether numba is installed (without importing it)."""
    return not UNAVAILABLE_REASON


def supports(src_dtype: str, out_dtype: str) -> bool:
    """Whether the kernels handle this source and output dtype (else: the numpy path)."""
    return not UNAVAILABLE_REASON and src_dtype in CODES and out_dtype in CODES


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
    k = _kernels()
    kind, out_kind = CODES[src_dtype], CODES[out_dtype]
    braw = _raw(base_buf, kind)
    n = braw.size
    w0 = np.empty(n, np.float32)
    if kind == F32:
        k._dec_f32(braw, w0)
    elif kind == BF16:
        k._dec_bf16(braw, w0)
    else:
        k._dec_f16(braw, w0, F16_TABLE)
    acc = np.zeros(n, np.float32)  # +0.0, as numpy's np.zeros_like
    for i, runs in enumerate(expert_runs):
        c = np.float32(coeffs[i])
        for lo, buf in runs:
            raw = _raw(buf, kind)
            a, w = acc[lo:lo + raw.size], w0[lo:lo + raw.size]
            if kind == F32:
                k._acc_f32(a, w, raw, c)
            elif kind == BF16:
                k._acc_bf16(a, w, raw, c)
            else:
                k._acc_f16(a, w, raw, c, F16_TABLE)
    scale = np.float32(base_scale)
    one = bool(scale == 1)
    if out_kind == F32:
        out32 = np.empty(n, np.float32)
        k._fin_f32(w0, acc, scale, one, out32)
        return out32.tobytes()
    out16 = np.empty(n, np.uint16)
    (k._fin_bf16 if out_kind == BF16 else k._fin_f16)(w0, acc, scale, one, out16)
    return out16.tobytes()


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel signature now, so that the first
    unit merged does not wait for the compiler."""
    if UNAVAILABLE_REASON:
        return
    for src in CODES:
        for out in CODES:
            b = np.zeros(4, _RAW[CODES[src]]).tobytes()
            fused_additive(b, [[(0, b)]], [0.5], 1.0, src, out)
            fused_additive(b, [[(0, b)]], [0.5], 0.5, src, out)


def encode_f16(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> float16 bits into ``out`` (uint16), exactly as numpy casts."""
    _kernels().encode_f16(values, out)


def encode_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bits into ``out`` (uint16), exactly as ml_dtypes casts."""
    _kernels().encode_bf16(values, out)
