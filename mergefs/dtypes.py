"""Tensor bytes <-> float32 arrays for the safetensors float dtypes (bf16/fp8 via ml_dtypes).

Pure functions; safe on worker threads.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


def decode_f32(buf: memoryview | bytes, dtype: str) -> np.ndarray:
    """Decode little-endian tensor bytes to a new, writable float32 array."""
    if dtype == "F32":
        return np.frombuffer(buf, dtype="<f4").copy()
    if dtype == "BF16":
        # bf16 is the top half of a float32: widening is exact and a shift does it.
        u16 = np.frombuffer(buf, dtype="<u2")
        return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.frombuffer(buf, dtype=NUMPY_DTYPES[dtype]).astype(np.float32)


def encode(values: np.ndarray, dtype: str) -> bytes:
    """Cast float32 values to ``dtype`` with round-to-nearest-even and return the bytes."""
    if dtype == "F32":
        return values.astype("<f4", copy=False).tobytes()
    return values.astype(NUMPY_DTYPES[dtype]).tobytes()
