"""Tensor bytes <-> float32 arrays for the safetensors float dtypes (bf16/fp8 via ml_dtypes,
imported on first use).

Pure functions; safe on worker threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import numpy as np

#: dtypes numpy has; ml_dtypes' are resolved on first use (see _Dtypes)
_NUMPY: dict[str, np.dtype] = {
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
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_ORDER = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32",
          "F64", "F8_E4M3", "F8_E5M2")


class _Dtypes(Mapping[str, np.dtype]):
    """safetensors dtype name -> numpy dtype. ``import ml_dtypes`` costs ~0.6 s of CPU (with the
    GIL held) on this machine, so it happens at the first lookup of one of its types, not at
    import: a mount or merge whose arithmetic runs in the compiled kernels (bf16 decoded by a
    shift, encoded by the kernel) never pays it."""

    _lock = threading.Lock()

    def __getitem__(self, name: str) -> np.dtype:
        got = _NUMPY.get(name)
        if got is not None:
            return got
        if name not in _ML_DTYPES:
            raise KeyError(name)
        with self._lock:
            if name not in _NUMPY:
                import ml_dtypes

                for key, attr in _ML_DTYPES.items():
                    _NUMPY[key] = np.dtype(getattr(ml_dtypes, attr))
        return _NUMPY[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_ORDER)

    def __len__(self) -> int:
        return len(_ORDER)

    def __contains__(self, name: object) -> bool:
        return name in _NUMPY or name in _ML_DTYPES


NUMPY_DTYPES: Mapping[str, np.dtype] = _Dtypes()


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
