"""Tokenizer merges against mergekit 0.1.5 in-process: tokenizer_source (base, union, a model),
the tokenizer: block (tokens, pad_to_multiple_of), experts with different vocabularies, and
chat_template; the same files and tensors through the mount."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")
pytest.importorskip("transformers")

from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit_runs import assert_identical, load_dir, run_mergefs

BASE_WORDS = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(13)]]
EXTRA = {"a": ["alpha", "beta"], "b": ["beta", "gamma", "delta"]}


def _save_model(path: Path, words: list[str], state: dict[str, Any] | None, seed: int,
                base_state: dict[str, Any] | None = None, base_words: list[str] | None = None
                ) -> dict[str, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if base_state is not None and base_words is not None:
        new = {}
        g = torch.Generator().manual_seed(seed)
        for name, t in model.state_dict().items():
            w0 = base_state[name]
            if t.shape == w0.shape:
                new[name] = (w0.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)
            else:  # vocabulary rows: shared tokens from the base plus a delta, new ones random
                rows = t.clone()
                for i, w in enumerate(words):
                    if w in base_words:
                        rows[i] = (w0[base_words.index(w)].float()
                                   + 0.01 * torch.randn(t.shape[1:], generator=g)).to(t.dtype)
                new[name] = rows
        model.load_state_dict(new)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def vocab_family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vocab")
    base_state = _save_model(root / "base", BASE_WORDS, None, 1)
    out = {"base": root / "base"}
    for k, (name, extra) in enumerate(EXTRA.items()):
        _save_model(root / name, BASE_WORDS + extra, None, 10 + k, base_state, BASE_WORDS)
        out[name] = root / name
    return out


def mergekit_dir(cfg: dict[str, Any], out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    run_merge(MergeConfiguration.model_validate(cfg), str(out),
              MergeOptions(quiet=True, copy_tokenizer=True, write_model_card=False))
    return out


def cfg_for(fam: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": str(fam["base"]),
            "models": [{"model": str(fam["a"]), "parameters": {"weight": 0.6}},
                       {"model": str(fam["b"]), "parameters": {"weight": 0.3}}],
            "dtype": "float32", "out_dtype": "bfloat16", **extra}


def vocab_of(path: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(path).get_vocab())


def tokenizer_doc(path: Path) -> dict[str, Any]:
    doc = json.loads((path / "tokenizer.json").read_text())
    return {"vocab": doc["model"]["vocab"], "added": doc["added_tokens"]}


def compare(fam: dict[str, Path], cfg: dict[str, Any], tmp_path: Path) -> tuple[Path, Path]:
    mk = mergekit_dir(cfg, tmp_path / "mk")
    run_mergefs(cfg, tmp_path / "fs")
    fs = tmp_path / "fs"
    a, b = load_dir(mk), load_dir(fs)
    assert set(a) == set(b)
    # mergekit adds a union's new tokens in the order of a Python set of models (it varies
    # from run to run); mergefs in spec order. Compare vocabulary rows token by token.
    va, vb = vocab_of(mk), vocab_of(fs)
    assert set(va) == set(vb)
    order = [vb[t] for t, _ in sorted(va.items(), key=lambda kv: kv[1])]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = b[name].shape[0]
        perm = order + list(range(len(order), rows))  # padding rows stay where they are
        b[name] = b[name][perm]
    assert_identical(a, b)
    if sorted(va.values()) == sorted(vb.values()) and va == vb:
        assert tokenizer_doc(mk) == tokenizer_doc(fs)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (mk, fs))
    assert ca["vocab_size"] == cb["vocab_size"]
    assert chat_of(mk) == chat_of(fs)
    return mk, fs


def chat_of(path: Path) -> str | None:
    """The chat template as transformers saves it (chat_template.jinja since v4.5x)."""
    from transformers import AutoTokenizer

    f = path / "chat_template.jinja"
    text = f.read_text() if f.exists() else None
    assert AutoTokenizer.from_pretrained(path).chat_template == text or text is None
    return text


def test_union_with_different_vocab_sizes_and_token_rules(vocab_family: dict[str, Path],
                                                          tmp_path: Path) -> None:
    cfg = cfg_for(vocab_family, tokenizer={
        "source": "union",
        "tokens": {"alpha": {"source": {"kind": "zero"}, "force": True},
                   "gamma": {"source": {"kind": "model_token", "model": str(vocab_family["a"]),
                                        "token": "w3"}},
                   "<extra>": {"source": str(vocab_family["b"])}}})
    cfg["tokenizer"]["tokens"].pop("<extra>")  # a token no model has: mergekit needs a donor
    mk, fs = compare(vocab_family, cfg, tmp_path)
    rows = load_dir(fs)["model.embed_tokens.weight"].shape[0]
    assert rows == len(BASE_WORDS) + 4


def test_tokenizer_source_base_padded(vocab_family: dict[str, Path], tmp_path: Path) -> None:
    cfg = cfg_for(vocab_family, tokenizer={"source": "base", "pad_to_multiple_of": 8})
    compare(vocab_family, cfg, tmp_path)
    assert load_dir(tmp_path / "fs")["lm_head.weight"].shape[0] == 16


def test_tokenizer_source_a_model(vocab_family: dict[str, Path], tmp_path: Path) -> None:
    compare(vocab_family, cfg_for(vocab_family, tokenizer_source=str(vocab_family["b"])),
            tmp_path)


def test_chat_template_chatml(vocab_family: dict[str, Path], tmp_path: Path) -> None:
    cfg = cfg_for(vocab_family, tokenizer_source="union", chat_template="chatml")
    compare(vocab_family, cfg, tmp_path)
    assert "<|im_start|>" in (chat_of(tmp_path / "fs") or "")


def test_inline_chat_template_alone(vocab_family: dict[str, Path], tmp_path: Path) -> None:
    """chat_template without a tokenizer merge: the base's tokenizer with the template."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    cfg = cfg_for(vocab_family, chat_template=template)
    cfg["models"] = [{"model": str(vocab_family["base"]), "parameters": {"weight": 1.0}}]
    cfg["merge_method"] = "linear"
    del cfg["base_model"]
    mk = mergekit_dir(cfg, tmp_path / "mk")
    run_mergefs(cfg, tmp_path / "fs")
    assert chat_of(tmp_path / "fs") == chat_of(mk) == template
    assert tokenizer_doc(mk) == tokenizer_doc(tmp_path / "fs")


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse")
def test_mount_serves_the_tokenizer_merge(vocab_family: dict[str, Path], tmp_path: Path,
                                          mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    cfg = cfg_for(vocab_family, tokenizer_source="union", chat_template="chatml")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**cfg, "budget": "50%", "block_size": "4KiB",
                                    "index_dir": str(tmp_path / "index")}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(m.path)
    assert "gamma" in tok.get_vocab() and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(m.path)
    assert model.config.vocab_size == len(tok.get_vocab())


def test_replay_of_a_tokenizer_merge(vocab_family: dict[str, Path], tmp_path: Path) -> None:
    from mounting import sha256

    from mergefs import cli

    cfg = cfg_for(vocab_family, tokenizer={"source": "union", "pad_to_multiple_of": 8},
                  chat_template="chatml")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**cfg, "budget": "40%", "block_size": "4KiB",
                                    "index_dir": str(tmp_path / "index")}))
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--manifest",
                     str(tmp_path / "m.jsonl")]) == 0
    # the vocabulary tensors are read whole beside the plan's blocks, and the totals say so
    totals = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()
              if '"totals"' in line][-1]
    from safetensors import safe_open

    vocab = 0
    for d in cfg["models"]:
        if Path(d["model"]) == Path(cfg["base_model"]):
            continue
        with safe_open(str(Path(d["model"]) / "model.safetensors"), "pt") as f:
            vocab += sum(f.get_tensor(n).nbytes
                         for n in ("model.embed_tokens.weight", "lm_head.weight"))
    assert totals["expert_bytes_vocabulary"] == vocab > 0
    assert totals["expert_bytes_read"] == totals["expert_bytes_planned"] + vocab
    assert cli.main(["replay", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "again")]) == 0
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(tmp_path / "out" / f) == sha256(tmp_path / "again" / f)


def test_union_over_http_equals_the_local_union(vocab_family: dict[str, Path],
                                                tmp_path: Path) -> None:
    """Models behind HTTP: their tokenizer files are fetched (small files), their vocabulary
    tensors read by ranges; the output equals the same merge of the local directories."""
    from bench.servers import RangeHTTPServer

    root = vocab_family["base"].parent
    tokens = {"gamma": {"source": {"kind": "model_token", "model": str(vocab_family["a"]),
                                   "token": "w3"}}}
    local = cfg_for(vocab_family, tokenizer={"source": "union", "tokens": tokens},
                    chat_template="chatml")
    run_mergefs(local, tmp_path / "local")
    srv = RangeHTTPServer(root).start()
    try:
        fam = {k: f"{srv.url}/{p.name}" for k, p in vocab_family.items()}
        remote = {**local, "base_model": fam["base"],
                  "models": [{**m, "model": fam[Path(m["model"]).name]} for m in local["models"]],
                  "tokenizer": {"source": "union", "tokens": {"gamma": {"source": {
                      "kind": "model_token", "model": fam["a"], "token": "w3"}}}}}
        run_mergefs(remote, tmp_path / "remote")
        assert srv.log.requests("tokenizer", "GET"), "tokenizer files were not fetched"
    finally:
        srv.stop()
    files = sorted(p.name for p in (tmp_path / "local").iterdir()  # the card names the models
                   if p.is_file() and p.name not in ("README.md", "mergekit_config.yml"))
    assert "tokenizer.json" in files and "model.safetensors" in files
    for name in files:
        assert (tmp_path / "local" / name).read_bytes() == \
            (tmp_path / "remote" / name).read_bytes(), name


# -- tokenizers with tokens past vocab_size (mergekit strips them from the base's, BPE only)

BPE_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5, "d": 6, "ab": 7, "cd": 8,
             "abcd": 9, "x": 10, "y": 11, "xy": 12}
BPE_MERGES = [("a", "b"), ("c", "d"), ("ab", "cd"), ("x", "y")]


def _save_past_vocab_model(path: Path, vocab_size: int, seed: int, kind: str = "BPE",
                           base_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Llama model with ``vocab_size`` rows whose tokenizer has more tokens (x, y, xy and
    an added <pad> at 13: padding tokens past the model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if base_state is not None:
        g = torch.Generator().manual_seed(seed)
        new = {}
        for name, t in model.state_dict().items():
            w0 = base_state[name]
            rows = t.float().clone()
            rows[:w0.shape[0]] = w0.float() + 0.01 * torch.randn(w0.shape, generator=g)
            new[name] = rows.to(t.dtype)
        model.load_state_dict(new)
    model.save_pretrained(path)
    if kind == "BPE":
        tok = Tokenizer(models.BPE(dict(BPE_VOCAB), list(BPE_MERGES), unk_token="<unk>"))
    else:
        tok = Tokenizer(models.WordLevel(dict(BPE_VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    # an added token, not a special one: declared as pad_token, a reload of the stripped
    # tokenizer adds it back at id 10, where mergekit's union then fails (a KeyError)
    fast.add_tokens(["<pad>"])
    fast.save_pretrained(path)
    assert fast.get_vocab()["<pad>"] == 13
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def past_vocab_family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base's tokenizer has 4 tokens past its vocab_size 10 (x, y, xy, <pad>); the
    experts use x, y and xy (vocab_size 13), <pad> is past theirs too."""
    root = tmp_path_factory.mktemp("past-vocab")
    base_state = _save_past_vocab_model(root / "base", 10, 1)
    for k, name in enumerate(("a", "b")):
        _save_past_vocab_model(root / name, 13, 10 + k, base_state=base_state)
    return {"base": root / "base", "a": root / "a", "b": root / "b"}


@pytest.mark.parametrize("source", ["base", "union"])
def test_tokens_past_vocab_size_are_stripped_as_mergekit_does(
        past_vocab_family: dict[str, Path], tmp_path: Path, source: str) -> None:
    cfg = cfg_for(past_vocab_family, tokenizer_source=source)
    # the union's new tokens (x, y, xy) come in mergekit's get_vocab() order, which varies
    # from run to run: compare() matches rows token by token
    mk, fs = compare(past_vocab_family, cfg, tmp_path)
    if source == "base":  # the stripped tokenizer itself, file for file
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (mk / f).exists() or (fs / f).exists():
                assert (mk / f).read_bytes() == (fs / f).read_bytes(), f
    doc = json.loads((fs / "tokenizer.json").read_text())
    assert "<pad>" not in doc["model"]["vocab"]
    assert all(t["content"] != "<pad>" for t in doc["added_tokens"])
    assert [m for m in doc["model"]["merges"] if "x" in m] == []  # "x y" went with x and y
    added = [t["content"] for t in doc["added_tokens"]]
    assert ("xy" in added) == (source == "union")
    rows = load_dir(fs)["lm_head.weight"].shape[0]
    assert rows == (13 if source == "union" else 10)
    for out in (mk, fs):
        assert json.loads((out / "config.json").read_text())["vocab_size"] == rows


def test_tokens_past_vocab_size_of_a_non_bpe_tokenizer_are_refused(tmp_path: Path) -> None:
    """mergekit strips BPE tokenizers only and refuses the others: so does mergefs."""
    from mergefs.core.errors import SpecError

    fam = {"base": tmp_path / "base", "a": tmp_path / "a", "b": tmp_path / "b"}
    state = _save_past_vocab_model(fam["base"], 10, 1, kind="WordLevel")
    for k in ("a", "b"):
        _save_past_vocab_model(fam[k], 13, 2, kind="WordLevel", base_state=state)
    cfg = cfg_for(fam, tokenizer_source="base")
    with pytest.raises(RuntimeError, match="only BPE"):
        mergekit_dir(cfg, tmp_path / "mk")
    with pytest.raises(SpecError, match=r"tokens past vocab_size 10; mergekit strips them "
                                        r"from BPE tokenizers only and refuses this "
                                        r"WordLevel one too"):
        run_mergefs(cfg, tmp_path / "fs")
