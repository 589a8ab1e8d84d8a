"""Parameter settings as mergekit writes them: a scalar, a gradient, or ``{filter, value}`` lists.

A *setting* is what a spec gives for one parameter at one level (global, slice, model or slice
source): a scalar (``0.5``), a gradient (``[0, 0.5, 1]``: interpolated across a slice's layers),
or conditional values (``[{filter: self_attn, value: [0, 1]}, {value: 0.5}]``: the first whose
``filter`` is a substring of the tensor name wins; no filter, or ``*``, matches everything).
``check`` validates one at the edge (each scalar coerced as mergekit's validation does, then checked
against the parameter's range) and returns it in a normal form; ``evaluate`` resolves it for one tensor at position ``t`` in ``[0, 1]`` exactly as
mergekit 0.1.5's ``evaluate_setting`` does (Python floats: ``(1 - f) * v[i] + f * v[i + 1]`` with
``i = int(t * (n - 1))``); ``resolve`` walks the levels from highest precedence down, a level that
yields nothing (no key, no matching filter) deferring to the next. Pure; any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mergefs.methods import values
from mergefs.methods.base import ParamDef

#: ``evaluate`` of a setting that gives no value for a tensor (no matching filter)
NO_VALUE = object()


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) or value is None


def is_scalar(setting: Any) -> bool:
    """Whether a (checked) setting is one plain value, the same for every tensor."""
    return _is_scalar(setting)


def _check_leaf(pdef: ParamDef, value: Any) -> tuple[Any, str | None]:
    """A scalar or a gradient checked: ``(normal form, None)`` or ``(None, what is wrong)``."""
    if isinstance(value, list):
        if not value:
            return None, "a gradient needs at least one value"
        out = []
        for v in value:
            if not _is_scalar(v) or v is None:
                return None, f"a gradient is a list of numbers, got {v!r}"
            normal, problem = pdef.coerce(v)
            if problem:
                return None, problem
            out.append(normal)
        return out, None
    return pdef.coerce(value)


def check(pdef: ParamDef, value: Any) -> tuple[Any, str | None]:
    """``(normal form, None)`` for a valid setting, ``(None, what is wrong)`` otherwise.

    The normal form has every scalar as mergekit's validation reads it (``ParamDef.coerce``:
    bools for bool parameters, floats for float ones, ints for int ones), gradients as lists of
    those, and conditional values as a tuple of ``(filter or None, value)`` pairs. Specs are
    checked once, here; the manifest records the normal form, which checks to itself.
    """
    if isinstance(value, dict) or (isinstance(value, list) and value
                                   and any(isinstance(v, dict) for v in value)):
        conds = value if isinstance(value, list) else [value]
        out = []
        for cond in conds:
            if not isinstance(cond, dict) or "value" not in cond or set(cond) - {"filter",
                                                                                  "value"}:
                return None, f"expected {{filter: NAME, value: ...}} entries, got {cond!r}"
            filt = cond.get("filter")
            if filt is not None and not isinstance(filt, str):
                return None, f"a filter is a substring of tensor names, got {filt!r}"
            inner = cond["value"]
            if isinstance(inner, dict) or (isinstance(inner, list)
                                           and any(isinstance(v, dict) for v in inner)):
                return None, "a filter's value is a number or a gradient list"
            normal, problem = _check_leaf(pdef, inner)
            if problem:
                return None, problem
            out.append((filt, normal))
        return tuple(out), None
    return _check_leaf(pdef, value)


def to_json(setting: Any) -> Any:
    """A checked setting as spec data again (what ``check`` accepts)."""
    if isinstance(setting, tuple):
        return [{"value": v} if f is None else {"filter": f, "value": v} for f, v in setting]
    return setting


def _validate(pdef: ParamDef, value: Any) -> Any:
    """An interpolated value validated again, as mergekit does (an int parameter's must be
    whole)."""
    try:
        return values.coerce(pdef.kind, value)
    except ValueError as exc:
        raise ValueError(f"{pdef.name}: an interpolated value {value!r}: {exc}") from None


def evaluate(pdef: ParamDef, setting: Any, tensor_name: str, t: float) -> Any:
    """The value of ``setting`` for tensor ``tensor_name`` at position ``t`` (mergekit's
    ``evaluate_setting``), or :data:`NO_VALUE`."""
    if isinstance(setting, tuple):
        for filt, value in setting:
            if filt is None or filt == "*" or (tensor_name and filt in tensor_name):
                return evaluate(pdef, value, tensor_name, t)
        return NO_VALUE
    if isinstance(setting, list):
        if not setting:
            return NO_VALUE
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in setting)
        if not numeric:
            return setting[int(t * (len(setting) - 1))]
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return _validate(pdef, (1 - frac) * setting[i0] + frac * setting[i1])
    return setting


def resolve(pdef: ParamDef, levels: Iterable[Mapping[str, Any] | None], tensor_name: str,
            t: float) -> Any:
    """The parameter's value for one tensor: the first level (highest precedence first) that
    gives one, else its default (:data:`NO_VALUE` when it has none: the caller reports it)."""
    for level in levels:
        if level is not None and pdef.name in level:
            value = evaluate(pdef, level[pdef.name], tensor_name, t)
            if value is not NO_VALUE and value is not None:
                return value
    return NO_VALUE if pdef.required else pdef.default
