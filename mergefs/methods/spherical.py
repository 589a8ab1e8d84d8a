"""Means on the hypersphere: ``multislerp`` (tangent-space barycentre, optionally of deltas from a
base) and ``karcher`` (iterated Karcher mean of every input). Pure; runs on any thread.
"""

from __future__ import annotations

from typing import Any

from mergefs.methods.base import (
    BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, flag, require_torch, weight,
)
from mergefs.core.errors import MergefsError

MULTISLERP = """\
`X_i = W_i` (minus `W0` with a base), flattened; `w` float32 weights, divided by their sum when
`normalize_weights`. `n_i = ||X_i||`, `U_i = X_i / (n_i + eps)`, `m = sum_i w_i U_i`; if
`||m|| < eps`: two models give `w_1 X_1 + w_2 X_2`, more are an error. Else `m /= ||m||`,
`T = sum_i w_i (U_i - (U_i . m) m)`, `r = ||T|| + eps`, `M = (m cos r + T sin r / r) * sum_i w_i n_i`
(plus `W0`). One model: `M = W_1`. Whole tensor, torch float32.
"""

KARCHER = """\
Inputs are every model (base included, as for linear), `alpha = 1/n`. Units `U_i = W_i / ||W_i||`
(zero for a zero tensor); inputs with `||W_i|| <= tol` are left out of the mean (all: `M = 0`).
Start from the normalised weighted mean of the units; `max_iter` times: tangent
`T = sum alpha_i theta_i / sin(theta_i) (U_i - cos(theta_i) m)` over inputs with
`theta_i = acos(clamp(m . U_i)) >= tol`; stop when `||T|| < tol`; else
`m = cos(||T||) m + sin(||T||) T / ||T||`, renormalised. `M = (sum alpha_i ||W_i||) m`.
Whole tensor, torch float32.
"""


def _multislerp(u: Unit) -> Any:
    torch = require_torch("multislerp")
    u = u.torch()

    base = u.base
    if len(u.inputs) == 1:
        return u.inputs[0]
    xs = torch.stack(list(u.inputs), dim=0)
    if base is not None:
        xs -= base
    flat = xs.view(xs.shape[0], -1)
    eps = u.params["eps"]
    w = torch.tensor(u.per_input("weight"), dtype=xs.dtype)
    if u.params["normalize_weights"]:
        w = w / w.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if xs.shape[0] == 2:
            res = (xs[0] * w[0] + xs[1] * w[1]).view(xs.shape[1:])
            return res + base if base is not None else res

        raise MergefsError(f"{u.tensor}: multislerp: the weighted sum of the inputs is zero "
                           "(antipodal inputs with balancing weights); change the weights")
    mean = mean / mean_norm
    dots = (units * mean).sum(-1, keepdim=True)
    tangent = ((units - dots * mean) * w.view(-1, 1)).sum(0)
    tnorm = torch.norm(tangent) + eps
    res = mean * torch.cos(tnorm) + tangent * (torch.sin(tnorm) / tnorm)
    res = (res * (norms.squeeze(-1) * w).sum()).view(xs.shape[1:])
    return res + base if base is not None else res


def _karcher(u: Unit) -> Any:
    torch = require_torch("karcher")
    u = u.torch()

    xs = list(u.inputs)
    if len(xs) == 1:
        return xs[0]
    max_iter, tol = u.params["max_iter"], u.params["tol"]
    alphas = [1.0 / len(xs)] * len(xs)
    norms = [torch.linalg.vector_norm(x) for x in xs]
    units = [torch.zeros_like(x) if float(n) == 0.0 else x / n for x, n in zip(xs, norms)]
    valid = [k for k, n in enumerate(norms) if float(n) > tol]
    if not valid:
        return sum(x * 0 for x in xs)
    total = sum(alphas[k] for k in valid)
    va = [alphas[k] / total for k in valid]
    vu = [units[k] for k in valid]
    mean = torch.zeros_like(vu[0])
    for a, x in zip(va, vu):
        mean += a * x
    mnorm = torch.linalg.vector_norm(mean)
    mean = vu[0].clone() if float(mnorm) < tol else mean / mnorm
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for a, x in zip(va, vu):
            dot = torch.clamp(torch.dot(mean.flatten(), x.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if float(theta) < tol:
                continue
            tangent += a * (theta / torch.sin(theta)) * (x - dot * mean)
        tnorm = torch.linalg.vector_norm(tangent)
        if float(tnorm) < tol:
            break
        mean = torch.cos(tnorm) * mean + torch.sin(tnorm) * (tangent / tnorm)
        unorm = torch.linalg.vector_norm(mean)
        if float(unorm) > tol:
            mean = mean / unorm
    scale = sum(a * n for a, n in zip(alphas, norms))
    return scale * mean


METHODS = (
    Method(
        name="multislerp", family="spherical",
        params=(weight(), flag("normalize_weights", True, "divide the weights by their sum"),
                ParamDef("eps", "float", Scope.GLOBAL, 1e-8, 0.0, doc="numerical guard")),
        caps=Capabilities(base=BasePolicy.OPTIONAL, min_inputs=1, max_inputs=None),
        merge=_multislerp, summary="barycentric interpolation on the hypersphere",
        arithmetic=MULTISLERP),
    Method(
        name="karcher", family="spherical",
        params=(ParamDef("max_iter", "int", Scope.GLOBAL, 10, 0, doc="iterations at most"),
                ParamDef("tol", "float", Scope.GLOBAL, 1e-5, 0.0, doc="convergence tolerance")),
        caps=Capabilities(base=BasePolicy.IGNORED, min_inputs=1, max_inputs=None),
        merge=_karcher, summary="Karcher (Riemannian) mean of every input on the hypersphere",
        arithmetic=KARCHER),
)
