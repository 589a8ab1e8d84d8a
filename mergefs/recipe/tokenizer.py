"""Building the output tokenizer as mergekit 0.1.5 does (transformers, imported on first use) and the embedding rows it implies; the spec's tokenizer keys are :mod:`mergefs.spec.tokenizer`. Blocking I/O."""

from __future__ import annotations
import importlib.resources
import json
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import numpy as np
from mergefs.core.errors import SpecError
from mergefs.methods.base import require_torch
from mergefs.spec.tokenizer import Dirs, TokenRule, TokenizerSpec


#: Files of a tokenizer: hidden from the base when the merge writes its own tokenizer.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json"})


@dataclass(frozen=True)
class BuiltTokenizer:
    files: Mapping[str, bytes]
    vocab: Mapping[str, int]  # output token -> output row
    rows: int  # output rows (the vocabulary, padded)
    permutations: Mapping[str, np.ndarray]  # model path -> (len(vocab),) source row or -1
    original_vocabs: Mapping[str, Mapping[str, int]]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SpecError("tokenizer merging needs transformers (pip install transformers)") \
            from None
    return transformers


def _load(path: str, dirs: Dirs | None = None) -> Any:
    tf = _transformers()
    try:
        return tf.AutoTokenizer.from_pretrained((dirs or {}).get(path, path), use_fast=True)
    except Exception as exc:  # noqa: BLE001 (transformers raises many kinds)
        raise SpecError(f"{path}: cannot load its tokenizer: {exc}".splitlines()[0]) from None


def vocab_size_of(config: Mapping[str, Any] | None, fallback: int) -> int:
    if config and isinstance(config.get("vocab_size"), int):
        return int(config["vocab_size"])
    return fallback


def _base_tokenizer(path: str, vocab_size: int | None, dirs: Dirs | None = None) -> Any:
    tok = _load(path, dirs)
    size = vocab_size if vocab_size is not None else len(tok.get_vocab())
    if any(i >= size for i in tok.get_vocab().values()):
        raise SpecError(f"{path}: its tokenizer has tokens past vocab_size {size}; stripping "
                        "them is not supported yet")
    return tok


def _union(base_tok: Any, toks: Mapping[str, Any], sizes: Mapping[str, int]) -> Any:
    tf = _transformers()
    vocab: dict[str, int] = {}
    added: dict[str, Any] = {}
    for path, tok in toks.items():
        size = sizes.get(path) or tok.vocab_size
        decoder = tok.added_tokens_decoder
        added_names = {info.content for info in decoder.values()}
        # by id: get_vocab() is a hash map whose order changes from process to process
        # (mergekit iterates it as it comes, so its union order varies run to run)
        for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if i >= size or t in added_names:
                continue
            vocab.setdefault(t, len(vocab))
        for i, info in sorted(decoder.items()):
            if i < size:
                added.setdefault(info.content, info)
    with tempfile.TemporaryDirectory() as d:  # a copy: the base's tokenizer stays as it is
        base_tok.save_pretrained(d, legacy_format=False, safe_serialization=True)
        out = tf.AutoTokenizer.from_pretrained(d, use_fast=True)
    base_vocab = base_tok.get_vocab()
    for t in vocab:
        if t not in added and t not in base_vocab:
            out.add_tokens(t)
    for info in added.values():
        out.add_tokens(info)
    return out


def chat_template_text(value: str, models: Sequence[str], dirs: Dirs | None = None
                       ) -> str | None:
    """The template text for ``chat_template`` (mergekit's rules)."""
    if value == "auto":
        found = []
        for m in models:
            try:
                t = _load(m, dirs).chat_template
            except SpecError:
                continue
            if isinstance(t, dict):
                t = t.get("default")
            if t:
                found.append(t.strip())
        return Counter(found).most_common(1)[0][0] if found else None
    if len(value) < 256 and "\n" not in value and "{" not in value:
        try:
            files = importlib.resources.files("mergekit._data.chat_templates")
        except ModuleNotFoundError:
            raise SpecError(f"chat_template: the built-in template {value!r} is mergekit's: "
                            "install mergekit, or give the Jinja text inline") from None
        t = files.joinpath(value + ".jinja")
        if t.is_file():
            return t.read_text()
    if len(value) < 20 or "{" not in value:
        raise SpecError(f"chat_template: {value!r} is neither a built-in name nor a template")
    return value


def build(spec_tok: TokenizerSpec, base: str, models: Sequence[str],
          configs: Mapping[str, Mapping[str, Any] | None], dirs: Dirs | None = None
          ) -> BuiltTokenizer:
    """The output tokenizer of ``models`` (base first), with each model's row permutation;
    ``dirs``: where remote models' tokenizer files were fetched to."""
    sizes = {m: vocab_size_of(configs.get(m), 0) for m in models}
    base_tok = _base_tokenizer(base, sizes[base] or None, dirs)
    toks: dict[str, Any] = {base: base_tok}
    for m in models:
        if m != base:
            try:
                toks[m] = _load(m, dirs)
            except SpecError:
                pass  # mergekit assumes the base's tokenizer
    if spec_tok.source is None or spec_tok.source == "base":
        out = base_tok
    elif spec_tok.source == "union":
        out = _union(base_tok, toks, sizes)
    else:
        out = _load(spec_tok.source, dirs)
    have = set(out.get_vocab())
    for t in spec_tok.tokens:
        if t not in have:
            out.add_tokens(t)
            have.add(t)
    if spec_tok.chat_template:
        text = chat_template_text(spec_tok.chat_template, models, dirs)
        if text is not None:
            out.chat_template = text
    vocab = dict(out.get_vocab())
    rows = len(vocab)
    pad = spec_tok.pad_to_multiple_of
    if pad and rows % pad:
        rows = (rows // pad + 1) * pad
    perms: dict[str, np.ndarray] = {}
    for m in models:
        mv = toks.get(m, base_tok).get_vocab()
        size = sizes[m] or len(mv)
        p = np.full(len(vocab), -1, dtype=np.int64)
        for t, i in vocab.items():
            j = mv.get(t)
            if j is not None and j < size:
                p[i] = j
        perms[m] = p
    with tempfile.TemporaryDirectory() as d:
        out.save_pretrained(d, safe_serialization=True)
        files = {p.relative_to(d).as_posix(): p.read_bytes()
                 for p in sorted(Path(d).rglob("*")) if p.is_file()}
    return BuiltTokenizer(files, vocab, rows, perms,
                          {m: dict(t.get_vocab()) for m, t in toks.items()})


def update_config(config: dict[str, Any], built: BuiltTokenizer) -> dict[str, Any]:
    out = dict(config)
    out["vocab_size"] = built.rows
    return out


def permute(built: BuiltTokenizer, spec_tok: TokenizerSpec, base: str | None,
            tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Each model's vocabulary tensor in the output's rows (torch float32, mergekit's rules).

    ``tensors``: model path -> its (rows, ...) tensor, in the merge's input order."""
    torch = require_torch("a tokenizer merge")

    models = list(tensors)
    vocab = built.vocab
    shape = next(iter(tensors.values())).shape[1:]
    perms = built.permutations
    rules = dict(spec_tok.tokens)
    average: set[str] = set()
    for t, i in vocab.items():  # where each token's embedding comes from
        if t in rules:
            continue
        present = [perms[m][i] >= 0 for m in models]
        if sum(present) == 1:
            rules[t] = TokenRule("model", models[present.index(True)])
        elif not any(present):
            rules[t] = TokenRule("zero")
        elif base in models and perms[base][i] >= 0:
            rules[t] = TokenRule("model", base)
        else:
            average.add(t)
    defaults: dict[str, Any] = {}
    for t, i in vocab.items():
        rule = rules.get(t)
        if not (rule is not None and rule.force) and all(perms[m][i] >= 0 for m in models):
            continue
        if t in average:
            e = torch.zeros(shape, dtype=torch.float32)
            n = 0
            for m in models:
                if perms[m][i] >= 0:
                    e = e + tensors[m][int(perms[m][i])]
                    n += 1
            e /= n
        elif rule is not None:
            e = _rule_embedding(built, tensors, t, i, rule)
        else:
            continue
        defaults[t] = e
    out: dict[str, Any] = {}
    for m in models:
        p = perms[m]
        new = torch.zeros((built.rows, *shape), dtype=torch.float32)
        for t, i in vocab.items():
            rule = spec_tok.tokens.get(t)
            force = rule.force if rule is not None else False
            if p[i] >= 0 and not force:
                new[i] = tensors[m][int(p[i])]
            elif t in defaults:
                new[i] = defaults[t]
        if built.rows > len(vocab):
            new[len(vocab):] = torch.mean(new[:len(vocab)], dim=0)
        out[m] = new
    return out


def _rule_embedding(built: BuiltTokenizer, tensors: Mapping[str, Any], token: str, i: int,
                    rule: TokenRule) -> Any:
    if rule.kind == "zero":
        t0 = next(iter(tensors.values()))
        return t0.new_zeros(t0.shape[1:])
    if rule.model is None or rule.model not in tensors:
        raise SpecError(f"tokenizer.tokens.{token}: its source {rule.model} is not an input "
                        "of this tensor")
    src = tensors[rule.model]
    if rule.kind == "model_token":
        j = rule.token_id
        if j is None:
            j = built.original_vocabs[rule.model].get(rule.token or "")
            if j is None:
                raise SpecError(f"tokenizer.tokens.{token}: {rule.token!r} is not in "
                                f"{rule.model}'s vocabulary")
        if not 0 <= j < src.shape[0]:
            raise SpecError(f"tokenizer.tokens.{token}: token id {j} out of range")
        return src[j]
    j = int(built.permutations[rule.model][i])
    if j < 0:
        raise SpecError(f"tokenizer.tokens.{token}: {rule.model} has no such token")
    return src[j]


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
