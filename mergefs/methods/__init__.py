"""The method registry: every merge method mergefs runs, one module per family.

``get(name)`` returns a :class:`~.base.Method` (parameters, capabilities, arithmetic);
``describe_methods()`` is what ``mergefs methods`` prints. Adding a method means adding one
module (or one row of a family) and its tests; nothing else names methods. Pure; any thread.
"""

from __future__ import annotations

from typing import Any

from mergefs.methods import gta, linear, needs, ram, simple, slerp, spherical, stock
from mergefs.methods import consensus, magmax, subspace
from mergefs.methods.base import (
    REQUIRED, BasePolicy, Capabilities, Fused, Method, ParamDef, Scope, TorchUse, Unit,
    require_torch,
)
from mergefs.methods.exact import TORCH_SUM_MAX
from mergefs.methods.gta import SEQUENTIAL_SUM_MAX
from mergefs.methods.papers import PAPERS

__all__ = [
    "METHODS",
    "BasePolicy",
    "Capabilities",
    "Fused",
    "Method",
    "ParamDef",
    "Scope",
    "TorchUse",
    "Unit",
    "describe_methods",
    "get",
    "require_torch",
]

_ALL: tuple[Method, ...] = (*linear.METHODS, *gta.METHODS, *slerp.METHODS, *stock.METHODS,
                            *spherical.METHODS, *simple.METHODS, *ram.METHODS,
                            *magmax.METHODS, *consensus.METHODS, *subspace.METHODS)
_BY_NAME: dict[str, Method] = {m.name: m for m in _ALL}
assert len(_BY_NAME) == len(_ALL), "duplicate method names"

#: Every method name, in registry order.
METHODS: tuple[str, ...] = tuple(_BY_NAME)


def get(name: str) -> Method | None:
    return _BY_NAME.get(name)


def _param_row(p: ParamDef) -> dict[str, Any]:
    return {"name": p.name, "scope": p.scope.value, "type": p.kind,
            "default": None if p.default is REQUIRED else p.default, "required": p.required,
            "range": None if p.kind == "bool" else p.describe_range(),
            "mergefs_only": p.mergefs_only, "no_op": p.no_op or None, "doc": p.doc}


def describe_methods() -> list[dict[str, Any]]:
    """One JSON-able row per method: name, family, parameters with defaults, capabilities,
    whether it needs torch ("no", "yes" or "only ...": :attr:`~.base.Method.torch_use`), its
    paper (name as published and URL, from :mod:`.papers`) and the bytes a tensor's merge holds
    at its peak (:func:`.needs.formula`)."""
    rows = []
    for m in _ALL:
        c = m.caps
        rows.append({
            "name": m.name, "family": m.family, "summary": m.summary,
            "parameters": [_param_row(p) for p in m.params],
            "base": c.base.value,
            "inputs": {"min": c.min_inputs, "max": c.max_inputs},
            "additive_bound": c.additive,
            "blockwise": blockwise_note(m),
            "random": c.random,
            "needs_torch": m.torch_use.note,
            "paper": dict(zip(("name", "url"), PAPERS.get(m.name, (m.name, None)))),
            "memory": needs.formula(m, blockwise_note(m) != "no"),
        })
    return rows


def blockwise_note(m: Method) -> str:
    """Whether the engine merges ``m`` block by block (else whole tensors), in words."""

    if m.elementwise(TORCH_SUM_MAX + 1, _defaults(m)):
        return "yes"
    if m.elementwise(SEQUENTIAL_SUM_MAX + 1, _defaults(m)):
        return (f"yes, up to {TORCH_SUM_MAX} models (x86; up to {SEQUENTIAL_SUM_MAX} "
                "elsewhere)")
    if m.elementwise(2, _defaults(m)):
        return f"yes, up to {SEQUENTIAL_SUM_MAX} models"
    if m.elementwise(2, {**_defaults(m), "rescale": False}):
        return f"with rescale: false, up to {SEQUENTIAL_SUM_MAX} models"
    return "no"


def _defaults(m: Method) -> dict[str, Any]:
    return {p.name: p.default for p in m.global_params if not p.required}
