"""Mixed input dtypes (an fp16 or bf16 expert beside an fp32 base, or the reverse): each source
is decoded with its own dtype and merged in float32, as mergekit promotes; budgets charge each
expert's own bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from families import Family, make_family, make_llama_family, write_spec
from reference import read_tensor, reference_merge_dir, tensor_dtype, tensor_names
from safetensors.numpy import load_file, save_file

from mergefs import cli
from mergefs.sources import open_source
from mergefs.core.errors import SpecError
from mergefs.recipe.family import check_coordinates

CASTS = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32}


def recast(src: Path, dst: Path, dtype: str) -> Path:
    """A copy of model directory ``src`` with every floating tensor cast to ``dtype``."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v.astype(CASTS[dtype]) if v.dtype.kind == "f" or v.dtype ==
                   ml_dtypes.bfloat16 else v for k, v in tensors.items()}, str(f),
                  metadata={"format": "pt"})
    return dst


def mixed(fam: Family, root: Path, dtypes: list[str]) -> Family:
    experts = [recast(e, root / f"{e.name}-{dt}", dt) for e, dt in zip(fam.experts, dtypes)]
    return Family(fam.base, experts, fam.root, fam.dtype, fam.tensor_names)


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp("mixed")
    return mixed(make_family(root / "f32", n_experts=2, seed=13), root, ["F16", "BF16"])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp("mixed_sharded")
    f = make_family(root / "f16", n_experts=2, seed=17, dtype="float16", sharded=True,
                    expert_layout="reversed")
    return mixed(f, root, ["F32", "BF16"])


def test_coordinates_accept_float_dtypes_only(fam: Family) -> None:
    base = open_source(fam.base)
    experts = [open_source(e) for e in fam.experts]
    assert {experts[0].tensors[n].dtype for n in fam.tensor_names} >= {"F16"}
    check_coordinates(base, experts)  # F16 and BF16 experts beside an F32 base: fine


def test_non_float_dtype_differences_are_still_refused(fam: Family, tmp_path: Path) -> None:
    bad = recast(fam.experts[0], tmp_path / "bad", "F16")
    f = bad / "model.safetensors"
    t = load_file(str(f))
    t["buffers.position_ids"] = t["buffers.position_ids"].astype(np.int32)
    save_file(t, str(f))
    with pytest.raises(SpecError, match=r"buffers\.position_ids: I32\[.*vs base I64"):
        check_coordinates(open_source(fam.base), [open_source(bad)])


@pytest.mark.parametrize("which", ["fam", "sharded"])
@pytest.mark.parametrize("method, params, models, extra", [
    ("task_arithmetic", {"lambda": 0.9}, None, {}),
    ("ties", {"lambda": 1.0}, [{"density": 0.5}, {"density": 0.7}], {}),
    ("linear", {}, None, {"dtype": "bfloat16"}),
])
def test_full_budget_merge_equals_the_reference(which: str, method: str, params: dict[str, Any],
                                                models: list[dict[str, Any]] | None,
                                                extra: dict[str, Any], tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    family: Family = request.getfixturevalue(which)
    spec = write_spec(tmp_path / "spec.yaml", family, method, weights=[0.6, -0.3],
                      parameters=params, model_parameters=models,
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx"), **extra})
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 0
    want = reference_merge_dir(spec)
    assert tensor_names(tmp_path / "out") == sorted(want)
    for name, arr in want.items():
        got = read_tensor(tmp_path / "out", name)
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes(), name


def test_slerp_with_a_bf16_expert(fam: Family, tmp_path: Path) -> None:
    one = Family(fam.base, fam.experts[1:], fam.root, fam.dtype, fam.tensor_names)
    spec = write_spec(tmp_path / "spec.yaml", one, "slerp", parameters={"t": 0.3},
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx")})
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 0
    for name, arr in reference_merge_dir(spec).items():
        assert read_tensor(tmp_path / "out", name).tobytes() == arr.tobytes(), name


def test_budget_charges_each_experts_own_bytes(sharded: Family, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An F32 expert beside an F16 base costs twice the base's bytes per block: a plan
    charging the base's block sizes would read more than its budget."""
    spec = write_spec(tmp_path / "spec.yaml", sharded, "task_arithmetic", weights=[0.5, 0.5],
                      extra={"block_size": 512, "budget": "30%",
                             "index_dir": str(tmp_path / "idx")})
    assert cli.main(["plan", str(spec), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    float_bytes = [sum(loc.size_bytes for loc in open_source(e).tensors.values()
                       if loc.dtype != "I64") for e in sharded.experts]
    assert rep["total_expert_bytes"] == sum(float_bytes)
    assert 0 < rep["planned_expert_bytes"] <= rep["budget_bytes"]
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 0
    records = [json.loads(x) for x in (tmp_path / "spec.manifest.jsonl").read_text().splitlines()]
    read = sum(r["end"] - r["start"] for r in records
               if r["type"] == "read" and r["source"] != "base")
    assert read == rep["planned_expert_bytes"] <= rep["budget_bytes"]
    totals = next(r for r in records if r["type"] == "totals")
    assert totals["expert_bytes_read"] == read == totals["expert_bytes_planned"]


def test_mergekit_agrees_on_a_mixed_family(tmp_path: Path) -> None:
    """mergekit 0.1.5 in process: an fp32 Llama base, an fp16 and a bf16 fine-tune."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    f32 = make_llama_family(tmp_path / "f32", n_experts=2, seed=3)
    e16 = make_llama_family(tmp_path / "f16", n_experts=2, seed=3, dtype="float16").experts[0]
    ebf = make_llama_family(tmp_path / "bf16", n_experts=2, seed=3,
                            dtype="bfloat16").experts[1]
    doc = {"merge_method": "task_arithmetic", "base_model": str(f32.base),
           "models": [{"model": str(e16), "parameters": {"weight": 0.7}},
                      {"model": str(ebf), "parameters": {"weight": 0.4}}],
           "parameters": {"lambda": 1.0}}
    run_merge(MergeConfiguration.model_validate(doc), str(tmp_path / "mk"),
              MergeOptions(copy_tokenizer=False, lazy_unpickle=False))
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({**doc, "index_dir": str(tmp_path / "idx")}))
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 0
    for name in tensor_names(tmp_path / "mk"):
        want, got = read_tensor(tmp_path / "mk", name), read_tensor(tmp_path / "out", name)
        assert tensor_dtype(tmp_path / "out", name) == tensor_dtype(f32.base, name), name
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name  # bit for bit
