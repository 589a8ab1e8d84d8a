"""Planning and merging with delta sidecars (issue 14 steps 2-3).

Expected merges come from the independent reference (tests/reference.py), never from mergefs.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import yaml
from families import Family, make_family, write_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_merge_dir
from safetensors.numpy import load_file

from mergefs.deltas import publish as compress
from mergefs.engine.session import Session
from mergefs.recipe.family import open_family
from mergefs.index.blocks import load_or_build
from mergefs.plan.levels import (
    DecodeCost, _hulls, _segments, choose, decode_seconds, level_runs, levels_from_runs,
)
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.replay import replay
from mergefs.core.errors import SpecError
from mergefs.spec.load import load_spec

BLOCK = 512
WEIGHTS = [0.5, -0.3, 0.8]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, Path]:
    """A float32 family with delta sidecars beside its experts, and its spec."""
    root = tmp_path_factory.mktemp("levels")
    fam = make_family(root / "fam", dtype="float32", seed=11)
    spec_path = write_spec(root / "spec.yaml", fam, weights=WEIGHTS,
                           extra={"block_size": BLOCK, "index_dir": str(root / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    compress.publish(base, experts, index)
    return fam, spec_path


def _merge(spec_path: Path, out: Path, budget: int | None, sidecars: bool = True,
           manifest: Path | None = None) -> tuple[Session, dict[str, np.ndarray]]:
    spec = load_spec(str(spec_path))
    writer = ManifestWriter(manifest) if manifest is not None else None
    s = Session(spec, budget_bytes=budget, sidecars=sidecars, manifest=writer)
    shutil.rmtree(out, ignore_errors=True)
    s.engine.materialise(out)
    s.finish()
    s.close()
    return s, load_file(str(out / "model.safetensors"))


def _hull_one(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """The hull one pair at a time (the planner's rule before it was vectorised): the
    reference for :func:`_hulls`."""
    hull = [(0.0, 0.0, 0)]
    for c, g, o in sorted(points, key=lambda p: (p[0], -p[1], p[2])):
        c = max(c, 1e-9)
        if g <= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (c1, g1, _), (c2, g2, _) = hull[-2], hull[-1]
            if (g2 - g1) * (c - c1) <= (g - g1) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append((c, g, o))
    return hull


def _rows(points: list[list[tuple[float, float, int]]]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray([[p[k] for p in row] for row in points],
                            np.int64 if k == 2 else np.float64) for k in range(3))


def test_hull_keeps_only_concave_upgrades() -> None:
    pts = [(10.0, 5.0, 1), (20.0, 6.0, 2), (30.0, 9.0, 3), (40.0, 9.0, -1), (5.0, 1.0, 4)]
    hc, hg, ho, h = _hulls(*_rows([pts]))
    assert ho[0, :h[0]].tolist() == [0, 1, 3]  # 4 and 2 under the chord, -1 no gain
    _, key, _, _ = _segments(hc, hg, ho, h)
    slopes = (-key).tolist()
    assert slopes == sorted(slopes, reverse=True) and len(slopes) == 2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 30), st.integers(0, 2**32 - 1))
def test_vectorised_hulls_equal_the_hull_one_pair_at_a_time(n_pts: int, n_rows: int,
                                                             seed: int) -> None:
    """Every row's hull (points, in order) and upgrades are those of the one-pair rule,
    float for float, also with ties in cost or gain, zero costs and points that gain
    nothing."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        cost = rng.choice([0.0, 1.0, 2.0, 3.0, 7.5], n_pts) if rng.random() < 0.4 \
            else rng.uniform(0, 100, n_pts)
        gain = rng.choice([0.0, 1.0, 2.0, 5.0], n_pts) if rng.random() < 0.4 \
            else rng.uniform(-1, 50, n_pts)
        opt = rng.permutation(np.arange(-1, n_pts - 1))
        rows.append(list(zip(cost.tolist(), gain.tolist(), opt.tolist())))
    hc, hg, ho, h = _hulls(*_rows(rows))
    row, key, oa, ob = _segments(hc, hg, ho, h)
    for r, pts in enumerate(rows):
        want = _hull_one(pts)
        got = list(zip(hc[r, :h[r]].tolist(), hg[r, :h[r]].tolist(), ho[r, :h[r]].tolist()))
        assert got == want, (pts, got, want)
        seg = [(-k, a, b) for k, a, b, rr in zip(key, oa, ob, row) if rr == r]
        assert seg == [((g2 - g1) / max(c2 - c1, 1e-12), o1, o2) for (c1, g1, o1), (c2, g2, o2)
                       in itertools.pairwise(want)]


def test_level_runs_round_trip() -> None:
    lv = np.asarray([[0, 2, 2, 3, 0, 1], [1, 1, 0, 0, 0, 4]], dtype=np.int16)
    assert np.array_equal(levels_from_runs(level_runs(lv), 6), lv)


@given(frac=st.floats(0.0, 0.8))
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_budget_never_exceeded_and_bound_never_below_error(
        published: tuple[Family, Path], tmp_path_factory: pytest.TempPathFactory,
        frac: float) -> None:
    _, spec_path = published
    out = tmp_path_factory.mktemp("out")
    want = reference_merge_dir(spec_path)
    spec = load_spec(str(spec_path))
    probe = Session(spec, budget_bytes=0)
    budget = int(frac * probe.plan.total_expert_bytes)
    probe.close()
    s, got = _merge(spec_path, out, budget)
    p = s.plan
    assert p.planned_bytes <= budget
    read = s.totals_record()
    assert read["expert_bytes_read"] <= budget
    assert sum(s.sidecar_bytes().values()) == p.sidecar_bytes
    err = np.sqrt(sum(float(((got[k].astype(np.float64) - want[k].astype(np.float64)) ** 2
                             ).sum()) for k in want if want[k].dtype.kind == "f"))
    assert p.bound_tight is not None and p.bound_loose is not None
    assert err <= p.bound_tight * (1 + 1e-6) + 1e-7
    assert p.bound_tight <= p.bound_loose * (1 + 1e-12) + 1e-15
    assert p.bound_output_tight is not None and p.bound_output_loose is not None
    assert err <= p.bound_output_tight <= p.bound_output_loose  # of the output bytes: no slack
    assert p.bound_tight <= p.bound_output_tight


def test_levels_beat_exact_blocks_at_small_budgets(published: tuple[Family, Path],
                                                   tmp_path: Path) -> None:
    fam, spec_path = published
    want = reference_merge_dir(spec_path)
    base = {k: v for k, v in load_file(str(fam.base / "model.safetensors")).items()}
    upd = sum(float(((want[k].astype(np.float64) - base[k]) ** 2).sum())
              for k in want if want[k].dtype.kind == "f")
    spec = load_spec(str(spec_path))
    probe = Session(spec, budget_bytes=0)
    budget = probe.plan.total_expert_bytes // 10
    probe.close()
    kept = {}
    for sidecars in (False, True):
        s, got = _merge(spec_path, tmp_path / str(sidecars), budget, sidecars=sidecars)
        err = sum(float(((got[k].astype(np.float64) - want[k]) ** 2).sum())
                  for k in want if want[k].dtype.kind == "f")
        kept[sidecars] = 1 - err / upd
        assert (s.plan.levels is not None) == sidecars
    assert kept[True] > kept[False] + 0.1


def test_full_budget_reads_exact_blocks_bit_identical(published: tuple[Family, Path],
                                                      tmp_path: Path) -> None:
    _, spec_path = published
    s, got = _merge(spec_path, tmp_path / "a", None)
    assert s.plan.levels is None and s.sidecar_bytes() in ({}, {"expert-0": 0, "expert-1": 0,
                                                              "expert-2": 0})
    want = reference_merge_dir(spec_path)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_manifest_records_sidecar_reads_and_replay_verifies(published: tuple[Family, Path],
                                                            tmp_path: Path) -> None:
    _, spec_path = published
    man = tmp_path / "m.jsonl"
    spec = load_spec(str(spec_path))
    probe = Session(spec, budget_bytes=0)
    budget = probe.plan.total_expert_bytes // 20
    probe.close()
    s, _ = _merge(spec_path, tmp_path / "out", budget, manifest=man)
    records = [json.loads(line) for line in man.read_text().splitlines()]
    header = records[0]
    assert "levels" in header and set(header["sidecars"]) == {"expert-0", "expert-1",
                                                               "expert-2"}
    side = [r for r in records if r["type"] == "read" and "mergefs-delta" in r["file"]]
    assert sum(r["end"] - r["start"] for r in side) == s.plan.sidecar_bytes
    for r in side:
        path = Path(header["sidecars"][r["source"]])
        with open(path, "rb") as f:
            f.seek(r["start"])
            assert xxhash.xxh3_64_hexdigest(f.read(r["end"] - r["start"])) == r["xxh3"]
    result = replay(str(man))
    assert result.reads_verified >= len(side) and result.outputs_verified > 0


def test_cli_compress_then_plan_reports_sidecar_bytes(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from mergefs import cli

    fam = make_family(tmp_path / "fam", seed=12)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, weights=WEIGHTS,
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx")})
    assert cli.main(["compress", str(spec_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == 3 and "mergefs-delta." in out
    assert cli.main(["plan", str(spec_path), "--json", "--budget", "5%"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert 0 < rep["sidecar_bytes"] <= rep["planned_expert_bytes"] <= rep["budget_bytes"]
    assert rep["blocks_from_sidecar"] > 0


def test_plan_table_rows_show_each_experts_sidecar_bytes(
        published: tuple[Family, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each "reads of" row once showed only exact bytes: with sidecars the rows did not add up
    to the planned expert reads."""
    from mergefs import cli
    from mergefs.core.sizes import human_bytes

    _, spec_path = published
    monkeypatch.setenv("COLUMNS", "200")  # one line per row
    probe = Session(load_spec(str(spec_path)), budget_bytes=0)
    budget = probe.plan.total_expert_bytes // 20
    probe.close()
    s, _ = _merge(spec_path, tmp_path / "out", budget)
    p = s.plan
    assert p.levels is not None and p.sidecar_bytes_by_expert is not None
    assert sum(p.sidecar_bytes_by_expert) == p.sidecar_bytes
    assert dict(zip(s.engine.labels, p.sidecar_bytes_by_expert)) == s.sidecar_bytes()  # as read
    exact = (s.index.expert_block_bytes() * p.selected).sum(axis=1)
    assert int(exact.sum()) + p.sidecar_bytes == p.planned_bytes
    capsys.readouterr()
    assert cli.main(["plan", str(spec_path), "--budget", f"{budget}B"]) == 0
    out = capsys.readouterr().out
    for i, label in enumerate(s.engine.labels):
        side = p.sidecar_bytes_by_expert[i]
        assert side > 0
        row = next(ln for ln in out.splitlines() if f"reads of {label} " in ln)
        assert f"{human_bytes(int(exact[i]))} exact + {human_bytes(side)} sidecar of " in row, row


def test_mount_serves_the_same_reconstructed_merge(tmp_path: Path, mounts: Any) -> None:
    import os

    from mounting import merge, sha256

    from viewcases import tree

    fam = make_family(tmp_path / "fam", seed=13, dtype="bfloat16")
    spec_path = write_spec(tmp_path / "spec.yaml", fam, weights=WEIGHTS,
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx"),
                                  "budget": "8%"})
    from mergefs import cli

    assert cli.main(["compress", str(spec_path)]) == 0
    out = merge(spec_path, tmp_path / "out")
    header = json.loads(Path(str(out) + ".manifest.jsonl").read_text().splitlines()[0])
    assert "levels" in header  # the merge did reconstruct blocks
    m = mounts.start(spec_path)
    want = {rel: sha256(p) for rel, p in tree(out).items()}
    got = {rel: sha256(p) for rel, p in tree(m.path).items()}
    assert got == want
    assert "manifest.jsonl" in os.listdir(m.path / ".mergefs")


def test_rows_levels_plan_within_budget_and_bound(tmp_path: Path) -> None:
    """Row-sparse experts (``rows`` levels): at small budgets the plan reads levels, stays within
    the budget, its tight bound is not below the measured error, and it keeps far more of the
    update than exact blocks; at the full budget the merge is the reference's, bit for bit."""
    from sidecar_cases import _row_sparse_family

    fam = _row_sparse_family(tmp_path / "fam")
    spec_path = write_spec(tmp_path / "spec.yaml", fam, weights=[0.6, -0.4],
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    compress.publish(base, experts, index)
    for c in [base, *experts]:
        c.close()
    want = reference_merge_dir(spec_path)
    w0 = load_file(str(fam.base / "model.safetensors"))
    names = [k for k in want if want[k].dtype.kind == "f"]
    upd = sum(float(((want[k].astype(np.float64) - w0[k]) ** 2).sum()) for k in names)
    probe = Session(spec, budget_bytes=0)
    total = probe.plan.total_expert_bytes
    probe.close()
    for frac in (0.02, 0.05):
        kept = {}
        for sidecars in (False, True):
            s, got = _merge(spec_path, tmp_path / f"out-{frac}-{sidecars}", int(frac * total),
                            sidecars=sidecars)
            p = s.plan
            assert s.totals_record()["expert_bytes_read"] <= int(frac * total)
            err = float(np.sqrt(sum(((got[k].astype(np.float64) - want[k]) ** 2).sum()
                                    for k in names)))
            assert p.bound_tight is not None and err <= p.bound_tight * (1 + 1e-6) + 1e-7
            kept[sidecars] = 1 - err**2 / upd
            if sidecars:
                assert p.levels is not None and int((p.levels > 0).sum()) > 0
        assert kept[True] > kept[False] + 0.3
    _, got = _merge(spec_path, tmp_path / "full", None)
    for k in want:
        assert np.array_equal(got[k].view(np.uint8), np.ascontiguousarray(want[k]).view(np.uint8))


@given(frac=st.floats(0.02, 0.6), ratio=st.floats(0.05, 3.0))
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_decode_limit_and_budget_hold(published: tuple[Family, Path],
                                                      frac: float, ratio: float) -> None:
    """With a decode limit, the modelled decode time of the plan's local sidecar blocks is at
    most ``ratio`` times the modelled read of the exact bytes they replace, and the plan stays
    within the byte budget; where the byte-budget plan is within the limit, the two are the
    same plan."""
    _, spec_path = published
    spec = load_spec(str(spec_path))
    s = Session(spec, budget_bytes=0)
    try:
        index, sc = s.index, s.engine.deltas
        coeffs = np.asarray(WEIGHTS)
        budget = int(frac * s.plan.total_expert_bytes)
        cost = DecodeCost(ratio=ratio)
        free = choose(index, coeffs, budget, sc)
        lim = choose(index, coeffs, budget, sc, cost)
    finally:
        s.close()
    dec_free, read_free = decode_seconds(index, free.levels, sc, cost)
    dec, read = decode_seconds(index, lim.levels, sc, cost)
    assert dec <= ratio * read * (1 + 1e-9) + 1e-15
    assert lim.exact_bytes + lim.sidecar_bytes <= budget
    assert free.exact_bytes + free.sidecar_bytes <= budget
    if dec_free <= ratio * read_free:
        assert np.array_equal(lim.levels, free.levels)
    else:
        assert not np.array_equal(lim.levels, free.levels)


def test_decode_limit_binds_on_the_published_family_and_spares_remote_sidecars(
        published: tuple[Family, Path]) -> None:
    """A tight limit changes this family's plan (the test above is not vacuous), and a sidecar
    read over the network (``fetch`` set) is never limited: its reads are the slow part."""
    _, spec_path = published
    spec = load_spec(str(spec_path))
    s = Session(spec, budget_bytes=0)
    try:
        index, sc = s.index, s.engine.deltas
        budget = s.plan.total_expert_bytes // 4
        coeffs = np.asarray(WEIGHTS)
        free = choose(index, coeffs, budget, sc)
        tight = DecodeCost(ratio=0.05)
        assert not np.array_equal(choose(index, coeffs, budget, sc, tight).levels, free.levels)
        for one in sc.values():
            one.fetch = lambda a, b: b""  # as a remote sidecar; never called by the planner
        try:
            assert np.array_equal(choose(index, coeffs, budget, sc, tight).levels, free.levels)
        finally:
            for one in sc.values():
                one.fetch = None
    finally:
        s.close()


def test_spec_decode_limit_reaches_the_plan(published: tuple[Family, Path],
                                            tmp_path: Path) -> None:
    """``decode_limit`` in the spec: a number limits the plan as choose() does, ``none`` plans
    by bytes alone; anything else is refused naming the key."""
    _, spec_path = published
    doc = yaml.safe_load(spec_path.read_text())
    plans = {}
    for value in (0.05, "none"):
        path = spec_path.parent / f"spec-decode-{value}.yaml"  # the family's relative paths
        path.write_text(yaml.safe_dump({**doc, "decode_limit": value}))
        spec = load_spec(str(path))
        assert spec.decode_limit == (None if value == "none" else value)
        s = Session(spec, budget_bytes=0)
        budget = s.plan.total_expert_bytes // 4
        s.close()
        s = Session(spec, budget_bytes=budget)
        plans[value] = s.plan.levels
        want = choose(s.index, np.asarray(WEIGHTS), budget, s.engine.deltas,
                      DecodeCost(ratio=0.05) if value != "none" else None)
        assert np.array_equal(s.plan.levels, want.levels)
        s.close()
        if value != "none":  # the limited plan's bound still holds on its merged bytes
            s, got = _merge(path, tmp_path / "limited", budget)
            ref = reference_merge_dir(spec_path)
            err = np.sqrt(sum(float(((got[k].astype(np.float64) - ref[k].astype(np.float64))
                                     ** 2).sum()) for k in ref if ref[k].dtype.kind == "f"))
            assert s.plan.bound_output_tight is not None
            assert err <= s.plan.bound_output_tight
    assert not np.array_equal(plans[0.05], plans["none"])
    for bad in (0, -1, "fast", True, float("inf")):
        path = spec_path.parent / "bad.yaml"
        path.write_text(yaml.safe_dump({**doc, "decode_limit": bad}))
        with pytest.raises(SpecError, match=r"bad\.yaml: decode_limit: expected a positive"):
            load_spec(str(path))


def _two_block_index(norms: list[float]) -> Any:
    """One float32 tensor of two row blocks (128 and 256 elements: 512 and 1024 bytes), one
    expert with these block norms."""
    from mergefs.index.blocks import BlockIndex
    from mergefs.index.layout import BlockLayout
    lay = BlockLayout(512, ("w",), (4,), np.zeros(2, np.int32), np.array([0, 128], np.int64),
                      np.array([128, 384], np.int64), np.array([0, 2], np.int64))
    return BlockIndex("k", lay, np.zeros(2, np.uint64), np.zeros((1, 2), np.uint64),
                      np.array([norms]), np.zeros((1, 2), bool), np.zeros((2, 1, 1)))


def test_tied_upgrades_square_norms_as_the_one_pair_loop_did() -> None:
    """These norms give both blocks the same energy per byte with Python's ``x ** 2`` (libm
    pow) but not with numpy's ``x * x``, one bit apart: the tie must break by block, as
    plans (and the manifests recording them) always have."""
    x, y = 1.913084525181784, 2.705510081478172
    assert x ** 2 / 512 == y ** 2 / 1024 and x * x / 512 != y * y / 1024
    got = choose(_two_block_index([x, y]), np.array([1.0]), 1024, {})
    assert got.selected.ravel().tolist() == [True, False] and got.exact_bytes == 512


def test_a_nan_block_is_read_first() -> None:
    """NaN weights give a NaN norm: the pair is planned (its merge is NaN whatever else is
    read), before any other, so the output shows it instead of silently leaving it out."""
    idx = _two_block_index([float("nan"), 1.0])
    for budget, want in ((512, [True, False]), (2000, [True, True]), (100, [False, False])):
        got = choose(idx, np.array([1.0]), budget, {})
        assert got.selected.ravel().tolist() == want, budget
