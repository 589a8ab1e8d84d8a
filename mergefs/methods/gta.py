"""Generalised task arithmetic: one arithmetic, eight methods as rows (sparsifier x consensus x
defaults), as mergekit registers them: task_arithmetic, ties, dare_linear, dare_ties,
breadcrumbs, breadcrumbs_ties, della, della_linear. Pure; runs on any thread.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mergefs.methods import exact, prng
from mergefs.methods import sparsify as sp
from mergefs.methods.base import (
    INT8_MASK, TORCH, BasePolicy, Capabilities, Fused, Method, ParamDef, Scope, Staged, TorchUse,
    Unit,
    flag, require_torch, weight,
)

#: Sums over the input axis are sequential (input order, from +0.0) in torch's CPU kernels for
#: up to this many inputs at every element; beyond, the order depends on the element's position
#: in the tensor, so units must be whole tensors to equal mergekit.
SEQUENTIAL_SUM_MAX = 4

ARITHMETIC = """\
Per tensor, with `D_i = W_i - W0` (float32) for the non-base models in order:

1. Sparsify each `D_i` (per-model `density`; `rescale` multiplies the kept values by
   `||D_i||_1 / ||kept||_1` (float32 sums) unless either is below 1e-7):
   - magnitude (ties): density >= 1 keeps all, <= 0 none; else keep the
     `max(1, int(density * n))` largest `|D_i|`: the first `k` of `torch.argsort(|D_i|,
     descending=True)` on the flat float32 tensor.
   - magnitude_outliers (breadcrumbs): `n_top = int(gamma * n)`, `kept = int(density * n)`,
     `n_bot = max(0, n - kept - n_top)`; keep positions `[n_bot, n_bot + kept)` of
     `torch.sort(|D_i|).indices` (flat, float32, ascending).
   - random (dare): keep element j iff `u(seed, tensor, i, j) < float32(density)`.
   - della_magprune (della): ascending rank `r` (1-based) of `|D_i|` along dim 1 (1-D: one
     row) in `torch.argsort`'s order, `p = (density - epsilon) + ((r - min r) / (max r - min r))
     * 2 * epsilon` (float32); keep iff `u(seed, tensor, i, j) < p_j`.
   Threshold-tie rule: among equal `|D_i|` at a cut, the elements torch's unstable CPU sort
   puts first are kept, as in mergekit (see Known differences); where no run of equal values
   straddles a cut the set is the same in any order and is found by partition.
   Masks multiply (`D * mask`, float32).
2. `X_i = T_i * w_i` (float32 weights).
3. Sign consensus (ties, dare_ties, breadcrumbs_ties, della): `majority = +1 where sum_i X_i >= 0
   else -1`; `mask_i = sign(X_i) == majority`; `mixed = sum_i X_i * mask_i`,
   `divisor = sum_i w_i * mask_i`, 1 where 0. Otherwise `mixed = sum_i X_i`,
   `divisor = sum_i w_i` (1 where `|divisor| < 1e-8`). Sums run over the input axis in order from
   +0.0 (torch's order for up to 4 models; for 5-256 models without sparsifier or consensus,
   torch's order, which mergefs models on x86: input order up to 16 models; from 17
   `S_rest + ((B_1 + B_2) + ...)` with `B_b` the sums of the full blocks of 16 models and
   `S_rest` that of the models after them (ATen's `multi_row_sum`); in the last `numel % 32`
   elements of the tensor 4 interleaved partial sums; the weight sum in torch's vectorised
   order; other cases with more models make the units whole tensors).
4. `mixed /= divisor` if normalize; `mixed *= lambda` if lambda != 1.
5. `M = W0 + mixed`.
"""


def _merge_numpy(u: Unit, sparsifier: str | None, consensus: bool) -> np.ndarray:
    """The same arithmetic in numpy, for elementwise rows (no sparsifier, or DARE without
    rescale) of up to 4 models: torch's kernels are plain IEEE float32 ops there."""
    base = u.base
    g = u.params
    w = [np.float32(x) for x in u.per_input("weight")]
    xs = []
    for k, x in enumerate(u.inputs):
        d = x - base
        if sparsifier == "random" and u.input_params[k]["density"] < 1:
            d = d * prng.keep_mask(g["seed"], u.tensor, u.expert_ids[k], u.elem_offset,
                                   np.full(d.size, u.input_params[k]["density"], np.float32))
        xs.append(d * w[k])
    mixed = mix_numpy(u, xs, w, consensus)
    if g["lambda"] != 1:
        mixed = mixed * np.float32(g["lambda"])
    return base + mixed


def mix_numpy(u: Unit, xs: list[np.ndarray], w: list[np.float32], consensus: bool
              ) -> np.ndarray:
    """Steps 3-4 of the arithmetic but lambda, in numpy: the weighted deltas ``xs`` (float32
    weights ``w``) of unit ``u`` mixed, with sign consensus or not, divided when normalize."""
    divisor: np.ndarray | np.float32
    if consensus:
        majority = (exact.outer_sum(xs) >= 0).astype(np.float32) * np.float32(2) - np.float32(1)
        masks = [np.sign(x) == majority for x in xs]
        mixed = exact.outer_sum([x * m for x, m in zip(xs, masks)])
        divisor = exact.outer_sum([wk * m for wk, m in zip(w, masks)])
        divisor[divisor == 0] = 1
    else:
        mixed = (exact.outer_sum(xs) if len(xs) <= SEQUENTIAL_SUM_MAX else
                 exact.torch_order_sum(xs, u.elem_offset, u.tensor_size or u.base.size))
        total = exact.vector_sum(w)
        divisor = np.float32(1) if abs(total) < np.float32(1e-8) else total
    if u.params["normalize"]:
        mixed = mixed / divisor
    return mixed


def _merge_torch(u: Unit, sparsifier: str | None, consensus: bool, name: str = "gta") -> Any:
    """The arithmetic in torch, as mergekit runs it (``name``: the row, for require_torch)."""
    require_torch(name)
    u = u.torch()
    base = u.base
    assert base is not None
    if not u.inputs:
        return base

    def delta(k: int) -> Any:
        d = u.inputs[k] - base
        p = u.input_params[k]
        if sparsifier == "magnitude":
            d = sp.magnitude(d, p["density"], g["rescale"])
        elif sparsifier == "magnitude_outliers":
            d = sp.magnitude_outliers(d, p["density"], p["gamma"], g["rescale"])
        elif sparsifier == "random":
            d = sp.random(d, p["density"], g["rescale"], g["seed"], u.tensor,
                          u.expert_ids[k], u.elem_offset)
        elif sparsifier == "della_magprune":
            d = sp.della(d, p["density"], p["epsilon"], g["rescale"], g["seed"], u.tensor,
                         u.expert_ids[k])
        return d

    g = u.params
    return _combine(base, delta, u.input_params, g, consensus)


def _combine(base: Any, delta: Callable[[int], Any], input_params: Sequence[Mapping[str, Any]],
             g: Mapping[str, Any], consensus: bool) -> Any:
    """Steps 2-5 of the arithmetic in torch on ``base`` (a whole tensor, or a block of one
    whose start is a multiple of 32 elements and which, when it holds the tensor's last
    ``numel % 32`` elements, holds at least 32 before them: torch's input-axis sums then add
    each element in the same order as on the whole tensor), with ``delta(k)`` input k's
    sparsified delta there."""
    deltas = base.new_empty((len(input_params), *base.shape))
    for k in range(len(input_params)):
        deltas[k] = delta(k)
    mixed = mix_torch(deltas, [p["weight"] for p in input_params], consensus, g["normalize"])
    if g["lambda"] != 1:
        mixed *= g["lambda"]
    return base + mixed


def mix_torch(deltas: Any, weights: Sequence[float], consensus: bool, normalize: bool) -> Any:
    """Steps 2-4 of the arithmetic but lambda, in torch as mergekit runs them: the (sparsified)
    deltas stacked along dim 0 are weighted in place, mixed with sign consensus or not, and
    divided when ``normalize``."""
    torch = require_torch("gta")
    w = torch.tensor(list(weights), dtype=deltas.dtype)
    while w.dim() < deltas.dim():
        w.unsqueeze_(-1)
    deltas.mul_(w)
    if consensus:
        majority = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
        mask = deltas.sign() == majority
        mixed = (deltas * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed /= divisor
    return mixed


def _staged(sparsifier: str | None, consensus: bool) -> Staged:
    """The torch path in two phases (:class:`.base.Staged`)."""
    def keep(d: Any, p: Mapping[str, Any], g: Mapping[str, Any], tensor: str, model: int
             ) -> sp.Kept:
        return sp.Kept("all") if sparsifier is None else sp.keep(d, sparsifier, p, g, tensor,
                                                                  model)

    def combine(base: Any, delta: Callable[[int], Any],
                input_params: Sequence[Mapping[str, Any]], g: Mapping[str, Any]) -> Any:
        return _combine(base, delta, input_params, g, consensus)

    workspace = 0 if sparsifier is None else (
        PHASE1_SORT_BYTES if sparsifier in ("magnitude", "magnitude_outliers") else
        PHASE1_DELLA_BYTES if sparsifier == "della_magprune" else PHASE1_RANDOM_BYTES)
    return Staged(keep, combine, workspace, BLOCK_BYTES_PER_INPUT, BLOCK_BYTES)


#: the staged path's workspace, bytes per element of the tensor (peaks measured in
#: tests/engine/test_staged.py, rounded up): phase 1 on one input's whole delta (on top of the
#: base's and the input's float32 values and its delta), phase 2 per element of a block
PHASE1_SORT_BYTES = 48  # |D| 4, np.partition's copy 4, torch.sort's values 4 and indices 8
#                         and its own scratch, bool masks, the masked delta for the rescale
PHASE1_DELLA_BYTES = 72  # |D| 4, two argsorts 8 + 8, float32 ranks and probabilities, the
#                          random draw's uint64/float64 chunks
PHASE1_RANDOM_BYTES = 32  # the random draw's chunks, the masked delta and its |.|
BLOCK_BYTES_PER_INPUT = 24  # the stacked deltas 4, sign 4, mask 1, deltas * mask 4,
#                             w * mask 4, the input's decoded values 4, its mask 4
BLOCK_BYTES = 48  # base, sums, majority, divisor, the output


def _numpy_path(sparsifier: str | None, consensus: bool, n: int, g: Mapping[str, Any],
                tensor_size: int) -> bool:
    """Whether ``_merge_numpy`` merges a unit of ``n`` inputs of a tensor of ``tensor_size``
    elements (else ``_merge_torch``): no sparsifier, or DARE without rescale, up to
    SEQUENTIAL_SUM_MAX models; task arithmetic with more models where :func:`_torch_order`
    holds and torch's sum order is modelled for the tensor's size."""
    if n < 1:
        return False
    if (sparsifier is None or (sparsifier == "random" and not g["rescale"])) \
            and n <= SEQUENTIAL_SUM_MAX:
        return True
    return _torch_order(sparsifier, consensus, n, g) and \
        exact.torch_sum_tail(tensor_size, n) is not None  # torch's sum order, modelled


def _merge(name: str, sparsifier: str | None, consensus: bool):  # type: ignore[no-untyped-def]
    def merge(u: Unit) -> Any:
        if _numpy_path(sparsifier, consensus, len(u.inputs), u.params,
                       u.tensor_size or (u.base.size if u.base is not None else 0)):
            return _merge_numpy(u, sparsifier, consensus)
        return _merge_torch(u, sparsifier, consensus, name)

    return merge


def _torch_use(sparsifier: str | None, consensus: bool) -> TorchUse:
    """When a row imports torch (:func:`_numpy_path`), in words."""
    def when(n: int, g: Mapping[str, Any], tensor_size: int) -> bool:
        return not _numpy_path(sparsifier, consensus, n, g, tensor_size)

    if sparsifier is None and not consensus:
        return TorchUse(
            f"only with more than {exact.TORCH_SUM_MAX} models, more than "
            f"{SEQUENTIAL_SUM_MAX} models off x86-64, or 8 or more models on a one-element "
            "tensor", when)
    if sparsifier == "random":
        return TorchUse(f"only with rescale: true (the default) or more than "
                        f"{SEQUENTIAL_SUM_MAX} models", when)
    return TORCH


def task_arithmetic_numpy(n: int, g: Mapping[str, Any], tensor_size: int) -> bool:
    """Whether task arithmetic's weighted sum (no sparsifier, no consensus) of ``n`` inputs runs
    in numpy (:func:`mix_numpy`, equal to torch's) for a tensor of ``tensor_size`` elements."""
    return _numpy_path(None, False, n, g, tensor_size)


def task_arithmetic_elementwise(n: int, g: Mapping[str, Any]) -> bool:
    """Whether task arithmetic's weighted sum of ``n`` inputs may run on slices of a tensor."""
    return n <= SEQUENTIAL_SUM_MAX or _torch_order(None, False, n, g)


#: when task arithmetic's weighted sum imports torch
TASK_ARITHMETIC_TORCH = _torch_use(None, False)


def _torch_order(sparsifier: str | None, consensus: bool, n: int, g: Mapping[str, Any]) -> bool:
    """Task arithmetic with 5-TORCH_SUM_MAX models on x86: torch's input-axis sum is modelled
    (:func:`.exact.torch_sum_tail`), so units may be slices of tensors."""
    return (sparsifier is None and not consensus and SEQUENTIAL_SUM_MAX < n <= exact.TORCH_SUM_MAX
            and platform.machine().lower() in ("x86_64", "amd64"))


def _fused(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> Fused | None:
    """The arithmetic without sparsifier and consensus (task arithmetic) as the kernel's delta
    form: ``_merge_numpy``'s up to SEQUENTIAL_SUM_MAX models; beyond (whole tensors,
    ``_merge_torch``) up to TORCH_SUM_MAX models on x86, where torch's input-axis sum is
    modelled (:func:`.exact.torch_sum_tail`)."""
    n = len(per)
    w = [np.float32(p["weight"]) for p in per]
    scale = float(np.float32(g["lambda"])) if g["lambda"] != 1 else None
    torch_order = _torch_order(None, False, n, g)  # _merge_numpy with torch's sum order
    if not (torch_order or 1 <= n <= SEQUENTIAL_SUM_MAX):
        return None
    total = exact.vector_sum(w)
    divisor = np.float32(1) if abs(total) < np.float32(1e-8) else total
    return Fused("delta", tuple(float(x) for x in w),
                 float(divisor) if g["normalize"] else None, scale,
                 order="torch" if torch_order else "sequential")


def _coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    """``c_i = lambda * w_i / n``, ``n = sum w`` when normalize (and ``|sum| >= 1e-8``) else 1."""
    w = [float(p["weight"]) for p in per]
    total = sum(w)
    n = total if g.get("normalize") and abs(total) >= 1e-8 else 1.0
    return [float(g.get("lambda", 1.0)) * x / n for x in w]


def _della_check(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> str | None:
    for k, p in enumerate(per):
        d, e = p["density"], p["epsilon"]
        if 0 < d < 1 and (d + e >= 1 or d - e <= 0):
            return (f"model {k}: density {d} +/- epsilon {e} must lie in (0, 1) "
                    "(mergekit refuses it too)")
    return None


def _no_fused(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> Fused | None:
    return None  # masks and sign consensus: the method merges its units itself


def _row(name: str, sparsifier: str | None, consensus: bool, normalize: bool, rescale: bool,
         summary: str) -> Method:
    """One row of the family: mergekit's sparsifier, consensus and defaults for ``name``."""
    params: list[ParamDef] = [
        INT8_MASK,
        flag("normalize", normalize, "divide by the sum of the (agreeing) weights"),
        flag("rescale", rescale, "rescale kept deltas to the L1 norm of the delta",
             no_op="" if sparsifier else "no sparsifier: nothing to rescale"),
        ParamDef("lambda", "float", Scope.GLOBAL, 1.0, doc="scale of the merged delta"),
        weight(),
        ParamDef("density", "float", Scope.NON_BASE, 1.0, 0.0, 1.0,
                 doc="fraction of each delta kept",
                 no_op="" if sparsifier else "no sparsifier: every delta is kept"),
    ]
    if sparsifier == "magnitude_outliers":
        params.append(ParamDef("gamma", "float", Scope.NON_BASE, 0.01, 0.0, 1.0,
                               doc="fraction of largest-magnitude deltas dropped"))
    if sparsifier == "della_magprune":
        params.append(ParamDef("epsilon", "float", Scope.NON_BASE, 0.15, 0.0, 1.0,
                               doc="spread of keep probabilities around density"))
    if sparsifier in ("random", "della_magprune"):
        params.append(ParamDef("seed", "int", Scope.GLOBAL, 0, mergefs_only=True,
                               doc="seed of mergefs' reproducible masks"))
    blockwise = sparsifier is None or sparsifier == "random"

    def elementwise(n: int, g: Mapping[str, Any]) -> bool:
        if sparsifier == "random" and g.get("rescale"):
            return False  # the L1 rescale needs whole tensors
        return blockwise and (n <= SEQUENTIAL_SUM_MAX or _torch_order(sparsifier, consensus, n, g))

    return Method(
        name=name, family="gta", params=tuple(params),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                          additive=sparsifier is None and not consensus,
                          random=sparsifier in ("random", "della_magprune"),
                          elementwise=elementwise, zero_delta_is_base=True),
        merge=_merge(name, sparsifier, consensus), coefficients=_coefficients,
        check=_della_check if sparsifier == "della_magprune" else None, summary=summary,
        arithmetic=ARITHMETIC, fused=_fused if sparsifier is None and not consensus else _no_fused,
        torch_use=_torch_use(sparsifier, consensus), staged=_staged(sparsifier, consensus),
        workspace=(48, 20))


METHODS = (
    _row("task_arithmetic", None, False, False, False, "W0 + lambda * sum w_i D_i"),
    _row("ties", "magnitude", True, True, False, "top-k by magnitude, sign consensus"),
    _row("dare_ties", "random", True, False, True, "random drop and rescale, sign consensus"),
    _row("dare_linear", "random", False, False, True, "random drop and rescale, weighted sum"),
    _row("breadcrumbs", "magnitude_outliers", False, False, False,
         "drop smallest and largest deltas, weighted sum"),
    _row("breadcrumbs_ties", "magnitude_outliers", True, False, False,
         "drop smallest and largest deltas, sign consensus"),
    _row("della", "della_magprune", True, True, True,
         "rank-dependent random drop, rescale, sign consensus"),
    _row("della_linear", "della_magprune", False, False, True,
         "rank-dependent random drop, rescale, weighted sum"),
)
