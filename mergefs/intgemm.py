"""The exact low-rank product of version-4 sidecar levels on oneDNN's int8 matmul (issue 14).

Version 4 defines a block's low-rank part as ``2**-G * (Q @ W)``: ``Q`` the U codes as odd
integers (``2 * code - (2**bits - 1)``), ``W`` integers on the grid of
:func:`mergefs.deltas.grid_of`, every partial sum below ``2**24``, so the float32 product is
exact in any order. The same integers multiply exactly in int8 x int8 -> int32 arithmetic,
which this CPU runs on AMX tiles (or AVX-512 VNNI) at several times the float32 rate; torch's
quantised linear (``torch.ops.onednn.qlinear_pointwise``, torch being a dependency) reaches it:

- ``x = Q + 128`` as uint8 with zero point 128 for codes of up to 7 bits; an 8-bit code's
  ``Q = 2 * (code - 128) + 1``, so its column is ``x = code`` against the row ``2 * W``, and its
  ``W`` row is added once to the output as a bias;
- the weight rows (``W`` or ``2 * W``) split into signed base-256 digits, ``W' = sum_d 256**d
  D_d`` with ``D_d`` in int8, the digits side by side as output channels, each scaled by
  ``256**d`` (exact);
- the caller adds a row's digit columns from the highest down: every partial sum is a multiple
  of 256 within a factor ``1 + 2**-7`` of the final value, so each addition is exact, and the
  last gives ``Q @ W`` exactly, the same float32 as the BLAS product.

The route is taken only where it is exact by construction: a CPU with AMX or VNNI (the AVX2
int8 path saturates 16-bit pair sums), at most :data:`MAX_K` columns (int32 accumulation and
the zero-point compensation stay far below ``2**24``), and after a one-time check against the
float32 product on values at the extremes; ``MERGEFS_EXACT_GEMM=blas`` turns it off,
``=onednn`` skips the CPU test (tests). Both routes give the same bits; this one is only
faster.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

#: at most this many columns of ``x``: ``255 * 128 * MAX_K < 2**24`` (every int32 sum and the
#: zero-point compensation exact even in float32)
MAX_K = 512
#: below this many multiply-adds a product goes to the BLAS (a oneDNN call costs ~40 us)
MIN_MACS = 1 << 21
ZERO_POINT = 128


@dataclass(frozen=True)
class IntWeights:
    """``W`` of one exact prefix, prepacked for oneDNN."""

    packed: Any  # torch tensor: the int8 digits, (ndig * cols, k), oneDNN's blocked layout
    scales: Any  # torch float32 (ndig * cols,): 256**d
    zero: Any  # torch int64 (ndig * cols,)
    bias: Any  # torch float32 (ndig * cols,) or None: the 8-bit rows of W, summed
    ndig: int
    k: int


_state: dict[str, Any] = {}
_lock = threading.Lock()


def available() -> bool:
    """True when the oneDNN route is on for this process (decided once)."""
    got = _state.get("ok")
    if got is None:
        with _lock:
            got = _state.get("ok")
            if got is None:
                got = _state["ok"] = _decide()
    return bool(got)


def _decide() -> bool:
    mode = os.environ.get("MERGEFS_EXACT_GEMM", "auto").strip().lower()
    if mode == "blas":
        return False
    try:
        import torch
        op = torch.ops.onednn.qlinear_pointwise  # noqa: F841 (present in this torch)
        cpu_ok = bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_vnni_supported())
    except Exception:  # noqa: BLE001 (an older or CPU-less torch build: the BLAS route)
        return False
    if mode != "onednn" and not cpu_ok:
        return False
    try:
        return _self_check()
    except Exception:  # noqa: BLE001 (any failure of the op: the BLAS route)
        return False


def _self_check() -> bool:
    """Products at the extremes of every code width, against float64: equal or the route is
    off."""
    rng = np.random.default_rng(20261202)
    rows, cols = 96, 80
    bits = np.array([8, 8, 4, 3, 2, 1, 7, 8] * 6)
    top = (1 << bits) - 1
    codes = rng.integers(0, top + 1, size=(rows, len(bits)))
    codes[:8] = top  # extremes
    codes[8:16] = 0
    q = 2 * codes - top
    budget = (1 << 23) // int(top.sum())
    w = rng.integers(-budget, budget + 1, size=(len(bits), cols)).astype(np.float32)
    w[:, :4] = budget
    iw = prepare(w, bits == 8)
    x = to_x(codes, bits)
    got = sum_digits(product(x, iw), iw.ndig, cols)
    want = q.astype(np.float64) @ w.astype(np.float64)
    return bool(np.array_equal(got.astype(np.float64), want))


def to_x(codes: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """``x`` of :func:`product` from codes (rows, k) of per-column widths ``bits`` (k,)."""
    top = (1 << bits.astype(np.int64)) - 1
    q = 2 * codes.astype(np.int64) - top
    x = np.where(bits == 8, codes, q + ZERO_POINT)
    return x.astype(np.uint8)


def prepare(w: np.ndarray, eight: np.ndarray) -> IntWeights:
    """``W`` (k, cols) float32 integers of an exact prefix, ``eight`` (k,) its 8-bit rows."""
    import torch

    wi = w.astype(np.int64)
    wx = wi.copy()
    wx[eight] *= 2
    digits = []
    rest = wx
    while True:
        d = ((rest + 128) & 255) - 128
        digits.append(d.astype(np.int8))
        rest = (rest - d) >> 8
        if not rest.any():
            break
    ndig = len(digits)
    cols = w.shape[1]
    stacked = np.concatenate(digits, axis=1)  # (k, ndig * cols)
    packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(np.ascontiguousarray(stacked.T)),
                                              None)
    scales = torch.from_numpy(np.repeat(np.float32(256.0) ** np.arange(ndig, dtype=np.float32),
                                        cols).astype(np.float32))
    bias = None
    if eight.any():
        b = np.zeros(ndig * cols, np.float32)
        b[:cols] = wi[eight].sum(axis=0)  # |sum| < 2**24 / 255: exact
        bias = torch.from_numpy(b)
    return IntWeights(packed, scales, torch.zeros(ndig * cols, dtype=torch.int64), bias, ndig,
                      int(w.shape[0]))


def product(x: np.ndarray, iw: IntWeights) -> np.ndarray:
    """``(rows, ndig * cols)`` float32: digit ``d`` of ``Q @ W`` times ``256**d`` in columns
    ``d * cols ..`` (the bias in digit 0), for ``x`` (rows, k) uint8 of :func:`to_x`."""
    import torch

    if x.shape[1] != iw.k:
        raise ValueError(f"intgemm.product: x has {x.shape[1]} columns, W {iw.k} rows")
    out = torch.ops.onednn.qlinear_pointwise(
        torch.from_numpy(np.ascontiguousarray(x)), 1.0, ZERO_POINT, iw.packed, iw.scales,
        iw.zero, iw.bias, 1.0, 0, torch.float32, "none", [], "")
    return out.numpy()


def sum_digits(p: np.ndarray, ndig: int, cols: int) -> np.ndarray:
    """``Q @ W`` from :func:`product`'s columns, the highest digit first (numpy; the compiled
    loop sums the same way)."""
    acc = p[:, (ndig - 1) * cols:ndig * cols].copy()
    for d in range(ndig - 2, -1, -1):
        acc += p[:, d * cols:(d + 1) * cols]
    return acc
