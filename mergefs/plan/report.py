"""What budgets buy, from the index alone: ``mergefs sweep SPEC --budgets 1%,10%,full``.

For every combination of budget, method and coefficient setting (``--grid KEY=V1,V2``), the plan
is made from the stored block index (no expert bytes are read once the index exists) and
reported: expert bytes read, the tight bound on ``||E||`` (before output rounding; the output
bytes' bound as ``bound_output_tight``), the exact ``||E||`` and the update
norm where the index has Gram matrices, and the share of the update's energy kept
(``1 - ||E||^2 / ||U||^2``). Non-additive methods report bytes only (no bound). Pure planning;
runs in the CLI's main thread.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mergefs.core.errors import MergefsError, SpecError
from mergefs.spec.model import Spec
from mergefs.spec.budget import parse_budget
from mergefs.spec.load import parse_spec
from mergefs.spec.variants import set_key, short_key
from mergefs.core.progress import byte_progress
from mergefs.index.blocks import load_or_build
from mergefs.plan.planner import make_plan
from mergefs.recipe.family import open_family
from mergefs.recipe.family import recipe_of
from mergefs.spec.variants import is_sweep
from mergefs.spec.variants import parse_variants


@dataclass(frozen=True)
class SweepRow:
    """One variant's plan figures (floats are None where the method or index has none)."""

    variant: str  # "method=..., lambda=..." (the grid values that differ from the spec)
    method: str
    budget: str
    budget_bytes: int
    planned_bytes: int
    total_expert_bytes: int
    bound_tight: float | None
    error_exact: float | None
    update_norm: float | None
    energy_kept: float | None  # 1 - (error/update)^2, from the index's Gram matrices
    bound_share: float | None  # bound_tight / update_norm (before output rounding)
    bound_output_tight: float | None = None  # of the output bytes (mergefs.plan.planner)
    #: which of error_exact, update_norm and bound_relative_to_update (bound_share) are
    #: estimated from the index's sketches (Plan.estimated); the norms' intervals
    #: (mergefs.plan.planner), each with probability >= 95%
    estimated: tuple[str, ...] = ()
    error_interval: tuple[float, float] | None = None
    update_interval: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def error_estimated(self) -> bool:
        """error / update (and the energy kept) is an estimate: the error is, or the update
        is and the error is not exactly 0."""
        return "error_exact" in self.estimated or (
            "update_norm" in self.estimated and self.error_exact != 0.0)

    def ranges(self) -> dict[str, tuple[float | None, float | None]]:
        """Intervals of the ratios (error / update, energy kept, bound / update) from those of
        the two norms: both hold with probability >= 90% (a union bound)."""
        out: dict[str, tuple[float | None, float | None]] = {
            "error": (None, None), "kept": (None, None), "share": (None, None)}
        if self.update_interval is None:
            return out
        u_lo, u_hi = self.update_interval
        if self.bound_tight is not None and u_lo > 0 and u_hi > 0:
            out["share"] = (self.bound_tight / u_hi, self.bound_tight / u_lo)
        if self.error_interval is not None and u_lo > 0 and u_hi > 0:
            e_lo, e_hi = self.error_interval
            out["error"] = (e_lo / u_hi, e_hi / u_lo)
            out["kept"] = (max(0.0, 1 - (e_hi / u_lo) ** 2), max(0.0, 1 - (e_lo / u_hi) ** 2))
        return out


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``["parameters.lambda=0.5,1", "models.0.parameters.weight=0.2,0.4"]`` -> key, values."""
    out: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise MergefsError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. "
                               "parameters.lambda=0.5,1.0 or models.0.parameters.weight=0.2,0.4)")
        out.append((key.strip(), [yaml.safe_load(v) for v in values.split(",")]))
    return out


def _row(spec: Spec, index: Any, budget: str, variant: str, coefficients: Any) -> SweepRow:

    b = parse_budget(budget)
    total = int(index.expert_block_bytes().sum())
    plan = make_plan(spec.with_budget(b), index, b.resolve(total), coefficients=coefficients)
    kept = share = None
    if plan.error_exact is not None and plan.update_norm:
        kept = max(0.0, 1.0 - (plan.error_exact / plan.update_norm) ** 2)
    if plan.bound_tight is not None and plan.update_norm:
        share = plan.bound_tight / plan.update_norm
    ei, ui = plan.error_interval(), plan.update_interval()
    return SweepRow(variant, spec.method, b.describe(), plan.budget_bytes, plan.planned_bytes,
                    plan.total_expert_bytes, plan.bound_tight, plan.error_exact,
                    plan.update_norm, kept, share, plan.bound_output_tight,
                    tuple(plan.estimated()), None if ei is None else ei[:2],
                    None if ui is None else ui[:2])


DEFAULT_BUDGETS = ("1%", "2%", "5%", "10%", "20%", "50%", "full")


def run_sweep(spec_path: str | Path, budgets: Sequence[str] | None, methods: Sequence[str] = (),
              grid: Sequence[tuple[str, list[Any]]] = (), strict: bool = False,
              progress: bool = True) -> list[SweepRow]:
    """Plan every (method, grid point, budget); the index is built once if missing.

    A sweep spec (``sweep:``/``variants:``, :mod:`mergefs.spec.variants`) without ``methods`` or
    ``grid`` plans each of its variants, at ``budgets`` or, when None, at its own budget.
    ``budgets`` None elsewhere: :data:`DEFAULT_BUDGETS`."""

    path = Path(spec_path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read spec: {exc}") from None
    base_dir = path.resolve().parent
    first = parse_spec(copy.deepcopy(doc), base_dir, str(path), strict=strict)
    base, experts = open_family(first)
    try:
        with byte_progress("indexing", enabled=progress) as tick:  # total: what it will read
            index, _ = load_or_build(base, experts, first.block_size, first.index_dir, tick,
                                     on_total=tick.set_total)
        if is_sweep(doc) and not methods and not grid:
            return _variant_rows(doc, base_dir, path, base, index, budgets, strict)
        return _sweep_rows(doc, base_dir, path, first, base, index,
                           DEFAULT_BUDGETS if budgets is None else budgets, methods, grid, strict)
    finally:
        for c in [base, *experts]:
            c.close()


def _sweep_rows(doc: Any, base_dir: Path, path: Path, first: Spec, base: Any, index: Any,
                budgets: Sequence[str], methods: Sequence[str],
                grid: Sequence[tuple[str, list[Any]]], strict: bool) -> list[SweepRow]:

    rows: list[SweepRow] = []
    keys = [k for k, _ in grid]
    for method in methods or [first.method]:
        for point in itertools.product(*(vals for _, vals in grid)) if grid else [()]:
            variant_doc = copy.deepcopy(doc)
            variant_doc["merge_method"] = method
            for key, value in zip(keys, point):
                set_key(variant_doc, key, value, str(path))
            label = " ".join([method] * bool(methods) +
                             [f"{short_key(k)}={v}" for k, v in zip(keys, point)]) or "spec"
            spec = parse_spec(variant_doc, base_dir, f"{path} ({label})", strict=strict)
            if spec.block_size != first.block_size or [e.path for e in spec.experts] != \
                    [e.path for e in first.experts]:
                raise MergefsError(f"--grid: {label} changes the experts or block size; a sweep "
                                   "varies coefficients, methods and budgets over one index")
            # per-tensor coefficients (gradients, filters), as `mergefs plan` uses them
            coeffs = recipe_of(spec, base).coefficients(spec, index.layout.tensors)
            rows.extend(_row(spec, index, b, label, coeffs) for b in budgets)
    return rows


def _variant_rows(doc: Any, base_dir: Path, path: Path, base: Any, index: Any,
                  budgets: Sequence[str] | None, strict: bool) -> list[SweepRow]:
    """A sweep spec's variants, each named as its directory in a sweep mount."""

    rows: list[SweepRow] = []
    for v, spec in parse_variants(doc, base_dir, str(path), strict):
        coeffs = recipe_of(spec, base).coefficients(spec, index.layout.tensors)
        for b in [spec.budget.to_spec()] if budgets is None else budgets:
            rows.append(_row(spec, index, b, v.name, coeffs))
    return rows


def plot(rows: Sequence[SweepRow], out: str | Path) -> None:
    """Energy kept and bound (as a share of the update) against expert bytes read, one line per
    variant; a PNG at ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MergefsError("--plot needs matplotlib: pip install 'mergefs[plot]' "
                           "(or pip install matplotlib)") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in dict.fromkeys(r.variant for r in rows):
        rs = sorted((r for r in rows if r.variant == variant), key=lambda r: r.planned_bytes)
        x = [100 * r.planned_bytes / r.total_expert_bytes if r.total_expert_bytes else 0
             for r in rs]
        if any(r.energy_kept is not None for r in rs):
            ax1.plot(x, [100 * r.energy_kept if r.energy_kept is not None else math.nan
                         for r in rs], marker="o", label=variant)
        if any(r.bound_share is not None for r in rs):
            ax2.plot(x, [100 * r.bound_share if r.bound_share is not None else math.nan
                         for r in rs], marker="o", label=variant)
    ax1.set(xlabel="expert bytes read (% of all)", ylabel="update energy kept (%)",
            title="measured, from the index")
    ax2.set(xlabel="expert bytes read (% of all)", ylabel="error bound (% of update norm)",
            title="guaranteed bound (additive methods)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
