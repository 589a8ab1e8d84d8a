"""The planner: which (expert, block) deltas to read under a byte budget, and what that costs.

Ranks non-zero ``(i, b)`` by ``|c_i| * ||D_ib||`` per byte (descending; ties by tensor, block,
expert; ``c_i`` is the method's coefficient from the registry), takes them greedily while they fit, and skips ones that do not fit (a smaller one later
may). Zero-delta blocks cost nothing and are never read. Reports the budget, planned bytes, the
tight and loose bounds on ``||E||`` of design.md, the exact ``||E||`` and ``||sum c_i D_i||`` from
the index's Gram matrices (null when the index came from published sidecars, which hold no cross
terms), and a plan hash. Bounds exist for additive methods only (the registry says which); for
the others omitted blocks count as zero delta and the report says there is no bound. Pure and
deterministic; no I/O.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .errors import BudgetError
from .index import BlockIndex
from .spec import Spec


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
    #: delta sidecars (:mod:`mergefs.levelplan`)
    levels: np.ndarray | None = None
    sidecar_bytes: int = 0  # included in planned_bytes

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
            "error_exact": self.error_exact,
            "update_norm": self.update_norm,
            "bound_relative_to_update": rel,
            "plan_hash": self.plan_hash,
        }
        if self.levels is not None:  # delta sidecars: what part of the reads they are
            out["sidecar_bytes"] = self.sidecar_bytes
            out["blocks_from_sidecar"] = int((self.levels > 0).sum())
        return out


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


def _bounds(index: BlockIndex, coeffs: np.ndarray, omitted: np.ndarray) -> tuple[float, float,
                                                                               float, float]:
    """(tight, loose, exact error, update norm) for an additive merge; ``coeffs`` (N, B)."""
    per_pair = np.abs(coeffs) * index.norms * omitted  # (N, B)
    loose = float(per_pair.sum())
    tight = float(np.sqrt((per_pair.sum(axis=0) ** 2).sum()))
    c_om = coeffs * omitted  # (N, B): c_ib where omitted, else 0
    err_sq = np.einsum("ib,bij,jb->", c_om, index.gram, c_om)
    upd_sq = np.einsum("ib,bij,jb->", coeffs, index.gram, coeffs)
    return tight, loose, float(np.sqrt(max(err_sq, 0.0))), float(np.sqrt(max(upd_sq, 0.0)))


def make_plan(spec: Spec, index: BlockIndex, budget_bytes: int | None = None,
              coefficients: np.ndarray | None = None, sidecars: Any = None) -> Plan:
    """Plan the reads for ``spec`` (its budget, unless ``budget_bytes`` is given).

    ``coefficients``: (N, T) each expert's coefficient per tensor of the layout (gradients and
    filters resolve per tensor: mergefs.recipe); default the spec's one per expert.
    ``sidecars`` ({expert: :class:`mergefs.deltas.DeltaSidecar`}): plan with their levels
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
    tight = loose = exact = update = None
    if spec.is_additive:
        tight, loose, exact, update = _bounds(index, coeffs, nonzero & ~selected)
        if not index.has_gram:  # statistics from sidecars: no cross terms, so no exact norms
            exact = update = None
    return _assemble(index, selected, int(budget_bytes), planned, total, nonzero_bytes,
                     (tight, loose, exact, update), plan_hash(spec, index, selected))


def _assemble(index: BlockIndex, selected: np.ndarray, budget_bytes: int, planned: int,
              total: int, nonzero_bytes: int,
              bounds4: tuple[float | None, float | None, float | None, float | None],
              digest: str, **levels: Any) -> Plan:
    """The Plan of a selection: its block counts, bounds and hash (``levels``: sidecar fields)."""
    tight, loose, exact, update = bounds4
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
        **levels,
    )


def _plan_with_levels(spec: Spec, index: BlockIndex, budget_bytes: int, coeffs: np.ndarray,
                      sidecars: Any, total: int, nonzero_bytes: int) -> Plan:
    """A plan mixing skip / sidecar levels / exact per pair (:mod:`mergefs.levelplan`)."""
    from .levelplan import bounds, choose

    got = choose(index, coeffs, budget_bytes, sidecars)
    planned = got.exact_bytes + got.sidecar_bytes
    assert planned <= budget_bytes
    tight = loose = exact = update = None
    if spec.is_additive:
        tight, loose = bounds(coeffs, got.resid)
        if index.has_gram:
            upd_sq = np.einsum("i,bij,j->", coeffs, index.gram, coeffs)
            update = float(np.sqrt(max(upd_sq, 0.0)))
            if not got.levels.any():  # no reconstructed block: the Gram gives the exact error
                per_block = np.repeat(coeffs[:, None], index.norms.shape[1], axis=1)
                exact = _bounds(index, per_block, ~index.zero & ~got.selected)[2]
    return _assemble(index, got.selected, budget_bytes, planned, total, nonzero_bytes,
                     (tight, loose, exact, update),
                     plan_hash(spec, index, got.selected, got.levels, sidecars),
                     levels=got.levels, sidecar_bytes=got.sidecar_bytes)
