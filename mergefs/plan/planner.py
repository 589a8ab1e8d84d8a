"""The planner: which (expert, block) deltas to read under a byte budget, and what that costs.

Ranks non-zero ``(i, b)`` by ``|c_i| * ||D_ib||`` per byte (descending; ties by tensor, block,
expert; ``c_i`` is the method's coefficient from the registry), takes them greedily while they fit, and skips ones that do not fit (a smaller one later
may). Zero-delta blocks cost nothing and are never read. Reports the budget, planned bytes, the
tight and loose bounds on ``||E||`` of design.md, the exact ``||E||`` and ``||sum c_i D_i||`` from
the index's Gram matrices (null when the index came from published sidecars, which hold no cross
terms), and a plan hash. Bounds exist for additive methods only (the registry says which); for
the others omitted blocks count as zero delta and the report says there is no bound. Pure and
deterministic; no I/O.

Two pairs of bounds. ``bound_tight`` / ``bound_loose`` bound the error of the merged
*values*, before output rounding (design.md): tight ``sqrt(sum_b t_b^2)``, loose ``sum_b t_b``
with ``t_b = sum_i |c_i| ||D_ib||`` over the omitted deltas; ``bound_relative_to_update`` is
``bound_tight / update_norm``. ``bound_output_tight`` / ``bound_output_loose`` bound the error
of the bytes written, ``||out(M_B) - out(M_full)||``, the budgeted and the full merge each
computed in float32 and rounded to the output dtype: each block with an omitted (or
reconstructed) delta adds to ``t_b`` a rounding term (:func:`rounding_terms`)

    rho_b = u_b (||M_B,b|| + ||M_full,b||) + (n + 2) 2^-24 (s_B,b + s_full,b + 2 w ||W0_b||)
            + 2 eta_b sqrt(n_b)

``u_b``: the output's unit roundoff (2^-24 for F32 and F64 outputs, else the dtype's, 2^-8 for
BF16, 2^-11 for F16, plus 2^-24 (1 + u) for the float32 result rounded again); the merged norms
are bounded from the index, ``||M_b|| <= a ||W0_b|| + s_b`` with ``s_b = sum_i |c_i| ||D_ib||``
over the deltas that merge adds (``a``: the base's weight in the merge, 1 for base-relative
methods, ``|sum c|`` over every input for linear); the second term bounds the float32 roundings of
the merge's own partial sums (``n`` inputs; ``w``: 0 for base-relative methods, whose partial
sums are of deltas, ``sum |c|`` for linear, whose are of weights). The third is the absolute
error of rounding to nearest where values are subnormal (``|fl(x) - x| <= u |x| + eta``, the
standard model with underflow): ``eta_b`` is half the output dtype's smallest subnormal
(:data:`OUT_ETA`: F16 2^-25, F8_E4M3 2^-10, F8_E5M2 2^-17, BF16 2^-134, F32 2^-150, F64 0)
plus ``(n + 3) 2^-150`` for the float32 roundings before it, ``n_b`` the block's element
count, and the 2 counts both merges. For float16 and float8 outputs this term is not
negligible: weights below 2^-14 (float16's smallest normal) round with an absolute error up to
2^-25, whatever their size. A block whose every non-zero delta is read exactly is computed
alike in both merges: no term. The blocks combine as the omitted deltas do: tight
``sqrt(sum_b (t_b + rho_b)^2)``, loose ``sum_b (t_b + rho_b)``. ``error_exact`` stays the
exact norm of the omitted deltas, before rounding; an index without base norms
(``BlockIndex.base_norms`` None) gives no output bounds (None). With a bfloat16 output the
rounding term is a worst case that usually dominates (bf16's 2^-8 is above a typical
fine-tune's relative delta): the output bounds then sit well above the update itself, which
is why sweeps and ``bound_relative_to_update`` use the bound before rounding.

**Exact or estimated.** ``error_exact`` and ``update_norm`` are ``sqrt(sum_b c_b^T G_b c_b)``
over the index's Gram matrices ``G_b``. Their diagonals (``||D_ib||^2``) are always exact; a
cross term ``<D_ib, D_jb>`` is exact where the index holds the pair (``mergefs index
--exact``), else estimated from the two experts' CountSketches (:mod:`mergefs.index.stats`,
``k`` buckets, one independent hash per block). Treating the seeded hash as random, the
estimated squared norm ``Q`` is unbiased and, per block, its deviation is the quadratic form
``sum_{p != q} M_pq s_p s_q [h_p = h_q]`` with ``M = sum over estimated (i, j), i != j, of
c_i c_j D_ib D_jb^T``, so ``Var(Q_b) <= (2/k) ||M||_F^2 <= (2/k) S_b^2`` with ``S_b = sum over
estimated ordered pairs i != j of |c_i| |c_j| ||D_ib|| ||D_jb||`` (computable from the exact
norms). Blocks are independent and a block of at most ``k`` elements is sketched whole (no
variance): ``sq_stderr = sqrt(sum over blocks of more than k elements of 2 S_b^2 / k)`` bounds
the standard deviation of ``Q``. The report's interval is Chebyshev's at 95%:
``Q +- sqrt(20) sq_stderr``, its square roots (the error's upper end capped by ``bound_tight``,
which holds always, as is the estimate itself). Where no estimated pair has two non-zero sides with non-zero
coefficients in an included block, ``S_b`` is 0 everywhere and the figure is exact, bit for
bit. The stored sketches are float32: their rounding (relative 2^-24 per bucket) is not in the
bar. Plans, bounds and the plan hash never depend on an estimate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from mergefs.core.errors import BudgetError
from mergefs.index.blocks import BlockIndex
from mergefs.methods.base import BasePolicy
from mergefs.spec.model import Spec
from mergefs.plan.bounds import combine
from mergefs.plan.bounds import bounds
from mergefs.plan.levels import DecodeCost, choose, decode_seconds

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Plan:
    """A plan: ``selected[i, b]`` is True when expert i's block b is read."""

    selected: np.ndarray  # (N, B) bool
    budget_bytes: int
    planned_bytes: int
    total_expert_bytes: int
    nonzero_expert_bytes: int
    blocks_read: int
    blocks_total: int
    blocks_zero: int
    bound_tight: float | None
    bound_loose: float | None
    error_exact: float | None
    update_norm: float | None
    plan_hash: str
    #: (N, B) int16: how many sidecar levels of each pair are read (0: none); None without
    #: delta sidecars (:mod:`mergefs.plan.levels`)
    levels: np.ndarray | None = None
    sidecar_bytes: int = 0  # included in planned_bytes
    #: per expert, its part of ``sidecar_bytes`` (None without delta sidecars)
    sidecar_bytes_by_expert: tuple[int, ...] | None = None
    #: bounds on the output bytes' error, output rounding included (None: not additive, or an
    #: index without base norms)
    bound_output_tight: float | None = None
    bound_output_loose: float | None = None
    #: delta sidecars on local disks: the modelled decode seconds of the reconstructed blocks
    #: and the modelled read seconds of the exact bytes they replace (one thread;
    #: :class:`mergefs.plan.levels.DecodeCost`), and the spec's ``decode_limit`` (None: none)
    decode_seconds: float | None = None
    replaced_read_seconds: float | None = None
    decode_limit: float | None = None
    #: bounds on the standard deviation of ``error_exact**2`` and ``update_norm**2`` where they
    #: are estimated from sketches (module docstring); None: the figure is exact
    error_sq_stderr: float | None = None
    update_sq_stderr: float | None = None

    def error_interval(self) -> tuple[float, float, float] | None:
        """(low, high, probability) for ``error_exact`` (an exact figure: itself, 1.0)."""
        return _interval(self.error_exact, self.error_sq_stderr, self.bound_tight)

    def update_interval(self) -> tuple[float, float, float] | None:
        """(low, high, probability) for ``update_norm`` (an exact figure: itself, 1.0)."""
        return _interval(self.update_norm, self.update_sq_stderr, None)

    def estimated(self) -> list[str]:
        """The report's figures that are estimates (from sketches), by key."""
        out = []
        if self.error_exact is not None and self.error_sq_stderr is not None:
            out.append("error_exact")
        if self.update_norm is not None and self.update_sq_stderr is not None:
            out.append("update_norm")
            if self.bound_tight and self.update_norm:  # a bound of 0 is 0 of any update
                out.append("bound_relative_to_update")
        return out

    @property
    def gap_allowance_bytes(self) -> int | None:
        """Gap bytes coalesced remote reads may fetch beyond the plan: the budget's slack,
        ``budget - planned`` (never negative), so that planned plus gap bytes fit the budget;
        None (no limit) with a full budget, which reads as the ``coalesce_gap`` alone says."""
        if self.budget_bytes >= self.total_expert_bytes:
            return None
        return max(0, self.budget_bytes - self.planned_bytes)

    def report(self) -> dict[str, Any]:
        """The JSON report of ``mergefs plan --json`` (keys documented in the README)."""
        rel: float | None = None
        if self.bound_tight is not None and self.update_norm:
            rel = self.bound_tight / self.update_norm
        out: dict[str, Any] = {
            "budget_bytes": self.budget_bytes,
            "planned_expert_bytes": self.planned_bytes,
            "total_expert_bytes": self.total_expert_bytes,
            "nonzero_expert_bytes": self.nonzero_expert_bytes,
            "blocks_read": self.blocks_read,
            "blocks_total": self.blocks_total,
            "blocks_zero": self.blocks_zero,
            "bound_tight": self.bound_tight,
            "bound_loose": self.bound_loose,
            "bound_output_tight": self.bound_output_tight,
            "bound_output_loose": self.bound_output_loose,
            "error_exact": self.error_exact,
            "update_norm": self.update_norm,
            "bound_relative_to_update": rel,
            "plan_hash": self.plan_hash,
            "estimated": self.estimated(),
            "error": _figure(self.error_exact, self.error_sq_stderr, self.error_interval()),
            "update": _figure(self.update_norm, self.update_sq_stderr, self.update_interval()),
        }
        if self.levels is not None:  # delta sidecars: what part of the reads they are
            out["sidecar_bytes"] = self.sidecar_bytes
            out["blocks_from_sidecar"] = int((self.levels > 0).sum())
            out["decode_seconds_model"] = self.decode_seconds
            out["replaced_read_seconds_model"] = self.replaced_read_seconds
            out["decode_limit"] = self.decode_limit
        return out


CONFIDENCE = 0.95  # of the intervals around estimated figures (Chebyshev)
_Z = float(np.sqrt(1.0 / (1.0 - CONFIDENCE)))


def _interval(value: float | None, sq_stderr: float | None, cap: float | None
              ) -> tuple[float, float, float] | None:
    if value is None:
        return None
    if sq_stderr is None:
        return value, value, 1.0
    sq = value * value  # >= the raw estimate where that was negative: the interval holds
    high = float(np.sqrt(sq + _Z * sq_stderr))
    if cap is not None:
        high = min(high, cap)
    return float(np.sqrt(max(0.0, sq - _Z * sq_stderr))), high, CONFIDENCE


def _figure(value: float | None, sq_stderr: float | None,
            interval: tuple[float, float, float] | None) -> dict[str, Any] | None:
    """A figure of the JSON report with whether it is exact and its error bar."""
    if value is None or interval is None:
        return None
    low, high, prob = interval
    return {"value": value, "exact": sq_stderr is None,
            "sq_stderr": 0.0 if sq_stderr is None else sq_stderr,
            "low": low, "high": high, "probability": prob}


def cross_sq_stderr(index: BlockIndex, coeffs: np.ndarray) -> float | None:
    """The bound on the standard deviation of ``||sum_i c_ib D_ib||^2`` computed from the
    index's Gram matrices (``coeffs`` (N, B), zero where a delta is left out), from the
    estimated cross terms (module docstring); None where no estimated term contributes (the
    figure is exact)."""
    if index.gram_exact is None or index.gram_exact.all():
        return None
    a = np.abs(coeffs) * index.norms
    s_b = np.einsum("ib,ij,jb->b", a, (~index.gram_exact).astype(np.float64), a)
    if not np.any(s_b > 0):
        return None
    k = index.sketch_buckets
    n_b = index.layout.elem_end - index.layout.elem_start
    return float(np.sqrt(np.sum(np.where(n_b > k, 2.0 * s_b * s_b / k, 0.0))))


def selected_runs(selected: np.ndarray) -> list[list[list[int]]]:
    """Per expert, the selected block indices as half-open runs ``[b0, b1)``."""
    out = []
    for row in selected:
        padded = np.concatenate([[False], row, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        out.append([[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])])
    return out


def selected_from_runs(runs: list[list[list[int]]], n_blocks: int) -> np.ndarray:
    sel = np.zeros((len(runs), n_blocks), dtype=bool)
    for i, expert_runs in enumerate(runs):
        for b0, b1 in expert_runs:
            sel[i, b0:b1] = True
    return sel


def plan_hash(spec: Spec, index: BlockIndex, selected: np.ndarray,
              levels: np.ndarray | None = None, sidecars: Any = None) -> str:
    extra: dict[str, Any] = {}
    if levels is not None:  # which levels of which (content-tied) sidecars are read
        extra = {"levels": xxhash.xxh3_128_hexdigest(np.ascontiguousarray(levels).tobytes()),
                 "sidecars": {str(i): xxhash.xxh3_128_hexdigest(
                     np.ascontiguousarray(sc.range_xxh3).tobytes())
                     for i, sc in sorted((sidecars or {}).items())}}
    blob = json.dumps(
        {
            **extra,
            "spec": {k: v for k, v in spec.raw.items() if k != "budget"},
            "index": index.key,
            # what the blocks hold, not only the files' identities: a source rewritten with its
            # identity kept gets a new plan hash once re-indexed, so no persistent cache entry
            # merged from its old bytes is ever served beside units merged from the new ones
            "content": _content_digest(index),
            "selected": selected_runs(selected),
        },
        sort_keys=True,
    ).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def _content_digest(index: BlockIndex) -> str:
    h = xxhash.xxh3_128()
    h.update(np.ascontiguousarray(index.base_hash, dtype="<u8").tobytes())
    h.update(np.ascontiguousarray(index.expert_hash, dtype="<u8").tobytes())
    return h.hexdigest()


F32_UNIT = 2.0 ** -24  # float32's unit roundoff (round to nearest)
#: unit roundoff of each output dtype (F64: the float32 result converts exactly)
OUT_UNIT = {"F32": F32_UNIT, "F64": F32_UNIT, "BF16": 2.0 ** -8, "F16": 2.0 ** -11,
            "F8_E4M3": 2.0 ** -4, "F8_E5M2": 2.0 ** -3}
F32_ETA = 2.0 ** -150  # half float32's smallest subnormal: round to nearest's absolute error
#: half the smallest subnormal of each output dtype (F64: the float32 result converts exactly)
OUT_ETA = {"F32": F32_ETA, "F64": 0.0, "BF16": 2.0 ** -134, "F16": 2.0 ** -25,
           "F8_E4M3": 2.0 ** -10, "F8_E5M2": 2.0 ** -17}
#: without an output dtype each tensor keeps its own; the layout knows its item size only
_BY_ITEMSIZE = {8: "F64", 4: "F32", 2: "BF16", 1: "F8_E5M2"}  # the coarser dtype of a size


def _out_dtypes(spec: Spec, index: BlockIndex) -> list[str]:
    """The output dtype of each tensor of the layout."""
    lay = index.layout
    return [spec.out_dtype or _BY_ITEMSIZE.get(lay.itemsize[t], "F8_E5M2")
            for t in range(len(lay.tensors))]


def output_units(spec: Spec, index: BlockIndex) -> np.ndarray:
    """(B,) the unit roundoff of each block's output, the float32 result rounded again
    included where the output is not float32 or float64."""
    lay = index.layout
    names = _out_dtypes(spec, index)
    u = np.asarray([OUT_UNIT.get(d, OUT_UNIT["F8_E5M2"]) for d in names], dtype=np.float64)
    u = np.where(u > F32_UNIT, u + F32_UNIT * (1 + u), u)
    return u[lay.tensor_of] if lay.n_blocks else np.zeros(0)


def output_etas(spec: Spec, index: BlockIndex, n_in: int) -> np.ndarray:
    """(B,) ``eta_b`` of the module docstring: the absolute rounding error of one output
    element where it is subnormal, the float32 roundings before it included."""
    lay = index.layout
    eta = np.asarray([OUT_ETA.get(d, OUT_ETA["F8_E4M3"]) for d in _out_dtypes(spec, index)],
                     dtype=np.float64) + (n_in + 3) * F32_ETA
    return eta[lay.tensor_of] if lay.n_blocks else np.zeros(0)


def rounding_terms(spec: Spec, index: BlockIndex, coeffs: np.ndarray, exact: np.ndarray,
                   approx: np.ndarray | None = None, resid: np.ndarray | None = None
                   ) -> np.ndarray | None:
    """(B,) the rounding term ``rho_b`` of the module docstring, or None without base norms.

    ``coeffs`` (N, B); ``exact`` (N, B): the non-zero deltas read exactly; ``approx`` (N, B):
    those reconstructed from sidecar levels, whose residual ``resid`` bounds ``||D_hat_ib||``
    by ``||D_ib|| + resid_ib``."""
    if index.base_norms is None:
        return None
    c = np.abs(coeffs)
    nonzero = ~index.zero
    s_full = (c * index.norms * nonzero).sum(axis=0)
    read = c * index.norms * exact
    if approx is not None:
        assert resid is not None
        read = read + c * (index.norms + resid) * approx
    s_b = read.sum(axis=0)
    a, w = _base_weight(spec, c)
    w0 = index.base_norms
    u = output_units(spec, index)
    n_in = max(len(spec.input_order), index.n_experts)
    rho = u * (2 * a * w0 + s_b + s_full) + (n_in + 2) * F32_UNIT * (s_b + s_full + 2 * w * w0)
    n_b = (index.layout.elem_end - index.layout.elem_start).astype(np.float64)
    rho = rho + 2 * output_etas(spec, index, n_in) * np.sqrt(n_b)  # subnormal outputs
    differs = (nonzero & ~exact).any(axis=0)  # else both merges compute the block alike
    return np.where(differs, rho, 0.0)


def _base_weight(spec: Spec, c: np.ndarray) -> tuple[Any, Any]:
    """(a, w) of :func:`rounding_terms`: the base's weight in the merge and the sum of the
    inputs' absolute weights (linear); ``c`` (N, B) the experts' absolute coefficients."""
    if spec.method_def.caps.base is BasePolicy.REQUIRED:  # M = W0 + sum c_i D_i
        return 1.0, 0.0
    try:
        inputs = [float(x) for x in
                  spec.method_def.coefficients(spec.parameters, spec.input_parameters())]
    except (TypeError, ValueError):  # per-tensor weights (gradients): a bound on both
        per_block = c.sum(axis=0) + 1.0  # the base as an input of weight at most 1
        return per_block, per_block
    return abs(sum(inputs)), sum(abs(x) for x in inputs)


Bounds = tuple[float | None, float | None, float | None, float | None, float | None,
               float | None]  # tight, loose, exact, update, output tight, output loose


def _bounds(index: BlockIndex, coeffs: np.ndarray, omitted: np.ndarray,
            rounding: np.ndarray | None = None) -> Bounds:
    """(tight, loose, exact error, update norm, output tight, output loose) for an additive
    merge; ``coeffs`` (N, B); ``rounding`` (B,): the output-rounding term of each block
    (:func:`rounding_terms`; None: no output bounds)."""
    per_block = (np.abs(coeffs) * index.norms * omitted).sum(axis=0)  # (B,)
    tight, loose = combine(per_block)
    out_tight, out_loose = (None, None) if rounding is None else combine(per_block + rounding)
    c_om = coeffs * omitted  # (N, B): c_ib where omitted, else 0
    err_sq = np.einsum("ib,bij,jb->", c_om, index.gram, c_om)
    upd_sq = np.einsum("ib,bij,jb->", coeffs, index.gram, coeffs)
    return (tight, loose, float(np.sqrt(max(err_sq, 0.0))), float(np.sqrt(max(upd_sq, 0.0))),
            out_tight, out_loose)


def make_plan(spec: Spec, index: BlockIndex, budget_bytes: int | None = None,
              coefficients: np.ndarray | None = None, sidecars: Any = None) -> Plan:
    """Plan the reads for ``spec`` (its budget, unless ``budget_bytes`` is given).

    ``coefficients``: (N, T) each expert's coefficient per tensor of the layout (gradients and
    filters resolve per tensor: mergefs.recipe.outputs); default the spec's one per expert.
    ``sidecars`` ({expert: :class:`mergefs.deltas.sidecar.DeltaSidecar`}): plan with their levels
    (:func:`_plan_with_levels`) unless the budget reads every non-zero block exactly; with
    per-tensor coefficients (gradients) levels are not planned yet: exact blocks only.
    """
    lay = index.layout
    n, nb = index.norms.shape
    block_bytes = index.expert_block_bytes()  # (N, B): experts' dtypes may differ
    total = int(block_bytes.sum())
    if budget_bytes is None:
        budget_bytes = spec.budget.resolve(total)
    if budget_bytes < 0:
        raise BudgetError(f"budget must not be negative, got {budget_bytes} bytes")
    nonzero = ~index.zero
    nonzero_bytes = int((block_bytes * nonzero).sum())
    if coefficients is None:
        per_tensor = np.repeat(np.asarray(spec.expert_coefficients(), dtype=np.float64)
                               .reshape(n, 1), len(lay.tensors), axis=1)
    else:
        per_tensor = np.asarray(coefficients, dtype=np.float64).reshape(n, len(lay.tensors))
    coeffs = per_tensor[:, lay.tensor_of]  # (N, B)
    selected = np.zeros((n, nb), dtype=bool)
    per_expert = per_tensor[:, 0] if per_tensor.shape[1] else np.zeros(n)
    uniform = bool(np.all(per_tensor == per_expert[:, None]))
    if sidecars and budget_bytes < nonzero_bytes and not uniform:
        log.warning("delta sidecars are not used with per-tensor coefficients (gradients or "
                    "filters) yet: planning exact blocks only")
    if budget_bytes >= nonzero_bytes:
        selected[:] = nonzero
    elif sidecars and uniform:
        return _plan_with_levels(spec, index, int(budget_bytes), per_expert, sidecars, total,
                                 nonzero_bytes)
    else:
        score = np.abs(coeffs) * index.norms / np.maximum(block_bytes, 1)
        ii, bb = np.nonzero(nonzero)
        # lexsort: last key is primary. Descending score, then tensor, block, expert ascending.
        order = np.lexsort((ii, bb, lay.tensor_of[bb], -score[ii, bb]))
        costs = block_bytes[ii[order], bb[order]]
        cum = np.cumsum(costs)
        fits = int(np.searchsorted(cum, budget_bytes, side="right"))
        take = list(order[:fits])
        used = int(cum[fits - 1]) if fits else 0
        for k in order[fits:]:  # fill the remainder with later blocks that still fit
            c = int(block_bytes[ii[k], bb[k]])
            if used + c <= budget_bytes:
                take.append(k)
                used += c
        selected[ii[take], bb[take]] = True
    planned = int((block_bytes * selected).sum())
    assert planned <= max(budget_bytes, 0) or budget_bytes >= nonzero_bytes
    got: Bounds = (None,) * 6  # type: ignore[assignment]
    if spec.is_additive:
        got = _bounds(index, coeffs, nonzero & ~selected,
                      rounding_terms(spec, index, coeffs, nonzero & selected))
        if not index.has_gram:  # statistics from sidecars: no cross terms, so no exact norms
            got = (got[0], got[1], None, None, got[4], got[5])
    stderr = {}
    if got[2] is not None:
        stderr = {"error_sq_stderr": cross_sq_stderr(index, coeffs * (nonzero & ~selected)),
                  "update_sq_stderr": cross_sq_stderr(index, coeffs)}
        if stderr["error_sq_stderr"] is not None and got[0] is not None:
            got = (got[0], got[1], min(got[2], got[0]), *got[3:])  # ||E|| <= tight, always
    return _assemble(index, selected, int(budget_bytes), planned, total, nonzero_bytes,
                     got, plan_hash(spec, index, selected), **stderr)


def _assemble(index: BlockIndex, selected: np.ndarray, budget_bytes: int, planned: int,
              total: int, nonzero_bytes: int,
              bounds6: Bounds, digest: str, **levels: Any) -> Plan:
    """The Plan of a selection: its block counts, bounds and hash (``levels``: sidecar fields)."""
    tight, loose, exact, update, out_tight, out_loose = bounds6
    return Plan(
        selected=selected,
        budget_bytes=budget_bytes,
        planned_bytes=planned,
        total_expert_bytes=total,
        nonzero_expert_bytes=nonzero_bytes,
        blocks_read=int(selected.sum()),
        blocks_total=int(selected.size),
        blocks_zero=int(index.zero.sum()),
        bound_tight=tight,
        bound_loose=loose,
        error_exact=exact,
        update_norm=update,
        plan_hash=digest,
        bound_output_tight=out_tight,
        bound_output_loose=out_loose,
        **levels,
    )


def _plan_with_levels(spec: Spec, index: BlockIndex, budget_bytes: int, coeffs: np.ndarray,
                      sidecars: Any, total: int, nonzero_bytes: int) -> Plan:
    """A plan mixing skip / sidecar levels / exact per pair (:mod:`mergefs.plan.levels`)."""

    limit = getattr(spec, "decode_limit", None)
    got = choose(index, coeffs, budget_bytes, sidecars,
                 DecodeCost(ratio=limit) if limit is not None else None)
    dec, read = decode_seconds(index, got.levels, sidecars, DecodeCost())
    planned = got.exact_bytes + got.sidecar_bytes
    assert planned <= budget_bytes
    tight = loose = exact = update = out_tight = out_loose = None
    stderr: dict[str, float | None] = {}
    if spec.is_additive:
        per_block = np.repeat(coeffs[:, None], index.norms.shape[1], axis=1)
        approx = (got.levels > 0) & ~index.zero
        tight, loose, out_tight, out_loose = bounds(coeffs, got.resid, rounding_terms(
            spec, index, per_block, ~index.zero & got.selected, approx, got.resid))
        if index.has_gram:
            upd_sq = np.einsum("i,bij,j->", coeffs, index.gram, coeffs)
            update = float(np.sqrt(max(upd_sq, 0.0)))
            stderr["update_sq_stderr"] = cross_sq_stderr(index, per_block)
            if not got.levels.any():  # no reconstructed block: the Gram gives the exact error
                omitted = ~index.zero & ~got.selected
                exact = _bounds(index, per_block, omitted)[2]
                stderr["error_sq_stderr"] = cross_sq_stderr(index, per_block * omitted)
                if stderr["error_sq_stderr"] is not None and tight is not None:
                    exact = min(exact, tight)  # ||E|| <= tight, always
    return _assemble(index, got.selected, budget_bytes, planned, total, nonzero_bytes,
                     (tight, loose, exact, update, out_tight, out_loose),
                     plan_hash(spec, index, got.selected, got.levels, sidecars),
                     levels=got.levels, sidecar_bytes=got.sidecar_bytes,
                     sidecar_bytes_by_expert=got.sidecar_bytes_by_expert,
                     decode_seconds=dec, replaced_read_seconds=read, decode_limit=limit,
                     **stderr)
