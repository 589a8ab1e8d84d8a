"""Independent whole-tensor numpy reference for the merge operators of docs/operators.md.

Written straight from the arithmetic contract, with the obvious algorithms (stable argsort for
the magnitude rules, explicit loops over experts in stable order), so that tests can compare the
production engine against it bit for bit. It reads checkpoints with safetensors' ``safe_open``
and never imports mergefs.

Scalar conventions the contract leaves implicit, fixed here (one place each):

- the additive coefficients ``c_i`` (and ``a``) are computed from the spec values in float64,
  then cast; elsewhere weights, density, gamma and lambda are ``np.float32(x)`` before use;
- counts ``floor(fraction * numel)`` use the float32 fraction multiplied in float64
  (``math.floor(float(np.float32(fraction)) * numel)``, exact for numel < 2**29);
- sums of spec weights in float64 run left to right from 0.0 (``w_b`` is added last, as
  ``w_b + sum_i w_i``);
- SLERP's ``t`` is used as the float64 spec value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import xxhash
import yaml
from safetensors import safe_open

ADDITIVE_METHODS = ("linear", "task_arithmetic")
GENERALISED_METHODS = ("ties", "dare_linear", "dare_ties", "breadcrumbs")
CONSENSUS_METHODS = ("ties", "dare_ties")
METHODS = ADDITIVE_METHODS + GENERALISED_METHODS + ("slerp",)

#: Global parameter defaults per method (mergekit's names).
GLOBAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "linear": {"normalize": True},
    "task_arithmetic": {"normalize": False, "lambda": 1.0},
    "ties": {"normalize": True, "lambda": 1.0},
    "dare_linear": {"normalize": False, "lambda": 1.0, "rescale": True, "seed": 0},
    "dare_ties": {"normalize": False, "lambda": 1.0, "rescale": True, "seed": 0},
    "breadcrumbs": {"normalize": False, "lambda": 1.0},
    "slerp": {},
}
#: Per-model parameter defaults; ``weight`` has none (required).
MODEL_DEFAULTS: dict[str, float] = {"density": 1.0, "gamma": 0.01}

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


def reference_merge(
    method: str,
    base: np.ndarray,
    experts: list[np.ndarray],
    tensor_name: str,
    params: Mapping[str, Any],
    model_params: Sequence[Mapping[str, Any]],
    base_weight: float | None = None,
    omit_masks: Sequence[np.ndarray | None] | None = None,
) -> np.ndarray:
    """Merge one floating tensor exactly as docs/operators.md defines; float32, base's shape.

    ``params`` is the spec's global ``parameters`` block, ``model_params[i]`` expert ``i``'s
    ``parameters`` (a global value of a per-model name is its default). ``base_weight`` is the
    base's weight when the base is listed among the models (``linear`` only). ``omit_masks[i]``
    (any shape with the tensor's element count, or None) is True where expert ``i``'s delta is
    omitted, i.e. set to exactly +0.0.
    """
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}")
    w0 = _decode(base).ravel()
    ws = [_decode(e).ravel() for e in experts]
    if any(w.shape != w0.shape for w in ws):
        raise ValueError(f"{tensor_name}: expert shape differs from base shape {base.shape}")
    merged_params = {**GLOBAL_DEFAULTS[method], **params}
    if method == "slerp":
        if omit_masks is not None and any(m is not None and np.any(m) for m in omit_masks):
            raise ValueError("slerp accepts only the full budget")
        return _slerp(w0, ws, float(merged_params["t"])).reshape(base.shape)
    if len(model_params) != len(ws):
        raise ValueError(f"{len(model_params)} model_params for {len(ws)} experts")
    masks = omit_masks if omit_masks is not None else [None] * len(ws)
    deltas = [_delta(w, w0, m) for w, m in zip(ws, masks, strict=True)]

    def model_value(name: str, i: int) -> Any:
        if name in model_params[i]:
            return model_params[i][name]
        if name in params:
            return params[name]
        if name in MODEL_DEFAULTS:
            return MODEL_DEFAULTS[name]
        raise ValueError(f"model {i}: required parameter {name!r} missing")

    if method in ADDITIVE_METHODS:
        weights = [float(model_value("weight", i)) for i in range(len(ws))]
        merged = _additive(method, w0, deltas, weights, merged_params, base_weight)
    else:
        merged = _generalised(method, w0, deltas, tensor_name, merged_params, model_value)
    return merged.reshape(base.shape)


def _decode(arr: np.ndarray) -> np.ndarray:
    if not any(arr.dtype == np.dtype(d) for d in FLOAT_DTYPES.values()):
        raise ValueError(f"not a floating tensor: {arr.dtype}")
    return np.asarray(arr).astype(np.float32)


def _delta(w: np.ndarray, w0: np.ndarray, omit: np.ndarray | None) -> np.ndarray:
    """``D = W - W0`` in float32, with omitted elements set to +0.0."""
    d = w - w0
    if omit is None:
        return d
    omit_flat = np.asarray(omit, dtype=bool).ravel()
    if omit_flat.shape != d.shape:
        raise ValueError(f"omit mask has {omit_flat.size} elements, tensor {d.size}")
    return np.where(omit_flat, np.float32(0.0), d)


def _additive(
    method: str,
    w0: np.ndarray,
    deltas: list[np.ndarray],
    weights: list[float],
    params: Mapping[str, Any],
    base_weight: float | None,
) -> np.ndarray:
    """``M = a * W0 + S`` with ``S = sum_i c_i D_i`` in stable order (linear, task arithmetic)."""
    total = 0.0
    for w in weights:
        total += w
    normalize = bool(params["normalize"])
    if method == "task_arithmetic":
        n = total if normalize and abs(total) >= 1e-8 else 1.0
        lam = float(params["lambda"])
        a = 1.0
        coeffs = [lam * w / n for w in weights]
    else:
        total = (0.0 if base_weight is None else float(base_weight)) + total
        n = total if normalize else 1.0
        if n == 0.0:
            raise ValueError("linear: weights sum to zero with normalize")
        a = total / n
        coeffs = [w / n for w in weights]
    s = np.zeros_like(w0)
    for c, d in zip(coeffs, deltas, strict=True):
        s = s + np.float32(c) * d
    a32 = np.float32(a)
    return (w0 if a32 == 1 else a32 * w0) + s


def _generalised(
    method: str,
    w0: np.ndarray,
    deltas: list[np.ndarray],
    tensor_name: str,
    params: Mapping[str, Any],
    model_value: Callable[[str, int], Any],
) -> np.ndarray:
    """mergekit's generalised task arithmetic: sparsify, weight, consensus, normalise, add."""
    weights = [np.float32(model_value("weight", i)) for i in range(len(deltas))]
    xs = []
    for i, d in enumerate(deltas):
        density = np.float32(model_value("density", i))
        if method == "ties":
            t = _magnitude(d, density)
        elif method == "breadcrumbs":
            t = _magnitude_outliers(d, density, np.float32(model_value("gamma", i)))
        else:
            t = _random(d, density, int(params["seed"]), tensor_name, i, bool(params["rescale"]))
        xs.append(t * weights[i])

    mixed = np.zeros_like(w0)
    if method in CONSENSUS_METHODS:
        sgn = np.zeros_like(w0)
        for x in xs:
            sgn = sgn + x
        majority = np.where(sgn >= 0, np.float32(1.0), np.float32(-1.0))
        divisor = np.zeros_like(w0)
        for x, w in zip(xs, weights, strict=True):
            agree = np.sign(x) == majority
            mixed = mixed + np.where(agree, x, np.float32(0.0))
            divisor = divisor + np.where(agree, w, np.float32(0.0))
        divisor = np.where(divisor == 0, np.float32(1.0), divisor)
    else:
        for x in xs:
            mixed = mixed + x
        total = np.float32(0.0)
        for w in weights:
            total = np.float32(total + w)
        divisor = np.full_like(w0, total if abs(float(total)) >= 1e-8 else np.float32(1.0))

    if bool(params["normalize"]):
        mixed = mixed / divisor
    lam = np.float32(params["lambda"])
    if lam != 1:
        mixed = mixed * lam
    return w0 + mixed


def _count(fraction: np.float32, numel: int) -> int:
    """``floor(fraction * numel)`` with the float32 fraction multiplied in float64."""
    return math.floor(float(fraction) * numel)


def _magnitude(d: np.ndarray, density: np.float32) -> np.ndarray:
    """TIES: keep the ``k`` largest ``|d|``, ties by lower flat index."""
    if density >= 1:
        return d
    k = _count(density, d.size)
    order = np.argsort(-np.abs(d), kind="stable")
    kept = order[:k]
    t = np.zeros_like(d)
    t[kept] = d[kept]
    return t


def _magnitude_outliers(d: np.ndarray, density: np.float32, gamma: np.float32) -> np.ndarray:
    """Breadcrumbs: drop the ``n_bot`` smallest and ``n_top`` largest ``|d|``."""
    if density >= 1:
        return d
    numel = d.size
    n_top = _count(gamma, numel)
    n_bot = numel - _count(density, numel) - n_top
    if n_bot < 0:
        n_top += n_bot
        n_bot = 0
    order = np.argsort(np.abs(d), kind="stable")
    kept = order[n_bot : numel - n_top]
    t = np.zeros_like(d)
    t[kept] = d[kept]
    return t


def _random(
    d: np.ndarray, density: np.float32, seed: int, tensor_name: str, expert: int, rescale: bool
) -> np.ndarray:
    """DARE: keep element ``j`` iff ``u(seed, tensor, expert, j) < density``, maybe rescaled."""
    if density >= 1:
        return d
    keep = dare_uniform(seed, tensor_name, expert, np.arange(d.size)) < float(density)
    t = np.zeros_like(d)
    t[keep] = d[keep] / density if rescale else d[keep]
    return t


def _slerp(v0: np.ndarray, experts: list[np.ndarray], t: float) -> np.ndarray:
    """Spherical interpolation of flat float32 ``v0`` towards the single expert."""
    if len(experts) != 1:
        raise ValueError(f"slerp needs exactly one expert besides the base, got {len(experts)}")
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"slerp t must be in [0, 1], got {t}")
    v1 = experts[0]
    n0 = np.linalg.norm(v0)
    n1 = np.linalg.norm(v1)
    u0 = v0 / n0 if n0 > 1e-8 else v0
    u1 = v1 / n1 if n1 > 1e-8 else v1
    dot = np.sum(u0 * u1)
    if abs(float(dot)) > 0.9995:
        s0, s1 = 1.0 - t, t
    else:
        theta0 = np.arccos(np.float64(dot))
        sin0 = np.sin(theta0)
        s0 = np.sin(theta0 - theta0 * t) / sin0
        s1 = np.sin(theta0 * t) / sin0
    return np.float32(s0) * v0 + np.float32(s1) * v1


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
    experts; the base's weight, if listed, is ``linear``'s ``w_b``. Output dtype: ``out_dtype``,
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
    base_path = (spec_dir / doc["base_model"]).resolve()
    expert_paths: list[Path] = []
    model_params: list[dict[str, Any]] = []
    base_weight: float | None = None
    for entry in doc["models"]:
        path = (spec_dir / entry["model"]).resolve()
        entry_params = dict(entry.get("parameters") or {})
        if path == base_path:
            weight = entry_params.get("weight", params.get("weight"))
            base_weight = None if weight is None else float(weight)
        else:
            expert_paths.append(path)
            model_params.append(entry_params)
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
            base_weight=base_weight if method == "linear" else None,
            omit_masks=None if omit_masks is None else omit_masks.get(name),
        )
        result[name] = cast_to(merged, out_dtype or own_dtype)
    return result
