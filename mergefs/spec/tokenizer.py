"""Tokenizers as mergekit 0.1.5 merges them: the output tokenizer and the embedding rows.

``TokenizerSpec`` is the spec's ``tokenizer_source`` / ``tokenizer:`` block / ``chat_template``.
``build`` makes the output tokenizer with transformers (``base``: the base's; ``union``: the
base's vocabulary then every other model's new tokens, in spec order; a model: that model's),
adds the ``tokens`` it names, sets the chat template (``auto``: the most common template of the
inputs; a built-in name, read from mergekit's package data when mergekit is installed; or inline
Jinja), and returns the files ``save_pretrained`` writes plus, per model, the permutation from
output rows to that model's rows (-1: the model lacks the token). ``permute`` builds one model's
vocabulary tensor for the output (rows copied, missing rows from the token rules, rows past the
vocabulary padded with the mean row) exactly as mergekit's ``PermutedVocabulary``. Runs at the
spec edge and in worker threads; transformers is imported only here, only when a spec asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenRule:
    """``tokenizer.tokens[TOKEN]``: where its embedding comes from."""

    kind: str  # "model" (a model's row of the same token) | "model_token" | "zero" | "auto"
    model: str | None = None
    token_id: int | None = None
    token: str | None = None
    force: bool = False


@dataclass(frozen=True)
class TokenizerSpec:
    source: str | None  # "base" | "union" | a model path | None (only a chat template)
    tokens: Mapping[str, TokenRule] = field(default_factory=dict)
    pad_to_multiple_of: int | None = None
    chat_template: str | None = None


#: model path -> a local directory holding its tokenizer files (remote models, fetched by
#: the engine for the duration of ``build``)
Dirs = Mapping[str, str]


def to_json(spec_tok: TokenizerSpec) -> dict[str, Any]:
    """For ``Spec.raw`` (a ``tokenizer:`` block that parses back to the same)."""
    tokens: dict[str, Any] = {}
    for t, r in spec_tok.tokens.items():
        src: Any
        if r.kind == "zero":
            src = {"kind": "zero"}
        elif r.kind == "model_token":
            src = {"kind": "model_token", "model": r.model,
                   **({"token_id": r.token_id} if r.token_id is not None else {"token": r.token})}
        elif r.kind == "model":
            src = r.model
        else:
            src = None
        tokens[t] = {"source": src, "force": r.force}
    return {"source": spec_tok.source, "tokens": tokens,
            "pad_to_multiple_of": spec_tok.pad_to_multiple_of}


