"""The output's layout: which tensors, in which dtype, in which files, and the non-weight files
that go beside them. Pure (reads headers already parsed).

Weight files are laid out as mergekit-yaml writes them (:class:`OutputOptions`, the default):
tensors in mergekit's write order (by name: mergekit schedules its save tasks by tensor name),
cut into shards of at most ``shard_bytes`` bytes of tensor data, named ``model.safetensors``
for one shard or ``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json``
listing them in write order; within a file, tensors are ordered as safetensors orders them
(:func:`mergefs.core.format.build_header`). ``shard_bytes`` None mirrors the base's sharding
instead (``--out-shard-size base``, and manifests written before this layout existed).
"""

from __future__ import annotations
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from mergefs.sources.base import SINGLE_NAME
from mergefs.sources.local import Checkpoint
from mergefs.core.format import DTYPES, FLOAT_DTYPES, build_header
from mergefs.recipe.outputs import Recipe, rewrite_config
from mergefs.spec.model import OUT_DTYPE_NAMES, Spec
from mergefs.sources.base import CONFIG_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output file: absolute ``[start, end)`` in that file."""

    name: str
    file: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    layout_index: int | None  # None: not merged (non-float), the base's bytes pass through


@dataclass(frozen=True)
class OutFile:
    name: str
    header: bytes
    size_bytes: int
    tensors: tuple[OutTensor, ...]  # in data order


#: mergekit's default ``--out-shard-size`` (5B: bytes of tensor data per shard, as its writer
#: counts them)
DEFAULT_SHARD_BYTES = 5 * 1000 ** 3

#: the tokenizer files mergekit copies from the base with ``--copy-tokenizer`` (its
#: ``merge._copy_tokenizer`` list, generation_config.json included), plus those mergefs also
#: counts as a tokenizer's (vocab.txt, vocab.json): left out with ``--no-copy-tokenizer``
TOKENIZER_FILES = frozenset({
    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
    "added_tokens.json", "merges.txt", "chat_template.jinja", "generation_config.json",
    "chat_template.json", "video_preprocessor_config.json", "vocab.txt", "vocab.json"})
#: the files of the model card: the base's describe the base, never the merge (never copied)
CARD_NAME = "README.md"
CONFIG_COPY_NAME = "mergekit_config.yml"


@dataclass(frozen=True)
class OutputOptions:
    """What a merge writes beside the merged tensors, as mergekit-yaml's flags say; recorded
    in the manifest's header (``output``) so that replay writes the same files.

    ``shard_bytes``: at most this many bytes of tensor data per weight file, in mergekit's
    write order (<= 0: one file); None mirrors the base's sharding. ``copy_tokenizer``: pass
    the base's tokenizer files (:data:`TOKENIZER_FILES`) on. ``model_card``: write README.md
    and mergekit_config.yml (``config_text``: the spec file's text). ``base_card``: pass the
    base's README.md and mergekit_config.yml on (only manifests written before these options
    existed did)."""

    shard_bytes: int | None = DEFAULT_SHARD_BYTES
    copy_tokenizer: bool = True
    model_card: bool = True
    config_text: str | None = None
    base_card: bool = False

    def to_json(self) -> dict[str, Any]:
        """As the manifest header records them: not ``config_text`` (the card's files are
        recorded whole when written; the spec's text may name private paths)."""
        return {"out_shard_size": "base" if self.shard_bytes is None else self.shard_bytes,
                "copy_tokenizer": self.copy_tokenizer, "write_model_card": self.model_card}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any] | None) -> OutputOptions:
        """The options a manifest header recorded; None (a manifest written before they were
        recorded): the output as mergefs wrote it then (the base's sharding and files)."""
        if doc is None:
            return cls(shard_bytes=None, model_card=False, base_card=True)
        size = doc.get("out_shard_size", "base")
        return cls(shard_bytes=None if size == "base" else int(size),
                   copy_tokenizer=bool(doc.get("copy_tokenizer", True)),
                   model_card=bool(doc.get("write_model_card", False)))

    def hidden(self, base_files: Iterable[str]) -> frozenset[str]:
        """The base's non-weight files not passed on to the output."""
        out = set() if self.base_card else {CARD_NAME, CONFIG_COPY_NAME}
        if not self.copy_tokenizer:
            out |= TOKENIZER_FILES
        return frozenset(r for r in base_files if r in out)


def parse_shard_size(value: str, where: str = "--out-shard-size") -> int | None:
    """mergekit's ``parse_kmb``: a count with an optional K, M or B suffix (powers of 1000,
    either case), as bytes of tensor data per shard; ``base``: None (mirror the base's
    sharding). Raises ValueError with one line naming ``where``."""
    text = value.strip()
    if text.lower() == "base":
        return None
    scale = {"k": 1000, "m": 1000 ** 2, "b": 1000 ** 3}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale != 1 else text
    sign = 1
    if scale != 1 and digits.startswith("-"):  # mergekit: int("-5") * 1000; <= 0: one file
        sign, digits = -1, digits[1:]
    if not digits.isdigit():
        raise ValueError(f"{where}: expected a size like 5B, 500M, 1000K or 1000000 (K, M, B: "
                         f"thousands, millions, billions of bytes) or `base`, got {value!r}")
    return sign * int(digits) * scale


def shard_names(count: int) -> list[str]:
    """mergekit's (and Hugging Face's) weight file names for ``count`` shards."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def mergekit_shards(tensors: Mapping[str, tuple[str, tuple[int, ...], int | None]],
                    shard_bytes: int) -> tuple[list[OutFile], bytes | None]:
    """``tensors`` (name -> (output dtype, shape, layout index)) cut as mergekit's writer cuts
    them: in write order (by name), a new shard whenever the current one holds a tensor and
    the next would take it past ``shard_bytes`` (<= 0: never); the shard index (mergekit's
    ``metadata.total_size`` and ``weight_map`` in write order) only for several shards."""
    groups: list[list[str]] = []
    size = 0
    for name in sorted(tensors):
        dtype, shape, _ = tensors[name]
        nbytes = math.prod(shape) * DTYPES[dtype][0]
        # as mergekit: a shard holding any tensor (an empty one too) is closed first
        if not groups or (shard_bytes > 0 and size + nbytes > shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files: list[OutFile] = []
    weight_map: dict[str, str] = {}
    total = 0
    for out_name, group in zip(shard_names(len(groups)), groups):
        header, lay = build_header({n: tensors[n][:2] for n in group}, {"format": "pt"})
        out = tuple(OutTensor(n, out_name, len(header) + lay[n].start, len(header) + lay[n].end,
                              lay[n].dtype, lay[n].shape, tensors[n][2])
                    for n in sorted(lay, key=lambda n: lay[n].start))
        files.append(OutFile(out_name, header, len(header) + sum(t.end - t.start for t in out),
                             out))
        for n in group:
            weight_map[n] = out_name
        total += sum(t.end - t.start for t in out)
    if len(files) <= 1:
        return files, None
    doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return files, json.dumps(doc, indent=2).encode()


def output_dtype(spec: Spec, src_dtype: str) -> str:
    if src_dtype in FLOAT_DTYPES and spec.out_dtype is not None:
        return spec.out_dtype
    return src_dtype


def output_layout(spec: Spec, base: Checkpoint, layout_index: dict[str, int],
                  shard_bytes: int | None = DEFAULT_SHARD_BYTES
                  ) -> tuple[list[OutFile], bytes | None]:
    """The merged model's weight files and its shard index: as mergekit writes them
    (:func:`mergekit_shards`), or with ``shard_bytes`` None mirroring the base's sharding."""
    if shard_bytes is not None:
        locs = [base.tensors[t.name] for f in base.files for t in base.headers[f].tensors]
        return mergekit_shards({t.name: (output_dtype(spec, t.dtype), t.shape,
                                         layout_index.get(t.name)) for t in locs}, shard_bytes)
    files: list[OutFile] = []
    weight_map: dict[str, str] = {}
    total = 0
    sharded = base.index_json is not None
    for f in base.files:
        names = [t.name for t in base.headers[f].tensors]
        spec_map = {n: (output_dtype(spec, base.tensors[n].dtype), base.tensors[n].shape)
                    for n in names}
        header, lay = build_header(spec_map, {"format": "pt"})
        out_name = f if sharded or base.is_dir else SINGLE_NAME
        tensors = tuple(
            OutTensor(n, out_name, len(header) + lay[n].start, len(header) + lay[n].end,
                      lay[n].dtype, lay[n].shape, layout_index.get(n))
            for n in sorted(lay, key=lambda n: lay[n].start)
        )
        size = len(header) + max((t.end for t in lay.values()), default=0)
        files.append(OutFile(out_name, header, size, tensors))
        for t in tensors:
            weight_map[t.name] = out_name
            total += t.end - t.start
    index_json = None
    if sharded:
        doc = {"metadata": {"total_size": total},
               "weight_map": dict(sorted(weight_map.items()))}
        index_json = (json.dumps(doc, indent=2) + "\n").encode()
    return files, index_json


def sliced_layout(spec: Spec, recipe: Recipe, base: Checkpoint, layout_index: dict[str, int],
                  vocab_shapes: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                  shard_bytes: int | None = DEFAULT_SHARD_BYTES
                  ) -> tuple[list[OutFile], bytes | None]:
    """The weight files of a sliced (or tokenizer) merge: as mergekit writes them
    (:func:`mergekit_shards`), or with ``shard_bytes`` None every output tensor in one file;
    ``vocab_shapes``: unit key -> (source dtype, output shape) of vocabulary tensors."""
    spec_map = {}
    for o in recipe.outputs:
        if vocab_shapes and o.key in vocab_shapes:
            dtype, shape = vocab_shapes[o.key]
        else:
            dtype, shape = base.tensors[o.key].dtype, base.tensors[o.key].shape
        spec_map[o.name] = (output_dtype(spec, dtype), shape)
    units = {o.name: o.key for o in recipe.outputs}
    if shard_bytes is not None:
        return mergekit_shards({n: (*spec_map[n], layout_index.get(units[n])) for n in spec_map},
                               shard_bytes)
    header, lay = build_header(spec_map, {"format": "pt"})
    tensors = tuple(
        OutTensor(n, SINGLE_NAME, len(header) + lay[n].start, len(header) + lay[n].end,
                  lay[n].dtype, lay[n].shape, layout_index.get(units[n]))
        for n in sorted(lay, key=lambda n: lay[n].start))
    size = len(header) + max((t.end for t in lay.values()), default=0)
    return [OutFile(SINGLE_NAME, header, size, tensors)], None


def output_extra_files(spec: Spec, base: Checkpoint, recipe: Recipe | None = None
                       ) -> dict[str, bytes]:
    """Non-weight files the merge writes differently from the base's, by relative path.

    ``config.json`` carries the output dtype (``torch_dtype`` and ``dtype``, the name
    transformers >= 5 reads), as mergekit writes it, so ``from_pretrained`` loads a float16
    merge as float16. Keys keep their order. Without an output dtype (each tensor keeps its own)
    or with a config that is not a JSON object, the base's file passes through unchanged.
    """
    sliced = recipe is not None and recipe.layers is not None
    if (spec.out_dtype is None and not sliced) or CONFIG_NAME not in base.extra_files:
        return {}
    try:
        config = json.loads(base.read_extra(CONFIG_NAME))
    except ValueError:
        log.warning("%s of the base is not valid JSON: copied unchanged (its dtype may not match "
                    "the merge)", CONFIG_NAME)
        return {}
    if not isinstance(config, dict):
        log.warning("%s of the base is not a JSON object: copied unchanged (its dtype may not "
                    "match the merge)", CONFIG_NAME)
        return {}
    if recipe is not None:
        config = rewrite_config(config, recipe)  # layer count and per-layer lists of slices
    if spec.out_dtype is not None:
        name = OUT_DTYPE_NAMES[spec.out_dtype]
        config["torch_dtype"] = name
        config["dtype"] = name
    return {CONFIG_NAME: (json.dumps(config, indent=2) + "\n").encode()}
