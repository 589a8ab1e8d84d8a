"""torch's CPU float32 arithmetic in numpy, bit for bit, for the elementwise methods' fast path.

The methods run in torch to equal mergekit; for the elementwise ones (linear, task arithmetic,
DARE without rescale, ram, nearswap, passthrough) these numpy kernels give the same bytes without
importing torch (which costs ~230 MiB of resident memory in a mount). Each is checked against
torch in tests/test_methods.py. Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: the most values torch sums with its scalar row_sum on any x86 CPU
SMALL_SUM_MAX = 7  # 8 floats are one AVX2 vector: torch vectorises from there


def fma32(x: np.ndarray, c: np.float32, acc: np.ndarray) -> np.ndarray:
    """float32 ``acc + x * c`` rounded once (torch's ``addcmul_``), via float64 round-to-odd.

    ``x * c`` is exact in float64 (24 + 24 bits); the float64 sum is made round-to-odd from its
    exact error term (TwoSum), and rounding that to float32 is then correctly rounded, since
    53 >= 2 * 24 + 2.
    """
    p = x.astype(np.float64) * np.float64(c)
    a = acc.astype(np.float64)
    s = a + p
    bb = s - a
    err = (a - (s - bb)) + (p - bb)
    inexact = (err != 0) & ((s.view(np.uint64) & np.uint64(1)) == 0)
    if inexact.any():
        s[inexact] = np.nextafter(s[inexact], np.where(err[inexact] > 0, np.inf, -np.inf))
    return s.astype(np.float32)


def small_sum(values: Sequence[float | np.float32]) -> np.float32:
    """torch's float32 ``sum`` of a few contiguous values (``row_sum``): four interleaved partial
    sums from +0.0, the remainder added to the first, then the partials added in order."""
    v = [np.float32(x) for x in values]
    if len(v) > SMALL_SUM_MAX:
        raise ValueError("small_sum: too many values")
    partial = [np.float32(0.0)] * 4
    full = len(v) // 4
    for i in range(full):
        for k in range(4):
            partial[k] = np.float32(partial[k] + v[4 * i + k])
    for i in range(4 * full, len(v)):
        partial[0] = np.float32(partial[0] + v[i])
    total = partial[0]
    for k in range(1, 4):
        total = np.float32(total + partial[k])
    return total


#: the most inputs whose sum over the input axis is modelled here (:func:`multi_row_sum`'s
#: cascade is modelled for any count; this bound is where it is tested against torch)
TORCH_SUM_MAX = 256
#: columns that torch's outer sum adds in input order per group: 4 vectors of 8 floats (its
#: sum kernel runs at AVX2 width on x86, AVX512 machines included; chunks of a multi-threaded
#: reduction start at multiples of 128 bytes, i.e. of this group)
TORCH_SUM_GROUP = 32
#: ATen's ``multi_row_sum`` levels: four accumulators per column
CASCADE_LEVELS = 4


def cascade_power(rows: int) -> int:
    """log2 of the rows ``multi_row_sum`` adds into its first level before carrying it up
    (``max(4, ceil(log2(rows)) // 4)``: 16 rows for fewer than 2**20)."""
    return max(4, (max(rows, 1) - 1).bit_length() // CASCADE_LEVELS)


def carry_levels(done: int, power: int) -> int:
    """How many levels ``multi_row_sum`` carries up after a block of ``2**power`` rows ends at
    row ``done``: level ``j`` (1..3) gets ``+= level j-1`` and level ``j-1`` restarts at +0.0,
    up to the first ``j`` whose mask ``(2**power - 1) << (j * power)`` meets ``done``."""
    mask = (1 << power) - 1
    for j in range(1, CASCADE_LEVELS):
        if done & (mask << (j * power)):
            return j
    return CASCADE_LEVELS - 1


def multi_row_sum(rows: Sequence[np.ndarray]) -> np.ndarray:
    """torch's float32 sum of ``rows`` (elementwise; ATen ``SumKernel.cpp``, ``multi_row_sum``):
    rows in order into level 0 from +0.0; after each full block of ``2**cascade_power`` rows,
    :func:`carry_levels`; the rows past the last full block into level 0; then level 0 plus
    levels 1, 2, 3 in order. Up to 15 rows (and 16) this is input order; with 17..31 it is
    ``sum(rows[16:]) + sum(rows[:16])``, with 32 ``sum(rows[:16]) + sum(rows[16:32])``, and
    so on: a block sum is carried into level 1 every 16 rows."""
    power = cascade_power(len(rows))
    step = 1 << power
    zero = np.zeros_like(rows[0])
    acc = [zero] * CASCADE_LEVELS
    i = 0
    while i + step <= len(rows):
        for x in rows[i:i + step]:
            acc[0] = acc[0] + x
        i += step
        for j in range(1, carry_levels(i, power) + 1):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = zero
    for x in rows[i:]:
        acc[0] = acc[0] + x
    total = acc[0]
    for j in range(1, CASCADE_LEVELS):
        total = total + acc[j]
    return total


def torch_sum_tail(numel: int, n: int) -> int | None:
    """Where the tail begins in torch's ``stack(xs).sum(dim=0)`` of ``n`` contiguous float32
    tensors of ``numel`` elements (x86, ATen's ``SumKernel.cpp``, ``vectorized_outer_sum``):
    flat positions before it are summed by :func:`multi_row_sum` (input order for up to
    16 inputs), positions from it on are ``row_sum`` (:func:`row_sum`). None: a case this does
    not model (one element and 8 or more inputs: torch then sums along the contiguous input
    axis; more than TORCH_SUM_MAX inputs)."""
    if n > TORCH_SUM_MAX or (numel == 1 and n >= 8) or numel < 1:
        return None
    if numel >= 8:
        return numel - numel % TORCH_SUM_GROUP
    return numel - numel % 4  # scalar_outer_sum: 4 columns at a time, then row_sum


def row_sum(xs: Sequence[np.ndarray]) -> np.ndarray:
    """torch's ``row_sum`` over inputs, elementwise: four interleaved partial sums
    (:func:`multi_row_sum` of inputs ``k, k + 4, k + 8, ...`` of the first ``4 * (n // 4)``
    for partial ``k``: from 64 inputs on, with its cascade), the rest added to the first, then
    the partials added in order. :func:`small_sum` is the same on scalars."""
    full = len(xs) // 4
    partial = [multi_row_sum([xs[4 * i + k] for i in range(full)]) if full
               else np.zeros_like(xs[0]) for k in range(4)]
    for i in range(4 * full, len(xs)):
        partial[0] = partial[0] + xs[i]
    total = partial[0]
    for k in range(1, 4):
        total = total + partial[k]
    return total


def vector_sum(values: Sequence[float | np.float32]) -> np.float32:
    """torch's float32 ``sum`` of a contiguous vector (mergekit's sums of the weights): up to
    SMALL_SUM_MAX values :func:`small_sum`; from 8 on ``vectorized_inner_sum``: the vectors of
    8 as :func:`row_sum` rows (lanewise), then from +0.0 the values past the last vector in
    order, then the 8 lanes in order."""
    v = np.asarray([np.float32(x) for x in values], np.float32)
    if v.size <= SMALL_SUM_MAX:
        return small_sum(list(v))
    lanes = 8
    full = v.size // lanes
    acc = row_sum([v[lanes * i:lanes * (i + 1)] for i in range(full)])
    total = np.float32(0.0)
    with np.errstate(all="ignore"):
        for x in [*v[lanes * full:], *acc]:
            total = np.float32(total + x)
    return total


def outer_sum(xs: Sequence[np.ndarray]) -> np.ndarray:
    """torch's ``stack(xs).sum(dim=0)`` for up to 4 inputs: sequential from +0.0."""
    if len(xs) > 4:
        raise ValueError("outer_sum: more than 4 inputs")
    return outer_sum_any(xs)


def torch_order_sum(xs: Sequence[np.ndarray], elem_offset: int, tensor_size: int) -> np.ndarray:
    """torch's ``stack(...).sum(dim=0)`` of a whole tensor, on the flat slice of it that starts
    at ``elem_offset`` (``xs``: the inputs' values there): :func:`multi_row_sum`, then
    :func:`row_sum` from :func:`torch_sum_tail` on. Requires a modelled case (torch_sum_tail
    not None)."""
    tail = torch_sum_tail(tensor_size, len(xs))
    if tail is None:
        raise ValueError("torch_order_sum: a case torch_sum_tail does not model")
    out = multi_row_sum(xs)
    lo = max(tail - elem_offset, 0)
    if lo < out.size:
        out[lo:] = row_sum([x[lo:] for x in xs])
    return out


def outer_sum_any(xs: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of ``xs`` in input order from +0.0 (torch's order for up to 4 inputs, and before
    :func:`torch_sum_tail` for up to 16)."""
    acc = np.zeros_like(xs[0])
    for x in xs:
        acc = acc + x
    return acc
