"""Sparsifiers of generalised task arithmetic: magnitude (TIES), magnitude_outliers (breadcrumbs),
random (DARE) and della_magprune (DELLA), with mergekit's L1 rescale.

Selections by magnitude use a stable order (ties by lower flat index) where mergekit uses
``torch.argsort``/``torch.sort`` without a stable order: outputs can differ only at elements
whose ``|delta|`` equals a selection threshold. Random masks come from :mod:`.prng`. Pure;
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


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k smallest values, ties by lower flat index, in O(n)."""
    n = values.size
    mask = np.zeros(n, dtype=bool)
    if k <= 0:
        return mask
    if k >= n:
        mask[:] = True
        return mask
    kth = np.partition(values, k - 1)[k - 1]
    below = values < kth
    mask |= below
    need = k - int(np.count_nonzero(below))
    if need > 0:
        mask[np.flatnonzero(values == kth)[:need]] = True
    return mask


def magnitude(t: torch.Tensor, density: float, rescale: bool) -> torch.Tensor:
    """Keep the ``max(1, int(density * n))`` largest ``|t|`` (TIES)."""
    torch = _torch()
    if density >= 1:
        return t
    n = t.numel()
    if density <= 0 or n == 0:
        return torch.zeros_like(t)
    k = max(1, int(density * n))
    absd = t.abs().reshape(-1).numpy()
    keep = _smallest(-absd, k)  # negation is exact: the k largest
    mask = torch.from_numpy(keep.astype(np.float32)).reshape(t.shape)
    return rescaled(t, mask, rescale)


def magnitude_outliers(t: torch.Tensor, density: float, gamma: float, rescale: bool
                       ) -> torch.Tensor:
    """Drop the ``n_bot`` smallest and the ``n_top = int(gamma * n)`` largest ``|t|`` (breadcrumbs):
    keep ascending ranks ``[n_bot, n_bot + int(density * n))``, ``n_bot = max(0, n - kept - n_top)``."""
    torch = _torch()
    if density >= 1:
        return t
    n = t.numel()
    target = int(density * n)
    n_top = int(gamma * n)
    n_bot = max(0, n - target - n_top)
    absd = t.abs().reshape(-1).numpy()
    hi = min(n, n_bot + target)
    keep = _smallest(absd, hi) & ~_smallest(absd, n_bot)
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
    """DELLA's keep probabilities: per row, ``density - eps + 2 eps * rank / (cols - 1)`` with
    ``rank`` the stable ascending rank of ``|t|`` (0-based) in its row; 1-D tensors are one row."""
    torch = _torch()
    rows = t.unsqueeze(0) if t.dim() < 2 else t
    absd = rows.abs().reshape(rows.shape[0], -1).numpy()
    order = np.argsort(absd, axis=1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(order.shape[1])[None, :], axis=1)
    r = torch.from_numpy(ranks.reshape(rows.shape)).to(torch.float32) + 1
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
