"""``model+lora`` experts (and bare PEFT adapter directories): ``W + scale * B @ A`` computed
block by block from the adapter's factors, against PEFT's merge_and_unload and mergekit 0.1.5."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_llama_family
from reference import read_tensor, tensor_names

from mergefs import cli
from mergefs.spec import refs as hub
from mergefs.core.errors import SourceError, SpecError
from mergefs.sources.base import ReadRange
from mergefs.sources import open_source
from mergefs.spec.load import parse_spec
from lora_adapters import make_adapter


def peft_merged(base: Path, adapter: Path, out: Path) -> Path:
    """What mergekit does with ``base+adapter``: PEFT's merge_and_unload, saved."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_llama_family(tmp_path_factory.mktemp("lora_family"), n_experts=1, seed=4)


@pytest.fixture(scope="module")
def adapter(fam: Family) -> Path:
    return make_adapter(fam.base, fam.root / "adapter", seed=1, modules_to_save=["lm_head"],
                        rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3})


@pytest.fixture(scope="module")
def merged(fam: Family, adapter: Path) -> Path:
    return peft_merged(fam.base, adapter, fam.root / "peft-merged")


def close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to float32 rounding of the factor product (PEFT multiplies with BLAS: about
    one ulp apart on a quarter of the adapted elements, bit-equal elsewhere)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-6,
                               atol=1e-8)


def test_lora_source_reads_as_the_peft_merged_model(fam: Family, adapter: Path,
                                                    merged: Path) -> None:
    base = open_source(fam.base)
    src = open_source(hub.join_lora(str(fam.base), str(adapter)), None, base)
    assert sorted(src.tensors) == tensor_names(merged)
    adapted = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.layers.1.mlp.down_proj.weight"}
    assert adapted <= set(src.factors) and "lm_head.weight" not in src.factors
    bit_equal = 0
    for name in tensor_names(merged):
        got = np.frombuffer(src.read_tensor(name), dtype=np.float32).reshape(
            src.tensors[name].shape)
        want = read_tensor(merged, name)
        close(got, want)
        bit_equal += got.tobytes() == want.tobytes()
        if name not in src.factors and name != "lm_head.weight":
            assert got.tobytes() == read_tensor(fam.base, name).tobytes(), name
    assert bit_equal >= len(tensor_names(merged)) - len(src.factors)
    # a range inside a tensor equals the same bytes of the whole tensor (blocks are hashed)
    loc = src.tensors["model.layers.0.self_attn.q_proj.weight"]
    whole = bytes(src.read_tensor(loc.name))
    part = src.read_ranges([ReadRange(loc.file, loc.start + 100, loc.start + 1003)])[0]
    assert bytes(part) == whole[100:1003]


def spec_doc(fam: Family, model: Any, **extra: Any) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": str(fam.base),
            "models": [{"model": model, "parameters": {"weight": 0.6}},
                       {"model": str(fam.experts[0]), "parameters": {"weight": 0.3}}],
            "parameters": {"lambda": 1.0}, **extra}


def merge(tmp_path: Path, name: str, doc: dict[str, Any]) -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"index_dir": str(tmp_path / f"idx-{name}"),
                                    "block_size": 4096, **doc}))
    assert cli.main(["merge", str(spec), str(tmp_path / name)]) == 0
    return tmp_path / name


#: the model card's files: they name the models as the spec gives them (here a URL or an id,
#: there a path) and the output directory, so two merges of the same weights differ there
CARD_FILES = ("README.md", "mergekit_config.yml")


def sha256_tree(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())
            if p.is_file() and p.name not in CARD_FILES}  # not .mergefs/ (which run wrote it)


def expert_read(totals: dict) -> int:
    """Bytes read from the first expert (labelled by its name; base first, then the experts
    in spec order)."""
    label = [k for k in totals["physical_bytes_read"] if k != "base"][0]
    return totals["physical_bytes_read"][label]


def test_merge_with_a_lora_expert(fam: Family, adapter: Path, merged: Path,
                                  tmp_path: Path) -> None:
    lora = merge(tmp_path, "lora", spec_doc(fam, f"{fam.base}+{adapter}"))
    full = merge(tmp_path, "full", spec_doc(fam, str(merged)))
    for name in tensor_names(full):
        close(read_tensor(lora, name), read_tensor(full, name))
    totals = json.loads((tmp_path / "lora.manifest.jsonl").read_text().splitlines()[-1])
    # the LoRA expert cost its adapter's bytes: only lm_head (saved in full) was read from it
    lm_head = open_source(merged).tensors["lm_head.weight"].size_bytes
    assert expert_read(totals) == lm_head
    full_totals = json.loads((tmp_path / "full.manifest.jsonl").read_text().splitlines()[-1])
    assert expert_read(full_totals) >= 4 * lm_head  # its changed blocks
    # mergekit's mapping form and a bare adapter directory give the same merge
    mapping = merge(tmp_path, "mapping", spec_doc(fam, {"model": str(fam.base),
                                                        "lora": str(adapter)}))
    bare = merge(tmp_path, "bare", spec_doc(fam, str(adapter)))
    assert sha256_tree(mapping) == sha256_tree(lora) == sha256_tree(bare)
    # replay reproduces it
    assert cli.main(["replay", str(tmp_path / "lora.manifest.jsonl")]) == 0


def test_lora_blocks_of_the_base_are_free_under_a_budget(fam: Family, adapter: Path,
                                                         tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    doc = spec_doc(fam, f"{fam.base}+{adapter}", budget=0, block_size=4096,
                   index_dir=str(tmp_path / "idx"))
    doc["models"] = doc["models"][:1]
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(doc))
    assert cli.main(["plan", str(spec), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["budget_bytes"] == rep["planned_expert_bytes"] == 0
    assert rep["blocks_read"] > 0  # the adapted tensors' blocks: computed from the base's bytes


def test_mergekit_agrees_on_model_plus_lora(fam: Family, adapter: Path, tmp_path: Path) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    doc = spec_doc(fam, f"{fam.base}+{adapter}")
    run_merge(MergeConfiguration.model_validate(doc), str(tmp_path / "mk"),
              MergeOptions(copy_tokenizer=False, lazy_unpickle=False,
                           lora_merge_cache=str(tmp_path / "lora-cache")))
    ours = merge(tmp_path, "ours", doc)
    for name in tensor_names(tmp_path / "mk"):
        close(read_tensor(ours, name), read_tensor(tmp_path / "mk", name))


def test_rslora_and_fan_in_fan_out_scales(fam: Family, tmp_path: Path) -> None:
    adapter = make_adapter(fam.base, tmp_path / "rs", seed=2, use_rslora=True,
                           target_modules=["o_proj", "up_proj"], r=8, lora_alpha=4)
    merged = peft_merged(fam.base, adapter, tmp_path / "rs-merged")
    src = open_source(str(adapter), None, open_source(fam.base))
    for name in src.factors:
        got = np.frombuffer(src.read_tensor(name), np.float32).reshape(src.tensors[name].shape)
        close(got, read_tensor(merged, name))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    factor = src.factors["model.layers.0.mlp.up_proj.weight"]
    assert factor.scale == pytest.approx(cfg["lora_alpha"] / np.sqrt(8))


@pytest.mark.parametrize("edit, needle", [
    ({"use_dora": True}, "use_dora is not supported yet"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported yet"),
    ({"layer_replication": [[0, 1]]}, "layer_replication is not supported yet"),
    ({"r": 5}, "rank 4 but the config says 5"),
])
def test_unsupported_adapters_are_refused(fam: Family, adapter: Path, tmp_path: Path,
                                          edit: dict[str, Any], needle: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(SourceError, match=needle):
        open_source(str(bad), None, open_source(fam.base))


def test_spec_forms_and_errors(fam: Family, adapter: Path, tmp_path: Path) -> None:
    cfg = hub.HubConfig(tmp_path / "no-cache", offline=True)
    spec = parse_spec(spec_doc(fam, f"{fam.base}+{adapter}"), tmp_path, "s", cfg)
    assert spec.experts[0].path == f"{fam.base}+{adapter}"
    assert spec.raw["models"][0]["model"] == {"model": str(fam.base), "lora": str(adapter),
                                              "resolved": spec.experts[0].path}
    again = parse_spec(json.loads(json.dumps(spec.raw)), tmp_path, "m", cfg)
    assert again.raw == spec.raw
    with pytest.raises(SpecError, match=r"s: base_model: model\+lora as the base model is not "
                                        "supported yet"):
        parse_spec({**spec_doc(fam, str(fam.experts[0])),
                    "base_model": f"{fam.base}+{adapter}"}, tmp_path, "s", cfg)
    with pytest.raises(SpecError, match=r"models\[0\]\.model: .*LoRA adapter ./nope: no such "
                                        "directory"):
        parse_spec(spec_doc(fam, f"{fam.base}+./nope"), tmp_path, "s", cfg)


def test_bf16_model_is_bit_equal_to_peft(tmp_path: Path) -> None:
    """Half precision: W + delta in float32, rounded once, as PEFT merges on CPU."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    bf = make_llama_family(tmp_path / "bf16", n_experts=1, seed=6, dtype="bfloat16")
    adapter = make_adapter(bf.base, tmp_path / "ad", seed=3)
    model = LlamaForCausalLM.from_pretrained(bf.base, dtype=torch.bfloat16)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(tmp_path / "m")
    src = open_source(str(adapter), None, open_source(bf.base))
    assert src.factors
    for name in tensor_names(tmp_path / "m"):
        assert bytes(src.read_tensor(name)) == read_tensor(tmp_path / "m", name).tobytes(), name


def test_adapter_on_another_model_reads_and_counts_that_model(fam: Family, adapter: Path,
                                                              tmp_path: Path) -> None:
    merged = peft_merged(fam.experts[0], adapter, tmp_path / "on-expert")
    base = open_source(fam.base)
    src = open_source(hub.join_lora(str(fam.experts[0]), str(adapter)), None, base)
    assert src.own_model and src.read_itemsize("model.layers.0.self_attn.q_proj.weight") == 4
    for name in tensor_names(merged):
        got = np.frombuffer(src.read_tensor(name), np.float32).reshape(src.tensors[name].shape)
        close(got, read_tensor(merged, name))
    assert src.counters.bytes_read >= sum(loc.size_bytes for loc in src.tensors.values()
                                          if loc.dtype == "F32")
    assert base.counters.bytes_read == 0


def test_lora_files_are_the_models_and_the_adapters(fam: Family, adapter: Path) -> None:
    """An output directory must hold neither the model's files nor the adapter's; the
    non-weight files (a tokenizer merge reads them by directory) are the model's."""
    base = open_source(fam.base)
    src = open_source(hub.join_lora(str(fam.experts[0]), str(adapter)), None, base)
    try:
        model = Path(fam.experts[0]).absolute()
        files = [p for _, p in src.local_files()]
        assert model / "model.safetensors" in files and model / "config.json" in files
        assert {adapter / "adapter_model.safetensors", adapter / "adapter_config.json"} <= {
            Path(p).absolute() for p in files}
        assert src.extra_dir() == model and src.file_ctimes().keys() == {
            str(model / "model.safetensors"), str(src.root / "adapter_model.safetensors")}
    finally:
        src.close()
        base.close()
