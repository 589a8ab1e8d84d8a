"""Real mergekit configs mergefs used to refuse or crash on (issue 29), against mergekit 0.1.5
in-process: parameters written as YAML gives them (``normalize: 1.0``, ``tol: 1e-5``), the
classic frankenmerge of overlapping layer ranges of one model (and of two, interleaved), and a
model listed twice in one merge, which mergekit refuses and so must mergefs.

Tiny Llama families written by transformers; mergekit computes in float32 and both write the
family's dtype; outputs must be byte-identical tensor by tensor, with the same tensor names and
the same config.json layer count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_llama_family

pytest.importorskip("torch")
pytest.importorskip("mergekit")

from mergekit_runs import assert_identical, run_mergefs, run_mergekit

from mergefs.core.errors import SpecError
from mergefs.spec.load import load_spec

N_LAYERS = 16
#: the classic self-stack (layers [0, 8], [4, 12], [8, 16] of one model: 24 layers); output
#: layers 12..15 repeat source layers 8..11 first output as 16..19, and "layers.1x" sorts
#: before "layers.8" in the output file: the case that crashed
OVERLAPPING = ([0, 8], [4, 12], [8, 16])


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_llama_family(tmp_path_factory.mktemp("dropin") / "f", n_experts=2,
                             dtype="bfloat16", seed=29, num_layers=N_LAYERS)


def common(fam: Family, method: str, **extra: Any) -> dict[str, Any]:
    return {"merge_method": method, "dtype": "float32", "out_dtype": fam.dtype, **extra}


def both(cfg: dict[str, Any], out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    mk, fs = run_mergekit(cfg, out / "mk"), run_mergefs(cfg, out / "fs")
    assert set(mk) == set(fs) and mk
    assert_identical(mk, fs)
    return mk, fs


def layer_count(out: Path) -> int:
    return json.loads((out / "config.json").read_text())["num_hidden_layers"]


def from_yaml(text: str, fam: Family) -> dict[str, Any]:
    """A config as both tools read it from a file: PyYAML's types (``1e-5`` is a string)."""
    return yaml.safe_load(text.format(base=fam.base, a=fam.experts[0], b=fam.experts[1],
                                      dtype=fam.dtype))


# -- parameter values as mergekit's validation reads them -----------------------------------------

BOOLEAN_CONFIGS = {
    "task_arithmetic 1.0": ("task_arithmetic", {"normalize": 1.0, "int8_mask": 1.0}),
    "ties words": ("ties", {"normalize": "off", "int8_mask": "Yes", "density": "1.0"}),
    "task_arithmetic words": ("task_arithmetic", {"normalize": "Yes", "lambda": "0.8"}),
    "linear 0": ("linear", {"normalize": 0}),
}


@pytest.mark.parametrize("case", list(BOOLEAN_CONFIGS))
def test_booleans_given_as_numbers_and_words(case: str, fam: Family, tmp_path: Path) -> None:
    method, params = BOOLEAN_CONFIGS[case]
    cfg = common(fam, method, parameters=params, models=[
        {"model": str(e), "parameters": {"weight": w}} for e, w in zip(fam.experts, [0.7, 0.6])])
    if method != "linear":  # linear's base would be one more input, needing a weight
        cfg["base_model"] = str(fam.base)
    both(cfg, tmp_path)
    spec = load_spec(tmp_path / "fs.yaml")
    for name, value in params.items():
        if name in ("normalize", "int8_mask"):
            assert spec.parameters[name] is (value in (1.0, "Yes"))


def test_numbers_given_as_yaml_strings(fam: Family, tmp_path: Path) -> None:
    """``1e-5`` has no dot, so PyYAML reads a string; mergekit's validation makes it a float."""
    cfg = from_yaml("""
merge_method: karcher
models: [{{model: {a}}}, {{model: {b}}}]
parameters: {{tol: 1e-5, max_iter: 3.0}}
dtype: float32
out_dtype: {dtype}
""", fam)
    assert cfg["parameters"]["tol"] == "1e-5"
    both(cfg, tmp_path / "karcher")
    cfg = from_yaml("""
merge_method: task_arithmetic
base_model: {base}
models:
  - {{model: {a}, parameters: {{weight: 5e-1}}}}
  - {{model: {b}, parameters: {{weight: "0.25"}}}}
parameters: {{lambda: 12e-1, normalize: 1}}
dtype: float32
out_dtype: {dtype}
""", fam)
    both(cfg, tmp_path / "ta")


REFUSED = {
    "bool 0.5": ("task_arithmetic", {"normalize": 0.5}, "parameters.normalize"),
    "bool 2": ("task_arithmetic", {"normalize": 2}, "parameters.normalize"),
    "int 0.5": ("karcher", {"max_iter": 0.5}, "parameters.max_iter"),
    "int 1e1": ("karcher", {"max_iter": "1e1"}, "parameters.max_iter"),
    "float word": ("karcher", {"tol": "tiny"}, "parameters.tol"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_values_mergekit_refuses_are_refused(case: str, fam: Family, tmp_path: Path) -> None:
    method, params, key = REFUSED[case]
    if method == "karcher":
        cfg = common(fam, method, parameters=params,
                     models=[{"model": str(e)} for e in fam.experts])
    else:
        cfg = common(fam, method, base_model=str(fam.base), parameters=params, models=[
            {"model": str(e), "parameters": {"weight": 0.5}} for e in fam.experts])
    with pytest.raises(Exception):  # pydantic's ValidationError, raised while merging
        run_mergekit(cfg, tmp_path / "mk")
    with pytest.raises(SpecError, match=f"fs.yaml: {key}: expected"):
        run_mergefs(cfg, tmp_path / "fs")


# -- frankenmerges: overlapping layer ranges ------------------------------------------------------

def self_stack(fam: Family) -> dict[str, Any]:
    return common(fam, "passthrough", slices=[
        {"sources": [{"model": str(fam.base), "layer_range": list(r)}]} for r in OVERLAPPING])


def test_overlapping_self_stack_equals_mergekit_and_replays(fam: Family, tmp_path: Path) -> None:
    from mergefs import cli
    from mounting import merge, sha256

    both(self_stack(fam), tmp_path)
    n_out = sum(hi - lo for lo, hi in OVERLAPPING)
    assert layer_count(tmp_path / "mk") == layer_count(tmp_path / "fs") == n_out
    # replay re-merges from its manifest and verifies every recorded hash
    out = merge(tmp_path / "fs.yaml", tmp_path / "merged")
    manifest = str(out) + ".manifest.jsonl"
    assert cli.main(["replay", manifest, "--out", str(tmp_path / "replayed")]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "replayed").glob("*.safetensors"))
    for f in files:
        assert sha256(out / f) == sha256(tmp_path / "replayed" / f)


def test_two_models_interleaved_with_overlaps(fam: Family, tmp_path: Path) -> None:
    a, b = str(fam.experts[0]), str(fam.experts[1])
    cfg = common(fam, "passthrough", slices=[
        {"sources": [{"model": a, "layer_range": [0, 8]}]},
        {"sources": [{"model": b, "layer_range": [4, 12]}]},
        {"sources": [{"model": a, "layer_range": [4, 12]}],
         "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]}},
        {"sources": [{"model": b, "layer_range": [8, 16]}]}])
    both(cfg, tmp_path)
    assert layer_count(tmp_path / "mk") == layer_count(tmp_path / "fs") == 32


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")
def test_mount_of_overlapping_self_stack(fam: Family, tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**self_stack(fam), "block_size": "4KiB",
                                    "index_dir": str(tmp_path / "index")}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    served = {r: sha256(p) for r, p in tree(m.path).items()}
    assert served == {r: sha256(p) for r, p in tree(out).items()}
    assert json.loads((m.path / "config.json").read_text())["num_hidden_layers"] == 24


# -- a model listed twice: mergekit 0.1.5 refuses duplicate merge inputs ---------------------------

def repeated(fam: Family) -> dict[str, tuple[dict[str, Any], str]]:
    base, a, b = str(fam.base), str(fam.experts[0]), str(fam.experts[1])

    def src(model: str, weight: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "layer_range": [0, 6]}
        if weight is not None:
            out["parameters"] = {"weight": weight}
        return out

    return {
        "one model three times": (common(fam, "linear", base_model=base, slices=[{"sources": [
            src(base, 0.0), src(base, 1.0), src(base, 0.0)]}]), "slices[0].sources[1].model"),
        "two models and a repeat": (common(fam, "task_arithmetic", base_model=base, slices=[
            {"sources": [src(base), src(a, 0.5), src(b, 0.5), src(a, 1.0)]}]),
            "slices[0].sources[3].model"),
        "models: a repeat": (common(fam, "task_arithmetic", base_model=base, models=[
            {"model": a, "parameters": {"weight": 0.5}},
            {"model": a, "parameters": {"weight": 1.0}}]), "models[1].model"),
        "models: the base twice": (common(fam, "linear", base_model=base, models=[
            {"model": base, "parameters": {"weight": 0.5}},
            {"model": a, "parameters": {"weight": 1.0}},
            {"model": base, "parameters": {"weight": 1.0}}]), "models[2].model"),
        "modules models: a repeat": (common(fam, "linear", modules={"default": {"models": [
            {"model": a, "parameters": {"weight": 0.5}},
            {"model": a, "parameters": {"weight": 1.0}}]}}), "modules.default.models[1].model"),
    }


@pytest.mark.parametrize("case", ["one model three times", "two models and a repeat",
                                  "models: a repeat", "models: the base twice",
                                  "modules models: a repeat"])
def test_a_model_listed_twice_is_refused_as_mergekit_refuses_it(case: str, fam: Family,
                                                                tmp_path: Path) -> None:
    cfg, key = repeated(fam)[case]
    with pytest.raises(ValueError, match="Duplicate merge inputs"):
        run_mergekit(cfg, tmp_path / "mk")
    with pytest.raises(SpecError, match=rf"fs.yaml: {re.escape(key)}: .* is listed again "
                                        r"\(first at .*\); mergekit refuses"):
        run_mergefs(cfg, tmp_path / "fs")
