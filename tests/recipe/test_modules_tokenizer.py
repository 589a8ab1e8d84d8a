"""Tokenizer merges of ``modules:`` specs against mergekit 0.1.5 in-process.

A tiny Mistral3ForConditionalGeneration family whose text decoder carries the vocabulary
(``language_model.model.embed_tokens`` and ``language_model.lm_head``, rows = the nested
``text_config.vocab_size``), experts with extra tokens. The vocabulary tensors are the ones
mergekit's architecture gives a vocabulary axis; the new size goes where mergekit writes it
(``text_config.vocab_size``).
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

from mergekit_runs import assert_identical, load_dir, run_mergefs
from test_tokenizer import mergekit_dir, vocab_of

from mergefs.recipe.modules import read_modules

BASE_WORDS = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(13)]]
EXTRA = {"a": ["alpha", "beta"], "b": ["beta", "gamma", "delta"]}
VOCAB = ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight")


def config(vocab_size: int) -> dict[str, Any]:
    cfg = transformers.Mistral3Config(
        vision_config={"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 28,
                       "patch_size": 14},
        text_config={"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "intermediate_size": 32,
                     "vocab_size": vocab_size, "head_dim": 8})
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    out: dict[str, Any] = cfg.to_dict()
    return out


def save(path: Path, words: list[str], seed: int,
         base: tuple[dict[str, Any], list[str]] | None = None) -> dict[str, Any]:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = config(len(words))
    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {}
    for mod in read_modules(cfg, "test").values():
        names = [w.name for w in mod.pre]
        for i in range(mod.n_layers):
            names += [w.name for w in mod.layer(i)]
        names += [w.name for w in mod.post]
        for name in names:
            shape = (len(words), 16) if name in VOCAB else (16,) if "norm" in name else (8, 16)
            w = rng.standard_normal(shape).astype(np.float32)
            if base is not None:
                b, base_words = base
                if name in VOCAB:  # shared tokens: the base's row plus a delta
                    for i, t in enumerate(words):
                        if t in base_words:
                            w[i] = b[name][base_words.index(t)] + 0.05 * w[i]
                else:
                    w = b[name] + 0.05 * w
            tensors[name] = w
    path.mkdir(parents=True)
    save_file({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return {k: torch.from_numpy(v).to(torch.bfloat16).float().numpy()
            for k, v in tensors.items()}


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modules-vocab")
    base = save(root / "base", BASE_WORDS, 0)
    for k, (name, extra) in enumerate(EXTRA.items()):
        save(root / name, BASE_WORDS + extra, 1 + k, (base, BASE_WORDS))
    return {"base": root / "base", **{n: root / n for n in EXTRA}}


def spec(fam: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": str(fam["base"]),
            "dtype": "float32", "out_dtype": "bfloat16",
            "modules": {
                "text_decoder": {"models": [
                    {"model": str(fam["a"]), "parameters": {"weight": 0.6}},
                    {"model": str(fam["b"]), "parameters": {"weight": 0.3}}]},
                "vision_tower": {"models": [{"model": str(fam["base"])}]}},
            **extra}


def compare(cfg: dict[str, Any], tmp_path: Path) -> tuple[Path, Path]:
    mk = mergekit_dir(cfg, tmp_path / "mk")
    fs = tmp_path / "fs"
    run_mergefs(cfg, fs)
    a, b = load_dir(mk), load_dir(fs)
    assert set(a) == set(b)
    # mergekit adds a union's new tokens in the order of a Python set (test_tokenizer.py):
    # compare the vocabulary rows token by token
    va, vb = vocab_of(mk), vocab_of(fs)
    assert set(va) == set(vb)
    order = [vb[t] for t, _ in sorted(va.items(), key=lambda kv: kv[1])]
    for name in VOCAB:
        b[name] = b[name][order + list(range(len(order), b[name].shape[0]))]
    assert_identical(a, b)
    return mk, fs


@pytest.mark.parametrize("tokenizer", [
    {"tokenizer_source": "union"},
    {"tokenizer": {"source": "union", "pad_to_multiple_of": 8, "tokens": {
        "alpha": {"source": {"kind": "zero"}, "force": True}}}},
    {"tokenizer_source": "model:b"},
])
def test_tokenizer_merge_of_a_modules_spec_equals_mergekit(fam: dict[str, Path],
                                                           tmp_path: Path,
                                                           tokenizer: dict[str, Any]) -> None:
    if tokenizer.get("tokenizer_source") == "model:b":
        tokenizer = {"tokenizer_source": str(fam["b"])}
    cfg = spec(fam, **tokenizer)
    mk, fs = compare(cfg, tmp_path)
    union = len(set(BASE_WORDS + EXTRA["a"] + EXTRA["b"]))
    rows = load_dir(fs)[VOCAB[0]].shape[0]
    assert rows == {"union": union, str(fam["b"]): len(BASE_WORDS) + 3}.get(
        cfg.get("tokenizer_source"), 24)
    for out in (mk, fs):  # the new size where mergekit writes it: the text module's config
        doc = json.loads((out / "config.json").read_text())
        assert doc["text_config"]["vocab_size"] == rows, out
        assert "vocab_size" not in doc or doc["vocab_size"] != rows
    assert json.loads((mk / "config.json").read_text()).get("vocab_size") == \
        json.loads((fs / "config.json").read_text()).get("vocab_size")
    assert (fs / "tokenizer.json").exists()


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")
def test_mount_serves_a_modules_tokenizer_merge(fam: dict[str, Path], tmp_path: Path,
                                                mounts: Any) -> None:
    import yaml
    from mounting import merge, sha256
    from viewcases import tree

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec(fam, tokenizer_source="union"), "budget": "50%",
                                    "block_size": "4KiB", "index_dir": str(tmp_path / "index")}))
    out = merge(path, tmp_path / "out")
    m = mounts.start(path)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    assert "gamma" in vocab_of(m.path)
