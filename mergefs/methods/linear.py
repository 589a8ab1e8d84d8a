"""``linear``: mergekit's weighted average (model soup) of every input, the base included when it is
listed or given as ``base_model``. Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mergefs.methods import exact
from mergefs.methods.base import (
    NO_TORCH, BasePolicy, Capabilities, Fused, Method, Scope, Unit, flag, weight,
)

ARITHMETIC = """\
Inputs `W_m` are the models in `models:` order, then `base_model` if it is set and not listed
(mergekit appends it; it then takes the global `weight`). With float32 weights `w_m`:

    R = zeros(float32)
    for m in order:  R = fma(W_m, w_m, R)        # torch addcmul_: one rounding per step
    M = R / (sum_m w_m)  if normalize  else R    # torch's float32 sum of the weights

Under a budget an omitted block of model m holds the reference model's values there (`W_m := W0`),
so `M_B - M = sum_m c_m (W0 - W_m)` on omitted blocks with `c_m = w_m / n` (`n` the weight sum
when normalize, else 1): the additive bound holds. Elementwise. The weight sum is torch's:
up to 7 weights four interleaved partial sums, from 8 on its vectorised order
(mergefs/methods/exact.py: vector_sum).
"""


def _merge(u: Unit) -> Any:
    w32 = [np.float32(x) for x in u.per_input("weight")]
    result = np.zeros_like(u.inputs[0])
    for x, c in zip(u.inputs, w32):
        result = exact.fma32(x, c, result)
    if u.params["normalize"]:
        result = result / exact.vector_sum(w32)
    return result


def _fused(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> Fused | None:
    """``_merge``'s numpy arithmetic as the kernel's fma form."""
    if not per:
        return None
    w32 = [np.float32(p["weight"]) for p in per]
    divisor = float(exact.vector_sum(w32)) if g["normalize"] else None
    return Fused("fma", tuple(float(w) for w in w32), divisor)


def _coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    """``c_m = w_m / n`` for every input, ``n = sum w`` when normalize, else 1."""
    total = sum(float(p["weight"]) for p in per)
    n = total if g.get("normalize") and total != 0 else 1.0
    return [float(p["weight"]) / n for p in per]


def _check(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> str | None:
    if g["normalize"] and sum(float(p["weight"]) for p in per) == 0:
        return "linear with normalize: the weights sum to zero (mergekit would divide by zero)"
    return None


METHODS = (
    Method(
        name="linear", family="linear",
        params=(flag("normalize", True, "divide by the sum of the weights"),
                weight(Scope.MODEL)),
        caps=Capabilities(base=BasePolicy.IGNORED, min_inputs=1, max_inputs=None,
                          additive=True, elementwise=lambda n, g: True),
        merge=_merge, coefficients=_coefficients, check=_check, fused=_fused,
        summary="weighted average sum w_m W_m / sum w_m (model soup)", arithmetic=ARITHMETIC,
        torch_use=NO_TORCH),
)
