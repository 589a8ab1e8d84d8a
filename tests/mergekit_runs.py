"""Helpers of the differential tests against mergekit (in-process): run both tools on a config, load output directories, compare bytes."""

from __future__ import annotations
import torch
import shutil
from pathlib import Path
from typing import Any
import numpy as np
import yaml
from families import Family
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from safetensors.torch import load_file
from mergefs.engine.session import Session
from mergefs.spec.load import load_spec


def config(fam: Family, method: str, n: int = 2, *, base: str = "separate",
           weights: list[float] | None = None, model_params: list[dict[str, Any]] | None = None,
           parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A mergekit config over ``n`` experts. ``base``: "separate" (base_model only), "listed"
    (also first in models, weight 0.3 when weights are given), "none" (no base_model)."""
    models: list[dict[str, Any]] = []
    if base == "listed":
        models.append({"model": str(fam.base)})
        if weights is not None:
            models[0]["parameters"] = {"weight": 0.3}
    for i in range(n):
        params: dict[str, Any] = {}
        if weights is not None:
            params["weight"] = weights[i]
        if model_params is not None:
            params.update(model_params[i])
        models.append({"model": str(fam.experts[i]), **({"parameters": params} if params else {})})
    cfg: dict[str, Any] = {"merge_method": method, "models": models, "dtype": "float32",
                           "out_dtype": fam.dtype}
    if base != "none":
        cfg["base_model"] = str(fam.base)
    if parameters:
        cfg["parameters"] = parameters
    cfg.update(extra)
    return cfg


def load_dir(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_mergekit(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    run_merge(MergeConfiguration.model_validate(cfg), str(out),
              MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False))
    return load_dir(out)


def run_mergefs(cfg: dict[str, Any], out: Path, budget: str = "full") -> dict[str, Any]:
    spec_path = out.with_suffix(".yaml")
    doc = {**cfg, "block_size": "4KiB", "budget": budget,
           "index_dir": str(out.parent / "index"), "manifest": str(out) + ".manifest.jsonl"}
    spec_path.write_text(yaml.safe_dump(doc))
    shutil.rmtree(out, ignore_errors=True)
    session = Session(load_spec(spec_path))
    try:
        session.engine.materialise(out)
    finally:
        session.close()
    return load_dir(out)


def assert_identical(mk: dict[str, Any], fs: dict[str, Any],
                     allowed: dict[str, np.ndarray] | None = None) -> None:
    """Byte equality per tensor; where ``allowed[name]`` is given, differences only there."""
    assert set(mk) <= set(fs), sorted(set(mk) - set(fs))
    for name, a in mk.items():
        b = fs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if not a.is_floating_point():
            assert torch.equal(a, b), name
            continue
        diff = bits(a) != bits(b)
        if allowed is not None and name in allowed:
            outside = diff & ~allowed[name].reshape(diff.shape)
            assert not outside.any(), f"{name}: {int(outside.sum())} differences off threshold"
        else:
            assert not diff.any(), f"{name}: {int(diff.sum())} of {diff.size} elements differ"


W2, W4 = [0.6, 0.4], [0.4, 0.3, 0.2, 0.5]


CASES: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "linear": ("linear", "float32", 2, {"weights": W2, "base": "none"}),
    "linear_nonorm_bf16": ("linear", "bfloat16", 2,
                           {"weights": W2, "base": "none", "parameters": {"normalize": False}}),
    "linear_base_listed": ("linear", "float16", 2, {"weights": W2, "base": "listed"}),
    "linear_base_unlisted_weight": ("linear", "float32", 2,
                                    {"weights": W2, "parameters": {"weight": 0.25}}),
    "linear_soup_4": ("linear", "bfloat16", 4, {"weights": W4, "base": "none"}),
    "task_arithmetic": ("task_arithmetic", "float32", 2, {"weights": W2}),
    "task_arithmetic_lambda_norm_4": ("task_arithmetic", "bfloat16", 4, {
        "weights": W4, "parameters": {"lambda": 0.7, "normalize": True}}),
    "task_arithmetic_f16_lambda": ("task_arithmetic", "float16", 2,
                                   {"weights": W2, "parameters": {"lambda": 1.3}}),
    "ties_0.5": ("ties", "float32", 2, {"weights": W2, "parameters": {"density": 0.5}}),
    "ties_0.7_0.9_bf16": ("ties", "bfloat16", 2, {
        "weights": W2, "model_params": [{"density": 0.7}, {"density": 0.9}]}),
    "ties_0.3_nonorm_rescale_4": ("ties", "float16", 4, {
        "weights": W4, "parameters": {"density": 0.3, "normalize": False, "rescale": True}}),
    "ties_density_0_1": ("ties", "float32", 2, {
        "weights": W2, "model_params": [{"density": 0.0}, {"density": 1.0}]}),
    "breadcrumbs": ("breadcrumbs", "float32", 2, {
        "weights": W2, "parameters": {"density": 0.9, "gamma": 0.05}}),
    "breadcrumbs_ties_bf16_4": ("breadcrumbs_ties", "bfloat16", 4, {
        "weights": W4, "parameters": {"density": 0.7, "gamma": 0.1}}),
    "dare_ties": ("dare_ties", "float32", 2, {"weights": W2, "parameters": {"density": 0.5}}),
    "dare_ties_bf16_4_lambda": ("dare_ties", "bfloat16", 4, {
        "weights": W4, "parameters": {"density": 0.3, "lambda": 0.8}}),
    "dare_linear_norescale": ("dare_linear", "float16", 2, {
        "weights": W2, "parameters": {"density": 0.7, "rescale": False}}),
    "dare_linear_norm": ("dare_linear", "float32", 4, {
        "weights": W4, "parameters": {"density": 0.9, "normalize": True}}),
    "della": ("della", "float32", 2, {
        "weights": W2, "parameters": {"density": 0.5, "epsilon": 0.1}}),
    "della_linear_bf16": ("della_linear", "bfloat16", 2, {
        "weights": W2, "parameters": {"density": 0.7, "epsilon": 0.15, "lambda": 1.1}}),
    "slerp_0.35": ("slerp", "float32", 1, {"parameters": {"t": 0.35}}),
    "slerp_bf16": ("slerp", "bfloat16", 1, {"parameters": {"t": 0.5}}),
    "slerp_0_1": ("slerp", "float16", 1, {"parameters": {"t": 1.0}}),
    "slerp_t0": ("slerp", "float32", 1, {"parameters": {"t": 0.0}}),
    "nuslerp_base": ("nuslerp", "float32", 2, {"weights": W2}),
    "nuslerp_rowwise_nobase": ("nuslerp", "bfloat16", 2, {
        "weights": W2, "base": "none",
        "parameters": {"nuslerp_row_wise": True, "nuslerp_flatten": False}}),
    "nuslerp_noflatten": ("nuslerp", "float16", 2, {
        "weights": W2, "parameters": {"nuslerp_flatten": False}}),
    "multislerp": ("multislerp", "float32", 2, {"weights": W2}),
    "multislerp_nobase_4": ("multislerp", "float32", 4, {"weights": W4, "base": "none"}),
    "multislerp_nobase_bf16": ("multislerp", "bfloat16", 2, {
        "weights": W2, "base": "none", "parameters": {"normalize_weights": False}}),
    "karcher": ("karcher", "float32", 2, {"base": "none"}),
    "karcher_base_bf16": ("karcher", "bfloat16", 2, {"parameters": {"max_iter": 5,
                                                                     "tol": 1e-6}}),
    "model_stock": ("model_stock", "float32", 2, {}),
    "model_stock_filter_wise_4": ("model_stock", "bfloat16", 4,
                                  {"parameters": {"filter_wise": True}}),
    "sce": ("sce", "float32", 2, {}),
    "sce_topk_4": ("sce", "float16", 4, {"parameters": {"select_topk": 0.5}}),
    "nearswap": ("nearswap", "float32", 1, {"parameters": {"t": 0.0005}}),
    "nearswap_bf16": ("nearswap", "bfloat16", 1, {"parameters": {"t": 0.001}}),
    "passthrough": ("passthrough", "float32", 1, {"base": "none"}),
    "passthrough_scale": ("passthrough", "bfloat16", 1, {
        "base": "none", "model_params": [{"scale": 0.5}]}),
    "arcee_fusion": ("arcee_fusion", "float32", 1, {}),
    "ram": ("ram", "float32", 2, {"parameters": {"epsilon": 1e-4}}),
    "ram_bf16_4": ("ram", "bfloat16", 4, {}),
    "ramplus_tl": ("ramplus_tl", "float32", 2, {"parameters": {"r": 0.2, "alpha": 0.3}}),
}


def bits(t: Any) -> np.ndarray:
    return t.contiguous().view(INT_VIEW[t.dtype]).numpy()




INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
