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
from mergefs.recipe.modules import set_dotted
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
    #: the (dotted) config.json key of the vocabulary size: read from each model's config,
    #: written into the output's (mergekit's architecture ``vocab_size_config_key``)
    size_key: str = "vocab_size"


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


def vocab_size_of(config: Mapping[str, Any] | None, fallback: int,
                  key: str = "vocab_size") -> int:
    """The vocabulary size at the dotted ``key`` of ``config`` (``text_config.vocab_size``),
    or ``fallback``."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if isinstance(node, int) and not isinstance(node, bool):
        return int(node)
    return fallback


def _base_tokenizer(path: str, vocab_size: int | None, dirs: Dirs | None = None) -> Any:
    """The base's tokenizer without the tokens at or past ``vocab_size`` (mergekit's
    ``get_stripped_tokenizer``: BPE only; their merges go too)."""
    tok = _load(path, dirs)
    size = vocab_size if vocab_size is not None else len(tok.get_vocab())
    unused = {t for t, i in tok.get_vocab().items() if i >= size}
    if not unused:
        return tok
    past = f"{path}: its tokenizer has tokens past vocab_size {size}"
    if not tok.is_fast:
        raise SpecError(f"{past} and no fast tokenizer to strip them from (mergekit refuses "
                        "it too)")
    doc = json.loads(tok.backend_tokenizer.to_str())
    kind = doc["model"]["type"]
    if kind != "BPE":
        raise SpecError(f"{past}; mergekit strips them from BPE tokenizers only and refuses "
                        f"this {kind} one too")
    doc["added_tokens"] = [e for e in doc["added_tokens"] if e["id"] < size]
    for t in unused:
        doc["model"]["vocab"].pop(t, None)
    doc["model"]["merges"] = [m for m in doc["model"]["merges"]
                              if not set(_merge_pair(m, past)) & unused]
    tok._tokenizer = _tokenizers().Tokenizer.from_str(json.dumps(doc))
    return tok


def _merge_pair(merge: Any, where: str) -> list[str]:
    """The two tokens of a BPE merge, stored as ``"a b"`` or ``["a", "b"]``."""
    if isinstance(merge, str) and merge.count(" ") == 1:
        return merge.split(" ")
    if isinstance(merge, list):
        return [str(t) for t in merge]
    raise SpecError(f"{where}; a merge of its BPE model is neither 'a b' nor a pair: "
                    f"{merge!r}")


def _tokenizers() -> Any:
    import tokenizers  # installed with transformers

    return tokenizers


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
          configs: Mapping[str, Mapping[str, Any] | None], dirs: Dirs | None = None,
          size_key: str = "vocab_size") -> BuiltTokenizer:
    """The output tokenizer of ``models`` (base first), with each model's row permutation;
    ``dirs``: where remote models' tokenizer files were fetched to; ``size_key``: the config
    key of the vocabulary size."""
    sizes = {m: vocab_size_of(configs.get(m), 0, size_key) for m in models}
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
                          {m: dict(t.get_vocab()) for m, t in toks.items()}, size_key)


def update_config(config: dict[str, Any], built: BuiltTokenizer) -> dict[str, Any]:
    """``config`` with the output's vocabulary size at ``built.size_key`` (a missing level:
    left alone, as mergekit warns and writes nothing)."""
    out = dict(config)
    set_dotted(out, built.size_key, built.rows)
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
