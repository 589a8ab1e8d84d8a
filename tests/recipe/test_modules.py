"""``modules:`` (per-module slices of multimodal models) against mergekit 0.1.5 in-process.

A tiny Mistral3ForConditionalGeneration family (text decoder 3 layers, vision tower 2 layers,
multi-modal projector), tensors named as mergekit's architecture definition names them, one
tensor outside every module (mergekit drops it). Outputs must be byte-identical tensor by
tensor, config.json must carry each module's output layer count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")
transformers = pytest.importorskip("transformers")

from mergekit_runs import assert_identical, run_mergefs, run_mergekit

from mergefs.core.errors import SpecError
from mergefs.recipe.modules import read_modules

TEXT_LAYERS, VISION_LAYERS = 3, 2
needs_fuse = pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")


def mistral3_config() -> dict[str, Any]:
    cfg = transformers.Mistral3Config(
        vision_config={"num_hidden_layers": VISION_LAYERS, "hidden_size": 16,
                       "intermediate_size": 32, "num_attention_heads": 2, "head_dim": 8,
                       "image_size": 28, "patch_size": 14},
        text_config={"hidden_size": 16, "num_hidden_layers": TEXT_LAYERS,
                     "num_attention_heads": 2, "num_key_value_heads": 2,
                     "intermediate_size": 32, "vocab_size": 64, "head_dim": 8})
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    out: dict[str, Any] = cfg.to_dict()
    out["num_hidden_layers"] = TEXT_LAYERS  # a top-level count too, as some configs have
    return out


def tensor_names(config: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for mod in read_modules(config, "test").values():
        names += [w.name for w in mod.pre]
        for i in range(mod.n_layers):
            names += [w.name for w in mod.layer(i)]
        names += [w.name for w in mod.post]
    return names


def write_model(path: Path, config: dict[str, Any], seed: int,
                base: dict[str, Any] | None = None) -> dict[str, Any]:
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {}
    for k, name in enumerate([*tensor_names(config), "unused_head.weight"]):
        shape = (16,) if "norm" in name else (8, 16)
        if base is None:
            w = rng.standard_normal(shape).astype(np.float32)
        else:
            w = base[name].float().numpy() + 0.05 * rng.standard_normal(shape).astype(np.float32)
        tensors[name] = torch.from_numpy(w).to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modules")
    config = mistral3_config()
    base = write_model(root / "base", config, 0)
    for k in (1, 2):
        write_model(root / f"e{k}", config, k, base)
    return {"base": root / "base", "e1": root / "e1", "e2": root / "e2"}


def layers(model: Path, n: int, **params: Any) -> dict[str, Any]:
    src: dict[str, Any] = {"model": str(model), "layer_range": [0, n]}
    if params:
        src["parameters"] = params
    return src


def task_arithmetic(fam: dict[str, Path]) -> dict[str, Any]:
    """Every precedence level: slice source (a gradient), module, global; the models form of
    two modules (mergekit appends the base) beside the slices form of the text decoder."""
    return {
        "merge_method": "task_arithmetic", "base_model": str(fam["base"]),
        "dtype": "float32", "out_dtype": "bfloat16", "parameters": {"weight": 1.0},
        "modules": {
            "text_decoder": {
                "slices": [{"sources": [
                    layers(fam["e1"], TEXT_LAYERS, weight=[0.2, 0.9]),
                    layers(fam["e2"], TEXT_LAYERS),
                    layers(fam["base"], TEXT_LAYERS)]}],
                "parameters": {"weight": 0.3}},
            "vision_tower": {"models": [
                {"model": str(fam["e1"]), "parameters": {"weight": 0.7}},
                {"model": str(fam["e2"])}]},
            "multi_modal_projector": {
                "models": [{"model": str(fam["e1"])}, {"model": str(fam["e2"])}],
                "parameters": {"weight": [{"filter": "linear_1", "value": 0.2},
                                          {"value": 0.9}]}},
        },
    }


def test_task_arithmetic_modules_equal_mergekit(fam: dict[str, Path], tmp_path: Path) -> None:
    cfg = task_arithmetic(fam)
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs) and "unused_head.weight" not in fs
    assert_identical(mk, fs)
    base = run_mergefs({**cfg, "parameters": {"weight": 0.0}}, tmp_path / "zero")
    assert any(not torch.equal(fs[n], base[n]) for n in fs)  # the merge did something


def test_passthrough_module_stack(fam: dict[str, Path], tmp_path: Path) -> None:
    """A text decoder of 4 layers stacked from two models; the vision tower of the base;
    the projector of one expert; each module's layer count rewritten in config.json."""
    cfg = {"merge_method": "passthrough", "dtype": "float32", "out_dtype": "bfloat16",
           "modules": {
               "text_decoder": {"slices": [
                   {"sources": [{"model": str(fam["e1"]), "layer_range": [0, 2]}]},
                   {"sources": [{"model": str(fam["e2"]), "layer_range": [1, 3]}],
                    "parameters": {"scale": [{"filter": "o_proj", "value": 0.5},
                                             {"value": 1.0}]}}]},
               "vision_tower": {"slices": [
                   {"sources": [{"model": str(fam["base"]), "layer_range": [1, 2]}]}]},
               "multi_modal_projector": {"models": [{"model": str(fam["e2"])}]}}}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    assert "language_model.model.layers.3.self_attn.o_proj.weight" in fs
    assert "vision_tower.transformer.layers.1.attention.q_proj.weight" not in fs
    config = json.loads((tmp_path / "fs" / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 4
    assert config["vision_config"]["num_hidden_layers"] == 1
    mk_config = json.loads((tmp_path / "mk" / "config.json").read_text())
    assert mk_config["text_config"]["num_hidden_layers"] == 4
    assert mk_config["vision_config"]["num_hidden_layers"] == 1


def test_a_module_only_spec_outputs_only_that_module(fam: dict[str, Path],
                                                     tmp_path: Path) -> None:
    cfg = {"merge_method": "linear", "dtype": "float32", "out_dtype": "bfloat16",
           "modules": {"vision_tower": {"models": [
               {"model": str(fam["e1"]), "parameters": {"weight": 0.25}},
               {"model": str(fam["e2"]), "parameters": {"weight": 0.75}}]}}}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs) and all(n.startswith("vision_tower.") for n in fs)
    assert_identical(mk, fs)


def test_unknown_module_is_named(fam: dict[str, Path], tmp_path: Path) -> None:
    cfg = {"merge_method": "linear", "modules": {"audio_tower": {"models": [
        {"model": str(fam["e1"]), "parameters": {"weight": 1.0}}]}}}
    with pytest.raises(SpecError, match=r"modules\.audio_tower: not a module of .*"
                                        r"text_decoder, multi_modal_projector, vision_tower"):
        run_mergefs(cfg, tmp_path / "fs")
    assert not (tmp_path / "fs").exists()


def test_modules_with_slices_and_models_both_refused(fam: dict[str, Path],
                                                     tmp_path: Path) -> None:
    from mergefs.spec.load import parse_spec

    cfg = {"merge_method": "linear", "models": [{"model": str(fam["e1"])}],
           "modules": {"vision_tower": {"models": [{"model": str(fam["e1"])}]}}}
    with pytest.raises(SpecError, match="modules: give only one of models, slices or modules"):
        parse_spec(cfg, tmp_path)


def base_alone(fam: dict[str, Path]) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": str(fam["base"]),
            "out_dtype": "float16", "modules": {
                "text_decoder": {"models": [{"model": str(fam["e1"]),
                                             "parameters": {"weight": 0.5}}]},
                "vision_tower": {"models": [{"model": str(fam["base"])}]}}}


@pytest.mark.mount
@needs_fuse
@pytest.mark.parametrize("which", ["task_arithmetic", "base_alone"])
def test_mount_of_a_modules_spec_equals_merge(fam: dict[str, Path], tmp_path: Path,
                                              mounts: Any, which: str) -> None:
    import yaml
    from mounting import merge, sha256
    from viewcases import tree

    cfg = task_arithmetic(fam) if which == "task_arithmetic" else base_alone(fam)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**cfg, "block_size": "4KiB",
                                    "budget": "50%", "index_dir": str(tmp_path / "index")}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    stats = m.stats()
    assert stats["expert_bytes_read"] <= stats["planned_expert_bytes"]


def test_replay_of_a_modules_merge(fam: dict[str, Path], tmp_path: Path) -> None:
    import yaml
    from mounting import sha256

    from mergefs import cli

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**task_arithmetic(fam), "block_size": "4KiB",
                                    "index_dir": str(tmp_path / "index")}))
    manifest = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--manifest",
                     str(manifest)]) == 0
    assert cli.main(["replay", str(manifest), "--out", str(tmp_path / "replayed")]) == 0
    assert sha256(tmp_path / "out" / "model.safetensors") == \
        sha256(tmp_path / "replayed" / "model.safetensors")


def test_a_module_without_a_layer_count_leaves_config_alone(fam: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """The projector has no layer-count key: config.json keeps every count (review finding:
    the slices rewrite set num_hidden_layers to the module's layer total)."""
    cfg = {"merge_method": "linear", "dtype": "float32", "out_dtype": "bfloat16",
           "modules": {"multi_modal_projector": {"models": [
               {"model": str(fam["e1"]), "parameters": {"weight": 0.5}},
               {"model": str(fam["e2"]), "parameters": {"weight": 0.5}}]}}}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    src = json.loads((fam["e1"] / "config.json").read_text())
    out = json.loads((tmp_path / "fs" / "config.json").read_text())
    assert out["text_config"] == src["text_config"]
    assert out["vision_config"] == src["vision_config"]
    assert out["num_hidden_layers"] == src["num_hidden_layers"] == TEXT_LAYERS


def test_modules_with_different_models_are_refused_naming_the_module(
        fam: dict[str, Path], tmp_path: Path) -> None:
    from mergefs.spec.load import parse_spec

    cfg = {"merge_method": "task_arithmetic", "base_model": str(fam["base"]),
           "modules": {"text_decoder": {"models": [{"model": str(fam["e1"])},
                                                   {"model": str(fam["e2"])}]},
                       "vision_tower": {"models": [{"model": str(fam["e1"])}]}}}
    with pytest.raises(SpecError, match=r"modules\.vision_tower\.models: 2 model\(s\), the "
                                        r"base at 1, where modules\.text_decoder\.models has 3 "
                                        r"model\(s\), the base at 2"):
        parse_spec(cfg, tmp_path)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_a_module_of_the_base_alone_equals_mergekit(fam: dict[str, Path], tmp_path: Path,
                                                    out_dtype: str) -> None:
    """The common multimodal recipe: merge the text decoder, keep the base's vision tower and
    projector (mergekit's task-arithmetic family returns the base tensor for a group without
    other models); listed first, so the lead slice is not the first."""
    cfg = {"merge_method": "ties", "base_model": str(fam["base"]), "dtype": "float32",
           "out_dtype": out_dtype, "parameters": {"density": 1.0},
           "modules": {
               "vision_tower": {"slices": [{"sources": [
                   {"model": str(fam["base"]), "layer_range": [0, VISION_LAYERS]}]}]},
               "text_decoder": {"models": [
                   {"model": str(fam["e1"]), "parameters": {"weight": 0.7}},
                   {"model": str(fam["e2"]), "parameters": {"weight": 0.4}}]},
               "multi_modal_projector": {"models": [{"model": str(fam["base"])}]},
           }}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    base = load_file_f32(fam["base"])
    assert all(torch.equal(fs[n].float(), base[n]) for n in fs if n.startswith("vision_tower."))
    assert any(not torch.equal(fs[n].float(), base[n]) for n in fs
               if n.startswith("language_model."))


def load_file_f32(model: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(model / "model.safetensors")).items()}


def test_a_missing_tied_weight_is_loaded_as_the_one_it_is_tied_to(
        fam: dict[str, Path], tmp_path: Path) -> None:
    """An expert without lm_head (a tied model): lm_head is read as its embed_tokens, as
    mergekit's loader does with the architecture's tied names."""
    import shutil

    from safetensors.torch import load_file, save_file

    e3 = tmp_path / "e3"
    shutil.copytree(fam["e2"], e3)
    tensors = load_file(str(e3 / "model.safetensors"))
    del tensors["language_model.lm_head.weight"]
    save_file(tensors, str(e3 / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"merge_method": "linear", "dtype": "float32", "out_dtype": "bfloat16",
           "modules": {"text_decoder": {"models": [
               {"model": str(fam["e1"]), "parameters": {"weight": 0.5}},
               {"model": str(e3), "parameters": {"weight": 0.5}}]}}}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert "language_model.lm_head.weight" in fs
    assert_identical(mk, fs)


def test_output_refused_inside_any_model_of_a_role(fam: dict[str, Path], tmp_path: Path) -> None:
    """A frankenmerge role spans two models: an output inside the second is refused too."""
    from mergefs.recipe.family import open_family
    from mergefs.engine.output import UnsafePath, check_source_files
    from mergefs.spec.load import parse_spec

    cfg = {"merge_method": "passthrough", "modules": {"text_decoder": {"slices": [
        {"sources": [{"model": str(fam["e1"]), "layer_range": [0, 1]}]},
        {"sources": [{"model": str(fam["e2"]), "layer_range": [1, 2]}]}]}}}
    base, experts = open_family(parse_spec(cfg, tmp_path))
    try:
        for model in ("e1", "e2"):
            with pytest.raises(UnsafePath, match="a file of the source"):
                check_source_files(fam[model], [base, *experts])
    finally:
        base.close()
