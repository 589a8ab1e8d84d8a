"""Small synthetic checkpoint families on disk, for tests and benchmarks.

A family is a base model and a few experts, each a Hugging Face-like directory (safetensors
weights, optionally sharded with an index, ``config.json``, ``tokenizer.json``). Experts are the
base plus small deltas; some whole tensors and some contiguous row ranges are left bit-identical
to the base, so zero-delta blocks exist at block sizes from a few hundred bytes to a few KiB.
Everything is deterministic given the seed. This module does not import mergefs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ml_dtypes
import numpy as np
import yaml
from safetensors.numpy import save_file

DtypeName = Literal["float32", "float16", "bfloat16"]
ExpertLayout = Literal["same", "single", "reversed"]
FileLayout = Literal["single", "sharded", "reversed"]

NUMPY_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}

#: Floating tensors of the default synthetic family (name -> shape).
DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (64, 48),
    "model.layers.0.self_attn.q_proj.weight": (48, 48),
    "model.layers.0.self_attn.k_proj.weight": (48, 48),
    "model.layers.0.mlp.up_proj.weight": (96, 48),
    "model.layers.0.mlp.down_proj.weight": (48, 96),
    "model.layers.0.input_layernorm.weight": (48,),
    "model.norm.weight": (48,),
    "lm_head.weight": (256, 48),
}
#: Tensors left bit-identical to the base in every expert, by default.
DEFAULT_ZERO_TENSORS: tuple[str, ...] = (
    "model.layers.0.self_attn.k_proj.weight",
    "model.norm.weight",
)
#: The integer tensor every synthetic model carries, identical in base and experts.
INT_TENSOR_NAME = "buffers.position_ids"
INT_TENSOR_SHAPE = (1, 16)

N_SHARDS = 3
RELATIVE_DELTA = 1e-2
SAFETENSORS_METADATA = {"format": "pt"}
#: A small stand-in for a tokenizer file, copied verbatim into every model directory.
TOKENIZER = {
    "version": "1.0",
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "a": 1, "b": 2}, "unk_token": "<unk>"},
}


@dataclass(frozen=True)
class Family:
    """A base model directory and its expert directories, all under ``root``."""

    base: Path
    experts: list[Path]
    root: Path
    dtype: str
    tensor_names: list[str]


def row_sparse(w0: np.ndarray, rng: np.random.Generator, share: float,
               scale: float = 2e-3) -> np.ndarray:
    """``w0`` plus a delta on about ``share`` of its rows (at least one), dense there: as a
    fine-tune changes only the embedding rows of the tokens it saw."""
    rows = rng.random(w0.shape[0]) < share
    rows[rng.integers(w0.shape[0])] = True
    d = np.zeros_like(w0)
    d[rows] = rng.normal(0, scale, (int(rows.sum()), w0.shape[1]))
    return w0 + d


def make_family(
    root: Path,
    *,
    n_experts: int = 3,
    dtype: DtypeName = "float32",
    sharded: bool = False,
    expert_layout: ExpertLayout = "same",
    seed: int = 0,
    zero_tensors: tuple[str, ...] = DEFAULT_ZERO_TENSORS,
    zero_row_fraction: float = 0.3,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> Family:
    """Write a synthetic family under ``root`` (``root/base``, ``root/expert-0``, ...).

    ``shapes`` maps floating tensor names to shapes (default :data:`DEFAULT_SHAPES`); the int64
    tensor :data:`INT_TENSOR_NAME` is always added and is identical in every model. Base values
    are N(0, 0.02); expert ``i`` is base + a delta of about ``RELATIVE_DELTA`` relative size (the
    scale varies per tensor and per row), except that tensors in ``zero_tensors`` are copied from
    the base, and in every other tensor one contiguous run of ``floor(zero_row_fraction * rows)``
    rows (at a seeded position, different per expert) is copied from the base bytes.

    With ``sharded=True`` the base is split across 3 files with an index; ``expert_layout`` then
    picks the experts' files: ``"same"`` (same split as the base), ``"single"`` (one
    ``model.safetensors``) or ``"reversed"`` (3 shards, tensors assigned in reverse name order,
    so each tensor sits in a different file and offset). Tensor values do not depend on the
    layout, only on ``seed`` and the other arguments.
    """
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if not sharded and expert_layout != "same":
        raise ValueError("expert_layout applies only to sharded families")
    float_shapes = dict(DEFAULT_SHAPES if shapes is None else shapes)
    unknown = set(zero_tensors) - set(float_shapes)
    if unknown:
        raise ValueError(f"zero_tensors not in shapes: {sorted(unknown)}")
    np_dtype = NUMPY_DTYPES[dtype]
    rng = np.random.default_rng(seed)

    base_f32 = {
        name: rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        for name, shape in sorted(float_shapes.items())
    }
    base = {name: arr.astype(np_dtype) for name, arr in base_f32.items()}
    base[INT_TENSOR_NAME] = np.arange(np.prod(INT_TENSOR_SHAPE), dtype=np.int64).reshape(
        INT_TENSOR_SHAPE
    )
    names = sorted(base)
    root.mkdir(parents=True, exist_ok=True)
    base_dir = root / "base"
    base_layout: FileLayout = "sharded" if sharded else "single"
    _write_model(base_dir, base, names, base_layout, dtype)

    expert_dirs = []
    for i in range(n_experts):
        expert = dict(base)
        for name, w0 in base_f32.items():
            if name not in zero_tensors:
                expert[name] = _expert_tensor(rng, w0, base[name], zero_row_fraction)
        layout: FileLayout = base_layout if expert_layout == "same" else expert_layout
        expert_dir = root / f"expert-{i}"
        _write_model(expert_dir, expert, names, layout, dtype)
        expert_dirs.append(expert_dir)
    return Family(base=base_dir, experts=expert_dirs, root=root, dtype=dtype, tensor_names=names)


def _expert_tensor(
    rng: np.random.Generator, w0: np.ndarray, encoded_base: np.ndarray, zero_row_fraction: float
) -> np.ndarray:
    """Base plus a row-scaled random delta, with one run of rows copied from the base bytes."""
    rows = w0.shape[0]
    tensor_scale = RELATIVE_DELTA * float(np.sqrt(np.mean(w0**2))) * rng.uniform(0.5, 2.0)
    row_scale = np.exp(rng.uniform(np.log(0.25), np.log(4.0), size=rows)).astype(np.float32)
    row_scale = row_scale.reshape((rows,) + (1,) * (w0.ndim - 1))
    delta = rng.normal(0.0, tensor_scale, size=w0.shape).astype(np.float32) * row_scale
    encoded = (w0 + delta).astype(encoded_base.dtype)
    n_zero = int(zero_row_fraction * rows)
    start = int(rng.integers(0, rows - n_zero + 1))
    encoded[start : start + n_zero] = encoded_base[start : start + n_zero]
    return encoded


def _write_model(
    model_dir: Path,
    tensors: Mapping[str, np.ndarray],
    names: Sequence[str],
    layout: FileLayout,
    dtype: str,
) -> None:
    """Write weights in ``layout`` plus ``config.json`` and ``tokenizer.json``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    if layout == "single":
        save_file(dict(tensors), model_dir / "model.safetensors", metadata=SAFETENSORS_METADATA)
    else:
        order = list(names) if layout == "sharded" else list(reversed(names))
        bounds = [round(k * len(order) / N_SHARDS) for k in range(N_SHARDS + 1)]
        groups = [order[bounds[k] : bounds[k + 1]] for k in range(N_SHARDS)]
        weight_map = {}
        for k, group in enumerate(groups):
            filename = f"model-{k + 1:05d}-of-{N_SHARDS:05d}.safetensors"
            save_file(
                {name: tensors[name] for name in group},
                model_dir / filename,
                metadata=SAFETENSORS_METADATA,
            )
            weight_map.update({name: filename for name in group})
        index = {
            "metadata": {"total_size": sum(int(tensors[n].nbytes) for n in names)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(model_dir / "model.safetensors.index.json", index)
    config = {
        "architectures": ["MergefsTestForCausalLM"],
        "model_type": "mergefs-test",
        "torch_dtype": dtype,
    }
    _write_json(model_dir / "config.json", config)
    _write_json(model_dir / "tokenizer.json", TOKENIZER)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_llama_family(
    root: Path,
    n_experts: int = 2,
    dtype: DtypeName = "float32",
    seed: int = 0,
    *,
    sharded: bool = False,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    vocab_size: int = 128,
) -> Family:
    """Write a tiny Llama base and fine-tune-like experts with transformers' ``save_pretrained``.

    Each directory holds what ``save_pretrained`` writes (weights, ``config.json``,
    ``generation_config.json``) plus the stand-in ``tokenizer.json``.

    The base is ``LlamaForCausalLM`` (by default hidden 64, intermediate 128, 2 layers, vocab
    128; other sizes give tensors whose sizes are not multiples of 32) initialised under
    ``torch.manual_seed(seed)``. Each expert adds a random delta of about ``RELATIVE_DELTA``
    relative size to every weight except the norms and layer 1's attention projections, which
    stay bit-identical to the base. ``sharded=True`` saves with ``max_shard_size="100KB"``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        dtype
    ]
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    # save_pretrained writes safetensors by default (transformers >= 4.35).
    save_kwargs: dict[str, Any] = {"max_shard_size": "100KB"} if sharded else {}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch_dtype)
    base_dir = root / "base"
    model.save_pretrained(base_dir, **save_kwargs)
    _write_json(base_dir / "tokenizer.json", TOKENIZER)
    base_state = {name: t.detach().clone() for name, t in model.state_dict().items()}

    generator = torch.Generator().manual_seed(seed + 1)
    expert_dirs = []
    for i in range(n_experts):
        state = {}
        for name, w0 in base_state.items():
            if _llama_untouched(name) or not w0.is_floating_point():
                state[name] = w0
                continue
            w32 = w0.float()
            scale = RELATIVE_DELTA * float(w32.pow(2).mean().sqrt())
            delta = torch.randn(w0.shape, generator=generator) * scale
            state[name] = (w32 + delta).to(torch_dtype)
        model.load_state_dict(state)
        expert_dir = root / f"expert-{i}"
        model.save_pretrained(expert_dir, **save_kwargs)
        _write_json(expert_dir / "tokenizer.json", TOKENIZER)
        expert_dirs.append(expert_dir)
    names = sorted(base_state)
    return Family(base=base_dir, experts=expert_dirs, root=root, dtype=dtype, tensor_names=names)


def _llama_untouched(name: str) -> bool:
    """Whether experts of the Llama family keep this tensor bit-identical to the base."""
    return "norm" in name or name.startswith("model.layers.1.self_attn.")


def write_spec(
    path: Path,
    family: Family,
    method: str = "task_arithmetic",
    weights: Sequence[float] | None = None,
    parameters: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    *,
    model_parameters: Sequence[Mapping[str, Any]] | None = None,
) -> Path:
    """Write a mergekit-style YAML spec for ``family`` at ``path`` and return ``path``.

    Model paths are relative to the spec's directory. ``weights`` (default ``1 / n_experts``
    each; none for ``slerp``) become ``models[i].parameters.weight``, merged with
    ``model_parameters[i]`` if given. ``parameters`` is the global ``parameters`` block and
    ``extra`` adds top-level keys (``budget``, ``block_size``, ``dtype``, ...).
    """
    n = len(family.experts)
    if weights is None and method != "slerp":
        weights = [1.0 / n] * n
    if weights is not None and len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} experts")
    if model_parameters is not None and len(model_parameters) != n:
        raise ValueError(f"{len(model_parameters)} model_parameters for {n} experts")
    models = []
    for i, expert in enumerate(family.experts):
        params: dict[str, Any] = {}
        if weights is not None:
            params["weight"] = float(weights[i])
        if model_parameters is not None:
            params.update(model_parameters[i])
        entry: dict[str, Any] = {"model": _relative(expert, path.parent)}
        if params:
            entry["parameters"] = params
        models.append(entry)
    spec: dict[str, Any] = {
        "merge_method": method,
        "base_model": _relative(family.base, path.parent),
        "models": models,
    }
    if parameters:
        spec["parameters"] = dict(parameters)
    spec.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _relative(target: Path, start: Path) -> str:
    return os.path.relpath(target.resolve(), start.resolve())


def forget_ctimes(index_dir: Path) -> None:
    """Make a stored block index look as if written without status-change times, so that only
    the sources' identities are checked (pieces under ``index_dir/pieces``)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    for piece in Path(index_dir).glob("pieces/*.safetensors"):
        with safe_open(str(piece), "np") as f:
            meta = dict(f.metadata() or {})
        if meta.pop("ctime_ns", None) is not None:
            save_file(load_file(str(piece)), str(piece), metadata=meta)
    for record in Path(index_dir).glob("pieces/source-*.json"):  # the times of sources
        rec = json.loads(record.read_text())
        if rec.pop("ctime_ns", None) is not None:
            record.write_text(json.dumps(rec))
