"""What a merge method is: its parameters, its capabilities and its arithmetic on one unit.

A :class:`Method` is plain data plus one function: ``merge(unit) -> tensor``. Spec validation,
the planner, the engine, ``mergefs methods`` and docs/operators.md all read these declarations;
nothing else in mergefs tests a method's name. Pure; runs on any thread.

Arithmetic is written with torch CPU float32 kernels on zero-copy views of the engine's numpy
buffers, op for op as mergekit 0.1.5 evaluates the same formula: mergekit's results are defined
by those kernels (fused multiply-add in ``addcmul``, reduction orders that change with the number
of inputs and the SIMD width, Sleef transcendentals), which numpy does not reproduce in general.
Elementwise methods also have numpy kernels equal to torch's (:mod:`.exact`) and use them, so
torch is imported only by the methods that need it: each declares when (:class:`TorchUse`), and
imports it first through :func:`require_torch`, which turns a missing torch into one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from types import ModuleType
from typing import Any

from mergefs.core.errors import DependencyMissing
from mergefs.methods import values

#: the oldest torch the methods accept (pyproject's ``torch`` extra: ``torch>=2.0``)
TORCH_MIN = (2, 0)


def require_torch(method: str) -> ModuleType:
    """torch, for ``method``: every method's first torch import goes through here. Raises
    :class:`DependencyMissing` in one line, naming the extra, when torch is missing (or older
    than :data:`TORCH_MIN`, or fails to import). Cheap once torch is imported; any thread."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":  # torch is there but one of its own imports is not
            raise DependencyMissing(f"{method} needs torch, which fails to import: "
                                    f"{str(exc).splitlines()[0]}") from exc
        raise DependencyMissing(f"{method} needs torch (pip install 'mergefs[torch]', "
                                "or any torch>=2.0 you already use)") from None
    except ImportError as exc:
        raise DependencyMissing(f"{method} needs torch, which fails to import: "
                                f"{str(exc).splitlines()[0]}") from exc
    release = re.match(r"(\d+)\.(\d+)", getattr(torch, "__version__", ""))
    if release is None or (int(release[1]), int(release[2])) < TORCH_MIN:
        raise DependencyMissing(f"{method} needs torch>=2.0, found "
                                f"{getattr(torch, '__version__', 'an unversioned torch')} "
                                "(pip install 'mergefs[torch]')")
    return torch


@dataclass(frozen=True)
class TorchUse:
    """Whether merging a unit imports torch: ``when(n_inputs, params, tensor_size)`` with the
    unit's number of inputs, its global parameters (defaults filled in) and the elements of its
    whole tensor; the method's merge dispatches on the same predicate. ``note`` says it in words
    for ``mergefs methods`` and docs/operators.md: "no", "yes" or "only ..."."""

    note: str
    when: Callable[[int, Mapping[str, Any], int], bool] = field(compare=False)


#: the method never imports torch (numpy kernels equal to torch's, :mod:`.exact`)
NO_TORCH = TorchUse("no", lambda n, g, size: False)
#: the method's arithmetic is torch's CPU kernels
TORCH = TorchUse("yes", lambda n, g, size: True)


class Scope(str, Enum):
    """Where a parameter is set: once globally, or per model (a global value is the default)."""

    GLOBAL = "global"
    #: every input model, the base included when it is an input (mergekit's INPUT scope)
    MODEL = "model"
    #: every input model but the base (mergekit's NON_BASE scope)
    NON_BASE = "non_base"


class BasePolicy(str, Enum):
    """mergekit's base policy: the base is the origin of the deltas, optional, or just an input."""

    REQUIRED = "required"
    OPTIONAL = "optional"
    IGNORED = "ignored"  # the base_model, if any, is one more weighted input (linear, karcher)


REQUIRED = object()  # default of a parameter without a default


@dataclass(frozen=True)
class ParamDef:
    """One parameter: mergekit's name, type, default and the range mergefs accepts."""

    name: str
    kind: str  # "bool" | "float" | "int" | "float?" (a float or null)
    scope: Scope
    default: Any = REQUIRED
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    doc: str = ""
    mergefs_only: bool = False  # not a mergekit parameter (``seed``)
    no_op: str = ""  # accepted but without effect on the result here: why

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe_range(self) -> str:
        if self.kind == "bool":
            return "true|false"
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"

    def coerce(self, value: Any) -> tuple[Any, str | None]:
        """``(value, None)`` with ``value`` as mergekit reads it (:mod:`.values`: ``1.0`` is true
        for a bool, ``"1e-5"`` a float, ``3.0`` an int), or ``(None, what is wrong)``: mergekit
        refuses it, or it is outside the range mergefs accepts."""
        try:
            out = values.coerce(self.kind, value)
        except ValueError as exc:
            return None, str(exc)
        if self.kind == "bool" or out is None:
            return out, None
        if not math.isfinite(out):
            return None, f"expected a finite number, got {value!r}"
        if self.lo is not None and (out < self.lo or (self.lo_open and out == self.lo)):
            return None, f"must be {'>' if self.lo_open else '>='} {self.lo}, got {out}"
        if self.hi is not None and out > self.hi:
            return None, f"must be <= {self.hi}, got {out}"
        return out, None

    def check(self, value: Any) -> str | None:
        """None if ``value`` is valid, else what is wrong with it."""
        return self.coerce(value)[1]


@dataclass(frozen=True)
class Capabilities:
    """What the planner and the engine may assume about a method."""

    base: BasePolicy
    min_inputs: int  # number of non-base inputs (all inputs when the base is ignored)
    max_inputs: int | None
    additive: bool = False  # M is affine in the deltas with fixed c_i: the error bound holds
    random: bool = False  # draws a mask (mergefs: counter-based, seeded, reproducible)
    #: elementwise: may run on any slice of a tensor (given the number of inputs and the
    #: global parameters); otherwise the engine hands it whole tensors
    elementwise: Callable[[int, Mapping[str, Any]], bool] = field(
        default=lambda n, g: False, compare=False)
    #: the output is the base exactly when every delta is zero (an unread unit is the base)
    zero_delta_is_base: bool = False


@dataclass(frozen=True)
class Unit:
    """The inputs of one merge unit, float32 numpy arrays that must not be modified
    (``torch()``: the same as torch tensors, sharing memory).

    ``base`` is the base's values when the method has a base; ``inputs`` the other inputs in
    mergekit's order (a model the plan omits here holds the reference model's values, i.e. a
    zero delta). Whole-tensor units have the tensor's shape; elementwise units are flat slices
    starting at flat element ``elem_offset``.
    """

    tensor: str
    shape: tuple[int, ...]
    elem_offset: int
    base: Any  # np.ndarray | None (torch.Tensor | None after ``torch()``)
    inputs: tuple[Any, ...]
    params: Mapping[str, Any]  # global parameters, defaults filled in
    input_params: tuple[Mapping[str, Any], ...]  # per input (same order as ``inputs``)
    expert_ids: tuple[int, ...]  # per input: its index among the non-base models (mask keys)
    #: elements of the whole tensor (0: the unit's own size): where a slice sits in it
    tensor_size: int = 0

    def per_input(self, name: str) -> list[Any]:
        return [p[name] for p in self.input_params]

    def torch(self) -> Unit:
        """This unit with torch tensors (zero-copy views) in place of the arrays."""
        import torch

        def conv(a: Any) -> Any:
            return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)

        return replace(self, base=None if self.base is None else conv(self.base),
                       inputs=tuple(conv(x) for x in self.inputs))


@dataclass(frozen=True)
class Fused:
    """A unit's arithmetic in one of the forms of mergefs' compiled kernel (mergefs.methods.kernels),
    operation for operation the method's numpy kernel, so the kernel's bytes are the method's.

    With ``X_k`` the inputs (mergekit order; an omitted block holds the reference's values),
    ``w_k`` = ``weights`` (float32) and every operation rounded to float32:

    - ``"delta"``: ``S = 0; S = S + (X_k - W0) * w_k`` in input order; ``S = S / divisor``
      (when not None); ``S = S * scale`` (when not None); ``M = W0 + S``.
    - ``"fma"``: ``S = 0; S = fma(X_k, w_k, S)`` in input order (one rounding per step);
      ``M = S / divisor`` (when not None).

    ``order="torch"`` (delta form): the sum over inputs is torch's ``stack(...).sum(dim=0)``
    over the whole tensor: :func:`.exact.multi_row_sum` (input order up to 16 inputs) up to
    :func:`.exact.torch_sum_tail` (a flat position in the tensor), then :func:`.exact.row_sum`.
    """

    form: str  # "delta" | "fma"
    weights: tuple[float, ...]  # float32 values
    divisor: float | None = None  # a float32 value
    scale: float | None = None  # a float32 value
    order: str = "sequential"  # "sequential" | "torch"


@dataclass(frozen=True)
class Staged:
    """A whole-tensor arithmetic merged in two phases, in memory bounded by one input's tensor
    plus blocks of all of them (the engine's staged path, mergefs.engine.staged).

    Phase 1, one input at a time: ``keep(delta, p, g, tensor, model)`` on input ``model``'s
    whole delta ``W_i - W0`` (float32 torch, the tensor's shape; ``p`` its parameters, ``g``
    the global ones) returns what the arithmetic keeps of it, small and elementwise-applicable
    (``mergefs.methods.sparsify.Kept``: a bit mask and a factor). Phase 2, by blocks of flat
    elements: ``combine(base, delta, input_params, g)`` merges a block (``base`` the block's
    float32 torch values, ``delta(k)`` input k's kept delta there) to the bytes ``merge`` gives
    there on the whole tensor, for blocks that start at a multiple of 32 elements and, when
    they hold the tensor's last ``numel % 32`` elements, hold at least 32 before them (torch's
    input-axis sums then add every element in the whole tensor's order).

    ``phase1_bytes``: the workspace of ``keep`` per element of the tensor (beyond the base's,
    the input's and the delta's float32 values); ``block_bytes_per_input`` and
    ``block_bytes``: ``combine``'s per element of a block, per input and once."""

    keep: Callable[..., Any] = field(compare=False)
    combine: Callable[..., Any] = field(compare=False)
    phase1_bytes: int = 0
    block_bytes_per_input: int = 0
    block_bytes: int = 0


#: a whole-tensor method's own temporaries unless it declares them: bytes per element of the
#: tensor, ``(a, b)`` for ``a + b * inputs``
DEFAULT_WORKSPACE = (24, 12)


@dataclass(frozen=True)
class Method:
    """A merge method: parameters, capabilities, arithmetic and its documentation."""

    name: str
    family: str
    params: tuple[ParamDef, ...]
    caps: Capabilities
    #: the arithmetic: a float32 numpy array or torch tensor of the unit's shape
    merge: Callable[[Unit], Any] = field(compare=False)
    #: per input (mergekit order), c_i for ranking reads by |c_i| ||D_i|| (and the bound's
    #: coefficients when additive)
    coefficients: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], list[float]] = \
        field(compare=False, default=lambda g, per: [1.0] * len(per))
    #: a method-specific check of the resolved parameters: None, or what is wrong
    check: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], str | None] | None = \
        field(compare=False, default=None)
    summary: str = ""
    arithmetic: str = ""  # docs/operators.md text: the exact formula
    #: the unit's arithmetic as a compiled kernel's form, for these global and per-input
    #: parameters (None: the method merges the unit itself)
    fused: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], Fused | None] = \
        field(compare=False, default=lambda g, per: None)
    #: when ``merge`` imports torch (tests/test_install.py runs every method without torch)
    torch_use: TorchUse = TORCH
    #: the arithmetic in two phases for whole-tensor units (None: whole tensors only)
    staged: Staged | None = None
    #: ``merge``'s own temporaries on a whole tensor, bytes per element: ``a + b * inputs``
    workspace: tuple[int, int] = DEFAULT_WORKSPACE

    def param(self, name: str) -> ParamDef | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def global_params(self) -> tuple[ParamDef, ...]:
        return tuple(p for p in self.params if p.scope == Scope.GLOBAL)

    @property
    def model_params(self) -> tuple[ParamDef, ...]:
        return tuple(p for p in self.params if p.scope != Scope.GLOBAL)

    def elementwise(self, n_inputs: int, params: Mapping[str, Any]) -> bool:
        return bool(self.caps.elementwise(n_inputs, params))

    def needs_torch(self, n_inputs: int, params: Mapping[str, Any], tensor_size: int) -> bool:
        """Whether merging a unit of ``n_inputs`` inputs of a tensor of ``tensor_size``
        elements with global ``params`` (defaults filled in) imports torch."""
        return bool(self.torch_use.when(n_inputs, params, tensor_size))


# -- parameter shorthands shared by the method modules --------------------------------------------

def weight(scope: Scope = Scope.NON_BASE, default: Any = REQUIRED) -> ParamDef:
    return ParamDef("weight", "float", scope, default, doc="the model's weight")


def flag(name: str, default: bool, doc: str = "", no_op: str = "") -> ParamDef:
    return ParamDef(name, "bool", Scope.GLOBAL, default, doc=doc, no_op=no_op)


INT8_MASK = flag("int8_mask", False, "store masks as int8",
                 no_op="a memory knob in mergekit; masks here never change the result")
