"""The merge engine, checked against the independent whole-tensor reference (tests/reference.py).

Never compares mergefs with itself: every expected output comes from ``reference_merge_dir``
(optionally with omit masks derived from the plan's selection), and every byte-accounting check
comes from the safetensors headers parsed here or from the checkpoints' physical read counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import yaml
from families import INT_TENSOR_NAME, Family, forget_ctimes, make_family, write_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import (
    cast_to,
    read_tensor,
    reference_merge_dir,
    tensor_dtype,
    tensor_names,
)
from safetensors import safe_open

from mergefs import cli, ops
from mergefs.engine.session import Session
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.engine.manifest import ManifestWriter, read_manifest
from mergefs.engine.replay import replay
from mergefs.spec.load import load_spec
from engine_checks import assert_matches, plan_omit_masks
from engine_checks import numel_of

BLOCK = 512  # rows of 48 fp32 = 192 B: two rows a block, tensors span up to ~100 blocks
WEIGHTS = [0.5, -0.3, 0.8]
FAMILIES = ["family_f32", "family_f16", "family_bf16", "family_sharded"]
INDEX_NAME = "model.safetensors.index.json"

# case -> (method, global parameters, per-model parameters, base weight or None)
CASES: dict[str, tuple[str, dict[str, Any], list[dict[str, Any]] | None, float | None]] = {
    "linear_base_weighted": ("linear", {}, None, 0.4),
    "linear_unnormalized": ("linear", {"normalize": False}, None, 0.25),
    "task_arithmetic": ("task_arithmetic", {"normalize": True, "lambda": 0.7}, None, None),
    "ties": ("ties", {}, [{"density": 0.5}, {"density": 0.3}, {"density": 0.8}], None),
    "dare_linear": ("dare_linear", {"seed": 5},
                    [{"density": 0.6}, {"density": 0.4}, {"density": 0.9}], None),
    "dare_ties": ("dare_ties", {"lambda": 1.3, "normalize": True},
                  [{"density": 0.6}, {"density": 0.5}, {"density": 0.7}], None),
    "breadcrumbs": ("breadcrumbs", {"gamma": 0.05},
                    [{"density": 0.7}, {"density": 0.6, "gamma": 0.1}, {"density": 0.9}], None),
    "slerp": ("slerp", {"t": 0.3}, None, None),
    # DARE without the L1 rescale is elementwise (block-wise units); with it, whole tensors
    "dare_linear_norescale": ("dare_linear", {"seed": 5, "rescale": False},
                              [{"density": 0.6}, {"density": 0.4}, {"density": 0.9}], None),
    "dare_ties_norescale": ("dare_ties", {"lambda": 1.3, "normalize": True, "rescale": False},
                            [{"density": 0.6}, {"density": 0.5}, {"density": 0.7}], None),
}
BUDGETED_CASES = list(CASES)


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One index directory for the module: indexes are keyed by family and block size."""
    return tmp_path_factory.mktemp("engine_index")


def write_case_spec(path: Path, fam: Family, case: str, index_dir: Path | None = None,
                    **extra: Any) -> Path:
    """A spec for ``case`` over ``fam`` (slerp uses the first expert only)."""
    method, params, model_params, base_weight = CASES[case]
    if method == "slerp":
        fam = dataclasses.replace(fam, experts=fam.experts[:1])
    n = len(fam.experts)
    weights = None if method == "slerp" else WEIGHTS[:n]
    top = {"block_size": BLOCK, **extra}
    if index_dir is not None:
        top["index_dir"] = str(index_dir)
    write_spec(path, fam, method, weights=weights, parameters=params or None,
               model_parameters=model_params[:n] if model_params else None, extra=top)
    if base_weight is not None:  # mergekit style: the base listed among the models, weighted
        doc = yaml.safe_load(path.read_text())
        doc["models"].insert(1, {"model": doc["base_model"],
                                 "parameters": {"weight": base_weight}})
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_merge(spec_path: Path, out: Path, manifest: Path | None = None,
              budget_bytes: int | None = None) -> tuple[Session, dict[str, str]]:
    spec = load_spec(spec_path)
    session = Session(spec, manifest=ManifestWriter(manifest) if manifest else None,
                      budget_bytes=budget_bytes)
    try:
        hashes = session.engine.materialise(out)
        session.finish()
    finally:
        session.close()
    return session, hashes


def parse_header(path: Path) -> dict[str, tuple[int, int, str, list[int]]]:
    """name -> (absolute start, absolute end, dtype, shape), parsed here from the raw bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1], v["dtype"],
                v["shape"]) for k, v in doc.items()}


def model_files(model: Path) -> list[str]:
    if (model / INDEX_NAME).exists():
        return sorted(set(json.loads((model / INDEX_NAME).read_text())["weight_map"].values()))
    return ["model.safetensors"]


def elem_bytes(model: Path, name: str) -> np.ndarray:
    """(numel, itemsize) uint8 view of a tensor's stored bytes."""
    a = np.ascontiguousarray(read_tensor(model, name)).reshape(-1)
    return a.view(np.uint8).reshape(a.size, a.dtype.itemsize)


ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8}


def read_blocks(session: Session, manifest: Path, fam: Family) -> dict[int, set[int]]:
    """Per expert, the blocks touched by the manifest's recorded expert reads.

    Every read must lie inside one floating tensor of that expert's file and start and end on
    block boundaries; the tensor is found from the file's header, not from the record.
    """
    lay = session.index.layout
    tindex = lay.tensor_index()
    headers: dict[tuple[int, str], dict] = {}
    touched: dict[int, set[int]] = {i: set() for i in range(len(fam.experts))}
    reads = read_manifest(manifest).reads
    assert reads
    labels = session.engine.labels
    for rec in reads:
        if rec["source"] == "base":
            continue
        i = labels.index(rec["source"])
        key = (i, rec["file"])
        if key not in headers:
            headers[key] = parse_header(fam.experts[i] / rec["file"])
        hits = [(n, v) for n, v in headers[key].items()
                if v[0] <= rec["start"] and rec["end"] <= v[1]]
        assert len(hits) == 1, rec
        name, (t0, _t1, dtype, _shape) = hits[0]
        item = ITEMSIZE[dtype]
        assert (rec["start"] - t0) % item == 0 and (rec["end"] - t0) % item == 0
        e0, e1 = (rec["start"] - t0) // item, (rec["end"] - t0) // item
        t = tindex[name]
        starts = {int(lay.elem_start[b]) for b in lay.blocks_of(t)}
        ends = {int(lay.elem_end[b]) for b in lay.blocks_of(t)}
        assert e0 in starts and e1 in ends, (rec, "not block-aligned")
        for b in lay.blocks_of(t):
            if int(lay.elem_start[b]) < e1 and e0 < int(lay.elem_end[b]):
                touched[i].add(b)
    return touched


# -- full budget: bit-identical to the reference ------------------------------------------------


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("case", list(CASES))
def test_full_budget_bit_identical(request: pytest.FixtureRequest, tmp_path: Path,
                                   index_dir: Path, family_name: str, case: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec_path = write_case_spec(tmp_path / "spec.yaml", fam, case, index_dir, budget="full")
    session, _ = run_merge(spec_path, tmp_path / "out")
    # full budget reads exactly the blocks whose delta is non-zero
    assert np.array_equal(session.plan.selected, ~session.index.zero)
    assert session.index.zero.any() and (~session.index.zero).any()
    assert_matches(tmp_path / "out", reference_merge_dir(spec_path))


def test_blocks_tile_every_float_tensor(family_sharded: Family, index_dir: Path,
                                        tmp_path: Path) -> None:
    """The block layout the omit masks rely on: contiguous blocks covering each tensor."""
    spec = load_spec(write_case_spec(tmp_path / "s.yaml", family_sharded, "task_arithmetic",
                                     index_dir))
    session = Session(spec)
    session.close()
    lay = session.index.layout
    floats = sorted(n for n in tensor_names(family_sharded.base)
                    if tensor_dtype(family_sharded.base, n) != "I64")
    assert sorted(lay.tensors) == floats
    many = 0
    for t, name in enumerate(lay.tensors):
        blocks = list(lay.blocks_of(t))
        assert int(lay.elem_start[blocks[0]]) == 0
        assert int(lay.elem_end[blocks[-1]]) == numel_of(family_sharded.base, name)
        for a, b in itertools.pairwise(blocks):
            assert lay.elem_end[a] == lay.elem_start[b]
        many = max(many, len(blocks))
    assert many >= 20  # the small block size really splits tensors into many blocks


def test_non_weight_files_sharding_and_passthrough(family_sharded: Family, index_dir: Path,
                                                  tmp_path: Path) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic",
                                index_dir, budget="40%")
    out = tmp_path / "out"
    assert cli.main(["merge", str(spec_path), str(out), "--out-shard-size", "base",
                     "--manifest", str(tmp_path / "m.jsonl")]) == 0
    base = family_sharded.base
    base_index = json.loads((base / INDEX_NAME).read_text())
    out_index = json.loads((out / INDEX_NAME).read_text())
    # sharding mirrors the base: same files, same tensors in each, same shapes and dtypes
    assert out_index["weight_map"] == base_index["weight_map"]
    total = 0
    for fname in model_files(base):
        with safe_open(str(base / fname), framework="np") as fb, \
                safe_open(str(out / fname), framework="np") as fo:
            names = fb.keys()
            assert sorted(fo.keys()) == sorted(names)
            for k in names:
                assert fo.get_slice(k).get_shape() == fb.get_slice(k).get_shape()
                assert fo.get_slice(k).get_dtype() == fb.get_slice(k).get_dtype()
                total += fo.get_tensor(k).nbytes
    assert out_index["metadata"]["total_size"] == total
    assert sorted(p.name for p in out.glob("*.safetensors")) == model_files(base)
    for extra in ("config.json", "tokenizer.json"):
        assert (out / extra).read_bytes() == (base / extra).read_bytes()
    assert [p.name for p in out.glob(".*")] == [".mergefs"]  # no partial files left behind
    assert not list(out.parent.glob(f".{out.name}.mergefs-partial-*"))
    ints = read_tensor(out, INT_TENSOR_NAME)
    assert ints.dtype == np.int64
    assert ints.tobytes() == read_tensor(base, INT_TENSOR_NAME).tobytes()


def test_single_file_output_layout(family_f16: Family, index_dir: Path, tmp_path: Path) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", family_f16, "dare_ties", index_dir)
    out = tmp_path / "out"
    run_merge(spec_path, out)
    assert sorted(p.name for p in out.iterdir()) == [
        ".mergefs", "README.md", "config.json", "mergekit_config.yml", "model.safetensors",
        "tokenizer.json"]  # as mergekit-yaml writes it, with the model card
    with safe_open(str(out / "model.safetensors"), framework="np") as fo, \
            safe_open(str(family_f16.base / "model.safetensors"), framework="np") as fb:
        names = fb.keys()
        assert sorted(fo.keys()) == sorted(names)
        for k in names:
            assert fo.get_slice(k).get_shape() == fb.get_slice(k).get_shape()
    assert read_tensor(out, INT_TENSOR_NAME).tobytes() == \
        read_tensor(family_f16.base, INT_TENSOR_NAME).tobytes()


# -- output dtype -------------------------------------------------------------------------------


def rne_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns with round-to-nearest-even, written with integers."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    assert not np.isnan(x).any()
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("key", ["dtype", "out_dtype"])
@pytest.mark.parametrize("budget", ["full", "35%"])
def test_bf16_output_from_fp32_rounds_to_nearest_even(family_f32: Family, index_dir: Path,
                                                      tmp_path: Path, key: str,
                                                      budget: str) -> None:
    spec_path = write_case_spec(tmp_path / "bf16.yaml", family_f32, "task_arithmetic", index_dir,
                                budget=budget, **{key: "bfloat16"})
    out = tmp_path / "out"
    session, _ = run_merge(spec_path, out)
    masks = plan_omit_masks(session, family_f32.base)
    # the same merge in float32, computed by the reference; rounding done here with integers
    f32_spec = write_case_spec(tmp_path / "f32.yaml", family_f32, "task_arithmetic", index_dir)
    ref32 = reference_merge_dir(f32_spec, omit_masks=masks)
    rounded_somewhere = False
    for name, want32 in ref32.items():
        got = read_tensor(out, name)
        if tensor_dtype(family_f32.base, name) == "I64":
            assert got.tobytes() == want32.tobytes()
            continue
        assert tensor_dtype(out, name) == "BF16"
        want_bits = rne_bf16_bits(want32)
        assert np.array_equal(got.view(np.uint16), want_bits), name
        truncated = (want32.view(np.uint32) >> 16).astype(np.uint16)
        rounded_somewhere |= bool((truncated != want_bits).any())
    assert rounded_somewhere  # the check can tell rounding from truncation
    assert_matches(out, reference_merge_dir(spec_path, omit_masks=masks))


def test_out_dtype_wins_over_dtype(family_bf16: Family, index_dir: Path, tmp_path: Path) -> None:
    spec_path = write_case_spec(tmp_path / "s.yaml", family_bf16, "ties", index_dir,
                                dtype="bfloat16", out_dtype="float16")
    out = tmp_path / "out"
    run_merge(spec_path, out)
    assert tensor_dtype(out, "lm_head.weight") == "F16"
    assert tensor_dtype(out, INT_TENSOR_NAME) == "I64"
    ref = reference_merge_dir(spec_path)  # reference: out_dtype or dtype
    assert_matches(out, ref)
    assert ref["lm_head.weight"].dtype == np.float16


# -- budgeted merges: the reference with the plan's omissions -----------------------------------


@pytest.mark.parametrize("family_name", ["family_f32", "family_bf16", "family_sharded"])
@pytest.mark.parametrize("case", BUDGETED_CASES)
def test_budgeted_matches_reference_with_plan_omissions(request: pytest.FixtureRequest,
                                                        tmp_path: Path, index_dir: Path,
                                                        family_name: str, case: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec_path = write_case_spec(tmp_path / "spec.yaml", fam, case, index_dir, budget="30%")
    session, _ = run_merge(spec_path, tmp_path / "out")
    plan = session.plan
    assert 0 < plan.planned_bytes <= plan.budget_bytes < plan.nonzero_expert_bytes
    masks = plan_omit_masks(session, fam.base)
    expected = reference_merge_dir(spec_path, omit_masks=masks)
    assert_matches(tmp_path / "out", expected)
    # the omissions matter: the budgeted result differs from the full merge
    full = reference_merge_dir(spec_path)
    assert any(full[n].tobytes() != expected[n].tobytes() for n in full)


@pytest.mark.parametrize("budget", [0, "2B", "5000B", "60000B", "12.5%", "0.05", "20KiB"])
def test_byte_and_fraction_budgets_match_reference(family_f32: Family, index_dir: Path,
                                                   tmp_path: Path, budget: Any) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", family_f32, "dare_linear", index_dir,
                                budget=budget)
    session, _ = run_merge(spec_path, tmp_path / "out")
    assert session.plan.planned_bytes <= session.plan.budget_bytes
    expected = reference_merge_dir(spec_path,
                                   omit_masks=plan_omit_masks(session, family_f32.base))
    assert_matches(tmp_path / "out", expected)


def test_every_method_runs_under_a_partial_budget(family_f32: Family, index_dir: Path,
                                                  tmp_path: Path) -> None:
    """slerp too: omitted blocks of the model hold the base's values (a zero delta)."""
    spec_path = write_case_spec(tmp_path / "b.yaml", family_f32, "slerp", index_dir,
                                budget="50%")
    session, _ = run_merge(spec_path, tmp_path / "out")
    assert 0 < session.plan.planned_bytes <= session.plan.budget_bytes
    assert_matches(tmp_path / "out", reference_merge_dir(
        spec_path, omit_masks=plan_omit_masks(session, family_f32.base)))


# -- the budget properties, over random budgets, coefficients and families ----------------------


@pytest.fixture(scope="module")
def hyp_families(family_f32: Family, family_bf16: Family, family_sharded: Family
                 ) -> dict[str, Family]:
    return {"f32": family_f32, "bf16": family_bf16, "sharded": family_sharded}


def expert_bytes_total(fam: Family) -> int:
    total = 0
    for name in tensor_names(fam.base):
        t = read_tensor(fam.base, name)
        if tensor_dtype(fam.base, name) != "I64":
            total += t.nbytes
    return total * len(fam.experts)


budgets = st.one_of(
    st.floats(0.0, 1.0, allow_nan=False),
    st.integers(0, 100).map(lambda p: f"{p}%"),
    st.integers(2, 400_000).map(lambda n: f"{n}B"),  # bytes (may exceed the total: clamped)
    st.integers(0, 300).map(lambda k: f"{k}KiB"),
)
weights_st = st.lists(st.floats(-2.0, 2.0, allow_nan=False).map(lambda w: round(w, 3)),
                      min_size=3, max_size=3)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(fam_key=st.sampled_from(["f32", "bf16", "sharded"]),
       method=st.sampled_from(["linear", "task_arithmetic"]),
       weights=weights_st, budget=budgets, normalize=st.booleans(),
       lam=st.floats(-2.0, 2.0, allow_nan=False).map(lambda x: round(x, 3)))
def test_budget_properties(hyp_families: dict[str, Family], index_dir: Path,
                           tmp_path_factory: pytest.TempPathFactory, fam_key: str, method: str,
                           weights: list[float], budget: Any, normalize: bool,
                           lam: float) -> None:
    fam = hyp_families[fam_key]
    if method == "linear" and normalize and abs(sum(weights)) < 0.2:
        normalize = False  # keep normalized coefficients bounded
    params: dict[str, Any] = {"normalize": normalize}
    if method == "task_arithmetic":
        params["lambda"] = lam
    work = tmp_path_factory.mktemp("hyp")
    spec_path = write_spec(work / "spec.yaml", fam, method, weights=weights, parameters=params,
                           extra={"block_size": BLOCK, "index_dir": str(index_dir),
                                  "budget": budget, "out_dtype": "float32"})
    spec = load_spec(spec_path)
    ops.index(spec, exact=True, progress=False)  # exact cross terms: error_exact is exact
    session = Session(spec)
    assert not session.index_built  # counters must not include what indexing read
    assert sum(e.counters.bytes_read for e in session.experts) == 0
    plan = session.plan

    total = expert_bytes_total(fam)
    assert plan.total_expert_bytes == total
    if isinstance(budget, float):
        want_budget = total if budget >= 1 else math.floor(budget * total)
    elif isinstance(budget, int):
        want_budget = min(budget, total)
    elif budget.endswith("%"):
        want_budget = math.floor(int(budget[:-1]) / 100 * total)
    elif budget.endswith("KiB"):
        want_budget = min(int(budget[:-3]) * 1024, total)
    else:  # "<n>B"
        want_budget = min(int(budget[:-1]), total)
    assert abs(plan.budget_bytes - want_budget) <= 1  # float rounding of the fraction
    assert plan.planned_bytes <= plan.budget_bytes

    out = work / "out"
    try:
        session.engine.materialise(out)
    finally:
        session.close()
    physical = sum(e.counters.bytes_read for e in session.experts)
    assert physical == plan.planned_bytes

    masks = plan_omit_masks(session, fam.base)
    expected = reference_merge_dir(spec_path, omit_masks=masks)
    assert_matches(out, expected)
    full = reference_merge_dir(spec_path)

    err_sq = full_sq = 0.0
    for name, m_full in full.items():
        if m_full.dtype == np.int64:
            continue
        m_b = read_tensor(out, name).astype(np.float64)
        err_sq += float(((m_b - m_full.astype(np.float64)) ** 2).sum())
        full_sq += float((m_full.astype(np.float64) ** 2).sum())
    err, full_norm = math.sqrt(err_sq), math.sqrt(full_sq)
    slack = 1e-6 * full_norm
    assert plan.bound_tight is not None and plan.bound_loose is not None
    assert plan.error_exact is not None
    assert err <= plan.bound_tight + slack
    assert plan.bound_tight <= plan.bound_loose * (1 + 1e-12) + 1e-300
    assert abs(err - plan.error_exact) <= slack + 1e-3 * plan.error_exact
    if plan.planned_bytes >= plan.nonzero_expert_bytes:
        assert err == 0.0 and plan.bound_loose == 0.0


# -- determinism, manifest and replay -----------------------------------------------------------


def test_same_spec_twice_same_plan_and_hashes(family_sharded: Family, index_dir: Path,
                                              tmp_path: Path) -> None:
    spec_path = write_case_spec(tmp_path / "s.yaml", family_sharded, "dare_ties", index_dir,
                                budget="40%")
    s1, h1 = run_merge(spec_path, tmp_path / "out1")
    s2, h2 = run_merge(spec_path, tmp_path / "out2")
    assert s1.plan.plan_hash == s2.plan.plan_hash
    assert np.array_equal(s1.plan.selected, s2.plan.selected)
    assert h1 == h2
    assert sorted(h1) == tensor_names(family_sharded.base)
    for name, digest in h1.items():  # the hashes are of the bytes written
        assert xxhash.xxh3_64_hexdigest(read_tensor(tmp_path / "out1", name).tobytes()) == digest
    for f in model_files(tmp_path / "out1"):
        assert (tmp_path / "out1" / f).read_bytes() == (tmp_path / "out2" / f).read_bytes()
    # a different budget plans differently
    s3, _ = run_merge(spec_path, tmp_path / "out3",
                      budget_bytes=s1.plan.budget_bytes // 2)
    assert s3.plan.plan_hash != s1.plan.plan_hash


def flip_byte(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


def test_replay_verifies_then_detects_changed_expert(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fam = make_family(tmp_path / "fam", dtype="float32", seed=7, sharded=True,
                      expert_layout="reversed")
    spec_path = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                           weights=[0.6, 0.3, -0.2],
                           extra={"block_size": 768, "budget": "60%", "index_dir": "idx"})
    manifest = tmp_path / "m.jsonl"
    out = tmp_path / "out"
    assert cli.main(["merge", str(spec_path), str(out), "--manifest", str(manifest)]) == 0
    contents = read_manifest(manifest)
    assert contents.header["type"] == "header" and contents.totals is not None
    assert contents.totals["expert_bytes_read"] == contents.totals["expert_bytes_planned"]

    res = replay(manifest)
    assert res.reads_verified > 0
    assert res.outputs_verified == len(contents.outputs) > 0
    assert res.plan_hash == contents.header["plan_hash"]
    assert cli.main(["replay", str(manifest)]) == 0
    assert "replay OK" in capsys.readouterr().out
    res = replay(manifest, out=tmp_path / "again")
    assert res.tensors_verified == len(tensor_names(fam.base))
    for f in model_files(out):
        assert (tmp_path / "again" / f).read_bytes() == (out / f).read_bytes()

    # modify expert 1 in place (same size) inside a range the plan read
    rec = next(r for r in contents.reads if r["source"] == "expert-1")  # its label
    changed = fam.experts[1] / rec["file"]
    size = changed.stat().st_size
    flip_byte(changed, (rec["start"] + rec["end"]) // 2)
    assert changed.stat().st_size == size

    with pytest.raises(SourceChanged) as exc:
        replay(manifest)
    assert str(changed) in str(exc.value)
    assert "\n" not in str(exc.value)

    new_out = tmp_path / "replayed"
    with pytest.raises(SourceChanged):
        replay(manifest, out=new_out)
    # nothing wrong was written under a final name: every final file present is right
    for p in new_out.iterdir() if new_out.exists() else []:
        assert not p.name.startswith("."), f"partial file left behind: {p}"
        assert p.read_bytes() == (out / p.name).read_bytes(), p
    base_map = json.loads((fam.base / INDEX_NAME).read_text())["weight_map"]
    assert not (new_out / base_map[rec["tensor"]]).exists()

    capsys.readouterr()
    assert cli.main(["replay", str(manifest), "--out", str(tmp_path / "third")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mergefs: error:") and str(changed) in err[0]


def test_changed_source_with_same_identity_is_refused(tmp_path: Path) -> None:
    """Bytes changed behind the index's back (size and mtime kept) are never merged."""
    fam = make_family(tmp_path / "fam", dtype="float32", seed=11)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                           extra={"block_size": BLOCK, "index_dir": "idx"})
    spec = load_spec(spec_path)
    s = Session(spec)
    s.close()
    target = fam.experts[2] / "model.safetensors"
    st_before = target.stat()
    # a row of lm_head that differs from the base: its block is non-zero, so it is read
    rows_e, rows_b = elem_bytes(fam.experts[2], "lm_head.weight"), elem_bytes(fam.base,
                                                                            "lm_head.weight")
    t0 = parse_header(target)["lm_head.weight"][0]
    diff = np.flatnonzero((rows_e != rows_b).any(axis=1))
    assert diff.size
    flip_pos = t0 + int(diff[0]) * 4
    flip_byte(target, flip_pos + 3)
    os.utime(target, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    # The moved ctime would make the index rebuild (test_live_change); without that evidence
    # (an index written before ctimes were recorded) only the identity is checked:
    forget_ctimes(tmp_path / "idx")
    s = Session(load_spec(spec_path))
    assert not s.index_built  # identity unchanged: the stale index is reused...
    out = tmp_path / "out"
    try:
        with pytest.raises(SourceChanged) as exc:
            s.engine.materialise(out)  # ...but the block hashes catch the change
    finally:
        s.close()
    assert str(target) in str(exc.value)
    assert not (out / "model.safetensors").exists()


# -- zero-delta blocks and read accounting ------------------------------------------------------


@pytest.mark.parametrize("budget", ["full", "25%"])
@pytest.mark.parametrize("family_name", ["family_sharded", "family_bf16"])
def test_zero_blocks_never_read(request: pytest.FixtureRequest, index_dir: Path, tmp_path: Path,
                                budget: str, family_name: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec_path = write_case_spec(tmp_path / "s.yaml", fam, "ties", index_dir, budget=budget)
    manifest = tmp_path / "m.jsonl"
    session, _ = run_merge(spec_path, tmp_path / "out", manifest=manifest)
    zero = session.index.zero
    # zero flags agree with the bytes: check against the reference's decoded tensors
    lay = session.index.layout
    for t, name in enumerate(lay.tensors):
        w0 = elem_bytes(fam.base, name)
        for i, e in enumerate(fam.experts):
            wi = elem_bytes(e, name)
            for b in lay.blocks_of(t):
                s, en = int(lay.elem_start[b]), int(lay.elem_end[b])
                assert zero[i, b] == np.array_equal(w0[s:en], wi[s:en]), (name, i, b)
    touched = read_blocks(session, manifest, fam)
    for i, blocks in touched.items():
        assert not any(zero[i, b] for b in blocks), f"expert {i} read a zero-delta block"
        # exactly the planned blocks were read
        assert blocks == set(np.flatnonzero(session.plan.selected[i]).tolist())
        if budget == "full":
            assert blocks == set(np.flatnonzero(~zero[i]).tolist())
    totals = read_manifest(manifest).totals
    assert totals is not None
    assert totals["expert_bytes_read"] == session.plan.planned_bytes


# -- index reuse --------------------------------------------------------------------------------


def test_index_reused_and_rebuilt_when_an_expert_changes(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    fam = make_family(tmp_path / "fam", dtype="bfloat16", seed=5, sharded=True)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, "linear",
                           extra={"block_size": 1024, "index_dir": "idx"})

    def session() -> Session:
        s = Session(load_spec(spec_path))
        s.close()
        return s

    caplog.set_level(logging.INFO, logger="mergefs")
    first = session()
    assert first.index_built
    assert list((tmp_path / "idx").iterdir())
    caplog.clear()
    assert not session().index_built
    assert "building block index" not in caplog.text

    # touch: mtime changes, bytes do not: the expert is hashed and its pieces reused
    shard = sorted(fam.experts[2].glob("*.safetensors"))[1]
    st0 = shard.stat()
    os.utime(shard, ns=(st0.st_atime_ns, st0.st_mtime_ns + 5_000_000_000))
    caplog.clear()
    again = session()
    assert not again.index_built
    assert f"{fam.experts[2]} holds the bytes it was indexed with" in caplog.text
    assert str(fam.experts[0]) not in caplog.text and str(fam.experts[1]) not in caplog.text
    assert np.array_equal(again.index.zero, first.index.zero)
    assert not session().index_built

    # modify: same size, different bytes in expert 0
    shard0 = min(fam.experts[0].glob("*.safetensors"))
    _name, (t0, t1, _dt, _sh) = max(parse_header(shard0).items())
    flip_byte(shard0, (t0 + t1) // 2)
    caplog.clear()
    changed = session()
    assert changed.index_built
    assert str(fam.experts[0]) in caplog.text and str(fam.experts[2]) not in caplog.text
    assert not np.array_equal(changed.index.expert_hash[0], first.index.expert_hash[0])
    assert np.array_equal(changed.index.expert_hash[1:], first.index.expert_hash[1:])


def test_materialise_refuses_non_empty_outdir(family_f32: Family, index_dir: Path,
                                              tmp_path: Path) -> None:
    spec_path = write_case_spec(tmp_path / "s.yaml", family_f32, "linear_base_weighted",
                                index_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(MergefsError, match="not empty"):
        run_merge(spec_path, out)
    assert (out / "keep.txt").read_text() == "x"
    assert not (out / "model.safetensors").exists()


def test_cast_helper_sanity() -> None:
    """The integer RNE helper above agrees with ml_dtypes on ties and carries."""
    x = np.array([1.0, 1.00390625, 1.01171875, 3.0e-39, -2.5, 65504.0, 1.0000001],
                 dtype=np.float32)
    assert np.array_equal(rne_bf16_bits(x), cast_to(x, "BF16").view(np.uint16))


def test_linear_global_weight_applies_to_listed_base(family_f32: Family, index_dir: Path,
                                                     tmp_path: Path) -> None:
    """A global ``weight`` is every listed model's default, the base's included (mergekit)."""
    spec_path = write_spec(tmp_path / "s.yaml", family_f32, "linear", weights=[0.2, 0.7, 0.4],
                           parameters={"weight": 0.5},
                           extra={"block_size": BLOCK, "index_dir": str(index_dir)})
    doc = yaml.safe_load(spec_path.read_text())
    doc["models"].append({"model": doc["base_model"]})  # listed, no weight of its own
    spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert load_spec(spec_path).base_weight == 0.5
    run_merge(spec_path, tmp_path / "out")
    assert_matches(tmp_path / "out", reference_merge_dir(spec_path))


@pytest.mark.parametrize("budget", ["full", "30%"])
@pytest.mark.parametrize("case", ["linear_unnormalized", "task_arithmetic",
                                  "dare_linear_norescale", "dare_ties_norescale"])
def test_block_units_match_reference(family_bf16: Family, index_dir: Path, tmp_path: Path,
                                     case: str, budget: str) -> None:
    """Elementwise operators merged one block at a time (as the mount serves them) give the
    same bytes as the whole-tensor reference: the DARE mask depends on the element index only."""
    spec_path = write_case_spec(tmp_path / "s.yaml", family_bf16, case, index_dir, budget=budget)
    session = Session(load_spec(spec_path))
    try:
        expected = reference_merge_dir(spec_path,
                                       omit_masks=plan_omit_masks(session, family_bf16.base))
        eng = session.engine
        for name in eng.layout.tensors:
            units = eng.units(name)
            assert len(units) == len(eng.layout.blocks_of(eng.tindex[name]))  # one block each
            parts = {u: eng.merge_unit(name, *u) for u in reversed(units)}  # any order
            got = b"".join(parts[u] for u in units)
            assert got == expected[name].tobytes(), name
    finally:
        session.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t", [0.0, 0.3, 0.75, 1.0])
def test_slerp_far_expert_bit_identical(tmp_path_factory: pytest.TempPathFactory, dtype: str,
                                        t: float) -> None:
    """An expert far from the base (cosine well below 0.9995) takes SLERP's spherical branch;
    identical and near-identical tensors take the linear one."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp(f"slerp-{dtype}")
    fam = make_family(root / "fam", n_experts=1, dtype=dtype, seed=13)  # type: ignore[arg-type]
    rng = np.random.default_rng(1013)  # not 13: that stream drew the base itself
    src = fam.experts[0] / "model.safetensors"
    tensors = load_file(str(src))
    base = load_file(str(fam.base / "model.safetensors"))
    cosines = {}
    for k, name in enumerate(sorted(base)):
        if name == INT_TENSOR_NAME or name == "model.norm.weight":
            continue  # integer passthrough; one tensor stays identical to the base
        w0 = base[name].astype(np.float32)
        mix = [0.2, 0.6, 0.9, -0.5][k % 4]  # includes an expert pointing away from the base
        w1 = mix * w0 + rng.normal(0, 0.02, w0.shape).astype(np.float32)
        tensors[name] = w1.astype(base[name].dtype)
        cosines[name] = float((w0 * w1).sum() / np.linalg.norm(w0) / np.linalg.norm(w1))
    save_file(tensors, str(src), metadata={"format": "pt"})
    assert max(abs(c) for c in cosines.values()) < 0.9995, cosines
    spec_path = write_spec(root / "slerp.yaml", fam, "slerp", parameters={"t": t},
                           extra={"block_size": BLOCK, "index_dir": "idx"})
    out = root / "out"
    run_merge(spec_path, out)
    assert_matches(out, reference_merge_dir(spec_path))
    if t == 0.0:  # M = W0 up to the float32 round trip of sin(theta)/sin(theta)
        w0 = read_tensor(fam.base, "lm_head.weight").astype(np.float32)
        np.testing.assert_allclose(read_tensor(out, "lm_head.weight").astype(np.float32), w0,
                                   rtol=1e-2 if dtype == "bfloat16" else 1e-6)
