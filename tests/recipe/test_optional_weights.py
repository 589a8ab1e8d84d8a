"""Optional weights that only some models have, against mergekit 0.1.5 in-process.

A tiny GraniteForCausalLM family (mergekit's architecture makes every attention and MLP bias
optional) given as ``modules: {default: ...}``: the biases are in some models only. mergekit
merges such a weight over the models that have it (by the method's policy: the one model that
has it passes through for slerp, the tensor is skipped for model_stock with fewer than three
inputs), and refuses it where the method needs the base's and the base lacks it.
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

LAYERS = 2
BIAS = "model.layers.1.self_attn.q_proj.bias"


def granite_config() -> dict[str, Any]:
    cfg = transformers.GraniteConfig(hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=LAYERS, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=8,
                                     tie_word_embeddings=False)
    cfg.architectures = ["GraniteForCausalLM"]
    out: dict[str, Any] = cfg.to_dict()
    return out


def write_model(path: Path, seed: int, biases: bool, base: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    from safetensors.torch import save_file

    config = granite_config()
    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {}
    mod = read_modules(config, "test")["default"]
    weights = [*mod.pre, *(w for i in range(mod.n_layers) for w in mod.layer(i)), *mod.post]
    for w in weights:
        if w.optional and w.name.endswith(".bias") and not biases:
            continue
        shape = (16,) if "norm" in w.name or w.name.endswith(".bias") else (8, 16)
        x = rng.standard_normal(shape).astype(np.float32)
        if base is not None and w.name in base:
            x = base[w.name] + 0.05 * x
        tensors[w.name] = x
    path.mkdir(parents=True)
    save_file({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy()
            for k, v in tensors.items()}


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base and e1 without biases; e2 and e3 with them; b_base: a base with biases."""
    root = tmp_path_factory.mktemp("optional")
    base = write_model(root / "base", 0, False)
    biased = write_model(root / "b_base", 5, True)
    write_model(root / "e1", 1, False, base)
    write_model(root / "e2", 2, True, {**biased, **base})
    write_model(root / "e3", 3, True, {**biased, **base})
    return {n: root / n for n in ("base", "b_base", "e1", "e2", "e3")}


def modules(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"default": {"models": models}}


def cases(f: dict[str, Path]) -> dict[str, dict[str, Any]]:
    m = {k: str(v) for k, v in f.items()}
    return {
        # no base: the biases are the e2/e3 average (e1 lacks them)
        "linear": {"merge_method": "linear", "modules": modules([
            {"model": m["e1"], "parameters": {"weight": 0.5}},
            {"model": m["e2"], "parameters": {"weight": 0.3}},
            {"model": m["e3"], "parameters": {"weight": 0.2}}])},
        # the base has them, one expert of two: merged over the base and that expert
        "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": m["b_base"],
                            "modules": modules([
                                {"model": m["e1"], "parameters": {"weight": 0.7}},
                                {"model": m["e2"], "parameters": {"weight": 0.4}}])},
        # the base has them, no expert: the base's
        "ties_base_alone": {"merge_method": "ties", "base_model": m["b_base"],
                            "parameters": {"density": 1.0},
                            "modules": modules([{"model": m["e1"],
                                                 "parameters": {"weight": 0.7}}])},
        # slerp: the one model that has it passes through
        "slerp": {"merge_method": "slerp", "base_model": m["base"],
                  "parameters": {"t": 0.3}, "modules": modules([{"model": m["e2"]}])},
        # model_stock with fewer than three inputs that have it: skipped
        "model_stock": {"merge_method": "model_stock", "base_model": m["base"],
                        "modules": modules([{"model": m["e1"]}, {"model": m["e2"]},
                                            {"model": m["e3"]}])},
    }


@pytest.mark.parametrize("case", ["linear", "task_arithmetic", "ties_base_alone", "slerp",
                                  "model_stock"])
def test_an_optional_weight_some_models_lack_equals_mergekit(
        fam: dict[str, Path], tmp_path: Path, case: str) -> None:
    cfg = {"dtype": "float32", "out_dtype": "bfloat16", **cases(fam)[case]}
    mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert set(mk) == set(fs)
    assert_identical(mk, fs)
    assert (BIAS in fs) == (case != "model_stock")
    if case == "slerp":  # e2's bias as it is
        from safetensors.torch import load_file

        e2 = load_file(str(fam["e2"] / "model.safetensors"))
        assert torch.equal(fs[BIAS], e2[BIAS])


def test_an_optional_weight_the_base_lacks_is_refused_as_mergekit_refuses_it(
        fam: dict[str, Path], tmp_path: Path) -> None:
    cfg = {"merge_method": "task_arithmetic", "base_model": str(fam["base"]),
           "dtype": "float32", "modules": modules([{"model": str(fam["e2"]),
                                                    "parameters": {"weight": 0.5}}])}
    with pytest.raises(Exception, match="Base input is not present"):
        run_mergekit(cfg, tmp_path / "mk")
    with pytest.raises(SpecError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias: an "
                                        r"optional weight the base lacks; task_arithmetic "
                                        r"needs the base's \(mergekit refuses it too\)"):
        run_mergefs(cfg, tmp_path / "fs")


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")
def test_mount_serves_optional_weights(fam: dict[str, Path], tmp_path: Path,
                                       mounts: Any) -> None:
    from mounting import assert_mount_serves_the_merge

    assert_mount_serves_the_merge(cases(fam)["task_arithmetic"], tmp_path, mounts, budget="50%",
                                  block_size="4KiB")


def test_the_optional_weight_rules_are_mergekits() -> None:
    """mergefs' table of mergekit's optional-tensor policies and input contracts, checked
    against mergekit's own method definitions."""
    from mergekit import merge_methods

    from mergefs import methods
    from mergefs.recipe import outputs

    theirs = {m.spec.name for m in merge_methods.registry.registered_methods()}
    assert theirs <= set(methods.METHODS)  # the methods beyond mergekit have their own tests
    for name in sorted(theirs):
        spec = merge_methods.get(name).spec
        policy = spec.optional_tensor_policy.value
        assert (name in outputs._SINGLETON) == (policy == "passthrough_singleton"), name
        assert (name in outputs._BASE_SINGLETON) == (policy == "passthrough_base_singleton")
        assert ((name in outputs._BASE_OR_SKIP) == (policy == "base_or_skip")), name
        c = spec.contract
        assert outputs._INPUTS.get(name, (1, None)) == (c.min_inputs, c.max_inputs), name
        assert outputs._NON_BASE.get(name, (0, None)) == (c.min_non_base or 0,
                                                         c.max_non_base), name
        if name in outputs._BASE_OR_SKIP:
            assert outputs._BASE_OR_SKIP[name] == c.min_inputs
