"""Consensus merging with TALL masks (Wang et al., "Localizing Task Information for Improved
Model Merging and Compression", ICML 2024, arXiv 2405.07813): consensus_ta and consensus_ties,
as mergekitty 0.3.0 registers them (rows of its generalised task arithmetic). The weighted mix is
:mod:`.gta`'s (task arithmetic; TIES' sparsifier and sign consensus); the TALL mask step is
added here. Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mergefs.methods import gta
from mergefs.methods import sparsify as sp
from mergefs.methods.base import (
    INT8_MASK, TORCH, BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, flag,
    require_torch, weight,
)

#: mergekitty's L1 rescale threshold (its ``rescale_sum``; mergekit 0.1.5's TIES uses 1e-7)
L1_EPS = 1e-8

ARITHMETIC = """\
Paper: [Localizing Task Information for Improved Model Merging and
Compression](https://arxiv.org/abs/2405.07813) (TALL masks, consensus merging; Wang et al.,
ICML 2024). The reference is mergekitty 0.3.0 (`merge_method: consensus_ta` / `consensus_ties`,
the same names in mergefs). Per tensor, with `D_i = W_i - W0` (float32) for the non-base models in order
and `w_i` their weights (float32):

1. consensus_ties only: sparsify each `D_i` as `ties` does (the `max(1, int(density * n))`
   largest `|D_i|`; density >= 1 keeps all, <= 0 none). With `rescale`, `D_i` itself is first
   multiplied by `||D_i||_1 / ||kept||_1` when both are >= 1e-8 (mergekitty's threshold), and
   that rescaled `D_i` is also what step 3 compares.
2. The mix of generalised task arithmetic: `X_i = T_i * w_i` (`T_i` the sparsified delta for
   consensus_ties, `D_i` for consensus_ta); consensus_ties takes the sign consensus (`mixed =
   sum_i X_i * mask_i`, `divisor = sum_i w_i * mask_i`, 1 where 0), consensus_ta the plain sum
   (`divisor = sum_i w_i`, 1 where `|divisor| < 1e-8`); `mixed /= divisor` if normalize. Sums
   run over the input axis in torch's order (see Generalised task arithmetic). There is no
   global `lambda` scale.
3. TALL masks: `m_i = |D_i| > lambda_i * |mixed - D_i|` (`lambda_i` as float32; strictly
   greater, as mergekitty); keep where at least `k` masks hold:
   `mixed = mixed * (sum_i m_i >= k)`, with `k` the first model's value.
4. `M = W0 + mixed`.

Every floating tensor is merged this way, as in mergekitty; non-floating tensors are the base's.
Where mergekitty fails an assertion (density > 0 with `int(density * n) == 0`), mergefs keeps the
one largest element, as its `ties` does. consensus_ta is block-wise when task arithmetic is
(its mix is elementwise, and so is the TALL mask); consensus_ties reads whole tensors.
"""


def _tall_numpy(base: np.ndarray, ds: Sequence[np.ndarray], mixed: np.ndarray,
                lambdas: Sequence[float], k: int) -> np.ndarray:
    count = np.zeros(mixed.shape, dtype=np.int64)
    for d, lam in zip(ds, lambdas):
        count += np.abs(d) > np.float32(lam) * np.abs(mixed - d)
    return base + mixed * (count >= k).astype(np.float32)


def _tall_torch(base: Any, ds: Sequence[Any], mixed: Any, lambdas: Sequence[float],
                k: int) -> Any:
    torch = require_torch("consensus")
    masks = torch.stack([d.abs() > lam * (mixed - d).abs() for d, lam in zip(ds, lambdas)])
    return base + mixed * (masks.sum(dim=0) >= k)


def _merge_ta(u: Unit) -> Any:
    """consensus_ta: task arithmetic's mix (numpy where task arithmetic runs in numpy), TALL."""
    g = u.params
    if gta.task_arithmetic_numpy(len(u.inputs), g, u.tensor_size or u.base.size):
        lambdas, k = u.per_input("lambda"), u.input_params[0]["k"]
        w = [np.float32(x) for x in u.per_input("weight")]
        ds = [x - u.base for x in u.inputs]
        mixed = gta.mix_numpy(u, [d * wk for d, wk in zip(ds, w)], w, False)
        return _tall_numpy(u.base, ds, mixed, lambdas, k)
    torch = require_torch("consensus_ta")
    u = u.torch()
    if not u.inputs:
        return u.base
    ds = [x - u.base for x in u.inputs]
    mixed = gta.mix_torch(torch.stack(ds), u.per_input("weight"), False, g["normalize"])
    return _tall_torch(u.base, ds, mixed, u.per_input("lambda"), u.input_params[0]["k"])


def _merge_ties(u: Unit) -> Any:
    """consensus_ties: TIES' sparsifier (mergekitty's rescale) and sign consensus, TALL."""
    torch = require_torch("consensus_ties")
    u = u.torch()
    base = u.base
    if not u.inputs:
        return base
    g = u.params
    ds, kept = [], []
    for x, p in zip(u.inputs, u.input_params):
        d = x - base
        density = p["density"]
        if density >= 1:
            ds.append(d)
            kept.append(d)
            continue
        mask = (torch.zeros_like(d) if density <= 0 or d.numel() == 0
                else sp.magnitude_mask(d, density))
        if g["rescale"]:
            before = d.abs().sum()
            after = (d * mask).abs().sum()
            if before >= L1_EPS and after >= L1_EPS:
                d = d * (before / after)
        ds.append(d)
        kept.append(d * mask)
    mixed = gta.mix_torch(torch.stack(kept), u.per_input("weight"), True, g["normalize"])
    return _tall_torch(base, ds, mixed, u.per_input("lambda"), u.input_params[0]["k"])


def _coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    """``c_i = w_i / n``, ``n = sum w`` when normalize (and ``|sum| >= 1e-8``) else 1 (ranking
    reads: the masks make the merge non-additive)."""
    w = [float(p["weight"]) for p in per]
    total = sum(w)
    n = total if g.get("normalize") and abs(total) >= 1e-8 else 1.0
    return [x / n for x in w]


def _row(name: str, ties: bool, summary: str) -> Method:
    params = (
        INT8_MASK,
        flag("normalize", ties, "divide by the sum of the (agreeing) weights"),
        flag("rescale", False, "rescale kept deltas to the L1 norm of the delta",
             no_op="" if ties else "no sparsifier: nothing to rescale"),
        weight(),
        ParamDef("density", "float", Scope.NON_BASE, 1.0, 0.0, 1.0,
                 doc="fraction of each delta kept",
                 no_op="" if ties else "no sparsifier: every delta is kept"),
        ParamDef("k", "int", Scope.NON_BASE, 1, 0,
                 doc="keep an element when at least k models' TALL masks hold there (the "
                     "first model's value is used, as in mergekitty)"),
        ParamDef("lambda", "float", Scope.NON_BASE, 1.0,
                 doc="TALL mask threshold: keep model i's element where |D_i| > "
                     "lambda * |mixed - D_i|"),
    )

    def elementwise(n: int, g: Mapping[str, Any]) -> bool:
        return not ties and gta.task_arithmetic_elementwise(n, g)

    return Method(
        name=name, family="consensus", params=params,
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                          elementwise=elementwise, zero_delta_is_base=True),
        merge=_merge_ties if ties else _merge_ta, coefficients=_coefficients,
        summary=summary, arithmetic=ARITHMETIC,
        torch_use=TORCH if ties else gta.TASK_ARITHMETIC_TORCH)


METHODS = (
    _row("consensus_ta", False, "task arithmetic kept where at least k TALL masks agree"),
    _row("consensus_ties", True, "TIES kept where at least k TALL masks agree"),
)
