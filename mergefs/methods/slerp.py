"""``slerp`` (base and one model) and ``nuslerp`` (two models, optionally as deltas from a base):
spherical interpolation with mergekit's float32 angle arithmetic. Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mergefs.methods.base import (
    BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, flag, require_torch, weight,
)

CHUNK_ELEMENTS = 1 << 20  # mergekit's chunking of the norm and dot reductions

SLERP = """\
`v0 = W0`, `v1 = W_1` as float32 rows. Norms: per chunk of 2^20 elements `vector_norm`, then the
norm of the chunk norms; a norm <= 1e-8 becomes 1. `dot = sum over chunks of sum(v0/n0 * v1/n1)`,
clamped to [-1, 1]. If `|dot| > 0.9995`: `M = (1 - t) v0 + t v1`; else `theta = acos(dot)`,
`M = sin((1 - t) theta) / sin(theta) * v0 + sin(t theta) / sin(theta) * v1`. All float32 (torch).
Whole tensor. Under a budget, omitted blocks of the model hold the base's values.
"""

NUSLERP = """\
`t = w_2 / (w_1 + w_2)` (0.5 when `|w_1 + w_2| < 1e-6`). With a base: `a = W_1 - W0`,
`b = W_2 - W0`, `M = W0 + s(a, b)`; without: `M = s(W_1, W_2)`. `s` interpolates rows
(`nuslerp_row_wise`: columns of dim 0; `nuslerp_flatten`: the whole tensor as one vector):
`u = x / max(||x||, 1e-7)` per row, `cos = clamp(sum(u_a u_b), -1, 1)`; where
`1 - cos^2 <= 1e-16`: `(1 - t) a + t b`; else `(sin((1-t) theta) a + sin(t theta) b) / sin(theta)`.
Whole tensor.
"""


def _slerp(u: Unit) -> Any:
    torch = require_torch("slerp")
    u = u.torch()

    assert u.base is not None
    t = torch.tensor([u.params["t"]], dtype=torch.float32).reshape(-1, 1)
    a = u.base.reshape(1, -1)
    b = u.inputs[0].reshape(1, -1)
    if not a.shape[1]:
        return ((1 - t) * a + t * b).reshape(u.base.shape)
    chunks = range(0, a.shape[1], CHUNK_ELEMENTS)
    na = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(a[:, s:s + CHUNK_ELEMENTS], dim=1, keepdim=True)
         for s in chunks]), dim=0)
    nb = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(b[:, s:s + CHUNK_ELEMENTS], dim=1, keepdim=True)
         for s in chunks]), dim=0)
    na = torch.where(na > 1e-8, na, 1)
    nb = torch.where(nb > 1e-8, nb, 1)
    dot = torch.stack([(a[:, s:s + CHUNK_ELEMENTS] / na * (b[:, s:s + CHUNK_ELEMENTS] / nb))
                       .sum(dim=1, keepdim=True) for s in chunks]).sum(dim=0).clamp(-1, 1)
    linear = dot.abs() > 0.9995
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    ca = torch.where(linear, 1 - t, torch.sin((1 - t) * theta) / sin_theta)
    cb = torch.where(linear, t, torch.sin(t * theta) / sin_theta)
    out = torch.empty_like(a)
    for s in chunks:
        out[:, s:s + CHUNK_ELEMENTS] = ca * a[:, s:s + CHUNK_ELEMENTS] + \
            cb * b[:, s:s + CHUNK_ELEMENTS]
    return out.reshape(u.base.shape)


def _nuslerp_rows(t: float, a: Any, b: Any, row_wise: bool, flatten: bool) -> Any:
    import torch

    shape = a.shape
    if flatten:
        a, b = a.reshape(-1), b.reshape(-1)
    elif row_wise:
        a, b = a.transpose(0, -1), b.transpose(0, -1)

    def unit(x: Any) -> Any:
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=1e-7)

    cos = torch.sum(unit(a) * unit(b), dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= 1e-8 ** 2
    theta = torch.acos(torch.where(colinear, 0, cos))
    out = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)
    out = torch.where(colinear, (1 - t) * a + t * b, out)
    if row_wise and not flatten:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def _nuslerp(u: Unit) -> Any:
    require_torch("nuslerp")
    u = u.torch()
    w = u.per_input("weight")
    total = sum(w)
    t = 0.5 if abs(total) < 1e-6 else w[1] / total
    row_wise, flatten = u.params["nuslerp_row_wise"], u.params["nuslerp_flatten"]
    if u.base is not None:
        return u.base + _nuslerp_rows(t, u.inputs[0] - u.base, u.inputs[1] - u.base,
                                      row_wise, flatten)
    return _nuslerp_rows(t, u.inputs[0], u.inputs[1], row_wise, flatten)


def _nuslerp_coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]
                          ) -> list[float]:
    w = [abs(float(p.get("weight", 1.0))) for p in per]
    total = sum(w) or 1.0
    return [x / total for x in w]


METHODS = (
    Method(
        name="slerp", family="slerp",
        params=(ParamDef("t", "float", Scope.GLOBAL, lo=0.0, hi=1.0,
                         doc="interpolation factor, 0 = base"),),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=1),
        merge=_slerp, summary="spherical interpolation of the base and one model",
        arithmetic=SLERP, workspace=(8, 0)),
    Method(
        name="nuslerp", family="slerp",
        params=(weight(), flag("nuslerp_row_wise", False, "interpolate columns of dim 0"),
                flag("nuslerp_flatten", True, "interpolate the tensor as one vector")),
        caps=Capabilities(base=BasePolicy.OPTIONAL, min_inputs=2, max_inputs=2),
        merge=_nuslerp, coefficients=_nuslerp_coefficients,
        summary="spherical interpolation of two models (of their deltas with a base)",
        arithmetic=NUSLERP, workspace=(48, 0)),
)
