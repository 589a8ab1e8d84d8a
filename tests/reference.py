"""The whole-tensor reference for the merge methods of docs/operators.md: mergekit 0.1.5 itself.

``reference_merge`` runs mergekit's registered method (``mergekit.merge_methods.get``) on whole
float32 tensors, with mergefs' documented choice fed in where mergekit leaves a result to
chance: ``torch.bernoulli`` draws mergefs' counter-based mask, here written independently
(:func:`dare_uniform`). Sorts stay torch's own (mergefs takes the same order among equal
magnitudes). Omitted blocks are set to the reference model's values (a zero delta) before
mergekit sees them. It reads checkpoints
with safetensors' ``safe_open`` and never imports mergefs.

mergekit's input order is kept: the models in ``models:`` order (the base excluded for methods
with a base role); for methods that take the base as one more input (linear, karcher,
passthrough) a base that is not listed is appended last, when it has the weight such methods
need (mergefs otherwise keeps the base as the coordinate reference only).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import xxhash
import yaml
from safetensors import safe_open

#: Methods whose base (``base_model``) is one more input rather than the origin of deltas.
BASE_AS_INPUT = ("linear", "karcher", "passthrough")
#: Methods that may run without a base model.
BASE_OPTIONAL = ("linear", "karcher", "passthrough", "multislerp", "nuslerp")
#: mergefs-only parameters mergekit does not know.
MERGEFS_ONLY = ("seed",)

#: safetensors dtype name -> numpy dtype, for the floating dtypes the operators merge.
FLOAT_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
#: Spec (torch-style) dtype names -> safetensors dtype names.
SPEC_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)


# ---------------------------------------------------------------------------------------------
# The counter-based uniform


def dare_uniform(
    seed: int, tensor_name: str, expert: int, indices: Iterable[int] | np.ndarray
) -> np.ndarray:
    """``u(seed, tensor_name, expert, j)`` for every flat element index ``j``, as float64."""
    key = np.uint64(xxhash.xxh3_64_intdigest(f"{seed}\x00{tensor_name}\x00{expert}".encode()))
    x = key + np.asarray(indices, dtype=np.uint64) * GOLDEN  # uint64 arrays wrap mod 2**64
    x = (x ^ (x >> np.uint64(30))) * MIX1
    x = (x ^ (x >> np.uint64(27))) * MIX2
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


# ---------------------------------------------------------------------------------------------
# Operators on whole tensors


@contextlib.contextmanager
def _mergefs_choices(seed: int, tensor_name: str) -> Iterator[None]:
    """``torch.bernoulli(p)`` as ``u(seed, tensor, k, j) < p_j`` for model k."""
    import mergekit.merge_methods.generalized_task_arithmetic as gta
    import torch

    state = {"calls": 0, "model": 0}
    orig = (torch.bernoulli, gta.sparsify)

    def bernoulli(p: Any, *_: Any, **__: Any) -> Any:
        u = dare_uniform(seed, tensor_name, state["model"], np.arange(p.numel()))
        keep = u < p.reshape(-1).double().numpy()
        return torch.from_numpy(keep.astype(np.float32)).reshape(p.shape).to(p.dtype)

    def sparsify(*a: Any, **kw: Any) -> Any:
        state["model"] = state["calls"]
        state["calls"] += 1
        return orig[1](*a, **kw)

    torch.bernoulli, gta.sparsify = bernoulli, sparsify
    try:
        yield
    finally:
        torch.bernoulli, gta.sparsify = orig


def reference_merge(
    method: str,
    base: np.ndarray,
    experts: list[np.ndarray],
    tensor_name: str,
    params: Mapping[str, Any],
    model_params: Sequence[Mapping[str, Any]],
    base_weight: float | None = None,
    omit_masks: Sequence[np.ndarray | None] | None = None,
    *,
    base_params: Mapping[str, Any] | None = None,
    base_position: int | None = None,
    base_role: bool | None = None,
) -> np.ndarray:
    """Merge one floating tensor as mergekit does (with mergefs' choices); float32, base's shape.

    ``params`` is the spec's global ``parameters`` block, ``model_params[i]`` expert ``i``'s
    ``parameters`` (a global value of a per-model name is its default). For methods that take
    the base as an input, ``base_weight`` / ``base_params`` make it one (at ``base_position``
    among the inputs, default last). ``omit_masks[i]`` (any shape with the tensor's element
    count, or None) is True where expert ``i``'s delta is omitted, i.e. its values are the
    base's. ``base_role=False``: ``base`` is the first model of a spec without ``base_model``
    (an input, and the reference omitted blocks fall back to).
    """
    import torch
    from mergekit import merge_methods
    from mergekit.merge_methods.base import ParameterScope, TensorEntry, TensorGroup, TensorMetadata

    m = merge_methods.get(method)
    w0 = torch.from_numpy(_decode(base).copy())
    ws = []
    masks = omit_masks if omit_masks is not None else [None] * len(experts)
    for e, om in zip(experts, masks, strict=True):
        w = torch.from_numpy(_decode(e).copy())
        if w.shape != w0.shape:
            raise ValueError(f"{tensor_name}: expert shape differs from base shape {base.shape}")
        if om is not None:
            omit = torch.from_numpy(np.asarray(om, dtype=bool).reshape(w.shape))
            w = torch.where(omit, w0, w)
        ws.append(w)
    if not model_params:
        model_params = [{}] * len(ws)
    if len(model_params) != len(ws):
        raise ValueError(f"{len(model_params)} model_params for {len(ws)} experts")
    entries = [TensorEntry(id=f"expert-{i}", tensor=w) for i, w in enumerate(ws)]
    per_id = {f"expert-{i}": dict(p) for i, p in enumerate(model_params)}
    if base_weight is not None and base_params is None:
        base_params = {"weight": base_weight}
    base_as_input = method in BASE_AS_INPUT or base_role is False
    if base_as_input and base_params is not None:
        pos = len(entries) if base_position is None else base_position
        entries.insert(pos, TensorEntry(id="base", tensor=w0))
        per_id["base"] = dict(base_params)
    elif not base_as_input:
        entries.insert(0, TensorEntry(id="base", tensor=w0, is_base=True))
    group = TensorGroup(entries=tuple(entries), metadata=TensorMetadata(name=tensor_name))
    names = {p.name: p for p in m.spec.parameters}
    bound: dict[str, Any] = {}
    for name, p in names.items():
        if p.scope == ParameterScope.SHARED:
            if name in params:
                bound[name] = params[name]
            continue
        ids = [en.id for en in entries if p.scope == ParameterScope.INPUT or not en.is_base]
        values = {}
        for i in ids:
            if name in per_id[i]:
                values[i] = per_id[i][name]
            elif name in params:
                values[i] = params[name]
            elif not p.required:
                values[i] = p.default
            else:
                raise ValueError(f"{i}: required parameter {name!r} missing")
        bound[name] = values
    with _mergefs_choices(int(params.get("seed", 0)), tensor_name), torch.no_grad():
        (out,) = m((group,), parameters=bound, dtype=torch.float32)
    return out.to(torch.float32).numpy().reshape(base.shape)


def _decode(arr: np.ndarray) -> np.ndarray:
    if not any(arr.dtype == np.dtype(d) for d in FLOAT_DTYPES.values()):
        raise ValueError(f"not a floating tensor: {arr.dtype}")
    return np.asarray(arr).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Dtypes and checkpoints


def cast_to(arr_f32: np.ndarray, dtype: str) -> np.ndarray:
    """Cast to a safetensors (``"F32"``, ``"F16"``, ``"BF16"``) or spec (``"bfloat16"``) dtype,
    rounding to nearest even."""
    return np.asarray(arr_f32).astype(FLOAT_DTYPES[SPEC_DTYPES.get(dtype, dtype)])


def omit_mask(numel: int, element_ranges: Iterable[tuple[int, int]]) -> np.ndarray:
    """A flat boolean mask, True on the half-open element ranges ``[start, end)``."""
    mask = np.zeros(numel, dtype=bool)
    for start, end in element_ranges:
        mask[start:end] = True
    return mask


def _tensor_file(path: Path | str, name: str) -> Path:
    """The safetensors file holding ``name``: ``path`` itself, via the shard index, or
    ``model.safetensors``."""
    path = Path(path)
    if path.is_file():
        return path
    index = path / "model.safetensors.index.json"
    if index.exists():
        filename: str = json.loads(index.read_text())["weight_map"][name]
        return path / filename
    return path / "model.safetensors"


def read_tensor(path: Path | str, name: str) -> np.ndarray:
    """Tensor ``name`` of a model directory or a safetensors file, in its stored dtype
    (bf16 as ``ml_dtypes.bfloat16``)."""
    with safe_open(str(_tensor_file(path, name)), framework="np") as f:
        return f.get_tensor(name)


def tensor_dtype(path: Path | str, name: str) -> str:
    """The safetensors dtype name (``"F32"``, ``"BF16"``, ``"I64"``, ...) of tensor ``name``."""
    with safe_open(str(_tensor_file(path, name)), framework="np") as f:
        return str(f.get_slice(name).get_dtype())


def tensor_names(path: Path | str) -> list[str]:
    """Sorted tensor names of a model directory or a safetensors file."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if path.is_dir() and index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(str(_tensor_file(path, "")), framework="np") as f:
        return sorted(f.keys())


# ---------------------------------------------------------------------------------------------
# Whole models from a spec


def reference_merge_dir(
    spec: Mapping[str, Any] | Path | str,
    *,
    relative_to: Path | None = None,
    omit_masks: Mapping[str, Sequence[np.ndarray | None]] | None = None,
) -> dict[str, np.ndarray]:
    """Merge every tensor of a mergekit-style spec; returns ``{name: array in output dtype}``.

    ``spec`` is a YAML file (paths relative to it) or a dict (paths relative to
    ``relative_to``, default the current directory). Models whose path is the base's are not
    experts (but inputs of linear, karcher, passthrough: see the module docstring). Output dtype:
    ``out_dtype``,
    else ``dtype``, else each tensor's own. Non-floating tensors are the base's, unchanged.
    ``omit_masks`` maps a tensor name to per-expert omit masks (see :func:`reference_merge`).
    Writes nothing.
    """
    if isinstance(spec, Mapping):
        doc = dict(spec)
        spec_dir = relative_to if relative_to is not None else Path.cwd()
    else:
        doc = yaml.safe_load(Path(spec).read_text())
        spec_dir = Path(spec).parent
    method = doc["merge_method"]
    params = dict(doc.get("parameters") or {})
    listed = [((spec_dir / e["model"]).resolve(), dict(e.get("parameters") or {}))
              for e in doc["models"]]
    base_path = (spec_dir / doc["base_model"]).resolve() if doc.get("base_model") else listed[0][0]
    expert_paths = [p for p, _ in listed if p != base_path]
    model_params = [q for p, q in listed if p != base_path]
    base_params: dict[str, Any] | None = None
    base_position: int | None = None
    base_role = None
    if not doc.get("base_model") and method not in BASE_AS_INPUT:
        base_params, base_position, base_role = listed[0][1], 0, False
    elif method in BASE_AS_INPUT:
        at = [k for k, (p, _) in enumerate(listed) if p == base_path]
        own = listed[at[0]][1] if at else {}
        if method != "linear" or "weight" in own or "weight" in params:
            base_params, base_position = own, (at[0] if at else None)
    base_weight = None
    out_dtype = doc.get("out_dtype") or doc.get("dtype")

    result = {}
    for name in tensor_names(base_path):
        base = read_tensor(base_path, name)
        own_dtype = tensor_dtype(base_path, name)
        if own_dtype not in FLOAT_DTYPES:
            result[name] = base
            continue
        experts = [read_tensor(p, name) for p in expert_paths]
        merged = reference_merge(
            method,
            base,
            experts,
            name,
            params,
            model_params,
            base_weight=base_weight,
            omit_masks=None if omit_masks is None else omit_masks.get(name),
            base_params=base_params,
            base_position=base_position,
            base_role=base_role,
        )
        result[name] = cast_to(merged, out_dtype or own_dtype)
    return result
