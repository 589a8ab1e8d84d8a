"""MagMax (Marczak et al., ECCV 2024, arXiv 2407.06322): per element, the task delta of largest
magnitude across the models, scaled and added to the base, as FusionBench 0.2.33's
``MagMaxAlgorithm`` computes it. Elementwise, in numpy (IEEE float32 comparisons, one multiply
and one add per element: torch's kernels give the same bytes). Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mergefs.methods.base import NO_TORCH, BasePolicy, Capabilities, Method, ParamDef, Scope, Unit

ARITHMETIC = """\
Paper: [MagMax](https://arxiv.org/abs/2407.06322) (Marczak et al., ECCV 2024). The reference is
FusionBench 0.2.33's `MagMaxAlgorithm` (config name `magmax`; mergefs uses the same name). Per
floating tensor, with `D_i = W_i - W0` (float32) for the non-base models in order:

1. `tau = D_1`; for `i = 2..n`: `tau = D_i where |D_i| >= |tau| else tau` (a later model wins a
   tie of magnitudes, as in the paper's release).
2. `M = W0 + scaling_factor * tau` (`scaling_factor` as float32).

Every floating tensor is merged this way, norms, biases and embeddings included (FusionBench
merges every floating parameter); non-floating tensors are the base's. FusionBench computes in
the models' dtype: mergefs' bytes equal its output on the models upcast to float32, cast once to
the output dtype (equal outright for float32 models). Block-wise: one block at a time.
"""


def _merge(u: Unit) -> np.ndarray:
    base = u.base
    tau = u.inputs[0] - base
    for x in u.inputs[1:]:
        d = x - base
        tau = np.where(np.abs(d) >= np.abs(tau), d, tau)
    return base + np.float32(u.params["scaling_factor"]) * tau


def _coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    """Every model's delta enters scaled by ``scaling_factor`` (ranking reads only)."""
    return [float(g.get("scaling_factor", 0.5))] * len(per)


METHODS = (
    Method(
        name="magmax", family="magmax",
        params=(ParamDef("scaling_factor", "float", Scope.GLOBAL, 0.5,
                         doc="scale of the selected delta (the paper's alpha; FusionBench's "
                             "default)"),),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                          elementwise=lambda n, g: True, zero_delta_is_base=True),
        merge=_merge, coefficients=_coefficients,
        summary="per element the delta of largest magnitude, scaled",
        arithmetic=ARITHMETIC, torch_use=NO_TORCH),
)
