"""The codes of delta sidecar levels: what a level is (kind, bits, components), bit packing, quantiser tables and the byte size of each kind's block; the file's layout is described in :mod:`mergefs.deltas.sidecar`. Pure; any thread."""

from __future__ import annotations
from dataclasses import dataclass
from typing import Any
import numpy as np
from mergefs.core.errors import MergefsError


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


def rows_block_size(changed: int, rows_b: int, cols: int, bits: int) -> int:
    return packed_size(rows_b, 1) + 4 * changed + packed_size(changed * cols, bits)


def vq_block_size(rows_b: int, cols: int, level: Level) -> int:
    return 4 * rows_b + rows_b * cols // level.k  # one byte per code: bits * k == 8
