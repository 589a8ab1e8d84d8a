"""The spec: mergekit YAML plus mergefs keys, validated at the edge with one-line errors."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_family, write_spec
from safetensors.numpy import load_file, save_file

from mergefs.sources import open_source
from mergefs.recipe.family import open_family
from mergefs.core.errors import BudgetError, SpecError
from mergefs.spec.budget import Budget, parse_budget
from mergefs.recipe.family import check_coordinates
from mergefs.spec.load import load_spec
from mergefs.core.sizes import parse_size


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def good_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "merge_method": "task_arithmetic",
        "base_model": "./base",
        "models": [
            {"model": "./expert-a", "parameters": {"weight": 0.5}},
            {"model": "./expert-b", "parameters": {"weight": 0.5}},
        ],
        "parameters": {"lambda": 1.0},
    }
    doc.update(changes)
    return doc


def spec_error(tmp_path: Path, doc: Any) -> str:
    """Write ``doc`` as a spec, load it, return the SpecError message (which must be one line
    naming the file) without the file's path."""
    path = tmp_path / "bad-spec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    return msg[len(f"{path}: "):]


# -- valid specs --------------------------------------------------------------------------------


def test_plain_mergekit_config_parses(tmp_path: Path) -> None:
    path = write(tmp_path / "ties.yaml", """\
        models:
          - model: ./base
            # no parameters necessary for base model
          - model: ./WizardMath-7B
            parameters:
              density: 0.5
              weight: 0.5
          - model: ./CodeLlama-7b
            parameters:
              density: 0.5
              weight: 0.3
        merge_method: ties
        base_model: ./base
        parameters:
          normalize: true
          int8_mask: true
        dtype: float16
        """)
    spec = load_spec(path)
    assert spec.method == "ties"
    assert spec.base == str((tmp_path / "base").resolve())
    assert [e.path for e in spec.experts] == [str((tmp_path / n).resolve())
                                              for n in ("WizardMath-7B", "CodeLlama-7b")]
    assert spec.experts[0].parameters == {"density": 0.5, "weight": 0.5}
    assert spec.experts[1].parameters == {"density": 0.5, "weight": 0.3}
    assert spec.parameters["normalize"] is True and spec.parameters["lambda"] == 1.0
    assert spec.parameters["int8_mask"] is True  # accepted; a no-op (docs/operators.md)
    assert spec.out_dtype == "F16"
    assert spec.budget == Budget("full") and spec.budget.is_full
    assert spec.block_size == 1 << 20
    assert spec.base_weight is None


def test_defaults_and_global_model_parameters(tmp_path: Path) -> None:
    path = write(tmp_path / "dare.yaml", """\
        merge_method: dare_ties
        base_model: base
        models:
          - model: a
            parameters: {weight: 1.0}
          - model: b
            parameters: {weight: 0.5, density: 0.3}
        parameters: {density: 0.7}
        """)
    spec = load_spec(path)
    assert spec.experts[0].parameters == {"weight": 1.0, "density": 0.7}  # global default
    assert spec.experts[1].parameters == {"weight": 0.5, "density": 0.3}  # own value wins
    assert spec.parameters == {"normalize": False, "lambda": 1.0, "rescale": True, "seed": 0,
                               "int8_mask": False}
    assert spec.out_dtype is None


def test_base_listed_without_weight_is_the_base_not_an_expert(tmp_path: Path) -> None:
    doc = good_doc()
    doc["models"].insert(0, {"model": "./base"})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert len(spec.experts) == 2
    assert all(e.path != spec.base for e in spec.experts)
    assert spec.base_weight is None
    # listed again, spelled differently: mergekit refuses it (a duplicate input, or an input
    # without a weight), and so does mergefs
    doc["models"].append({"model": "base/"})
    assert spec_error(tmp_path, doc).startswith("models[3].model: ")


def test_base_listed_with_weight_in_linear(tmp_path: Path) -> None:
    doc = good_doc(merge_method="linear", parameters={})
    doc["models"].append({"model": "./base", "parameters": {"weight": 0.25}})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert len(spec.experts) == 2 and spec.base_weight == 0.25
    assert spec.parameters == {"normalize": True}


def test_only_the_base_is_an_error(tmp_path: Path) -> None:
    msg = spec_error(tmp_path, good_doc(models=[{"model": "./base"}]))
    assert "models" in msg


def test_out_dtype_wins_over_dtype(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(good_doc(dtype="bfloat16", out_dtype="float32")))
    assert load_spec(path).out_dtype == "F32"
    path.write_text(yaml.safe_dump(good_doc(dtype="bf16")))
    assert load_spec(path).out_dtype == "BF16"


def test_mergefs_keys(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "my-merge.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(good_doc(budget="10%", block_size="4KiB",
                                            cache={"memory": "1MiB", "dir": "c"},
                                            index_dir="idx")))
    spec = load_spec(path)
    assert spec.budget == Budget("fraction", 0.1)
    assert spec.block_size == 4096
    assert spec.cache_memory_bytes == 1 << 20
    assert spec.cache_dir == str((path.parent / "c").resolve())
    assert spec.index_dir == str((path.parent / "idx").resolve())
    assert spec.manifest == str((path.parent / "my-merge.manifest.jsonl").resolve())


def test_paths_resolve_relative_to_the_spec_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fam = make_family(tmp_path / "models" / "fam", n_experts=2, seed=3)
    spec_path = write_spec(tmp_path / "specs" / "deep" / "s.yaml", fam, "linear")
    text = spec_path.read_text()
    assert "../" in text and str(tmp_path) not in text  # really relative
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_spec(os.path.relpath(spec_path, elsewhere))
    assert spec.base == str(fam.base.resolve())
    assert [e.path for e in spec.experts] == [str(p.resolve()) for p in fam.experts]
    assert spec.index_dir == str((spec_path.parent / ".mergefs" / "index").resolve())
    base, experts = open_family(spec)  # and they open
    assert len(experts) == 2
    for c in [base, *experts]:
        c.close()


def test_raw_is_a_valid_spec_again(tmp_path: Path) -> None:
    from mergefs.spec.load import parse_spec

    path = tmp_path / "s.yaml"
    doc = good_doc(merge_method="linear", parameters={"normalize": False}, budget="25%",
                   dtype="float16", block_size=4096)
    doc["models"].append({"model": "./base", "parameters": {"weight": 0.2}})
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    again = parse_spec(dict(spec.raw), base_dir=Path("/nonexistent"))
    for field in ("method", "base", "experts", "base_weight", "parameters", "out_dtype",
                  "budget", "block_size"):
        assert getattr(again, field) == getattr(spec, field), field


# -- bad specs: one line naming file and key ----------------------------------------------------


def with_model_params(params: dict[str, Any], method: str = "task_arithmetic",
                      **top: Any) -> dict[str, Any]:
    doc = good_doc(merge_method=method, **top)
    doc["models"][0]["parameters"] = params
    return doc


BAD: dict[str, tuple[Any, str]] = {
    "unknown top-level key": (good_doc(mystery=1, strict=True), "mystery"),
    "slices": (good_doc(slices=[{"sources": [{"model": "a", "layer_range": [0, 4]}]}]),
               "slices"),
    "tokenizer_source and tokenizer": (good_doc(tokenizer_source="union",
                                                tokenizer={"source": "base"}), "tokenizer"),
    "pad_to_multiple_of zero": (good_doc(tokenizer={"pad_to_multiple_of": 0}),
                                "tokenizer.pad_to_multiple_of"),
    "modules": (good_doc(modules={"text": {"models": []}}), "modules"),
    "gradient out of range": (with_model_params({"weight": 0.5, "density": [0.2, 1.5]},
                                                "ties"), "models[0].parameters.density"),
    "filter entry without value": (with_model_params({"weight": {"filter": "self_attn"}}),
                                   "models[0].parameters.weight"),
    "filter of a non-string": (with_model_params({"weight": [{"filter": 3, "value": 0.5}]}),
                               "models[0].parameters.weight"),
    "nested filter": (good_doc(parameters={"weight": [{"filter": "mlp", "value": [
        {"value": 0.3}]}]}), "parameters.weight"),
    "unknown method": (good_doc(merge_method="frankenmerge"), "merge_method"),
    "missing method": ({k: v for k, v in good_doc().items() if k != "merge_method"},
                       "merge_method"),
    "missing base": ({k: v for k, v in good_doc().items() if k != "base_model"},
                     "base_model"),
    "unknown global parameter": (good_doc(parameters={"epsilon": 0.1}, strict=True),
                                 "parameters.epsilon"),
    "unknown model parameter": (with_model_params({"weight": 0.5, "gamma": 0.5}, strict=True),
                                "models[0].parameters.gamma"),
    "density above 1": (with_model_params({"weight": 0.5, "density": 1.5}, "ties"),
                        "models[0].parameters.density"),
    "density negative": (with_model_params({"weight": 0.5, "density": -0.5}, "dare_ties"),
                         "models[0].parameters.density"),
    "global density negative": (good_doc(merge_method="ties", parameters={"density": -0.1}),
                                "parameters.density"),
    "missing weight": (with_model_params({}), "models[0].parameters.weight"),
    "weight not a number": (with_model_params({"weight": "half"}),
                            "models[0].parameters.weight"),
    "bad normalize": (good_doc(parameters={"normalize": "yes please"}), "parameters.normalize"),
    "slerp without t": (good_doc(merge_method="slerp", parameters={},
                                 models=[{"model": "./a"}]), "parameters.t"),
    "slerp t out of range": (good_doc(merge_method="slerp", parameters={"t": 1.5},
                                      models=[{"model": "./a"}]), "parameters.t"),
    "slerp two experts": (good_doc(merge_method="slerp", parameters={"t": 0.5},
                                   models=[{"model": "./a"}, {"model": "./b"}]), "models"),
    "bad dtype": (good_doc(dtype="float8"), "dtype"),
    "bad out_dtype": (good_doc(out_dtype="int8"), "out_dtype"),
    "negative budget": (good_doc(budget=-1), "budget"),
    "budget 150%": (good_doc(budget="150%"), "budget"),
    "budget lots": (good_doc(budget="lots"), "budget"),
    "budget fraction above 1": (good_doc(budget=1.5), "budget"),
    "bad block_size": (good_doc(block_size="lots"), "block_size"),
    "tiny block_size": (good_doc(block_size=8), "block_size"),
    "negative block_size": (good_doc(block_size=-4096), "block_size"),
    "models not a list": (good_doc(models={"model": "./a"}), "models"),
    "model entry extra key": (good_doc(models=[{"model": "./a", "layer_range": [0, 2],
                                                "parameters": {"weight": 1.0}}]),
                              "layer_range"),
    "index_dir is a URL": (good_doc(index_dir="s3://bucket/idx"), "index_dir"),
    "duplicate expert": (good_doc(models=[{"model": "./a", "parameters": {"weight": 1}},
                                          {"model": "a", "parameters": {"weight": 1}}]),
                         "models[1].model"),
    "bad cache": (good_doc(cache={"memory": "1GiB", "disk": "x"}), "cache"),
    "linear weights sum to zero": (good_doc(merge_method="linear", parameters={},
                                            models=[{"model": "a", "parameters": {"weight": 1}},
                                                    {"model": "b",
                                                     "parameters": {"weight": -1}}]),
                                   "models"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_spec_one_line_naming_file_and_key(tmp_path: Path, case: str) -> None:
    doc, key = BAD[case]
    msg = spec_error(tmp_path, doc)
    assert msg.startswith(f"{key}:") or f".{key}:" in msg, msg


def test_setting_errors_say_what_is_wrong(tmp_path: Path) -> None:
    assert "must be <= 1" in spec_error(tmp_path, BAD["gradient out of range"][0])
    assert "filter" in spec_error(tmp_path, BAD["filter entry without value"][0])
    assert "substring" in spec_error(tmp_path, BAD["filter of a non-string"][0])
    assert "not both" in spec_error(tmp_path, BAD["slices"][0])
    assert "not both" in spec_error(tmp_path, BAD["tokenizer_source and tokenizer"][0])
    assert "give only one of models, slices or modules" in spec_error(tmp_path, BAD["modules"][0])
    assert "expected a non-empty list" in spec_error(
        tmp_path, {k: v for k, v in BAD["modules"][0].items() if k != "models"})


@pytest.mark.parametrize("text", ["merge_method: [unclosed\n", "- just\n- a list\n", ""])
def test_not_a_spec_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "nope.yaml")


# -- budgets and sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [
    ("10%", Budget("fraction", 0.1)),
    ("12.5%", Budget("fraction", 0.125)),
    (0.1, Budget("fraction", 0.1)),
    ("0.1", Budget("fraction", 0.1)),
    (0, Budget("fraction", 0.0)),
    (0.0, Budget("fraction", 0.0)),
    ("0%", Budget("fraction", 0.0)),
    ("2GiB", Budget("bytes", 2 * 1024**3)),
    ("2GB", Budget("bytes", 2 * 1000**3)),
    ("512 KiB", Budget("bytes", 512 * 1024)),
    ("1500000B", Budget("bytes", 1_500_000)),
    ("2 b", Budget("bytes", 2)),
    ("full", Budget("full")),
    ("FULL", Budget("full")),
    ("100%", Budget("full")),
    (1, Budget("full")),
    (1.0, Budget("full")),
    ("1", Budget("full")),
])
def test_parse_budget(value: Any, want: Budget) -> None:
    got = parse_budget(value)
    assert got.kind == want.kind
    assert got.value == pytest.approx(want.value, rel=1e-12)


@pytest.mark.parametrize("value", [-1, -0.5, "-10%", "150%", "100.5%", "lots", 1.5, "1.5",
                                   True, None, float("nan"), float("inf"), [0.1], "10 parsecs"])
def test_parse_budget_rejects(value: Any) -> None:
    with pytest.raises(BudgetError) as exc:
        parse_budget(value)
    assert "budget" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("value", [10, 100, "10", "100", 1_500_000, "1500000", 2.5])
def test_bare_number_above_one_is_ambiguous(value: Any) -> None:
    """``budget: 10`` once meant ten *bytes*: nothing was read and the output was the base."""
    with pytest.raises(BudgetError, match="ambiguous: write .*% .*B / .*MiB"):
        parse_budget(value)


def test_budget_resolve() -> None:
    total = 1000
    assert parse_budget("full").resolve(total) == 1000
    assert parse_budget("10%").resolve(total) == 100
    assert parse_budget(0.3333).resolve(total) == 333  # floor
    assert parse_budget(0).resolve(total) == 0
    assert parse_budget("2KiB").resolve(total) == 1000  # clamped to the total
    assert parse_budget("500B").resolve(total) == 500
    assert not parse_budget("99%").is_full and parse_budget("100%").is_full


@pytest.mark.parametrize("value, want", [(4096, 4096), ("1MiB", 1 << 20), ("1.5KiB", 1536),
                                         ("64", 64), ("2 kb", 2000), ("3G", 3 * 1000**3)])
def test_parse_size(value: Any, want: int) -> None:
    assert parse_size(value) == want


@pytest.mark.parametrize("value", [-1, "lots", "1 furlong", True, 1.5, None, "MiB"])
def test_parse_size_rejects(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


# -- coordinate systems -------------------------------------------------------------------------


def _mangle(src: Path, dst: Path, fn: Any) -> Path:
    """Copy a single-file model, rewriting its tensors with ``fn(dict) -> dict``."""
    dst.mkdir(parents=True)
    tensors = fn(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def small_family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("coords"), n_experts=2, seed=9)


def test_check_coordinates_accepts_the_family(small_family: Family) -> None:
    base = open_source(small_family.base)
    experts = [open_source(p) for p in small_family.experts]
    check_coordinates(base, experts)  # no error


def test_check_coordinates_lists_differences(small_family: Family, tmp_path: Path) -> None:
    def mangle(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t["lm_head.weight"] = t["lm_head.weight"][:-1]  # shape
        t["model.norm.weight"] = t["model.norm.weight"].astype(np.float16)  # allowed: promoted
        t["buffers.position_ids"] = t["buffers.position_ids"].astype(np.int32)  # refused
        t["model.extra.weight"] = np.zeros((2, 2), np.float32)  # not in base
        del t["model.layers.0.mlp.up_proj.weight"]  # missing
        return t

    bad = _mangle(small_family.experts[1], tmp_path / "bad-expert", mangle)
    base = open_source(small_family.base)
    experts = [open_source(small_family.experts[0]), open_source(bad)]
    with pytest.raises(SpecError) as exc:
        check_coordinates(base, experts)
    msg = str(exc.value)
    assert "\n" not in msg
    assert str(bad) in msg and str(small_family.base) in msg
    assert "lm_head.weight" in msg and "[255, 48]" in msg and "[256, 48]" in msg
    assert "model.norm.weight" not in msg  # floating dtypes may differ
    assert "buffers.position_ids: I32" in msg and "vs base I64" in msg
    assert "model.extra.weight: not in base" in msg
    assert "model.layers.0.mlp.up_proj.weight: missing" in msg
    assert str(small_family.experts[0]) + ":" not in msg  # the good expert is not blamed


def test_check_coordinates_truncates_long_lists(small_family: Family, tmp_path: Path) -> None:
    bad = _mangle(small_family.experts[0], tmp_path / "renamed",
                  lambda t: {f"x.{k}": v for k, v in t.items()})
    with pytest.raises(SpecError, match=r"and \d+ more"):
        check_coordinates(open_source(small_family.base), [open_source(bad)])


def test_open_family_checks_coordinates(small_family: Family, tmp_path: Path) -> None:
    bad = _mangle(small_family.experts[0], tmp_path / "reshaped",
                  lambda t: {**t, "model.norm.weight": t["model.norm.weight"].reshape(6, 8)})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "merge_method": "linear",
        "base_model": str(small_family.base),
        "models": [{"model": str(bad), "parameters": {"weight": 1.0}}],
    }))
    with pytest.raises(SpecError, match=r"model\.norm\.weight"):
        open_family(load_spec(path))


# -- leniency: what mergekit silently ignores is a warning, or an error with strict --------------

def test_ignored_keys_warn_once_each_and_strict_refuses(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    doc = good_doc(normalize=True, anchors={"x": 1}, parameters={"lambda": 1.0, "typo": 2})
    doc["models"][0]["parameters"]["t"] = 0.5  # a parameter task_arithmetic does not have
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    with caplog.at_level("WARNING", logger="mergefs.spec.spec"):
        spec = load_spec(path)
    keys = ["normalize", "anchors", "parameters.typo", "models[0].parameters.t"]
    assert len(spec.warnings) == len(keys)
    for key, warning in zip(sorted(keys), sorted(spec.warnings)):
        assert f": {key}: ignored" in warning and str(path) in warning
    assert len(caplog.records) == len(keys)
    assert spec.parameters.get("typo") is None and spec.raw["models"][0]["parameters"] == {
        "weight": 0.5, "density": 1.0}
    with pytest.raises(SpecError, match="strict"):
        load_spec(path, strict=True)


def test_slerp_model_weight_is_ignored_like_mergekit(tmp_path: Path) -> None:
    doc = good_doc(merge_method="slerp", parameters={"t": 0.5},
                   models=[{"model": "./a", "parameters": {"weight": 1.0}}])
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert len(spec.warnings) == 1 and "models[0].parameters.weight" in spec.warnings[0]


def test_linear_base_without_weight_is_only_the_reference(tmp_path: Path) -> None:
    doc = good_doc(merge_method="linear", parameters={})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert spec.input_order == (0, 1) and "mergekit refuses" in spec.warnings[0]
    doc["parameters"] = {"weight": 0.25}  # mergekit then averages the base in, appended last
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert spec.input_order == (0, 1, -1) and spec.base_weight == 0.25 and not spec.warnings
    assert spec.raw["models"][-1] == {"model": spec.base, "parameters": {"weight": 0.25}}


def test_methods_without_base_use_the_first_model_as_reference(tmp_path: Path) -> None:
    doc = good_doc(merge_method="karcher", parameters={})
    del doc["base_model"]
    for m in doc["models"]:
        del m["parameters"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert spec.base.endswith("expert-a") and [e.path[-8:] for e in spec.experts] == ["expert-b"]
    assert spec.input_order == (-1, 0) and not spec.has_base
