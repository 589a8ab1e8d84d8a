"""The recipe language against mergekit 0.1.5 in-process: gradients and filters, slices,
passthrough layer stacks and self-stacks, per-tensor coefficients under a budget.

Tiny Llama families (5 layers) written by transformers; mergekit computes in float32 and both
write the family's dtype; outputs must be byte-identical tensor by tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_llama_family

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")

from mergekit_runs import assert_identical, run_mergefs, run_mergekit

from mergefs.engine.session import Session
from mergefs.plan.planner import rounding_terms
from mergefs.recipe.outputs import build_recipe
from mergefs.spec.settings import evaluate
from mergefs.spec.load import load_spec

N_LAYERS = 5
T_TEMPLATE = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
              {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
              {"value": 0.5}]


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_llama_family(tmp_path_factory.mktemp("recipe") / "f", n_experts=3,
                             dtype="bfloat16", seed=5, num_layers=N_LAYERS)


def common(fam: Family, method: str, **extra: Any) -> dict[str, Any]:
    return {"merge_method": method, "dtype": "float32", "out_dtype": fam.dtype, **extra}


def all_layers(model: Path, n: int = N_LAYERS, **params: Any) -> dict[str, Any]:
    src: dict[str, Any] = {"model": str(model), "layer_range": [0, n]}
    if params:
        src["parameters"] = params
    return src


def both(cfg: dict[str, Any], out: Path, budget: str = "full") -> tuple[dict, dict]:
    return run_mergekit(cfg, out / "mk"), run_mergefs(cfg, out / "fs", budget)


def materialise(cfg: dict[str, Any], out: Path, manifest: Path, budget: str = "full") -> Path:
    from mergefs.engine.manifest import ManifestWriter

    spec_path = out.with_suffix(".yaml")
    spec_path.write_text(yaml.safe_dump({**cfg, "block_size": "4KiB", "budget": budget,
                                         "index_dir": str(out.parent / "index")}))
    writer = ManifestWriter(manifest)
    session = Session(load_spec(spec_path), manifest=writer)
    try:
        session.engine.materialise(out)
        session.finish()
    finally:
        writer.close()
        session.close()
    return spec_path


def test_evaluate_matches_mergekit_evaluate_setting() -> None:
    from mergekit.config import ConditionalParameter, evaluate_setting

    from mergefs.methods import get
    from mergefs.spec.settings import check

    pdef = get("slerp").param("t")  # type: ignore[union-attr]
    mk = [ConditionalParameter(**c) for c in T_TEMPLATE]
    ours, problem = check(pdef, T_TEMPLATE)
    assert problem is None
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight",
                 "model.norm.weight"):
        for t in np.linspace(0, 1, 17):
            assert evaluate(pdef, ours, name, float(t)) == evaluate_setting(
                name, mk, float(t), validate=float)


def test_all_layers_slerp_template(fam: Family, tmp_path: Path) -> None:
    cfg = common(fam, "slerp", base_model=str(fam.base),
                 slices=[{"sources": [all_layers(fam.base), all_layers(fam.experts[0])]}],
                 parameters={"t": T_TEMPLATE})
    mk, fs = both(cfg, tmp_path)
    assert set(mk) == set(fs)
    assert_identical(mk, fs)


def test_models_form_gradient_and_filters(fam: Family, tmp_path: Path) -> None:
    """Gradients in a models: spec run over all layers (mergekit's one implicit slice); per-model
    filters fall back to the global setting where no filter matches."""
    cfg = common(fam, "task_arithmetic", base_model=str(fam.base), models=[
        {"model": str(fam.experts[0]),
         "parameters": {"weight": [{"filter": "mlp", "value": [0.2, 1.0]}]}},
        {"model": str(fam.experts[1]), "parameters": {"weight": [1.0, 0.0, 0.5]}},
    ], parameters={"weight": 0.4, "lambda": [1.0, 0.8]})
    mk, fs = both(cfg, tmp_path)
    assert_identical(mk, fs)


def test_ties_gradient_density_one(fam: Family, tmp_path: Path) -> None:
    cfg = common(fam, "ties", base_model=str(fam.base), models=[
        {"model": str(e), "parameters": {"weight": [0.3, 0.9], "density": 1.0}}
        for e in fam.experts[:2]])
    mk, fs = both(cfg, tmp_path)
    assert_identical(mk, fs)


def test_slice_merge_with_gradients(fam: Family, tmp_path: Path) -> None:
    """Two slices merging different layer ranges, slice-level parameters and a slice source's
    own parameter, renumbered into a 4-layer output."""
    cfg = common(fam, "linear", slices=[
        {"sources": [{"model": str(fam.experts[0]), "layer_range": [0, 2],
                      "parameters": {"weight": [1.0, 0.2]}},
                     {"model": str(fam.experts[1]), "layer_range": [1, 3]}],
         "parameters": {"weight": 0.5}},
        {"sources": [{"model": str(fam.experts[0]), "layer_range": [3, 5]},
                     {"model": str(fam.experts[1]), "layer_range": [3, 5]}],
         "parameters": {"weight": {"filter": "mlp", "value": [0.1, 0.9]}}},
    ], parameters={"weight": 0.7})
    mk, fs = both(cfg, tmp_path)
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    config = json.loads((tmp_path / "fs" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4


def test_passthrough_layer_stack(fam: Family, tmp_path: Path) -> None:
    """A frankenmerge: layers of two models stacked, with a per-slice scale filter."""
    cfg = common(fam, "passthrough", slices=[
        {"sources": [{"model": str(fam.experts[0]), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(fam.experts[1]), "layer_range": [2, 5]}],
         "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}},
    ])
    mk, fs = both(cfg, tmp_path)
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    config = json.loads((tmp_path / "fs" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6


def test_self_stack_reads_each_source_once(fam: Family, tmp_path: Path) -> None:
    cfg = common(fam, "passthrough", slices=[
        {"sources": [all_layers(fam.base)]}, {"sources": [all_layers(fam.base)]}])
    mk, fs = both(cfg, tmp_path)
    assert set(mk) == set(fs) and len(fs) > 0
    assert_identical(mk, fs)
    assert any(".9." in n for n in fs)
    manifest = tmp_path / "m.jsonl"
    materialise(cfg, tmp_path / "again", manifest)
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    reads = [(r["file"], r["start"], r["end"]) for r in records if r["type"] == "read"]
    assert len(reads) == len(set(reads)), "a source range was read twice"
    weights = sum(f.stat().st_size for f in fam.base.glob("*.safetensors"))
    assert sum(e - s for _, s, e in reads) <= weights


def test_per_tensor_coefficients_under_budget(fam: Family, tmp_path: Path) -> None:
    """A filter giving mlp weight 0: the planner never reads an mlp block (|c| = 0), never
    exceeds the budget, and its additive bound uses the per-tensor coefficients."""
    cfg = common(fam, "task_arithmetic", base_model=str(fam.base), models=[
        {"model": str(e), "parameters": {"weight": [{"filter": "mlp", "value": 0.0},
                                                    {"value": [0.2, 1.0]}]}}
        for e in fam.experts[:2]])
    for budget in ("5%", "30%", "full"):
        spec_path = tmp_path / f"s{budget.strip('%')}.yaml"
        spec_path.write_text(yaml.safe_dump({**cfg, "block_size": "4KiB", "budget": budget,
                                             "index_dir": str(tmp_path / "index")}))
        session = Session(load_spec(spec_path))
        try:
            plan, lay = session.plan, session.index.layout
            assert plan.planned_bytes <= plan.budget_bytes
            coeffs = session.recipe.coefficients(session.spec, lay.tensors)[:, lay.tensor_of]
            mlp = np.array(["mlp" in lay.tensors[t] for t in lay.tensor_of])
            assert (coeffs[:, mlp] == 0).all() and (coeffs[:, ~mlp] > 0).all()
            assert len({round(float(c), 6) for c in coeffs[0, ~mlp]}) > 1  # a gradient
            omitted = ~session.index.zero & ~plan.selected
            per_pair = np.abs(coeffs) * session.index.norms * omitted
            # + the output rounding of each block with an omitted delta (mergefs.plan.planner)
            rho = rounding_terms(session.spec, session.index, coeffs,
                                 ~session.index.zero & plan.selected)
            assert rho is not None and (rho[~omitted.any(axis=0)] == 0).all()
            before = per_pair.sum(axis=0)
            assert plan.bound_tight == pytest.approx(
                float(np.sqrt((before ** 2).sum())), rel=1e-12, abs=1e-300)
            assert plan.bound_loose == pytest.approx(float(before.sum()), rel=1e-12, abs=1e-300)
            per_block = before + rho
            assert plan.bound_output_tight == pytest.approx(
                float(np.sqrt((per_block ** 2).sum())), rel=1e-12, abs=1e-300)
            assert plan.bound_output_loose == pytest.approx(float(per_block.sum()), rel=1e-12,
                                                            abs=1e-300)
            if budget == "full":
                assert plan.bound_tight == plan.bound_output_tight == 0.0
            else:
                assert plan.bound_tight > 0
        finally:
            session.close()
    mk, fs = both(cfg, tmp_path / "full")
    assert_identical(mk, fs)


def test_recipe_units_and_positions(fam: Family, tmp_path: Path) -> None:
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump(common(fam, "passthrough", slices=[
        {"sources": [all_layers(fam.base, 3)]}, {"sources": [all_layers(fam.base, 3)]}])))
    spec = load_spec(spec_path)
    from mergefs.sources import open_source

    base = open_source(spec.base)
    recipe = build_recipe(spec, {spec.base: list(base.tensors)})
    base.close()
    assert recipe.layers is not None and len(recipe.layers) == 6
    by_name = {o.name: o for o in recipe.outputs}
    q3 = by_name["model.layers.3.self_attn.q_proj.weight"]
    assert q3.sources == ("model.layers.0.self_attn.q_proj.weight",)
    assert q3.key == "model.layers.0.self_attn.q_proj.weight"
    assert by_name["model.layers.4.mlp.up_proj.weight"].t == 0.5


# -- through the mount and replay -----------------------------------------------------------------

needs_fuse = pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")


def spec_file(cfg: dict[str, Any], path: Path, budget: str = "full") -> Path:
    path.write_text(yaml.safe_dump({**cfg, "block_size": "4KiB", "budget": budget,
                                    "index_dir": str(path.parent / "index")}))
    return path


def sliced_cases(fam: Family) -> dict[str, tuple[dict[str, Any], str]]:
    return {
        "slerp-template": (common(fam, "slerp", base_model=str(fam.base), slices=[
            {"sources": [all_layers(fam.base), all_layers(fam.experts[0])]}],
            parameters={"t": T_TEMPLATE}), "60%"),
        "layer-stack": (common(fam, "passthrough", slices=[
            {"sources": [{"model": str(fam.experts[0]), "layer_range": [0, 3]}]},
            {"sources": [{"model": str(fam.experts[1]), "layer_range": [2, 5]}],
             "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}}]),
            "full"),
        "filtered-task-arithmetic": (common(fam, "task_arithmetic", base_model=str(fam.base),
                                            models=[{"model": str(e), "parameters": {"weight": [
                                                {"filter": "mlp", "value": [0.1, 0.9]},
                                                {"value": 0.5}]}} for e in fam.experts[:2]]),
                                     "30%"),
    }


@pytest.mark.mount
@needs_fuse
@pytest.mark.parametrize("case", ["slerp-template", "layer-stack", "filtered-task-arithmetic"])
def test_mount_equals_merge(case: str, fam: Family, tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    cfg, budget = sliced_cases(fam)[case]
    spec = spec_file(cfg, tmp_path / "spec.yaml", budget)
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    stats = m.stats()
    assert stats["expert_bytes_read"] <= stats["planned_expert_bytes"]


@pytest.mark.mount
@needs_fuse
def test_mount_of_a_self_stack_serves_twice_the_layers(fam: Family, tmp_path: Path,
                                                       mounts: Any) -> None:
    from mounting import merge, sha256
    from transformers import AutoModelForCausalLM
    from viewcases import tree

    cfg = common(fam, "passthrough", slices=[{"sources": [all_layers(fam.base)]},
                                             {"sources": [all_layers(fam.base)]}])
    spec = spec_file(cfg, tmp_path / "spec.yaml")
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    model = AutoModelForCausalLM.from_pretrained(m.path)
    assert model.config.num_hidden_layers == 2 * N_LAYERS
    assert len(model.model.layers) == 2 * N_LAYERS
    weights = sum(f.stat().st_size for f in fam.base.glob("*.safetensors"))
    assert m.stats()["physical_bytes_read"]["base"] <= weights  # each source block once


@pytest.mark.parametrize("case", ["layer-stack", "slerp-template", "filtered-task-arithmetic"])
def test_replay_of_a_recipe_merge(case: str, fam: Family, tmp_path: Path) -> None:
    from mergefs import cli

    cfg, budget = sliced_cases(fam)[case]
    manifest = tmp_path / "m.jsonl"
    materialise(cfg, tmp_path / "out", manifest, budget)
    assert cli.main(["replay", str(manifest), "--out", str(tmp_path / "replayed")]) == 0
    from mounting import sha256

    assert sha256(tmp_path / "out" / "model.safetensors") == \
        sha256(tmp_path / "replayed" / "model.safetensors")


# -- multi-document specs (mergekit-multi) --------------------------------------------------------

def test_multi_document_equals_mergekit_multi(fam: Family, tmp_path: Path) -> None:
    from mergekit.scripts.multimerge import main as multimerge
    from mergekit_runs import load_dir

    docs = [
        {"name": "soup", "merge_method": "linear", "dtype": "float32", "out_dtype": fam.dtype,
         "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.7}},
                    {"model": str(fam.experts[1]), "parameters": {"weight": 0.3}}]},
        {"merge_method": "slerp", "base_model": str(fam.base), "dtype": "float32",
         "out_dtype": fam.dtype,
         "slices": [{"sources": [all_layers(fam.base), all_layers("soup")]}],  # type: ignore
         "parameters": {"t": T_TEMPLATE}},
    ]
    mk_cfg = tmp_path / "mk.yaml"
    mk_cfg.write_text(yaml.safe_dump_all(docs))
    multimerge([str(mk_cfg), "--intermediate-dir", str(tmp_path / "mk-inter"), "--out-path",
                str(tmp_path / "mk"), "--no-copy-tokenizer"], standalone_mode=False)
    fs_docs = [dict(d) for d in docs]
    fs_docs[1] = {**fs_docs[1], "intermediate_dir": str(tmp_path / "fs-inter"),
                  "block_size": "4KiB", "index_dir": str(tmp_path / "index")}
    spec = tmp_path / "fs.yaml"
    spec.write_text(yaml.safe_dump_all(fs_docs))
    from mergefs import cli

    assert cli.main(["merge", str(spec), str(tmp_path / "fs")]) == 0
    assert_identical(load_dir(tmp_path / "mk"), load_dir(tmp_path / "fs"))
    assert_identical(load_dir(tmp_path / "mk-inter" / "soup"),
                     load_dir(tmp_path / "fs-inter" / "soup"))
    assert len(load_dir(tmp_path / "mk")) > 0 and len(load_dir(tmp_path / "mk-inter" / "soup"))
    mtime = (tmp_path / "fs-inter" / "soup" / "model.safetensors").stat().st_mtime_ns
    assert cli.main(["merge", str(spec), str(tmp_path / "fs2")]) == 0  # reused, not redone
    assert (tmp_path / "fs-inter" / "soup" / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.mount
@needs_fuse
def test_mount_of_a_multi_document_spec(fam: Family, tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    docs = [
        {"name": "stack", "merge_method": "passthrough", "dtype": "float32",
         "slices": [{"sources": [all_layers(fam.experts[0], 3)]},
                    {"sources": [all_layers(fam.experts[0], 3)]}]},
        {"name": "stack-b", "merge_method": "passthrough", "dtype": "float32",
         "slices": [{"sources": [all_layers(fam.experts[1], 3)]},
                    {"sources": [all_layers(fam.experts[1], 3)]}]},
        {"merge_method": "task_arithmetic", "base_model": "stack", "dtype": "float32",
         "models": [{"model": "stack-b", "parameters": {"weight": 0.5}}],
         "block_size": "4KiB", "budget": "50%", "index_dir": str(tmp_path / "index"),
         "intermediate_dir": str(tmp_path / "inter")},
    ]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump_all(docs))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    assert json.loads((m.path / "config.json").read_text())["num_hidden_layers"] == 6


def test_slice_level_required_parameter(fam: Family, tmp_path: Path) -> None:
    """slerp's t given only on the slices (a different gradient each), none globally."""
    cfg = common(fam, "slerp", base_model=str(fam.base), slices=[
        {"sources": [{"model": str(fam.base), "layer_range": [0, 2]},
                     {"model": str(fam.experts[2]), "layer_range": [0, 2]}],
         "parameters": {"t": [0.1, 0.9]}},
        {"sources": [{"model": str(fam.base), "layer_range": [2, 5]},
                     {"model": str(fam.experts[2]), "layer_range": [2, 5]}],
         "parameters": {"t": {"filter": "mlp", "value": [0.8, 0.2]}}},
    ])
    cfg["slices"][1]["parameters"]["t"] = [cfg["slices"][1]["parameters"]["t"], {"value": 0.3}]
    mk, fs = both(cfg, tmp_path)
    assert set(mk) == set(fs)
    assert_identical(mk, fs)


def test_output_inside_a_slice_only_model_is_refused(fam: Family, tmp_path: Path) -> None:
    """A model only a later slice reads is a source too: no output may land in it."""
    from mergefs import cli

    cfg, _ = sliced_cases(fam)["layer-stack"]
    spec = spec_file(cfg, tmp_path / "spec.yaml")
    assert cli.main(["merge", str(spec), str(fam.experts[1] / "merged")]) == 1
    assert not (fam.experts[1] / "merged").exists()


def test_intermediate_dir_inside_a_source_is_refused(fam: Family, tmp_path: Path) -> None:
    """An intermediate merge is an output too: never written into a source (issue 10's rule)."""
    from mergefs import cli

    docs = [
        {"name": "stack", "merge_method": "passthrough", "dtype": "float32",
         "slices": [{"sources": [all_layers(fam.experts[0], 3)]}]},
        {"merge_method": "task_arithmetic", "base_model": str(fam.base), "dtype": "float32",
         "models": [{"model": "stack", "parameters": {"weight": 0.5}}],
         "index_dir": str(tmp_path / "index"),
         "intermediate_dir": str(fam.base / "inter")},
    ]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump_all(docs))
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 1
    assert not (fam.base / "inter").exists()
    assert not (tmp_path / "out").exists()
