"""The output's layout: which tensors, in which dtype, in which files, and the non-weight files that go beside them. Pure (reads headers already parsed)."""

from __future__ import annotations
import json
import logging
from dataclasses import dataclass
from mergefs.sources.base import SINGLE_NAME
from mergefs.sources.local import Checkpoint
from mergefs.core.format import FLOAT_DTYPES, build_header
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


def output_dtype(spec: Spec, src_dtype: str) -> str:
    if src_dtype in FLOAT_DTYPES and spec.out_dtype is not None:
        return spec.out_dtype
    return src_dtype


def output_layout(spec: Spec, base: Checkpoint, layout_index: dict[str, int]
                  ) -> tuple[list[OutFile], bytes | None]:
    """The merged model's weight files (mirroring the base's sharding) and its shard index."""
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
                  vocab_shapes: dict[str, tuple[str, tuple[int, ...]]] | None = None
                  ) -> tuple[list[OutFile], bytes | None]:
    """The weight file of a sliced (or tokenizer) merge: every output tensor, one file;
    ``vocab_shapes``: unit key -> (source dtype, output shape) of vocabulary tensors."""
    spec_map = {}
    for o in recipe.outputs:
        if vocab_shapes and o.key in vocab_shapes:
            dtype, shape = vocab_shapes[o.key]
        else:
            dtype, shape = base.tensors[o.key].dtype, base.tensors[o.key].shape
        spec_map[o.name] = (output_dtype(spec, dtype), shape)
    header, lay = build_header(spec_map, {"format": "pt"})
    units = {o.name: o.key for o in recipe.outputs}
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
