"""The planner: deterministic, budget-sound, greedy by |c_i| ||D_ib|| per byte, zero blocks free."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from families import Family, make_family, write_spec
from reference import read_tensor, tensor_dtype, tensor_names

from mergefs import cli
from mergefs.engine.session import Session
from mergefs.core.errors import BudgetError
from mergefs.index.blocks import BlockIndex
from mergefs.index.layout import BlockLayout
from mergefs.plan.planner import make_plan, selected_from_runs, selected_runs
from mergefs.spec.load import load_spec, parse_spec

README_KEYS = {
    "budget_bytes", "planned_expert_bytes", "total_expert_bytes", "nonzero_expert_bytes",
    "blocks_read", "blocks_total", "blocks_zero", "bound_tight", "bound_loose",
    "bound_output_tight", "bound_output_loose", "error_exact",
    "update_norm", "bound_relative_to_update", "plan_hash", "estimated", "error", "update",
}


# -- hand-built indexes -------------------------------------------------------------------------


def hand_spec(tmp_path: Path, weights: list[float], method: str = "task_arithmetic") -> Any:
    doc = {
        "merge_method": method,
        "base_model": "base",
        "models": [{"model": f"e{i}", "parameters": {"weight": w}}
                   for i, w in enumerate(weights)],
    }
    return parse_spec(doc, base_dir=tmp_path)


def hand_index(norms: list[list[float]], block_elems: list[int],
               cross: dict[int, float] | None = None) -> BlockIndex:
    """One float32 tensor whose blocks hold ``block_elems`` elements; experts' block norms
    ``norms[i][b]`` (0 means a zero-delta block); ``cross[b]`` is <D_0b, D_1b>."""
    nrm = np.asarray(norms, dtype=np.float64)
    n, nb = nrm.shape
    ends = np.cumsum(block_elems).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    layout = BlockLayout(400, ("t",), (4,), np.zeros(nb, np.int32), starts, ends,
                         np.array([0, nb], np.int64))
    gram = np.zeros((nb, n, n))
    for b in range(nb):
        gram[b] = np.diag(nrm[:, b] ** 2)
        for b2, g in (cross or {}).items():
            if b2 == b:
                gram[b, 0, 1] = gram[b, 1, 0] = g
    return BlockIndex("hand", layout, np.zeros(nb, np.uint64), np.zeros((n, nb), np.uint64),
                      nrm, nrm == 0, gram)


def plan_for(tmp_path: Path, weights: list[float], index: BlockIndex, budget: int,
             method: str = "task_arithmetic") -> Any:
    spec = hand_spec(tmp_path, weights, method)
    return make_plan(spec, index, budget)


def chosen(plan: Any) -> set[tuple[int, int]]:
    return {(int(i), int(b)) for i, b in zip(*np.nonzero(plan.selected))}


# c = [1, -0.5]; blocks of 100 bytes. Scores |c_i| ||D_ib|| / 100:
#   e0: b0 1, b1 4, b2 zero, b3 2        e1: b0 3, b1 0.5, b2 1.5, b3 zero
# so the ranking is (0,1) > (1,0) > (0,3) > (1,2) > (0,0) > (1,1).
NORMS = [[1.0, 4.0, 0.0, 2.0], [6.0, 1.0, 3.0, 0.0]]
RANKED = [(0, 1), (1, 0), (0, 3), (1, 2), (0, 0), (1, 1)]


@pytest.mark.parametrize("budget, n_taken", [(0, 0), (99, 0), (100, 1), (250, 2), (300, 3),
                                             (599, 5), (600, 6), (800, 6)])
def test_ranking_by_abs_coefficient_times_norm_per_byte(tmp_path: Path, budget: int,
                                                        n_taken: int) -> None:
    plan = plan_for(tmp_path, [1.0, -0.5], hand_index(NORMS, [25] * 4), budget)
    assert chosen(plan) == set(RANKED[:n_taken])
    assert plan.planned_bytes == 100 * n_taken <= budget
    assert plan.total_expert_bytes == 800
    assert plan.nonzero_expert_bytes == 600
    assert plan.blocks_zero == 2 and plan.blocks_total == 8 and plan.blocks_read == n_taken
    assert plan.budget_bytes == budget


def test_negative_coefficient_ranks_by_magnitude(tmp_path: Path) -> None:
    # flipping the sign of c_1 changes nothing; scaling it up moves its blocks ahead
    idx = hand_index(NORMS, [25] * 4)
    assert chosen(plan_for(tmp_path, [1.0, 0.5], idx, 300)) == \
        chosen(plan_for(tmp_path, [1.0, -0.5], idx, 300))
    assert chosen(plan_for(tmp_path, [1.0, -2.0], idx, 300)) == {(1, 0), (1, 2), (0, 1)}


def test_bounds_by_hand(tmp_path: Path) -> None:
    # budget 100: only (0,1) is read. Omitted |c| ||D||: b0: 1 (e0) + 3 (e1); b1: 0.5 (e1);
    # b2: 1.5 (e1); b3: 2 (e0). <D_0, D_1> on b0 is 3.
    idx = hand_index(NORMS, [25] * 4, cross={0: 3.0})
    plan = plan_for(tmp_path, [1.0, -0.5], idx, 100)
    assert chosen(plan) == {(0, 1)}
    assert plan.bound_loose == pytest.approx(1 + 3 + 0.5 + 1.5 + 2)
    assert plan.bound_tight == pytest.approx(math.sqrt(4**2 + 0.5**2 + 1.5**2 + 2**2))
    # exact: b0: 1 + 9 + 2 * (1)(-0.5)(3) = 7
    assert plan.error_exact == pytest.approx(math.sqrt(7 + 0.25 + 2.25 + 4))
    # update: b0 7, b1 16 + 0.25, b2 2.25, b3 4
    assert plan.update_norm == pytest.approx(math.sqrt(7 + 16.25 + 2.25 + 4))
    rep = plan.report()
    assert rep["bound_relative_to_update"] == pytest.approx(plan.bound_tight / plan.update_norm)
    full = plan_for(tmp_path, [1.0, -0.5], idx, 800)
    assert full.bound_tight == full.bound_loose == full.error_exact == 0.0


def test_per_byte_not_per_block(tmp_path: Path) -> None:
    # b0: 100 B, norm 2 (0.02/B); b1: 400 B, norm 6 (0.015/B): the small block goes first even
    # though the big one has the larger norm.
    idx = hand_index([[2.0, 6.0]], [25, 100])
    assert chosen(plan_for(tmp_path, [1.0], idx, 450)) == {(0, 0)}
    assert chosen(plan_for(tmp_path, [1.0], idx, 500)) == {(0, 0), (0, 1)}
    assert chosen(plan_for(tmp_path, [1.0], idx, 399)) == {(0, 0)}


def test_blocks_that_do_not_fit_are_skipped_for_smaller_ones(tmp_path: Path) -> None:
    # b0: 400 B, norm 10 (0.025/B, best); b1: 100 B norm 1 (0.01); b2: 100 B norm 1.2 (0.012)
    idx = hand_index([[10.0, 1.0, 1.2]], [100, 25, 25])
    plan = plan_for(tmp_path, [1.0], idx, 150)
    assert chosen(plan) == {(0, 2)}
    assert plan.planned_bytes == 100
    assert chosen(plan_for(tmp_path, [1.0], idx, 450)) == {(0, 0)}
    assert chosen(plan_for(tmp_path, [1.0], idx, 599)) == {(0, 0), (0, 2)}


def test_ties_broken_by_tensor_block_expert(tmp_path: Path) -> None:
    idx = hand_index([[1.0] * 4, [1.0] * 4], [25] * 4)
    assert chosen(plan_for(tmp_path, [1.0, 1.0], idx, 300)) == {(0, 0), (1, 0), (0, 1)}


def test_zero_blocks_cost_nothing(tmp_path: Path) -> None:
    idx = hand_index([[0.0, 0.0, 5.0], [0.0, 0.0, 0.0]], [25] * 3)
    plan = plan_for(tmp_path, [1.0, 1.0], idx, 100)
    assert chosen(plan) == {(0, 2)}
    assert plan.nonzero_expert_bytes == 100
    assert plan.error_exact == 0.0 and plan.bound_loose == 0.0
    none = plan_for(tmp_path, [1.0, 1.0], idx, 0)
    assert chosen(none) == set() and none.planned_bytes == 0
    assert none.error_exact == pytest.approx(5.0)


def test_non_additive_has_no_bound_and_slerp_takes_budgets(tmp_path: Path) -> None:
    idx = hand_index(NORMS, [25] * 4)
    spec = parse_spec({"merge_method": "ties", "base_model": "b",
                       "models": [{"model": "x", "parameters": {"weight": 1.0}},
                                  {"model": "y", "parameters": {"weight": 0.5}}]},
                      base_dir=tmp_path)
    plan = make_plan(spec, idx, 300)
    assert plan.bound_tight is plan.bound_loose is plan.error_exact is plan.update_norm is None
    assert plan.report()["bound_relative_to_update"] is None
    assert plan.planned_bytes <= 300
    slerp = parse_spec({"merge_method": "slerp", "base_model": "b", "models": [{"model": "x"}],
                        "parameters": {"t": 0.5}}, base_dir=tmp_path)
    one = hand_index([NORMS[0]], [25] * 4)
    partial = make_plan(slerp, one, 399)  # omitted blocks: the model's values are the base's
    assert partial.planned_bytes <= 399 and partial.bound_tight is None
    assert make_plan(slerp, one, 400).blocks_read == 3
    with pytest.raises(BudgetError):
        make_plan(spec, idx, -1)


def test_selected_runs_round_trip() -> None:
    rng = np.random.default_rng(0)
    sel = rng.random((3, 50)) < 0.4
    runs = selected_runs(sel)
    assert np.array_equal(selected_from_runs(runs, 50), sel)
    assert selected_runs(np.array([[True, True, False, True]])) == [[[0, 2], [3, 4]]]


# -- on a real family ---------------------------------------------------------------------------

EQUAL_SHAPES = {"a.weight": (64, 32), "b.weight": (32, 32), "c.weight": (128, 32)}


@pytest.fixture(scope="module")
def equal_family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """fp32 rows of 128 B; with block_size 256 every block is exactly 256 B."""
    return make_family(tmp_path_factory.mktemp("plan_family"), n_experts=3, seed=4,
                       shapes=EQUAL_SHAPES, zero_tensors=("b.weight",))


def family_spec(tmp_path: Path, fam: Family, weights: list[float], **extra: Any) -> Path:
    return write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=weights,
                      extra={"block_size": 256, "index_dir": str(fam.root / "idx"), **extra})


def open_session(spec_path: Path, **kw: Any) -> Session:
    s = Session(load_spec(spec_path), **kw)
    s.close()
    return s


def test_index_norms_and_zero_flags_match_the_bytes(equal_family: Family,
                                                    tmp_path: Path) -> None:
    s = open_session(family_spec(tmp_path, equal_family, [0.5, 0.3, 0.2]))
    lay = s.index.layout
    assert set(lay.block_bytes().tolist()) == {256}
    for t, name in enumerate(lay.tensors):
        w0 = read_tensor(equal_family.base, name).astype(np.float32).ravel()
        for i, e in enumerate(equal_family.experts):
            wi = read_tensor(e, name).astype(np.float32).ravel()
            for b in lay.blocks_of(t):
                sl = slice(int(lay.elem_start[b]), int(lay.elem_end[b]))
                d = (wi[sl] - w0[sl]).astype(np.float64)
                assert s.index.norms[i, b] == pytest.approx(math.sqrt((d * d).sum()), rel=1e-12)
                assert bool(s.index.zero[i, b]) == bool(np.array_equal(
                    read_tensor(e, name).ravel()[sl].view(np.uint8),
                    read_tensor(equal_family.base, name).ravel()[sl].view(np.uint8)))


@pytest.mark.parametrize("k", [0, 1, 7, 40, 100])
def test_equal_blocks_plan_is_the_top_k(equal_family: Family, tmp_path: Path, k: int) -> None:
    weights = [0.9, -0.4, 0.15]
    s = open_session(family_spec(tmp_path, equal_family, weights, budget=f"{k * 256 + 255}B"))
    idx, lay = s.index, s.index.layout
    cands = [(-abs(weights[i]) * idx.norms[i, b] / 256, int(lay.tensor_of[b]), b, i)
             for i in range(3) for b in range(lay.n_blocks) if not idx.zero[i, b]]
    top = {(i, b) for _s, _t, b, i in sorted(cands)[:k]}
    assert chosen(s.plan) == top
    assert s.plan.planned_bytes == 256 * min(k, len(cands))


def test_plan_is_deterministic(equal_family: Family, tmp_path: Path) -> None:
    spec_path = family_spec(tmp_path, equal_family, [0.7, 0.2, -0.3], budget="23%")
    a, b = open_session(spec_path), open_session(spec_path)
    assert np.array_equal(a.plan.selected, b.plan.selected)
    assert a.plan.plan_hash == b.plan.plan_hash
    again = make_plan(a.spec, a.index)
    assert np.array_equal(again.selected, a.plan.selected)
    assert again.plan_hash == a.plan.plan_hash
    assert again.report() == a.plan.report()
    # other coefficients: another hash; the full budget spelled two ways: the same hash
    other = open_session(family_spec(tmp_path, equal_family, [0.7, 0.2, -0.31], budget="23%"))
    assert other.plan.plan_hash != a.plan.plan_hash
    full1 = open_session(family_spec(tmp_path, equal_family, [0.7, 0.2, -0.3], budget="full"))
    full2 = open_session(family_spec(tmp_path, equal_family, [0.7, 0.2, -0.3], budget=0.999))
    assert full2.plan.planned_bytes == full1.plan.planned_bytes  # everything non-zero fits
    assert full1.plan.plan_hash == full2.plan.plan_hash


def test_budget_zero_reads_nothing(equal_family: Family, tmp_path: Path) -> None:
    spec_path = family_spec(tmp_path, equal_family, [0.5, 0.5, 0.5], budget=0)
    s = Session(load_spec(spec_path))
    try:
        assert s.plan.planned_bytes == 0 and s.plan.blocks_read == 0
        assert not s.plan.selected.any()
        s.engine.materialise(tmp_path / "out")
    finally:
        s.close()
    assert all(e.counters.bytes_read == 0 for e in s.experts)
    # nothing read means M = W0 + 0 = W0: the base's tensors, bit for bit
    for name in tensor_names(equal_family.base):
        assert read_tensor(tmp_path / "out", name).tobytes() == \
            read_tensor(equal_family.base, name).tobytes()
    assert s.plan.error_exact == pytest.approx(s.plan.update_norm)


@pytest.mark.parametrize("budget", [0, "5%", "20%", "50%", "full"])
def test_bounds_order_and_zero_blocks_never_selected(equal_family: Family, tmp_path: Path,
                                                     budget: Any) -> None:
    s = open_session(family_spec(tmp_path, equal_family, [0.6, -1.2, 0.3], budget=budget))
    p, idx = s.plan, s.index
    assert not (p.selected & idx.zero).any()
    nz_bytes = int((idx.layout.block_bytes()[None, :] * ~idx.zero).sum())
    assert p.nonzero_expert_bytes == nz_bytes < p.total_expert_bytes
    assert p.blocks_zero == int(idx.zero.sum()) > 0
    assert p.planned_bytes <= p.budget_bytes
    assert p.error_exact is not None and p.bound_tight is not None and p.bound_loose is not None
    assert p.error_exact <= p.bound_tight * (1 + 1e-9) + 1e-15
    assert p.bound_tight <= p.bound_loose * (1 + 1e-12) + 1e-15
    if budget == "full":
        assert np.array_equal(p.selected, ~idx.zero)
        assert p.bound_loose == 0.0 and p.error_exact == 0.0


def test_budget_equal_to_nonzero_bytes_reads_everything(equal_family: Family,
                                                        tmp_path: Path) -> None:
    s = open_session(family_spec(tmp_path, equal_family, [0.6, 0.2, 0.3]))
    nz = s.plan.nonzero_expert_bytes
    exact = make_plan(s.spec, s.index, nz)
    assert np.array_equal(exact.selected, ~s.index.zero) and exact.error_exact == 0.0
    short = make_plan(s.spec, s.index, nz - 1)
    assert short.planned_bytes == nz - 256
    assert short.error_exact is not None and short.error_exact > 0


# -- plan --json --------------------------------------------------------------------------------


def test_plan_json_keys_match_the_readme(equal_family: Family, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = family_spec(tmp_path, equal_family, [0.5, 0.25, 0.25], budget="full")
    capsys.readouterr()
    assert cli.main(["plan", str(spec_path), "--json", "--budget", "10%"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == README_KEYS
    floats = sum(read_tensor(equal_family.base, n).nbytes for n in tensor_names(
        equal_family.base) if tensor_dtype(equal_family.base, n) != "I64")
    assert rep["total_expert_bytes"] == 3 * floats
    assert rep["budget_bytes"] == math.floor(0.1 * rep["total_expert_bytes"])
    assert rep["planned_expert_bytes"] <= rep["budget_bytes"]
    assert rep["blocks_read"] == rep["planned_expert_bytes"] // 256
    assert rep["bound_relative_to_update"] == pytest.approx(rep["bound_tight"]
                                                            / rep["update_norm"])
    s = open_session(family_spec(tmp_path, equal_family, [0.5, 0.25, 0.25], budget="10%"))
    assert rep == json.loads(json.dumps(s.plan.report()))


def test_plan_json_non_additive(equal_family: Family, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = write_spec(tmp_path / "ties.yaml", equal_family, "ties",
                           model_parameters=[{"density": 0.5}] * 3,
                           extra={"block_size": 256, "index_dir": str(equal_family.root / "idx"),
                                  "budget": "30%"})
    capsys.readouterr()
    assert cli.main(["plan", str(spec_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == README_KEYS
    for key in ("bound_tight", "bound_loose", "error_exact", "update_norm",
                "bound_relative_to_update"):
        assert rep[key] is None
    assert 0 < rep["planned_expert_bytes"] <= rep["budget_bytes"]


def test_per_tensor_norms_match_numpy(family_f32, tmp_path) -> None:
    """The index keeps per-tensor delta norms; check them against plain numpy."""
    import numpy as np
    from families import write_spec
    from reference import read_tensor

    from mergefs.recipe.family import open_family
    from mergefs.index.blocks import load_or_build
    from mergefs.spec.load import load_spec

    spec = load_spec(write_spec(tmp_path / "s.yaml", family_f32, extra={
        "block_size": "512B", "index_dir": str(tmp_path / "idx")}))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    got = index.tensor_norms()
    for t, name in enumerate(index.layout.tensors):
        w0 = read_tensor(family_f32.base, name).astype(np.float32)
        for i, e in enumerate(family_f32.experts):
            d = (read_tensor(e, name).astype(np.float32) - w0).astype(np.float64)
            assert got[i, t] == pytest.approx(np.sqrt((d * d).sum()), rel=1e-9, abs=1e-12)


def test_index_tensors_table(family_f32, tmp_path, capsys) -> None:
    from families import write_spec

    from mergefs.cli import main

    spec = write_spec(tmp_path / "s.yaml", family_f32, extra={
        "block_size": "512B", "index_dir": str(tmp_path / "idx")})
    assert main(["index", str(spec), "--tensors", "3"]) == 0
    out = capsys.readouterr().out
    assert "largest deltas by tensor (top 3 of" in out and "||D_0||" in out


# -- the output rounding in the bounds (issue 14) -------------------------------------------------

ROUNDING_SHAPES = {"q.weight": (64, 48), "v.weight": (64, 48), "mlp.weight": (96, 32)}


def ulp_family(root: Path, dtype: str) -> Family:
    """Large base weights and one LoRA-like expert: on q and v, each element moved by 3 units in
    the last place of ``dtype`` (away from zero where a rank-1 sign pattern is positive, towards
    it elsewhere); mlp untouched. With weight 0.25 the update is 0.75 ulp per element, so the
    merged output rounds to 1 ulp: the measured error exceeds the omitted-delta bound."""
    from families import _write_model

    rng = np.random.default_rng(7)
    np_dt, bits = {"float32": (np.float32, np.uint32), "bfloat16": (None, np.uint16)}[dtype]
    base, expert = {}, {}
    for name, shape in ROUNDING_SHAPES.items():
        w = (rng.standard_normal(shape) * 300 + 1000 * np.sign(rng.standard_normal(shape)))
        if dtype == "bfloat16":
            import ml_dtypes

            w0 = w.astype(ml_dtypes.bfloat16)
        else:
            w0 = w.astype(np_dt)
        raw = w0.view(bits)
        if name == "mlp.weight":
            x = raw.copy()
        else:
            sign = np.outer(np.sign(rng.standard_normal(shape[0])),
                            np.sign(rng.standard_normal(shape[1])))
            x = np.where(sign > 0, raw + bits(3), raw - bits(3)).astype(bits)
        base[name], expert[name] = w0, x.view(w0.dtype)
    root.mkdir(parents=True)
    _write_model(root / "base", base, list(base), "single", dtype)
    _write_model(root / "expert-0", expert, list(expert), "single", dtype)
    return Family(root / "base", [root / "expert-0"], root, dtype, list(base))


def outputs(spec_path: Path, out: Path) -> dict[str, np.ndarray]:
    s = Session(load_spec(spec_path))
    try:
        s.engine.materialise(out)
    finally:
        s.close()
    return {n: read_tensor(out, n).astype(np.float64) for n in ROUNDING_SHAPES}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [0, "50%"])
def test_bounds_hold_where_the_output_rounding_dominates(tmp_path: Path, dtype: str,
                                                         budget: Any) -> None:
    fam = ulp_family(tmp_path / "fam", dtype)
    extra = {"block_size": 1024, "index_dir": str(tmp_path / "idx"), "dtype": dtype}
    part = write_spec(tmp_path / "b.yaml", fam, "task_arithmetic", [0.25],
                      extra={**extra, "budget": budget})
    full = write_spec(tmp_path / "f.yaml", fam, "task_arithmetic", [0.25],
                      extra={**extra, "budget": "full"})
    got, want = outputs(part, tmp_path / "b"), outputs(full, tmp_path / "f")
    measured = math.sqrt(sum(((got[n] - want[n]) ** 2).sum() for n in ROUNDING_SHAPES))
    s = open_session(part)
    p, idx = s.plan, s.index
    omitted = ~idx.zero & ~p.selected
    per_block = (0.25 * idx.norms * omitted).sum(axis=0)
    old_tight, old_loose = math.sqrt((per_block ** 2).sum()), float(per_block.sum())
    assert measured > 0 and p.error_exact is not None
    assert old_tight < measured  # the bound without the rounding term fails here
    assert (p.bound_tight, p.bound_loose) == pytest.approx((old_tight, old_loose), rel=1e-12)
    assert p.bound_output_tight is not None and p.bound_output_loose is not None
    assert old_tight < p.bound_output_tight and old_loose < p.bound_output_loose
    assert measured <= p.bound_output_tight <= p.bound_output_loose
    assert p.bound_output_tight < 4 * measured  # and is not vacuous
    assert idx.base_norms is not None
    w0 = math.sqrt(sum((read_tensor(fam.base, n).astype(np.float64) ** 2).sum()
                       for n in ROUNDING_SHAPES))
    assert math.sqrt((idx.base_norms ** 2).sum()) == pytest.approx(w0, rel=1e-12)
    fp = open_session(full).plan
    assert fp.bound_tight == fp.bound_output_tight == 0.0  # the full read: the same bytes
