"""Small methods: ``nearswap`` (move the base towards a model where they are close),
``passthrough`` (one model, optionally scaled) and ``arcee_fusion`` (keep the deltas whose
importance is an outlier). Pure; runs on any thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mergefs.methods.base import (
    NO_TORCH, BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, require_torch,
)

NEARSWAP = """\
`w = clamp(t / max(|W0 - W_1|, 1e-6), 0, 1)`; `M = w W_1 + (1 - w) W0` (torch float32; `t / x` is
torch's reciprocal-then-multiply). Elementwise.
"""

PASSTHROUGH = """\
`M = W` (the only input), or `W * scale` when the model sets `scale`. Elementwise.
"""

ARCEE_FUSION = """\
`D = W_1 - W0`; importance `I = |D| * KL` with `KL = sum(p log(p / q), dim=-1)`, `p = softmax(W_1)
+ 1e-8`, `q = softmax(W0) + 1e-8` over the last dim; threshold `median + 1.5 (q3 - q1)` of the
sorted `I` at indices `int(q * (n - 1))` (mergefs sorts every element; mergekit samples 10^6 with
replacement above 10^6 elements); `M = W0 + D * (I >= threshold)`. Whole tensor.
"""


def _nearswap(u: Unit) -> Any:
    """numpy, as torch computes it: ``t / x`` is ``reciprocal(x) * t``, scalars in float32."""
    a, b = u.base, u.inputs[0]
    assert a is not None
    one = np.float32(1)
    w = (one / np.maximum(np.abs(a - b), np.float32(1e-6))) * np.float32(u.params["t"])
    w = np.minimum(np.maximum(w, np.float32(0)), one)
    return w * b + (one - w) * a


def _nearswap_torch(u: Unit) -> Any:
    """The same in torch (the numpy kernel's reference in the tests)."""
    require_torch("nearswap")
    u = u.torch()
    a, b = u.base, u.inputs[0]
    assert a is not None
    w = (u.params["t"] / (a - b).abs().clamp(min=1e-6)).clamp(min=0, max=1)
    return w * b + (1 - w) * a


def _passthrough(u: Unit) -> Any:
    scale = u.input_params[0]["scale"]  # torch multiplies float32 by float32(scale)
    return u.inputs[0] if scale is None else u.inputs[0] * np.float32(scale)


def _arcee_fusion(u: Unit) -> Any:
    torch = require_torch("arcee_fusion")
    u = u.torch()
    import torch.nn.functional as F

    base, x = u.base, u.inputs[0]
    assert base is not None
    diff = (x - base).abs()
    p = F.softmax(x, dim=-1) + 1e-8
    q = F.softmax(base, dim=-1) + 1e-8
    importance = diff * torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    ordered, _ = torch.sort(importance.reshape(-1))
    idx = (torch.tensor([0.25, 0.5, 0.75]) * (ordered.numel() - 1)).long()
    q1, median, q3 = ordered[idx]
    mask = (importance >= median + 1.5 * (q3 - q1)).float()
    return base + (x - base) * mask


METHODS = (
    Method(
        name="nearswap", family="simple",
        params=(ParamDef("t", "float", Scope.GLOBAL, lo=0.0, doc="similarity threshold"),),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=1,
                          elementwise=lambda n, g: True),
        merge=_nearswap, summary="take the model's value where it is within t of the base",
        arithmetic=NEARSWAP, torch_use=NO_TORCH),
    Method(
        name="passthrough", family="simple",
        params=(ParamDef("scale", "float?", Scope.MODEL, None, doc="multiply by this"),),
        caps=Capabilities(base=BasePolicy.IGNORED, min_inputs=1, max_inputs=1,
                          elementwise=lambda n, g: True),
        merge=_passthrough, summary="one model's tensors, optionally scaled",
        arithmetic=PASSTHROUGH, torch_use=NO_TORCH),
    Method(
        name="arcee_fusion", family="simple",
        params=(),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=1),
        merge=_arcee_fusion, summary="keep deltas whose KL-weighted importance is an outlier",
        arithmetic=ARCEE_FUSION),
)
