"""Differential tests: mergekit 0.1.5 in-process (``run_merge``) against ``mergefs merge``.

Tiny Llama families (float32, bfloat16, float16; 4 experts) written by transformers; mergekit
computes in float32 (``dtype: float32``) and writes the family's dtype (``out_dtype``). Outputs
must be byte-identical, tensor by tensor, except the two documented cases:

- magnitude selections (ties, breadcrumbs): mergekit keeps what an unstable sort puts first among
  equal ``|delta|``; outputs may differ only at elements whose ``|delta|`` equals a selection
  threshold of some model, which is asserted exactly;
- random masks (DARE, DELLA): mergekit's ``torch.bernoulli`` is replaced inside the test by
  mergefs' counter-based mask for the same (tensor, model), then bytes are compared.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_llama_family

torch = pytest.importorskip("torch")
mergekit = pytest.importorskip("mergekit")

from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from safetensors.torch import load_file

from mergefs.engine.session import Session
from mergefs.methods import prng
from mergefs.spec.load import load_spec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("parity")
    return {d: make_llama_family(root / d, n_experts=4, dtype=d, seed=3)  # type: ignore[arg-type]
            for d in ("float32", "bfloat16", "float16")}


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


@contextlib.contextmanager
def mergefs_masks(seed: int = 0) -> Iterator[None]:
    """Make mergekit's DARE/DELLA masks mergefs' own: keep element j of model k of a tensor iff
    ``u(seed, tensor, k, j) < p_j``, with mergefs' keep probabilities ``p``. mergekit's own
    probabilities must equal them except, for DELLA, where a row holds equal ``|delta|`` (its
    ranks come from an unstable argsort; mergefs ranks ties by lower index)."""
    import mergekit.merge_methods.generalized_task_arithmetic as gta
    from mergekit.sparsify import SparsificationMethod

    from mergefs.methods.sparsify import della_probs

    state: dict[str, Any] = {}
    orig_group, orig_sparsify, orig_bernoulli = (gta.GeneralizedTaskArithmeticMerge.merge_group,
                                                 gta.sparsify, torch.bernoulli)

    def merge_group(self: Any, group: Any, /, **kw: Any) -> Any:
        state.update(tensor=group.metadata.name, calls=0)
        return orig_group(self, group, **kw)

    def sparsify(tensor: Any, **kw: Any) -> Any:  # called once per model, in order
        state["model"] = state["calls"]
        state["calls"] += 1
        state["probs"] = state["ties"] = None
        if kw["method"] == SparsificationMethod.della_magprune and 0 < kw["density"] < 1:
            probs = della_probs(tensor.float(), kw["density"], kw["epsilon"])
            rows = tensor.abs().reshape(probs.shape[0], -1)
            srt = rows.sort(dim=1).values
            dup = torch.zeros_like(srt, dtype=torch.bool)
            dup[:, 1:] |= srt[:, 1:] == srt[:, :-1]
            dup[:, :-1] |= srt[:, 1:] == srt[:, :-1]
            tied = torch.zeros_like(rows, dtype=torch.bool)
            for r in range(rows.shape[0]):
                tied[r] = torch.isin(rows[r], srt[r][dup[r]])
            state["probs"], state["ties"] = probs, tied.reshape(probs.shape)
        return orig_sparsify(tensor, **kw)

    def bernoulli(p: Any, *a: Any, **kw: Any) -> Any:
        probs = p
        if state["probs"] is not None:
            probs = state["probs"]
            off = (probs != p) & ~state["ties"]
            assert not off.any(), f"{state['tensor']}: DELLA probabilities differ off ties"
        keep = prng.keep_mask(seed, state["tensor"], state["model"], 0,
                              probs.reshape(-1).float().numpy())
        return torch.from_numpy(keep).reshape(p.shape).to(p.dtype)

    gta.GeneralizedTaskArithmeticMerge.merge_group = merge_group  # type: ignore[method-assign]
    gta.sparsify = sparsify
    torch.bernoulli = bernoulli
    try:
        yield
    finally:
        gta.GeneralizedTaskArithmeticMerge.merge_group = orig_group  # type: ignore[method-assign]
        gta.sparsify = orig_sparsify
        torch.bernoulli = orig_bernoulli


def bits(t: Any) -> np.ndarray:
    return t.contiguous().view(INT_VIEW[t.dtype]).numpy()


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


def threshold_ties(fam: Family, n: int, cfg: dict[str, Any], kind: str) -> dict[str, np.ndarray]:
    """Per tensor, elements where some model's ``|delta|`` equals a selection threshold."""
    base = load_dir(fam.base)
    experts = [load_dir(p) for p in fam.experts[:n]]
    params = [m.get("parameters", {}) for m in cfg["models"] if m["model"] != str(fam.base)]
    glob = cfg.get("parameters", {})
    out: dict[str, np.ndarray] = {}
    for name, w0 in base.items():
        if not w0.is_floating_point():
            continue
        mask = np.zeros(w0.numel(), dtype=bool)
        for e, p in zip(experts, params):
            a = (e[name].float() - w0.float()).abs().reshape(-1).numpy()
            density = p.get("density", glob.get("density", 1.0))
            if density >= 1:
                continue
            s = np.sort(a)
            cut = []
            if kind == "magnitude":
                cut = [s[a.size - max(1, int(density * a.size))]]
            else:
                target = int(density * a.size)
                n_top = int(p.get("gamma", glob.get("gamma", 0.01)) * a.size)
                n_bot = max(0, a.size - target - n_top)
                cut = [s[n_bot]] + ([s[n_bot + target - 1]] if target else [])
            for c in cut:
                mask |= a == c
        out[name] = mask
    return out


# -- cases: (method, dtype, n experts, config keywords) -----------------------------------------

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_equal_to_mergekit(case: str, families: dict[str, Family], tmp_path: Path) -> None:
    method, dtype, n, kw = CASES[case]
    fam = families[dtype]
    cfg = config(fam, method, n, **kw)
    random = method.startswith(("dare", "della"))
    with mergefs_masks() if random else contextlib.nullcontext():
        mk = run_mergekit(cfg, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    allowed = None
    if method in ("ties",):
        allowed = threshold_ties(fam, n, cfg, "magnitude")
    elif method.startswith("breadcrumbs"):
        allowed = threshold_ties(fam, n, cfg, "outliers")
    assert_identical(mk, fs, allowed)


# -- mergekit's own configs: examples/*.yml and tests/test_basic_merges.py ----------------------
# Transcribed from arcee-ai/mergekit (the examples that use only supported features: no slices,
# gradients, filters or methods outside 0.1.5's registry), with model names replaced by local
# stand-ins. mergefs runs them as they are; mergekit runs them with dtype float32 and out_dtype
# the config's dtype (the rule of this suite: mergekit's dtype is its compute dtype).

EXAMPLES: dict[str, str] = {
    "examples/linear.yml": """
models:
  - model: MODEL_A
    parameters:
      weight: 1.0
  - model: MODEL_B
    parameters:
      weight: 0.3
  - model: MODEL_C
    parameters:
      weight: 0.5
merge_method: linear
dtype: float16
""",
    "examples/bio-merge.yml": """
models:
  - model: MODEL_A
    parameters:
      density: 0.5
      weight: 0.5
  - model: MODEL_B
    parameters:
      density: 0.5
      weight: 0.5
merge_method: ties
base_model: BASE
parameters:
  normalize: false
  int8_mask: true
dtype: float16
""",
    "examples/arcee_fusion.yml": """
models:
  - model: BASE
  - model: MODEL_A
merge_method: arcee_fusion
base_model: BASE
dtype: bfloat16
""",
}


def _basic(method: str, base: str | None, params: dict[str, Any] | None) -> str:
    """test_basic_merges.py's two_model_config: weights 0.6 and 0.4, dtype bfloat16."""
    doc: dict[str, Any] = {"merge_method": method,
                           "models": [{"model": "MODEL_A", "parameters": {"weight": 0.6}},
                                      {"model": "MODEL_B", "parameters": {"weight": 0.4}}],
                           "dtype": "bfloat16"}
    if base is not None:
        doc["base_model"] = base
    if params is not None:
        doc["parameters"] = params
    return yaml.safe_dump(doc)


EXAMPLES.update({
    "test_basic_merges:gpt2_copy": "merge_method: passthrough\nmodels:\n  - model: MODEL_A\n"
                                   "dtype: bfloat16\n",
    "test_basic_merges:linear": _basic("linear", None, None),
    # model_a is the base there and listed with a weight, which slerp ignores (a warning here)
    "test_basic_merges:slerp": _basic("slerp", "MODEL_A", {"t": 0.35}),
    "test_basic_merges:task_arithmetic": _basic("task_arithmetic", "BASE", None),
    "test_basic_merges:breadcrumbs": _basic("breadcrumbs", "BASE", None),
    "test_basic_merges:ties": _basic("ties", "BASE", {"density": 0.3}),
    "test_basic_merges:dare_ties": _basic("dare_ties", "BASE", {"density": 0.66}),
    "test_basic_merges:model_stock": _basic("model_stock", "BASE", None),
    "test_basic_merges:model_stock_filterwise": _basic("model_stock", "BASE",
                                                       {"filter_wise": True}),
})


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_mergekit_example_configs(name: str, families: dict[str, Family], tmp_path: Path) -> None:
    fam = families["float32"]
    names = {"BASE": fam.base, "MODEL_A": fam.experts[0], "MODEL_B": fam.experts[1],
             "MODEL_C": fam.experts[2]}
    text = EXAMPLES[name]
    for key in sorted(names, key=len, reverse=True):
        text = text.replace(key, str(names[key]))
    cfg = yaml.safe_load(text)
    with mergefs_masks() if cfg["merge_method"].startswith("dare") else contextlib.nullcontext():
        mk = run_mergekit({**cfg, "dtype": "float32", "out_dtype": cfg["dtype"]}, tmp_path / "mk")
    fs = run_mergefs(cfg, tmp_path / "fs")
    allowed = None
    if cfg["merge_method"] == "ties":
        n = sum(1 for m in cfg["models"] if m["model"] != cfg.get("base_model"))
        allowed = threshold_ties(fam, n, cfg, "magnitude")
    assert_identical(mk, fs, allowed)
