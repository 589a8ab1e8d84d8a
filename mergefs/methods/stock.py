"""``model_stock`` (interpolate the base towards the models' average by their mean delta angle)
and ``sce`` (select by variance, weight by delta energy, sign consensus). Pure; any thread.
"""

from __future__ import annotations

from typing import Any

from mergefs.methods.base import (
    INT8_MASK, BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, flag, require_torch,
)

MODEL_STOCK = """\
`D_i = W_i - W0` (flattened; `filter_wise`: per row, 1-D tensors one row). `cos` = mean over pairs
i < j of `clamp(D_i . D_j / max(||D_i|| ||D_j||, 1e-6), -1, 1)`; `t = n cos / (1 + (n - 1) cos)`
(0 where `|1 + (n-1) cos| < 1e-6`); `M = t * (sum_i W_i / n) + (1 - t) W0`. Whole tensor.
"""

SCE = """\
`D_i = W_i - W0`. If `select_topk < 1`: keep the `int(count_nonzero(var) * select_topk)` elements
with the largest variance over models (`var` unbiased=False; ties by torch.topk), zero elsewhere.
Sign consensus mask as ties; `e_i = mean(D_i^2)` normalised by their sum (uniform when the sum is
< 1e-6); `M = W0 + sum_i D_i e_i mask_i / max(sum_i e_i mask_i, 1e-6)`. Whole tensor.
"""


def _model_stock(u: Unit) -> Any:
    torch = require_torch("model_stock")
    u = u.torch()

    assert u.base is not None
    w0, ws = u.base, list(u.inputs)
    shape = w0.shape
    if u.params["filter_wise"]:
        if w0.dim() == 1:
            w0, ws = w0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    else:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cos = []
    for k, a in enumerate(offsets):
        for b in offsets[k + 1:]:
            norm = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cos.append(((a * b).sum(dim=-1) / norm.clamp(min=1e-6)).clamp(-1, 1))
    c = torch.stack(cos).mean(dim=0).unsqueeze(-1)
    n = len(ws)
    den = 1 + (n - 1) * c
    singular = den.abs() < 1e-6
    safe = torch.where(singular, torch.ones_like(den), den)
    t = torch.where(singular, torch.zeros_like(c), (n * c) / safe)
    avg = sum(ws) / n
    return (t * avg + (1 - t) * w0).reshape(shape)


def _sce(u: Unit) -> Any:
    torch = require_torch("sce")
    u = u.torch()

    base = u.base
    assert base is not None
    if not u.inputs:
        return base
    tv = torch.stack([x - base for x in u.inputs], dim=0)
    k_frac = u.params["select_topk"]
    if k_frac < 1:
        tv = tv * _topk_mask(tv, k_frac).unsqueeze(0)
    majority = (tv.sum(dim=0) >= 0).to(tv.dtype) * 2 - 1
    erase = tv.sign() == majority
    e = tv.square().reshape(tv.shape[0], -1).mean(dim=1)
    total = torch.sum(e).item()
    e = torch.ones_like(e) / e.shape[0] if abs(total) < 1e-6 else e / total
    while e.dim() < tv.dim():
        e = e.unsqueeze(-1)
    ew = e * erase
    return base + (tv * ew).sum(dim=0) / torch.sum(ew, dim=0).clamp(min=1e-6)


def _topk_mask(tv: Any, frac: float) -> Any:
    import torch

    if frac <= 0:
        return torch.zeros_like(tv[0])
    var = torch.var(tv, dim=0, unbiased=False)
    k = int(torch.count_nonzero(var) * frac)
    mask = torch.zeros_like(var)
    if k == 0:
        return mask
    _, idx = torch.topk(var.abs().view(-1), k=k, largest=True)
    mask.view(-1)[idx] = 1
    return mask


METHODS = (
    Method(
        name="model_stock", family="stock",
        params=(flag("filter_wise", False, "one interpolation factor per row"),),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=2, max_inputs=None),
        merge=_model_stock, summary="base towards the models' average by their delta angles",
        arithmetic=MODEL_STOCK, workspace=(40, 6)),
    Method(
        name="sce", family="stock",
        params=(INT8_MASK, ParamDef("select_topk", "float", Scope.GLOBAL, 1.0, 0.0, 1.0,
                                    doc="fraction of highest-variance elements kept")),
        caps=Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None),
        merge=_sce, summary="variance selection, energy weights, sign consensus",
        arithmetic=SCE, workspace=(32, 21)),
)
