"""Differential tests: mergekit 0.1.5 in-process (``run_merge``) against ``mergefs merge``.

Tiny Llama families (float32, bfloat16, float16; 4 experts) written by transformers; mergekit
computes in float32 (``dtype: float32``) and writes the family's dtype (``out_dtype``). Outputs
must be byte-identical, tensor by tensor, magnitude selections (ties, breadcrumbs) included:
among equal ``|delta|`` at a cut both keep what torch's unstable sort puts first. Random masks
(DARE, DELLA) are the one documented difference: mergekit's ``torch.bernoulli`` is replaced inside
the test by mergefs' counter-based mask for the same (tensor, model), then bytes are compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
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
    ``u(seed, tensor, k, j) < p_j``, with mergefs' keep probabilities ``p``, which must equal
    mergekit's own (DELLA's ranks included, equal ``|delta|`` too)."""
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
        state["probs"] = None
        if kw["method"] == SparsificationMethod.della_magprune and 0 < kw["density"] < 1:
            state["probs"] = della_probs(tensor.float(), kw["density"], kw["epsilon"])
        return orig_sparsify(tensor, **kw)

    def bernoulli(p: Any, *a: Any, **kw: Any) -> Any:
        probs = p
        if state["probs"] is not None:
            probs = state["probs"]
            assert torch.equal(probs, p), f"{state['tensor']}: DELLA probabilities differ"
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
    assert_identical(mk, fs)


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
    assert_identical(mk, fs)


# -- the sparsifiers alone, on every tensor's deltas: ties among equal |delta| at a cut ---------

DENSITIES = (0.1, 0.3, 0.5, 0.7, 0.9)


def _deltas(fam: Family) -> Iterator[tuple[str, int, Any]]:
    """(tensor, expert, float32 delta) of every floating tensor, the family's first two experts."""
    base = load_dir(fam.base)
    for k, path in enumerate(fam.experts[:2]):
        expert = load_dir(path)
        for name, w0 in sorted(base.items()):
            if w0.is_floating_point():
                yield name, k, expert[name].float() - w0.float()


def _straddles(d: Any, lo: int, hi: int) -> bool:
    """Whether a run of equal ``|d|`` straddles ascending position ``lo`` or ``hi`` (a tie at a
    cut: the case where the order among equal values decides the selection)."""
    s = d.abs().reshape(-1).sort().values
    n = s.numel()
    return bool((0 < lo < n and s[lo - 1] == s[lo]) or (0 < hi < n and s[hi - 1] == s[hi]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sparsifiers_choose_among_equal_magnitudes_as_mergekit(
        dtype: str, families: dict[str, Family]) -> None:
    """magnitude (ties), magnitude_outliers (breadcrumbs) and DELLA's keep probabilities equal
    mergekit's bit for bit on every delta of the family at densities 0.1..0.9, rescaled or not.
    Ties at a cut must occur in the half-precision families, so the order among equal values is
    exercised (a stable order, mergefs' old rule, chooses differently in some of them)."""
    from mergekit import sparsify as mk

    from mergefs.methods import sparsify as sp

    def eq(a: Any, b: Any) -> bool:
        return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))

    captured: list[Any] = []

    def capture(p: Any, *a: Any, **kw: Any) -> Any:
        captured.append(p)
        return torch.ones_like(p)

    at_cut = stable_differs = 0
    for name, k, d in _deltas(families[dtype]):
        n = d.numel()
        for density in DENSITIES:
            kept = max(1, int(density * n))
            rescale = density < 0.5  # either way the kept set decides; rescale adds the L1 sums
            norm = mk.RescaleNorm.l1 if rescale else None
            assert eq(got := sp.magnitude(d, density, rescale), mk.magnitude(d, density, norm)), \
                (name, k, density, rescale)
            got = got != 0
            stable = torch.zeros(n, dtype=torch.bool)
            stable[torch.argsort(d.abs().reshape(-1), descending=True, stable=True)[:kept]] = True
            stable_differs += not torch.equal(got.reshape(-1), stable & (d.reshape(-1) != 0))
            at_cut += _straddles(d, n - kept, n)
            gamma = 0.05
            assert eq(sp.magnitude_outliers(d, density, gamma, True),
                      mk.magnitude_outliers(d, density, mk.RescaleNorm.l1, gamma)), \
                (name, k, density, gamma)
            eps = min(density, 1 - density) / 2
            captured.clear()
            torch.bernoulli, orig = capture, torch.bernoulli
            try:
                mk.della_magprune(d, density, eps)
            finally:
                torch.bernoulli = orig
            assert torch.equal(sp.della_probs(d, density, eps), captured[0]), (name, k, density)
    if dtype == "float32":
        return
    assert at_cut > 0 and stable_differs > 0, (at_cut, stable_differs)


@pytest.mark.parametrize("method,dtype,density", [
    ("ties", "bfloat16", 0.7), ("ties", "float16", 0.1), ("ties", "float32", 0.9),
    ("breadcrumbs", "bfloat16", 0.3), ("breadcrumbs_ties", "float16", 0.5)])
def test_threshold_ties_merge_as_mergekit(method: str, dtype: str, density: float,
                                          families: dict[str, Family], tmp_path: Path) -> None:
    """Whole merges whose magnitude cuts fall inside runs of equal ``|delta|`` (half precision):
    byte-identical to mergekit, no element excepted."""
    fam = families[dtype]
    cfg = config(fam, method, 2, weights=[0.7, 0.6], parameters={"density": density})
    assert_identical(run_mergekit(cfg, tmp_path / "mk"), run_mergefs(cfg, tmp_path / "fs"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, float("inf"), float("nan")]),
                min_size=1, max_size=300),
       st.floats(0.0, 1.0), st.floats(0.0, 0.5))
def test_selections_are_the_sort_slices(vals: list[float], density: float, gamma: float) -> None:
    """Whatever runs of equal values (NaN, inf) sit at the cuts, the kept positions are exactly
    torch's sort slices mergekit keeps: the partition shortcut never changes the set."""
    from mergefs.methods import sparsify as sp

    t = torch.tensor(vals, dtype=torch.float32)
    n = t.numel()

    def same(got: Any, keep: Any) -> bool:  # got == t * keep, bit for bit (inf * 0 is NaN)
        return torch.equal(got.view(torch.int32), (t * keep.float()).view(torch.int32))

    keep = torch.zeros(n, dtype=torch.bool)
    if 0 < density < 1:
        keep[torch.argsort(t, descending=True)[:max(1, int(density * n))]] = True
    got = sp.magnitude(t, density, False)
    if density <= 0:  # mergekit's zeros_like, not t * 0
        assert torch.equal(got.view(torch.int32), torch.zeros(n, dtype=torch.int32))
    else:
        assert got is t if density >= 1 else same(got, keep)
    if density >= 1:
        return
    target, n_top = int(density * n), int(gamma * n)
    n_bot = max(0, n - target - n_top)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.sort(t).indices[n_bot:n_bot + target]] = True
    assert same(sp.magnitude_outliers(t, density, gamma, False), keep)


# -- many experts (issue 30): torch's cascade sum order, in the compiled kernel -------------------

MANY: dict[str, tuple[str, int, dict[str, Any]]] = {
    "task_arithmetic-16": ("task_arithmetic", 16, {"lambda": 0.8}),
    "task_arithmetic-17-normalize": ("task_arithmetic", 17, {"normalize": True}),
    "task_arithmetic-24": ("task_arithmetic", 24, {}),
    "task_arithmetic-32": ("task_arithmetic", 32, {"lambda": 1.3}),
    "task_arithmetic-32-normalize": ("task_arithmetic", 32, {"normalize": True}),
    "linear-17": ("linear", 17, {}),
    "linear-32-plain": ("linear", 32, {"normalize": False}),
}


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """32 bf16 experts of a Llama whose tensor sizes are 0, 8, 16 and 24 past a multiple of 32
    (embeddings 131 x 40, projections 40 x 40, 20 x 40, 98 x 40, norms 40: RoPE wants an even
    head size, so the hidden size is a multiple of 8; tails of 1-7 elements are tested against
    torch in tests/methods/test_kernels.py), embeddings summed by torch's threads (16 x 5240
    elements and more)."""
    return make_llama_family(tmp_path_factory.mktemp("many") / "fam", n_experts=32,
                             dtype="bfloat16", seed=5, hidden_size=40, intermediate_size=98,
                             vocab_size=131)


@pytest.mark.parametrize("case", sorted(MANY))
def test_many_experts_equal_mergekit(case: str, many_experts: Family, tmp_path: Path) -> None:
    """16-32 experts: byte-identical to mergekit, merged by the compiled kernel in block units
    (the sum order of 16+ inputs is torch's cascade: mergefs.methods.exact.multi_row_sum)."""
    from mergefs.methods import kernels

    method, n, params = MANY[case]
    rng = np.random.default_rng(n)
    weights = (rng.uniform(-0.4, 1.0, n) * np.exp2(rng.integers(-6, 4, n))).tolist()
    cfg = config(many_experts, method, n, weights=weights, parameters=params,
                 base="none" if method == "linear" else "separate")
    mk = run_mergekit(cfg, tmp_path / "mk")
    before = kernels.counters.units
    fs = run_mergefs(cfg, tmp_path / "fs")
    assert_identical(mk, fs)
    if kernels.available():
        assert kernels.counters.units > before  # the fast path ran
