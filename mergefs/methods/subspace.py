"""Merges in the singular subspaces of the task matrices, as FusionBench 0.2.33 runs them:
``tsv_m`` (Task Singular Vectors, TSV-M), ``iso_c`` and ``iso_cts`` (isotropic merging in the
common, and the common and task-specific, subspaces). Pure; runs on any thread.

Every 2-D tensor is one matrix (embeddings and the LM head included, as in FusionBench); other
tensors (norms, biases) take the methods' fallback, the mean of the deltas. The arithmetic is
torch's CPU float32 kernels (``torch.linalg.svd``, ``multi_dot``) in FusionBench's order of
operations, so the bytes equal FusionBench's on float32 checkpoints with the same torch. Memory
per unit: the engine's whole-tensor inputs plus 10-22 matrices of the tensor's size (one task's
delta and its SVD at a time, the concatenated factors and their SVDs; LAPACK's workspace).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from mergefs.methods.base import (
    BasePolicy, Capabilities, Method, ParamDef, Scope, Unit, require_torch,
)

REFERENCE = """
Memory: one tensor at a time; besides the engine's T + 1 float32 inputs, a peak of about {mem}
times the float32 matrix (measured on 1024 x 1024, 4 models; one torch SVD alone takes 6.5).

Reference: FusionBench 0.2.33's `{cls}` (`fusion_bench
method={cfg}`), whose bytes mergefs gives for float32 checkpoints with the same torch
(tests/methods/test_subspace.py); FusionBench computes the deltas of 16-bit checkpoints in
their dtype, mergefs in float32. FusionBench's `exclude_keys` (matrices merged as other
tensors) is not offered.
"""

TSV_M = """\
`D_i = w_i * (W_i - W0)` for the T non-base models (`w_i * ` only where `weight` is not 1).
Matrices (2-D): `U_i S_i V_i^T = svd(D_i)` (torch.linalg.svd, full_matrices=False, k singular
values), `r = int(k * (1 / T))` (0 when k < T: the matrix keeps the base); `U` (m x k) holds
`U_i[:, :r]` in columns `[i r, (i+1) r)`, `s` the matching `S_i[:r]`, `V^T` (k x n) the rows
`V_i^T[:r]` (zeros elsewhere); `P_u Q_u = svd(U)`, `P_v Q_v = svd(V^T)` (each orthogonal
factor's `P Q`, the polar factor that whitens the concatenated directions); `M = W0 + alpha *
multi_dot(P_u, Q_u, diag(s), P_v, Q_v)`. Other tensors: the running mean `m = D_1; m += (D_i -
m) / i`, `M = W0 + alpha * m`. Whole tensor, torch float32. FusionBench's `alpha` list is
`weight` here (per model); mergefs accepts both, the weights applied first.
""" + REFERENCE.format(mem=11, cls="TaskSingularVectorMerging",
                       cfg="task_singular_vector/TaskSingularVectorMerging")

ISO_C = """\
`D_i = W_i - W0`; `A = (sum_i D_i) / T` (Python's `sum`, from integer 0). Matrices: `A *= T`,
`U S V^T = svd(A)`, `A = multi_dot(U, diag(mean(S) * ones), V^T)` (the spectrum flattened to
its mean). `M = W0 + scaling_factor * A`. Whole tensor, torch float32.
""" + REFERENCE.format(mem=10, cls="ISO_C_Merge", cfg="isotropic_merging/iso_c")

ISO_CTS = """\
`D_i = W_i - W0`. Other than matrices: the running mean `A = D_1; A += (D_i - A) / i`.
Matrices (m x n, `k = min(m, n)`): `c = int(k * common_space_fraction)`, `c = k - round((k - c)
/ T) * T` (Python's round), `d = int((k - c) / T)`; `U S V^T = svd(sum_i D_i)`, the common
space `U[:, :c]`, `S[:c]`, `V^T[:c]`; per task `R_i = D_i - U_c U_c^T D_i`, its top `d`
singular triplets in columns/rows `[i d, (i+1) d)`, the common space after them at `[T d, T d +
c)`; both factor matrices orthogonalised as in tsv_m (`P Q` of their SVDs), every singular value
replaced by their mean: `A = multi_dot(U', diag(mean(s) * ones), V'^T)`; `M = W0 +
scaling_factor * A`. Whole tensor, torch float32. When `c < 0` (`k < T` and a small fraction),
the slices are Python's and drop the last tasks' directions and the common space, as
FusionBench's do. `U_c U_c^T D_i` is computed left to right as FusionBench does, except for
matrices with more than 8 times as many rows as columns (embeddings, LM heads), where FusionBench
would build an m x m matrix (92 GB for a 152k-token vocabulary): there `U_c (U_c^T D_i)`, the
same projection rounded differently.
""" + REFERENCE.format(mem=22, cls="ISO_CTS_Merge", cfg="isotropic_merging/iso_cts")


def _deltas(u: Unit, weights: Sequence[float] | None = None) -> Iterator[Any]:
    """The task vectors ``W_i - W0`` (torch tensors), each scaled by its weight unless 1, made
    one at a time (a consumer that drops each keeps one delta alive, not T)."""
    assert u.base is not None
    for k, x in enumerate(u.inputs):
        d = x - u.base
        yield d if weights is None or weights[k] == 1 else weights[k] * d


def _running_mean(deltas: Iterable[Any]) -> Any:
    """FusionBench's mean of the non-matrix tensors: ``m += (d_i - m) / (i + 1)``."""
    mean = None
    for i, d in enumerate(deltas):
        if mean is None:
            mean = d.clone()
        else:
            mean += (d - mean) / (i + 1)
    return mean


def _whiten(torch: Any, a: Any) -> Any:
    """``P Q`` for ``P S Q = svd(a)``: the nearest matrix with orthonormal columns (or rows)."""
    p, _, q = torch.linalg.svd(a, full_matrices=False)
    return p, q


def _tsv_m(u: Unit) -> Any:
    torch = require_torch("tsv_m")
    u = u.torch()
    deltas = _deltas(u, u.per_input("weight"))
    if len(u.shape) != 2:
        merged = _running_mean(deltas)
    else:
        share = 1 / len(u.inputs)
        for i, d in enumerate(deltas):
            left, s, right = torch.linalg.svd(d, full_matrices=False)
            if i == 0:
                sum_u, sum_s, sum_v = (torch.zeros_like(left), torch.zeros_like(s),
                                       torch.zeros_like(right))
            r = int(s.shape[0] * share)
            sum_u[:, i * r:(i + 1) * r] = left[:, :r]
            sum_s[i * r:(i + 1) * r] = s[:r]
            sum_v[i * r:(i + 1) * r, :] = right[:r, :]
            del d, left, s, right  # before the next task's SVD
        pu, qu = _whiten(torch, sum_u)
        pv, qv = _whiten(torch, sum_v)
        merged = torch.linalg.multi_dot((pu, qu, torch.diag(sum_s), pv, qv))
    alpha = u.params["alpha"]
    return alpha * merged + u.base


def _iso_c(u: Unit) -> Any:
    torch = require_torch("iso_c")
    u = u.torch()
    n = len(u.inputs)
    merged = sum(_deltas(u)) / n
    if len(u.shape) == 2:
        merged *= n
        left, s, right = torch.linalg.svd(merged, full_matrices=False)
        flat = torch.ones_like(s) * s.mean()
        merged = torch.linalg.multi_dot((left, torch.diag(flat), right))
    return u.base + u.params["scaling_factor"] * merged


def _iso_cts(u: Unit) -> Any:
    torch = require_torch("iso_cts")
    u = u.torch()
    n = len(u.inputs)
    if len(u.shape) != 2:
        return u.base + u.params["scaling_factor"] * _running_mean(_deltas(u))
    k = min(u.shape)
    common = int(k * u.params["common_space_fraction"])
    common = k - round((k - common) / n) * n
    # common < 0 (k < T with a small fraction): the slices below then drop the last tasks'
    # directions and the common space, as FusionBench's (torch broadcasts them into empty ones)
    left, s, right = torch.linalg.svd(sum(_deltas(u)), full_matrices=False)
    cu, cs, cv = left[:, :common], s[:common], right[:common, :]
    per_task = int((k - common) / n)
    # FusionBench's projection (cu @ cu.T) @ d builds a rows x rows matrix: 92 GB for a 152k-token
    # embedding. Beyond TALL_RATIO rows per column it is computed as cu @ (cu.T @ d) instead:
    # the same projection, rounded differently (FusionBench's bytes only up to that ratio)
    tall = u.shape[0] > TALL_RATIO * u.shape[1]
    for i, d in enumerate(_deltas(u)):  # made again: one delta alive at a time
        inside = cu @ (cu.T @ d) if tall else cu @ cu.T @ d
        tl, ts, tr = torch.linalg.svd(d - inside, full_matrices=False)
        if i == 0:
            all_u, all_s, all_v = (torch.zeros_like(tl), torch.zeros_like(ts),
                                   torch.zeros_like(tr))
        all_u[:, i * per_task:(i + 1) * per_task] = tl[:, :per_task]
        all_s[i * per_task:(i + 1) * per_task] = ts[:per_task]
        all_v[i * per_task:(i + 1) * per_task, :] = tr[:per_task, :]
        del d, tl, ts, tr  # before the next task's SVD
    at = n * per_task
    all_u[:, at:at + common] = cu
    all_s[at:at + common] = cs
    all_v[at:at + common, :] = cv
    pu, qu = _whiten(torch, all_u)
    pv, qv = _whiten(torch, all_v)
    flat = torch.ones_like(all_s) * all_s.mean()
    merged = torch.linalg.multi_dot((pu @ qu, torch.diag(flat), pv @ qv))
    return u.base + u.params["scaling_factor"] * merged


def _tsv_coefficients(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    return [float(g["alpha"]) * float(p["weight"]) for p in per]


def _scaled(g: Mapping[str, Any], per: Sequence[Mapping[str, Any]]) -> list[float]:
    return [float(g["scaling_factor"])] * len(per)


def _caps() -> Capabilities:
    # all-zero deltas: every singular value is 0, so the merged delta is 0 (of either sign)
    return Capabilities(base=BasePolicy.REQUIRED, min_inputs=1, max_inputs=None,
                        zero_delta_is_base=True)


SCALING = ParamDef("scaling_factor", "float", Scope.GLOBAL, 1.0,
                   doc="scale of the merged delta (FusionBench's config default)")

#: each method's temporaries beyond its inputs, bytes per element ``(a, b)`` for ``a + b * k``
#: (the memory cap's formula, :mod:`.needs`): peaks measured on a 1024 x 1024 matrix with 4
#: models (about 11, 10 and 22 float32 matrices; one torch SVD alone is 6.5), rounded up
TSV_M_WORKSPACE = (32, 4)
ISO_C_WORKSPACE = (40, 2)
ISO_CTS_WORKSPACE = (104, 6)  # + the rows x rows projector, up to TALL_RATIO matrices
#: iso_cts projects matrices with more rows than this many times their columns without the
#: rows x rows projector (see :func:`_iso_cts`)
TALL_RATIO = 8

METHODS = (
    Method(
        name="tsv_m", family="subspace",
        params=(ParamDef("alpha", "float", Scope.GLOBAL, 1.0,
                         doc="scale of the merged delta (FusionBench's scalar alpha)"),
                ParamDef("weight", "float", Scope.NON_BASE, 1.0,
                         doc="scale of the model's delta before its SVD (FusionBench's "
                             "alpha list)")),
        caps=_caps(), merge=_tsv_m, coefficients=_tsv_coefficients,
        summary="top 1/T singular directions of each delta, whitened across tasks, summed",
        arithmetic=TSV_M, workspace=TSV_M_WORKSPACE),
    Method(
        name="iso_c", family="subspace", params=(SCALING,), caps=_caps(), merge=_iso_c,
        coefficients=_scaled, summary="the summed delta with its singular values flattened",
        arithmetic=ISO_C, workspace=ISO_C_WORKSPACE),
    Method(
        name="iso_cts", family="subspace",
        params=(SCALING, ParamDef("common_space_fraction", "float", Scope.GLOBAL, 0.8, 0.0, 1.0,
                                  doc="share of the rank given to the common subspace")),
        caps=_caps(), merge=_iso_cts, coefficients=_scaled,
        summary="isotropic merging in the common subspace and each model's own directions",
        arithmetic=ISO_CTS, workspace=ISO_CTS_WORKSPACE),
)
