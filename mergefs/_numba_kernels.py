"""The numba code behind :mod:`mergefs.kernels` (imported on first use: numba takes ~0.5 s to
import, which a command that merges nothing should not pay). See that module for what the
kernels compute and why they are bit-identical to numpy."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")

# One loop per source and per output dtype, each without branches LLVM cannot turn into
# selects, so that it vectorises (a runtime dtype switch inside one loop did not).

@_jit
def _add(a: Any, b: Any) -> Any:
    """``a + b`` in float32; when both are NaN, ``a`` quietened (x86's rule for the first
    operand, which numpy's vector loops follow; LLVM may swap an fadd's operands)."""
    r = a + b
    q = np.uint32(np.float32(a).view(np.uint32) | np.uint32(0x00400000)).view(np.float32)
    return q if np.isnan(r) and np.isnan(a) else r

@_jit
def _bf16(u: Any) -> Any:
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)

@_jit
def _f32(u: Any) -> Any:
    return np.uint32(u).view(np.float32)

@_jit
def _acc_f32(acc: Any, w0: Any, raw: Any, c: Any) -> None:
    for j in range(raw.size):
        acc[j] = _add(acc[j], (_f32(raw[j]) - w0[j]) * c)

@_jit
def _acc_bf16(acc: Any, w0: Any, raw: Any, c: Any) -> None:
    for j in range(raw.size):
        acc[j] = _add(acc[j], (_bf16(raw[j]) - w0[j]) * c)

@_jit
def _acc_f16(acc: Any, w0: Any, raw: Any, c: Any, table: Any) -> None:
    for j in range(raw.size):
        acc[j] = _add(acc[j], (table[raw[j]] - w0[j]) * c)

@_jit
def _dec_f32(raw: Any, out: Any) -> None:
    for j in range(raw.size):
        out[j] = _f32(raw[j])

@_jit
def _dec_bf16(raw: Any, out: Any) -> None:
    for j in range(raw.size):
        out[j] = _bf16(raw[j])

@_jit
def _dec_f16(raw: Any, out: Any, table: Any) -> None:
    for j in range(raw.size):
        out[j] = table[raw[j]]

@_jit
def _f32_to_bf16(v: Any) -> Any:
    u = np.float32(v).view(np.uint32)
    bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    r = np.uint16((u + bias) >> np.uint32(16))
    nan = np.uint16(0xFFC0) if u >> np.uint32(31) else np.uint16(0x7FC0)
    return nan if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r

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
def _merged(w0: Any, acc: Any, j: int, scale: Any, scale_is_one: bool) -> Any:
    return _add(w0[j], acc[j]) if scale_is_one else _add(scale * w0[j], acc[j])

@_jit
def _fin_f32(w0: Any, acc: Any, scale: Any, scale_is_one: bool, out: Any) -> None:
    for j in range(w0.size):
        out[j] = _merged(w0, acc, j, scale, scale_is_one)

@_jit
def _fin_bf16(w0: Any, acc: Any, scale: Any, scale_is_one: bool, out: Any) -> None:
    for j in range(w0.size):
        out[j] = _f32_to_bf16(_merged(w0, acc, j, scale, scale_is_one))

@_jit
def _fin_f16(w0: Any, acc: Any, scale: Any, scale_is_one: bool, out: Any) -> None:
    for j in range(w0.size):
        out[j] = _f32_to_f16(_merged(w0, acc, j, scale, scale_is_one))

@_jit
def encode_f16(values: Any, out: Any) -> None:
    for j in range(values.size):
        out[j] = _f32_to_f16(values[j])

@_jit
def encode_bf16(values: Any, out: Any) -> None:
    for j in range(values.size):
        out[j] = _f32_to_bf16(values[j])
