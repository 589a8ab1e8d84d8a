"""Through a real mount: a base and experts named by Hub id (fake cache), a LoRA expert and an
fp16 expert beside an fp32 base serve the same bytes as ``mergefs merge``; from_pretrained loads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from families import make_llama_family
from hub_cache import COMMIT_A, COMMIT_B, COMMIT_C, cache_model
from lora_adapters import make_adapter
from mounting import Mounts, merge, sha256
from viewcases import tree

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                       reason="needs /dev/fuse and fusermount3"),
]


def test_hub_lora_and_mixed_dtypes_through_the_mount(tmp_path: Path, mounts: Mounts,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    f32 = make_llama_family(tmp_path / "f32", n_experts=1, seed=8)
    f16 = make_llama_family(tmp_path / "f16", n_experts=1, seed=8, dtype="float16")
    adapter = make_adapter(f32.base, tmp_path / "adapter", seed=2)
    cache = tmp_path / "hf"
    cache_model(cache, "org/llama", f32.base, COMMIT_A)
    cache_model(cache, "org/llama-ft", f16.experts[0], COMMIT_B, refs=("main", "v1"))
    cache_model(cache, "org/llama-lora", adapter, COMMIT_C)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # the mount's subprocess inherits it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": "org/llama",
        "models": [{"model": "org/llama-ft@v1", "parameters": {"weight": 0.5}},
                   {"model": "org/llama+org/llama-lora", "parameters": {"weight": 0.7}}],
        "block_size": 4096, "index_dir": str(tmp_path / "idx"), "budget": "full"}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {rel: sha256(p) for rel, p in tree(m.path).items()} == \
        {rel: sha256(p) for rel, p in tree(out).items()}
    model = AutoModelForCausalLM.from_pretrained(m.path)
    want = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)


def test_a_remote_base_mounts(tmp_path: Path, mounts: Mounts) -> None:
    """A base behind a URL (``file://`` here, as ``hf://`` for an uncached Hub id): its ranges
    are read on demand and its small files (config.json, ...) served from memory."""
    from transformers import AutoModelForCausalLM

    fam = make_llama_family(tmp_path / "f", n_experts=1, seed=9)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": f"file://{fam.base}",
        "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.5}}],
        "block_size": 4096, "index_dir": str(tmp_path / "idx"), "budget": "50%"}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    got = {rel: sha256(p) for rel, p in tree(m.path).items()}
    assert "config.json" in got and got == {rel: sha256(p) for rel, p in tree(out).items()}
    assert AutoModelForCausalLM.from_pretrained(m.path).config.num_hidden_layers == 2
