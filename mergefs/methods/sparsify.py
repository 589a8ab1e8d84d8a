"""Sparsifiers of generalised task arithmetic: magnitude (TIES), magnitude_outliers (breadcrumbs),
random (DARE) and della_magprune (DELLA), with mergekit's L1 rescale.

Selections by magnitude take the positions mergekit takes from torch's unstable CPU sort
(``torch.sort``/``torch.argsort`` of the float32 ``|delta|``; x86-simd-sort on AVX2/AVX-512
builds), so equal ``|delta|`` at a selection threshold are chosen as mergekit chooses them on the
same torch build and CPU; where no run of equal values straddles a cut, every order gives the same
set and an O(n) partition finds it without sorting. Random masks come from :mod:`.prng`. Pure;
runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mergefs.methods import prng

if TYPE_CHECKING:
    import torch

L1_EPS = 1e-7


def _torch():  # type: ignore[no-untyped-def]
    import torch

    return torch


def rescale_factor(t: torch.Tensor, masked: torch.Tensor) -> torch.Tensor | None:
    """``||t||_1 / ||masked||_1`` (float32 sums, a 0-d tensor), or None when either is below
    1e-7 (no rescale)."""
    before = t.abs().sum()
    after = masked.abs().sum()
    if before < L1_EPS or after < L1_EPS:
        return None
    return before / after


def rescaled(t: torch.Tensor, mask: torch.Tensor, rescale: bool) -> torch.Tensor:
    """``t * mask``, times ``||t||_1 / ||t * mask||_1`` when rescaling and both exceed 1e-7."""
    masked = t * mask
    if not rescale:
        return masked
    factor = rescale_factor(t, masked)
    return masked if factor is None else masked * factor


def _sorted_slice(values: torch.Tensor, lo: int, hi: int, descending: bool) -> np.ndarray:
    """Boolean mask of ``torch.sort(values, descending=descending).indices[lo:hi]`` (1-D float32
    ``values``): torch's own unstable order decides among equal values at a cut. When neither cut
    splits a run of equal values (and nothing is NaN) the set is order-free: found by partition."""
    torch = _torch()
    n = values.numel()
    lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
    mask = np.zeros(n, dtype=bool)
    if hi <= lo:
        return mask
    v = values.numpy()
    a_lo, a_hi = (n - hi, n - lo) if descending else (lo, hi)  # ascending positions [a_lo, a_hi)
    if not np.isnan(v).any():
        kth = sorted({k for k in (a_lo - 1, a_lo, a_hi - 1, a_hi) if 0 <= k < n})
        p = np.partition(v, kth)
        split = (a_lo > 0 and p[a_lo - 1] == p[a_lo]) or (a_hi < n and p[a_hi - 1] == p[a_hi])
        if not split:
            return (v >= p[a_lo]) & (v <= p[a_hi - 1])
        del p  # (before the sort's own buffers)
    order = torch.sort(values, descending=descending).indices[lo:hi]
    mask[order.numpy()] = True
    return mask


def magnitude(t: torch.Tensor, density: float, rescale: bool) -> torch.Tensor:
    """Keep the ``max(1, int(density * n))`` largest ``|t|`` (TIES): the first of torch's
    descending sort of the float32 ``|t|``, as mergekit's ``torch.argsort``."""
    torch = _torch()
    if density >= 1:
        return t
    n = t.numel()
    if density <= 0 or n == 0:
        return torch.zeros_like(t)
    return rescaled(t, magnitude_mask(t, density), rescale)


def magnitude_mask(t: torch.Tensor, density: float) -> torch.Tensor:
    """TIES' keep mask (float32 0/1, ``t``'s shape) for ``0 < density < 1`` and a non-empty
    ``t``: the ``max(1, int(density * n))`` largest ``|t|``, in torch's descending order."""
    torch = _torch()
    k = max(1, int(density * t.numel()))
    keep = _sorted_slice(t.abs().reshape(-1).float(), 0, k, descending=True)
    return torch.from_numpy(keep.astype(np.float32)).reshape(t.shape)


def magnitude_outliers(t: torch.Tensor, density: float, gamma: float, rescale: bool
                       ) -> torch.Tensor:
    """Drop the ``n_bot`` smallest and the ``n_top = int(gamma * n)`` largest ``|t|`` (breadcrumbs):
    keep ascending ranks ``[n_bot, n_bot + int(density * n))``,
    ``n_bot = max(0, n - kept - n_top)``, in the order of torch's ascending sort of the float32
    ``|t|``, as mergekit's ``torch.sort``."""
    torch = _torch()
    if density >= 1:
        return t
    n = t.numel()
    target = int(density * n)
    n_top = int(gamma * n)
    n_bot = max(0, n - target - n_top)
    keep = _sorted_slice(t.abs().reshape(-1).float(), n_bot, n_bot + target, descending=False)
    mask = torch.from_numpy(keep.astype(np.float32)).reshape(t.shape)
    return rescaled(t, mask, rescale)


def random(t: torch.Tensor, density: float, rescale: bool, seed: int, tensor: str, model: int,
           elem_offset: int) -> torch.Tensor:
    """DARE: keep element j iff ``u(seed, tensor, model, j) < float32(density)``."""
    torch = _torch()
    if density >= 1:
        return t
    keep = prng.keep_mask(seed, tensor, model, elem_offset,
                          np.full(t.numel(), density, dtype=np.float32))
    mask = torch.from_numpy(keep).reshape(t.shape)
    return rescaled(t, mask, rescale)


def della_probs(t: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's keep probabilities: ``density - eps + 2 eps * (r - min r) / (max r - min r)`` with
    ``r`` the 1-based rank of ``|t|`` along dim 1 (1-D tensors are one row) in torch's ascending
    sort, as mergekit's ``torch.argsort`` (equal ``|t|`` ranked as torch's unstable order puts
    them)."""
    torch = _torch()
    rows = t.unsqueeze(0) if t.dim() < 2 else t
    order = torch.argsort(rows.abs(), dim=1)
    r = order.argsort(dim=1).to(torch.float32) + 1  # a permutation: no ties left
    lo = r.min(dim=1, keepdim=True).values
    hi = r.max(dim=1, keepdim=True).values
    norm = ((r - lo) / (hi - lo)).clamp(0, 1)
    return (density - epsilon) + norm * 2 * epsilon


def della(t: torch.Tensor, density: float, epsilon: float, rescale: bool, seed: int,
          tensor: str, model: int) -> torch.Tensor:
    """DELLA magprune: keep element j iff ``u(seed, tensor, model, j) < p_j`` (:func:`della_probs`)."""
    torch = _torch()
    if density >= 1:
        return t
    if density <= 0:
        return torch.zeros_like(t)
    probs = della_probs(t, density, epsilon)
    keep = prng.keep_mask(seed, tensor, model, 0, probs.reshape(-1).numpy())
    mask = torch.from_numpy(keep).reshape(probs.shape)
    rows = t.unsqueeze(0) if t.dim() < 2 else t
    return rescaled(rows, mask, rescale).reshape(t.shape)


#: elements of a random mask drawn at once (prng's uint64/float64 temporaries: ~40 bytes each)
MASK_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True)
class Kept:
    """One input's sparsified delta as a whole-tensor pass leaves it for merging by blocks:
    ``"all"`` (the delta unchanged), ``"none"`` (zeros) or ``"mask"``: ``D * mask`` with the
    mask bit-packed (``np.packbits``, little bit order, flat element order: n/8 bytes), times
    ``factor`` (a 0-d float32 tensor) when the L1 rescale applies. :meth:`apply` on a block
    gives the bytes the whole-tensor sparsifier gives there (the same elementwise ops)."""

    mode: str  # "all" | "none" | "mask"
    bits: np.ndarray | None = None
    factor: Any = None

    def apply(self, d: torch.Tensor, start: int) -> torch.Tensor:
        """The sparsified delta of flat elements ``[start, start + d.numel())`` (``start`` a
        multiple of 8) from the delta ``d`` there."""
        torch = _torch()
        if self.mode == "all":
            return d
        if self.mode == "none":
            return torch.zeros_like(d)
        assert self.bits is not None and start % 8 == 0
        n = d.numel()
        keep = np.unpackbits(self.bits[start // 8:(start + n + 7) // 8], count=n,
                             bitorder="little")
        masked = d * torch.from_numpy(keep.astype(np.float32)).reshape(d.shape)
        return masked if self.factor is None else masked * self.factor


def _pack(mask: np.ndarray) -> np.ndarray:
    return np.packbits(mask.reshape(-1).astype(bool), bitorder="little")


def _random_bits(seed: int, tensor: str, model: int, probs: np.ndarray | float, n: int
                 ) -> np.ndarray:
    """Packed ``prng.keep_mask`` of ``n`` elements from 0, drawn by chunks (the same bits)."""
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    for s in range(0, n, MASK_CHUNK_ELEMS):  # a multiple of 8: chunks pack to whole bytes
        e = min(n, s + MASK_CHUNK_ELEMS)
        p = np.full(e - s, probs, np.float32) if np.ndim(probs) == 0 else \
            probs[s:e]  # type: ignore[index]
        bits[s // 8:(e + 7) // 8] = _pack(prng.keep_mask(seed, tensor, model, s, p))
    return bits


def keep(t: torch.Tensor, sparsifier: str, p: Mapping[str, Any], g: Mapping[str, Any],
         tensor: str, model: int) -> Kept:
    """What :func:`magnitude`, :func:`magnitude_outliers`, :func:`random` or :func:`della`
    (``sparsifier``) keep of the whole delta ``t`` of input ``model`` (per-input parameters
    ``p``, global ``g``), as a :class:`Kept`: the same masks and factor, without the masked
    tensor."""
    torch = _torch()
    density, rescale = p["density"], g["rescale"]
    n = t.numel()
    if density >= 1:
        return Kept("all")
    if sparsifier == "magnitude":
        if density <= 0 or n == 0:
            return Kept("none")
        mask = _sorted_slice(t.abs().reshape(-1).float(), 0, max(1, int(density * n)),
                             descending=True)
        bits = _pack(mask)
    elif sparsifier == "magnitude_outliers":
        target, n_top = int(density * n), int(p["gamma"] * n)
        n_bot = max(0, n - target - n_top)
        mask = _sorted_slice(t.abs().reshape(-1).float(), n_bot, n_bot + target,
                             descending=False)
        bits = _pack(mask)
    elif sparsifier == "random":
        bits = _random_bits(g["seed"], tensor, model, density, n)
    elif sparsifier == "della_magprune":
        if density <= 0:
            return Kept("none")
        probs = della_probs(t, density, p["epsilon"]).reshape(-1).numpy()
        bits = _random_bits(g["seed"], tensor, model, probs, n)
        del probs
    else:
        raise ValueError(f"unknown sparsifier {sparsifier!r}")
    if not rescale:
        return Kept("mask", bits)
    masked = Kept("mask", bits).apply(t, 0)  # with t's shape: the whole path's sums
    return Kept("mask", bits, rescale_factor(t, masked))
