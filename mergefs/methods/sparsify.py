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

from typing import TYPE_CHECKING

import numpy as np

from mergefs.methods import prng

if TYPE_CHECKING:
    import torch

L1_EPS = 1e-7


def _torch():  # type: ignore[no-untyped-def]
    import torch

    return torch


def rescaled(t: torch.Tensor, mask: torch.Tensor, rescale: bool) -> torch.Tensor:
    """``t * mask``, times ``||t||_1 / ||t * mask||_1`` when rescaling and both exceed 1e-7."""
    masked = t * mask
    if not rescale:
        return masked
    before = t.abs().sum()
    after = masked.abs().sum()
    if before < L1_EPS or after < L1_EPS:
        return masked
    return masked * (before / after)


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
