"""The exact low-rank product of version-4 and -5 sidecar levels on oneDNN's int8 matmul
(issue 14).

Version 4 defines a block's low-rank part as ``2**-G * (Q @ W)``: ``Q`` the U codes as odd
integers (``2 * code - (2**bits - 1)``), ``W`` integers on the grid of
:func:`mergefs.deltas.reconstruct.grid_of`, every partial sum below ``2**24``, so the float32 product is
exact in any order. The same integers multiply exactly in int8 x int8 -> int32 arithmetic,
which this CPU runs on AMX tiles (or AVX-512 VNNI) at several times the float32 rate; torch's
quantised linear (``torch.ops.onednn.qlinear_pointwise``, torch being a dependency) reaches it:

- ``x = Q + 128`` as uint8 with zero point 128 for codes of up to 7 bits; an 8-bit code's
  ``Q = 2 * (code - 128) + 1``, so its column is ``x = code`` against the row ``2 * W``, and its
  ``W`` row is added once to the output as a bias;
- the weight rows (``W`` or ``2 * W``) split into signed base-256 digits, ``W' = sum_d 256**d
  D_d`` with ``D_d`` in int8; a digit's product (only the rows where it is nonzero: the
  leading components) is scaled by ``256**d`` (exact) and added onto the higher digits' by
  oneDNN's sum post-op, the highest first: every partial sum is a multiple of ``256**d`` near
  the final value, so each addition is exact, and the last gives ``Q @ W`` exactly, the same
  float32 as the BLAS product. Version 5's grid keeps ``W'`` in int8: one digit, one call
  (version 4's ~15-bit ``W`` needs two or three; with three the BLAS is faster).

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
#: below this many multiply-adds per digit a product goes to the BLAS (a oneDNN call costs
#: ~30 us, the BLAS runs ~80 GMAC/s on one thread here)
MIN_MACS = 1 << 21
ZERO_POINT = 128
#: products of weights with more base-256 digits go to the BLAS: each call writes and reads
#: back the whole output, so three calls cost more than the BLAS product they replace
#: (measured: version-4 sidecars of MiniLM at 10%, 0.274 s on this route, 0.242 s by BLAS)
MAX_DIGITS = 2


@dataclass(frozen=True)
class Digit:
    """One base-256 digit of ``W'``: its nonzero rows, prepacked, and its scale ``256**d``."""

    rows: np.ndarray | None  # the rows of W' (columns of x) it has; None: all
    packed: Any  # torch int8, oneDNN's blocked layout
    scales: Any  # torch float32 (cols,): 256**d
    bias: Any  # torch float32 (cols,) (digit 0, 8-bit rows) or None


@dataclass(frozen=True)
class IntWeights:
    """``W`` of one exact prefix as digits, the highest first."""

    digits: tuple[Digit, ...]
    zero: Any  # torch int64 (cols,)
    k: int

    @property
    def ndig(self) -> int:
        return len(self.digits)


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
    decay = 2.0 ** -np.arange(len(bits))  # the leading rows need more digits than the rest
    w = np.rint(rng.uniform(-1, 1, size=(len(bits), cols)) * budget * decay[:, None])
    w[:, :4] = np.rint(budget * decay)[:, None]
    w = w.astype(np.float32)
    iw = prepare(w, bits == 8)
    x = to_x(codes, bits)
    got = product(x, iw)
    want = q.astype(np.float64) @ w.astype(np.float64)
    return bool(np.array_equal(got.astype(np.float64), want))


def _omp() -> tuple[Any, Any] | None:
    """``(omp_get_max_threads, omp_set_num_threads)`` of the OpenMP runtime torch runs oneDNN
    on (its bundled libgomp), or None (another build: torch's own setter is used)."""
    if "omp" not in _state:
        got = None
        try:
            import ctypes
            from pathlib import Path

            import torch
            lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"))
            get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
            get.restype, get.argtypes = ctypes.c_int, []
            put.restype, put.argtypes = None, [ctypes.c_int]
            got = (get, put)
        except (OSError, AttributeError, ImportError):
            got = None
        _state["omp"] = got
    return _state["omp"]


def to_x(codes: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """``x`` of :func:`product` from codes (rows, k) of per-column widths ``bits`` (k,)."""
    top = (1 << bits.astype(np.int64)) - 1
    q = 2 * codes.astype(np.int64) - top
    x = np.where(bits == 8, codes, q + ZERO_POINT)
    return x.astype(np.uint8)


def prepare(w: np.ndarray, eight: np.ndarray) -> IntWeights:
    """``W`` (k, cols) float32 integers of an exact prefix, ``eight`` (k,) its 8-bit rows.
    A digit above the first holds only the rows that need it (the leading components, whose
    values are largest): its product has that many columns of ``x``."""
    import torch

    wi = w.astype(np.int32)  # |W| < 2**24
    wx = wi.copy()
    wx[eight] *= 2
    found = []
    if np.abs(wx).max(initial=0) <= 127:  # one digit (version 5, and small weights)
        found.append(wx)
    else:
        rest = wx
        while True:
            d = ((rest + 128) & 255) - 128
            found.append(d)
            rest = (rest - d) >> 8
            if not rest.any():
                break
    cols = w.shape[1]
    digits = []
    for level in range(len(found) - 1, -1, -1):  # the highest first: the order of the sums
        d = found[level]
        rows = None if level == 0 else np.flatnonzero(d.any(axis=1))
        if rows is not None and len(rows) == 0:
            continue
        part = d if rows is None else d[rows]
        packed = torch.ops.onednn.qlinear_prepack(
            torch.from_numpy(np.ascontiguousarray(part.T.astype(np.int8))), None)
        bias = None
        if level == 0 and eight.any():  # |sum| < 2**24 / 255: exact
            bias = torch.from_numpy(wi[eight].sum(axis=0, dtype=np.int64).astype(np.float32))
        digits.append(Digit(rows, packed, torch.full((cols,), float(256 ** level)), bias))
    return IntWeights(tuple(digits), torch.zeros(cols, dtype=torch.int64), int(w.shape[0]))


def digits_of(w: np.ndarray, eight: np.ndarray) -> int:
    """How many digits (oneDNN calls) :func:`prepare` of these weights has, at most."""
    peak = 2 * int(np.abs(w[eight]).max(initial=0)) if eight.any() else 0
    peak = max(peak, int(np.abs(w[~eight]).max(initial=0)))
    n = 1
    while peak > 127:  # each digit above the first takes 8 bits off (rounding: +1)
        peak = (peak + 128) >> 8
        n += 1
    return n


def product(x: np.ndarray, iw: IntWeights) -> np.ndarray:
    """``Q @ W`` (rows, cols) float32, exact, for ``x`` (rows, k) uint8 of :func:`to_x`: the
    highest digit's product, then each lower one added onto it by oneDNN's sum post-op."""
    import torch

    if x.shape[1] != iw.k:
        raise ValueError(f"intgemm.product: x has {x.shape[1]} columns, W {iw.k} rows")
    # one thread: the engine's workers already use the cores, and oneDNN's OpenMP team spins
    # against them (measured: a product 10-20x slower on a busy 2-core machine); set as the
    # calling thread's own OpenMP count, restored after (torch.set_num_threads would also
    # change the count threads started later take)
    omp = _omp()
    threads = omp[0]() if omp is not None else torch.get_num_threads()
    if threads != 1:
        (omp[1] if omp is not None else torch.set_num_threads)(1)
    try:
        xt = torch.from_numpy(np.ascontiguousarray(x))
        out = None
        for dg in iw.digits:
            xd = xt if dg.rows is None else torch.from_numpy(np.ascontiguousarray(x[:, dg.rows]))
            if out is None:
                out = torch.ops.onednn.qlinear_pointwise(
                    xd, 1.0, ZERO_POINT, dg.packed, dg.scales, iw.zero, dg.bias, 1.0, 0,
                    torch.float32, "none", [], "")
            else:  # in place: out += this digit's product (exact, see the module docstring)
                out = torch.ops.onednn.qlinear_pointwise.binary(
                    xd, 1.0, ZERO_POINT, dg.packed, dg.scales, iw.zero, out, dg.bias, 1.0, 0,
                    torch.float32, 1.0, 0, "sum", 1.0, "none", [], "")
    finally:
        if threads != 1:
            (omp[1] if omp is not None else torch.set_num_threads)(threads)
    assert out is not None
    return out.numpy()
