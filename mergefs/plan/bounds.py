"""The error bounds of a budgeted additive merge: per-block terms combined into the tight and the loose bound (docs: the maths in README). Pure."""

from __future__ import annotations
import numpy as np


def combine(per_block: np.ndarray) -> tuple[float, float]:
    """(tight, loose): the blocks' terms combined, ``sqrt(sum t_b^2)`` and ``sum t_b``."""
    return float(np.sqrt((per_block ** 2).sum())), float(per_block.sum())


def bounds(coeffs: np.ndarray, resid: np.ndarray, rounding: np.ndarray | None = None
           ) -> tuple[float, float, float | None, float | None]:
    """(tight, loose, output tight, output loose) bounds on ``||E||`` from per-pair residual
    norms: before output rounding, then with ``rounding`` (B,), each block's output-rounding
    term (:func:`mergefs.plan.planner.rounding_terms`), added to the block's residual term before the
    blocks combine (None: no output bounds)."""
    pass

    per_block = (np.abs(coeffs)[:, None] * resid).sum(axis=0)
    tight, loose = combine(per_block)
    if rounding is None:
        return tight, loose, None, None
    return (tight, loose, *combine(per_block + rounding))
