"""``ram`` and ``ramplus_tl`` (Reinforced Agent Merging): average deltas where several models
change an element, keep unique ones (ramplus_tl: scaled up by the tensor's overlap ratio).
Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mergefs.methods import exact
from mergefs.methods.base import (
    BasePolicy, Capabilities, Method, ParamDef, Scope, TorchUse, Unit, require_torch,
)
from mergefs.methods.gta import SEQUENTIAL_SUM_MAX

RAM = """\
`D_i = W_i - W0`; `nz_i = |D_i| > epsilon`; `c = sum_i nz_i` per element; `M = W0 + sum_i
(D_i nz_i [c == 1] + D_i nz_i [c > 1] / max(c, 1))`. Elementwise for up to 4 models.
"""

RAMPLUS = """\
As ram, with each unique delta scaled by `1 + r * clamp(rho_i, 0, alpha)`, `rho_i = (#elements
where model i is non-zero and shared) / max(#where it is non-zero and unique, epsilon)` over the
whole tensor. Whole tensor.
"""


def _prepare(u: Unit) -> tuple[Any, Any, Any, Any, Any]:
    """``u`` holds torch tensors (``u.torch()``)."""
    import torch  # imported by the caller through require_torch

    assert u.base is not None
    tv = torch.stack([x - u.base for x in u.inputs], dim=0).view(len(u.inputs), -1)
    nz = tv.abs() > u.params["epsilon"]
    counts = nz.sum(dim=0, keepdim=True)
    return tv, nz, counts, counts > 1, counts == 1


def _ram(u: Unit) -> Any:
    """numpy for up to 4 models (torch's sums over the models are sequential there)."""
    base = u.base
    assert base is not None
    if _ram_needs_torch(len(u.inputs), u.params, u.tensor_size):
        return _ram_torch(u)
    tv = [x - base for x in u.inputs]
    nz = [np.abs(d) > np.float32(u.params["epsilon"]) for d in tv]
    counts = np.zeros(base.shape, dtype=np.int64)
    for m in nz:
        counts = counts + m
    overlap, unique = counts > 1, counts == 1
    divisor = np.maximum(counts, 1).astype(np.float32)
    z = [d * m for d, m in zip(tv, nz)]
    merged = exact.outer_sum([(zk * unique) + (zk * overlap / divisor) for zk in z])
    return base + merged


def _ram_torch(u: Unit) -> Any:
    """The same in torch: more than 4 models (and the numpy kernel's reference in the tests)."""
    require_torch("ram")
    u = u.torch()
    assert u.base is not None
    if not u.inputs:
        return u.base
    tv, nz, counts, overlap, unique = _prepare(u)
    z = tv * nz
    merged = ((z * unique) + (z * overlap / counts.clamp(min=1))).sum(dim=0, keepdim=True)
    return u.base + merged.reshape_as(u.base)


def _ramplus(u: Unit) -> Any:
    require_torch("ramplus_tl")
    u = u.torch()
    assert u.base is not None
    if not u.inputs:
        return u.base
    tv, nz, counts, overlap, unique = _prepare(u)
    g = u.params
    shared = (nz & overlap).sum(dim=1)
    uniq = (nz & unique).sum(dim=1)
    rho = shared / uniq.clamp(min=g["epsilon"])
    lam = 1 + g["r"] * rho.clamp(min=0, max=g["alpha"])
    z = tv * nz
    merged = ((z * unique * lam.unsqueeze(-1)) + (z * overlap / counts.clamp(min=1))
              ).sum(dim=0, keepdim=True)
    return u.base + merged.reshape_as(u.base)


def _eps() -> ParamDef:
    return ParamDef("epsilon", "float", Scope.GLOBAL, 1e-5, 0.0,
                    doc="a delta counts as a change above this")


def _elementwise(n: int, g: Mapping[str, Any]) -> bool:
    return n <= SEQUENTIAL_SUM_MAX


def _ram_needs_torch(n: int, g: Mapping[str, Any], tensor_size: int) -> bool:
    """ram's numpy kernel: up to SEQUENTIAL_SUM_MAX models (torch's sums over them are
    sequential there)."""
    return not 1 <= n <= SEQUENTIAL_SUM_MAX


METHODS = (
    Method(
        name="ram", family="ram", params=(_eps(),),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                          elementwise=_elementwise, zero_delta_is_base=True),
        merge=_ram, summary="average overlapping deltas, keep unique ones", arithmetic=RAM,
        torch_use=TorchUse(f"only with more than {SEQUENTIAL_SUM_MAX} models",
                           _ram_needs_torch)),
    Method(
        name="ramplus_tl", family="ram",
        params=(ParamDef("r", "float", Scope.GLOBAL, 0.1, doc="unique-delta boost"),
                ParamDef("alpha", "float", Scope.GLOBAL, 0.2, doc="cap of the overlap ratio"),
                _eps()),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                          zero_delta_is_base=True),
        merge=_ramplus, summary="ram with unique deltas boosted by the overlap ratio",
        arithmetic=RAMPLUS),
)
