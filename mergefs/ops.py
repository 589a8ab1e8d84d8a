"""Merge operators over float32 arrays, exactly as docs/operators.md defines them.

Every operator takes the base values ``w0`` and, per expert, either a delta array or ``None``
(omitted by the plan or zero: exactly +0.0 everywhere). Elementwise operators may be called on any
slice of a tensor (``elem_offset`` is the flat index of the slice's first element); whole-tensor
operators must get whole tensors. Pure numpy; runs on worker threads (numpy releases the GIL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from .spec import Spec

WHOLE_TENSOR = frozenset({"ties", "breadcrumbs", "slerp"})
CONSENSUS = frozenset({"ties", "dare_ties"})
DARE = frozenset({"dare_linear", "dare_ties"})

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class OpParams:
    """Everything an operator needs, resolved from a spec once."""

    method: str
    weights: tuple[float, ...]
    densities: tuple[float, ...]
    gammas: tuple[float, ...]
    coefficients: tuple[float, ...]  # additive c_i (ranking weight for the others)
    base_scale: float  # `a` of the additive form
    normalize: bool
    lam: float
    rescale: bool
    seed: int
    t: float

    @property
    def whole_tensor(self) -> bool:
        return self.method in WHOLE_TENSOR


def resolve_params(spec: Spec) -> OpParams:
    """Compute the float64 coefficients of docs/operators.md from a spec."""
    method = spec.method
    g = spec.parameters
    w = [float(e.parameters.get("weight", 1.0)) for e in spec.experts]
    lam = float(g.get("lambda", 1.0))
    normalize = bool(g.get("normalize", False))
    if method == "linear":
        wb = spec.base_weight or 0.0
        total = wb + sum(w)
        n = total if normalize else 1.0
        if n == 0:
            n = 1.0
        coeffs = tuple(x / n for x in w)
        base_scale = total / n
    elif method == "task_arithmetic":
        n = sum(w) if normalize and abs(sum(w)) >= 1e-8 else 1.0
        coeffs = tuple(lam * x / n for x in w)
        base_scale = 1.0
    else:
        n = sum(w) if normalize and abs(sum(w)) >= 1e-8 else 1.0
        coeffs = tuple(lam * x / n for x in w) if method != "slerp" else (1.0,)
        base_scale = 1.0
    return OpParams(
        method=method,
        weights=tuple(w),
        densities=tuple(float(e.parameters.get("density", 1.0)) for e in spec.experts),
        gammas=tuple(float(e.parameters.get("gamma", 0.01)) for e in spec.experts),
        coefficients=coeffs,
        base_scale=base_scale,
        normalize=normalize,
        lam=lam,
        rescale=bool(g.get("rescale", True)),
        seed=int(g.get("seed", 0)),
        t=float(g.get("t") or 0.0),
    )


def dare_uniform(seed: int, tensor: str, expert: int, start: int, count: int) -> np.ndarray:
    """The counter-based uniforms u(seed, tensor, expert, j) for j in [start, start + count)."""
    key = np.uint64(xxhash.xxh3_64_intdigest(f"{seed}\x00{tensor}\x00{expert}".encode()))
    x = np.arange(start, start + count, dtype=np.uint64)
    x *= _GOLDEN
    x += key
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def _topk_mask(absd: np.ndarray, k: int) -> np.ndarray:
    """Mask of the k largest values, ties broken by lower flat index (negation is exact)."""
    return _smallest_mask(-absd, k)


def _rank_range_mask(absd: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Mask of ascending ranks [lo, hi) (stable order), as breadcrumbs keeps them."""
    n = absd.size
    if lo >= hi:
        return np.zeros(n, dtype=bool)
    smallest_hi = _smallest_mask(absd, hi)
    smallest_lo = _smallest_mask(absd, lo)
    return smallest_hi & ~smallest_lo


def _smallest_mask(absd: np.ndarray, k: int) -> np.ndarray:
    """Mask of the k smallest values, ties broken by lower flat index, in O(n)."""
    n = absd.size
    mask = np.zeros(n, dtype=bool)
    if k <= 0:
        return mask
    if k >= n:
        mask[:] = True
        return mask
    kth = np.partition(absd, k - 1)[k - 1]
    below = absd < kth
    mask |= below
    need = k - int(np.count_nonzero(below))
    if need > 0:
        mask[np.flatnonzero(absd == kth)[:need]] = True
    return mask


def sparsify(p: OpParams, d: np.ndarray, tensor: str, expert: int, elem_offset: int) -> np.ndarray:
    """Step 1 of generalised task arithmetic for one expert's delta (flat float32)."""
    d32 = np.float32(p.densities[expert])  # scalars are float32 (docs/operators.md)
    if d32 >= 1:
        return d
    density = float(d32)
    n = d.size
    if p.method == "ties":
        return np.where(_topk_mask(np.abs(d), math.floor(density * n)), d, np.float32(0))
    if p.method == "breadcrumbs":
        target = math.floor(density * n)
        n_top = math.floor(float(np.float32(p.gammas[expert])) * n)
        n_bot = n - target - n_top
        if n_bot < 0:
            n_top += n_bot
            n_bot = 0
        keep = _rank_range_mask(np.abs(d), n_bot, n - n_top)
        return np.where(keep, d, np.float32(0))
    # DARE
    keep = dare_uniform(p.seed, tensor, expert, elem_offset, n) < density
    kept = d / d32 if p.rescale else d
    return np.where(keep, kept, np.float32(0))


def merge_gta(
    p: OpParams, w0: np.ndarray, deltas: Sequence[np.ndarray | None], tensor: str, elem_offset: int
) -> np.ndarray:
    """ties / dare_linear / dare_ties / breadcrumbs over flat float32 arrays."""
    zero = np.float32(0)
    xs: list[np.ndarray | None] = []
    for i, d in enumerate(deltas):
        if d is None:
            xs.append(None)
            continue
        xs.append(sparsify(p, d, tensor, i, elem_offset) * np.float32(p.weights[i]))
    mixed = np.zeros_like(w0)
    divisor: np.ndarray | np.float32
    if p.method in CONSENSUS:
        sgn = np.zeros_like(w0)
        for x in xs:
            if x is not None:
                sgn += x
        majority = np.where(sgn >= 0, np.float32(1), np.float32(-1))
        divisor = np.zeros_like(w0)
        for i, x in enumerate(xs):
            if x is None:
                continue  # sign(0) never agrees: contributes nothing to mixed or divisor
            agree = np.sign(x) == majority
            mixed += np.where(agree, x, zero)
            divisor += np.where(agree, np.float32(p.weights[i]), zero)
        divisor[divisor == 0] = 1
    else:
        for x in xs:
            if x is not None:
                mixed += x
        total = np.float32(0)
        for wi in p.weights:
            total = np.float32(total + np.float32(wi))
        divisor = np.float32(1) if abs(float(total)) < 1e-8 else total
    if p.normalize:
        mixed = mixed / divisor
    if np.float32(p.lam) != 1:
        mixed = mixed * np.float32(p.lam)
    return w0 + mixed


def merge_slerp(p: OpParams, v0: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """SLERP of two whole tensors (flat float32)."""
    n0 = np.linalg.norm(v0)
    n1 = np.linalg.norm(v1)
    u0 = v0 / n0 if n0 > 1e-8 else v0
    u1 = v1 / n1 if n1 > 1e-8 else v1
    dot = np.sum(u0 * u1)
    t = p.t
    if abs(float(dot)) > 0.9995:
        return np.float32(1 - t) * v0 + np.float32(t) * v1
    theta0 = np.arccos(np.float64(dot))
    s0 = np.sin(theta0 - theta0 * t) / np.sin(theta0)
    s1 = np.sin(theta0 * t) / np.sin(theta0)
    return np.float32(s0) * v0 + np.float32(s1) * v1
