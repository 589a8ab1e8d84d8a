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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_llama_family

torch = pytest.importorskip("torch")
mergekit = pytest.importorskip("mergekit")


from mergefs.methods import prng
from mergekit_runs import CASES, assert_identical, config, load_dir, run_mergefs, run_mergekit

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("parity")
    return {d: make_llama_family(root / d, n_experts=4, dtype=d, seed=3)  # type: ignore[arg-type]
            for d in ("float32", "bfloat16", "float16")}


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
