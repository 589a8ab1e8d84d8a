"""magmax, consensus_ta and consensus_ties against their reference implementations run in-process
(FusionBench 0.2.33's ``MagMaxAlgorithm``; mergekitty 0.3.0's ``run_merge`` and its ``GTATask``),
against numpy references written from the papers' equations, under budgets (omitted blocks are
zero deltas; the full budget is the unbudgeted merge bit for bit), under the mount and in replay.

Every comparison is byte for byte: the arithmetic is the same float32 operations in the same
order (sums over at most 4 models are sequential in torch; for 5-6 models consensus_ta follows
torch's order, checked against mergekitty's task on units). FusionBench computes in the models'
dtype, so bfloat16 families are compared with FusionBench run on the models upcast to float32
and its output cast once to bfloat16, which is what mergefs (and mergekit with ``dtype:
float32``) computes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import yaml
from engine_checks import plan_omit_masks
from families import Family, make_llama_family
from mergekit_runs import assert_identical, config, load_dir, run_mergefs
from reference import cast_to, read_tensor, tensor_dtype, tensor_names

from mergefs import cli
from mergefs.engine.session import Session
from mergefs.methods import describe_methods, get
from mergefs.methods.base import Unit
from mergefs.spec.load import load_spec

torch = pytest.importorskip("torch")
pytest.importorskip("mergekitty")
pytest.importorskip("fusion_bench")

W4, W3 = [0.4, 0.3, 0.2, 0.5], [0.6, 0.5, 0.7]


@pytest.fixture(scope="module")
def fams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    root = tmp_path_factory.mktemp("magcons")
    return {"float32": make_llama_family(root / "f32", n_experts=4, seed=11),
            "bfloat16": make_llama_family(root / "bf16", n_experts=3, dtype="bfloat16",
                                          seed=12)}


# -- the references, in-process -------------------------------------------------------------------

def fusionbench_magmax(fam: Family, n: int, scaling_factor: float | None) -> dict[str, Any]:
    """FusionBench's MagMaxAlgorithm on the base and the first ``n`` experts, loaded in float32;
    its state dict cast to the family's dtype."""
    from fusion_bench.method.magmax import MagMaxAlgorithm
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    pool = {"_pretrained_": load(fam.base)}
    pool.update({f"task{i}": load(fam.experts[i]) for i in range(n)})
    algo = MagMaxAlgorithm() if scaling_factor is None else MagMaxAlgorithm(scaling_factor)
    merged = algo.run(pool)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[fam.dtype]
    return {k: v.detach().to(dtype).contiguous() for k, v in merged.state_dict().items()}


def run_mergekitty(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """mergekitty's run_merge in-process, without its default ``tokenizer_source: base`` (which
    would rebuild the embeddings for the test families' stand-in tokenizer; mergefs and mergekit
    leave them alone without a tokenizer key)."""
    from mergekitty.architecture import ConfiguredArchitectureInfo
    from mergekitty.config import MergeConfiguration
    from mergekitty.merge import run_merge
    from mergekitty.options import MergeOptions

    # transformers' PretrainedConfig names torch in annotations pydantic resolves late
    ConfiguredArchitectureInfo.model_rebuild(_types_namespace={"torch": torch})
    conf = MergeConfiguration.model_validate(cfg)
    conf.tokenizer_source = None
    shutil.rmtree(out, ignore_errors=True)
    run_merge(conf, str(out), MergeOptions(quiet=True, copy_tokenizer=False,
                                           write_model_card=False))
    return load_dir(out)


def mergekitty_task(method: str, base: np.ndarray, xs: Sequence[np.ndarray],
                    params: dict[str, Any], per: Sequence[dict[str, Any]]) -> np.ndarray:
    """mergekitty's GTATask for ``method`` executed on one tensor (float32)."""
    from mergekitty.architecture import WeightInfo
    from mergekitty.common import ImmutableMap, ModelReference
    from mergekitty.merge_methods.generalized_task_arithmetic import GTATask
    from mergekitty.merge_methods.registry import REGISTERED_MERGE_METHODS

    refs = [ModelReference.parse(f"m{i}") for i in range(len(xs) + 1)]
    task = GTATask.model_construct(
        method=REGISTERED_MERGE_METHODS[method], tensors=None, base_model=refs[0],
        weight_info=WeightInfo(name="t"),
        tensor_parameters=ImmutableMap({r: ImmutableMap(p) for r, p in zip(refs[1:], per)}),
        int8_mask=False, normalize=params["normalize"], rescale=params["rescale"])
    tensors = {refs[0]: torch.from_numpy(base.copy())}
    tensors.update({r: torch.from_numpy(x.copy()) for r, x in zip(refs[1:], xs)})
    with torch.no_grad():
        return task.execute(tensors=tensors).numpy()


# -- numpy references from the papers' equations ---------------------------------------------------

def paper_magmax(base: np.ndarray, experts: Sequence[np.ndarray], lam: float) -> np.ndarray:
    """MagMax (arXiv 2407.06322, eq. 2): per element the task vector of largest magnitude (the
    last of equal magnitudes, as the paper's code), ``theta_0 + lam * tau_max``."""
    tau = np.stack([e - base for e in experts])
    last_max = len(experts) - 1 - np.argmax(np.abs(tau)[::-1], axis=0)
    pick = np.take_along_axis(tau, last_max[None], axis=0)[0]
    return base + np.float32(lam) * pick


def paper_consensus(base: np.ndarray, experts: Sequence[np.ndarray], weights: Sequence[float],
                    ties: bool, density: float, k: int, lambdas: Sequence[float],
                    normalize: bool) -> np.ndarray:
    """Consensus merging (arXiv 2405.07813, eq. 9-10) over task arithmetic or TIES (arXiv
    2306.01708: trim to the top ``density`` magnitudes, elect the sign of the weighted sum, mean
    over agreeing tasks): TALL mask ``m_t = |tau_t| > lambda_t |tau_MTL - tau_t|``, keep where
    at least ``k`` masks hold. float32, sums in task order."""
    taus = [e - base for e in experts]
    w = [np.float32(x) for x in weights]
    trimmed = []
    for t in taus:
        if ties and density < 1:
            flat = np.abs(t).ravel()
            keep = np.zeros(flat.size, bool)
            keep[np.argsort(-flat, kind="stable")[:max(1, int(density * flat.size))]] = True
            t = t * keep.reshape(t.shape).astype(np.float32)
        trimmed.append(t)
    weighted = [t * wk for t, wk in zip(trimmed, w)]

    def total(xs: Sequence[Any]) -> Any:
        acc = np.zeros(base.shape, np.float32)
        for x in xs:
            acc = acc + x
        return acc

    if ties:
        elected = np.where(total(weighted) >= 0, np.float32(1), np.float32(-1))
        agree = [np.sign(x) == elected for x in weighted]
        tau_mtl = total([x * a for x, a in zip(weighted, agree)])
        divisor = total([wk * a for wk, a in zip(w, agree)])
        divisor[divisor == 0] = 1
    else:
        tau_mtl = total(weighted)
        divisor = total(w)
    if normalize:
        tau_mtl = tau_mtl / divisor
    votes = sum((np.abs(t) > np.float32(lam) * np.abs(tau_mtl - t)).astype(np.int64)
                for t, lam in zip(taus, lambdas))
    return base + tau_mtl * (votes >= k).astype(np.float32)


def paper_merge_dir(fam: Family, method: str, n: int, cfg: dict[str, Any],
                    omit: dict[str, list[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of ``fam`` merged by the paper references (``omit[name][i]``: elements where
    expert ``i`` holds the base's values), in the output dtype; non-float tensors the base's."""
    g = cfg.get("parameters", {})
    per = [m.get("parameters", {}) for m in cfg["models"]]
    out = {}
    for name in tensor_names(fam.base):
        raw = read_tensor(fam.base, name)
        if tensor_dtype(fam.base, name) not in ("F32", "BF16", "F16"):
            out[name] = raw
            continue
        base = raw.astype(np.float32)
        experts = []
        for i in range(n):
            e = read_tensor(fam.experts[i], name).astype(np.float32)
            if omit is not None:
                e = np.where(omit[name][i].reshape(e.shape), base, e)
            experts.append(e)
        if method == "magmax":
            merged = paper_magmax(base, experts, g.get("scaling_factor", 0.5))
        else:
            ties = method == "consensus_ties"
            merged = paper_consensus(
                base, experts, [p["weight"] for p in per], ties,
                g.get("density", 1.0), per[0].get("k", g.get("k", 1)),
                [p.get("lambda", g.get("lambda", 1.0)) for p in per],
                g.get("normalize", ties))
        out[name] = cast_to(merged, fam.dtype)
    return out


def as_numpy(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in tensors.items():
        if v.dtype == torch.bfloat16:
            out[k] = v.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[k] = v.numpy()
    return out


def assert_same_bytes(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert set(want) == set(got)
    bad = [k for k in want if want[k].dtype != got[k].dtype or want[k].tobytes() !=
           got[k].reshape(want[k].shape).tobytes()]
    assert not bad, bad


# -- equal to the references ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype, n, scaling_factor", [
    ("float32", 4, None),  # FusionBench's default, 0.5
    ("float32", 2, 1.0),
    ("bfloat16", 3, 0.7),
])
def test_magmax_equals_fusionbench(dtype: str, n: int, scaling_factor: float | None,
                                   fams: dict[str, Family], tmp_path: Path) -> None:
    fam = fams[dtype]
    params = {} if scaling_factor is None else {"scaling_factor": scaling_factor}
    cfg = config(fam, "magmax", n, parameters=params)
    ours = run_mergefs(cfg, tmp_path / "out")
    theirs = fusionbench_magmax(fam, n, scaling_factor)
    assert_identical(theirs, ours)
    moved = [k for k, v in theirs.items()
             if not torch.equal(v, load_dir(fam.base).get(k, v))]
    assert moved  # the merge changed something: the comparison is not base against base


CONSENSUS_CASES = {
    "ta_defaults": ("consensus_ta", "float32", 4, {"weights": W4}),
    "ta_k2_lambda_norm": ("consensus_ta", "bfloat16", 3, {
        "weights": W3, "parameters": {"k": 2, "lambda": 0.5, "normalize": True}}),
    "ties_k2": ("consensus_ties", "float32", 3, {
        "weights": W3, "parameters": {"density": 0.5, "k": 2, "lambda": 0.8}}),
    "ties_rescale_per_model": ("consensus_ties", "bfloat16", 3, {
        "weights": W3, "parameters": {"rescale": True, "normalize": False, "k": 1},
        "model_params": [{"density": 0.3, "lambda": 0.4}, {"density": 0.6, "lambda": 0.6},
                         {"density": 1.0, "lambda": 1.0}]}),
    "ties_k_above_n": ("consensus_ties", "float32", 2, {
        "weights": W3[:2], "parameters": {"density": 0.7, "k": 3}}),
}


@pytest.mark.parametrize("case", sorted(CONSENSUS_CASES))
def test_consensus_equals_mergekitty(case: str, fams: dict[str, Family], tmp_path: Path) -> None:
    method, dtype, n, kw = CONSENSUS_CASES[case]
    fam = fams[dtype]
    cfg = config(fam, method, n, **kw)
    theirs = run_mergekitty(cfg, tmp_path / "mk")
    ours = run_mergefs(cfg, tmp_path / "out")
    assert_identical(theirs, ours)


def _unit(rng: np.random.Generator, n: int, size: int, params: dict[str, Any],
          per: list[dict[str, Any]]) -> Unit:
    """bfloat16-like values (many equal magnitudes), -0.0 and zero deltas."""
    def values() -> np.ndarray:
        v = rng.normal(scale=0.02, size=size).astype(ml_dtypes.bfloat16).astype(np.float32)
        v[rng.random(size) < 0.05] = np.float32(-0.0)
        return v

    w0 = values()
    xs = []
    for _ in range(n):
        x = w0 + rng.normal(scale=2e-4, size=size).astype(ml_dtypes.bfloat16).astype(np.float32)
        same = rng.random(size) < 0.2
        x[same] = w0[same]
        xs.append(x.astype(np.float32))
    return Unit(tensor="t", shape=(size,), elem_offset=0, base=w0, inputs=tuple(xs),
                params=params, input_params=tuple(per), expert_ids=tuple(range(n)),
                tensor_size=size)


@pytest.mark.parametrize("n", [1, 2, 4, 5, 6])
@pytest.mark.parametrize("method, normalize, rescale", [
    ("consensus_ta", False, False), ("consensus_ta", True, False),
    ("consensus_ties", True, False), ("consensus_ties", False, True)])
def test_unit_equals_mergekitty_task(method: str, normalize: bool, rescale: bool, n: int) -> None:
    """On units of bfloat16-like values (equal magnitudes, -0.0, zero deltas), 1-6 models (5-6:
    torch's position-dependent sum order), per-model lambdas."""
    rng = np.random.default_rng(n * 10 + normalize + 2 * rescale)
    params = {"normalize": normalize, "rescale": rescale, "int8_mask": False}
    per = [{"weight": 0.3 + 0.2 * i, "density": 0.4 + 0.1 * i, "k": 2 if n > 2 else 1,
            "lambda": 0.3 + 0.15 * i} for i in range(n)]
    u = _unit(rng, n, 117, params, per)  # 117 = 3 * 32 + 21: torch's sum tail is exercised
    ours = np.asarray(get(method).merge(u))  # type: ignore[union-attr]
    theirs = mergekitty_task(method, u.base, u.inputs, params, per)
    assert ours.tobytes() == theirs.tobytes()


def test_magmax_tie_and_sign_rules() -> None:
    """Equal magnitudes: the later model wins (-1 over +1); zero deltas keep the running value."""
    base = np.zeros(4, np.float32)
    xs = (np.array([1, 2, 0, -3], np.float32), np.array([-1, 0, 0, 3], np.float32),
          np.array([0.5, -2, 0, 1], np.float32))
    u = Unit(tensor="t", shape=(4,), elem_offset=0, base=base, inputs=xs,
             params={"scaling_factor": 1.0}, input_params=({}, {}, {}), expert_ids=(0, 1, 2))
    got = get("magmax").merge(u)  # type: ignore[union-attr]
    assert got.tolist() == [-1.0, -2.0, 0.0, 3.0]
    assert got.tobytes() == paper_magmax(base, xs, 1.0).tobytes()


@pytest.mark.parametrize("method, dtype, n, kw", [
    ("magmax", "float32", 4, {"parameters": {"scaling_factor": 0.8}}),
    ("magmax", "bfloat16", 3, {}),
    ("consensus_ta", "float32", 4, {"weights": W4, "parameters": {"k": 2, "lambda": 0.6}}),
    ("consensus_ties", "float32", 3, {"weights": W3, "parameters": {"density": 0.4, "k": 2}}),
])
def test_equals_paper_equations(method: str, dtype: str, n: int, kw: dict[str, Any],
                                fams: dict[str, Family], tmp_path: Path) -> None:
    fam = fams[dtype]
    cfg = config(fam, method, n, **kw)
    run_mergefs(cfg, tmp_path / "out")
    got = {k: read_tensor(tmp_path / "out", k) for k in tensor_names(tmp_path / "out")}
    assert_same_bytes(paper_merge_dir(fam, method, n, cfg), got)


# -- budgets --------------------------------------------------------------------------------------

def write_spec(tmp_path: Path, cfg: dict[str, Any], name: str, **extra: Any) -> Path:
    path = tmp_path / f"{name}.yaml"
    doc = {**cfg, "block_size": "2KiB", "index_dir": str(tmp_path / "index"), **extra}
    path.write_text(yaml.safe_dump(doc))
    return path


BUDGET_CASES = [
    ("magmax", 4, {}),
    ("consensus_ta", 4, {"weights": W4, "parameters": {"k": 2}}),
    ("consensus_ties", 3, {"weights": W3, "parameters": {"density": 0.5, "k": 2}}),
]


@pytest.mark.parametrize("method, n, kw", BUDGET_CASES)
def test_budget_omitted_blocks_are_zero_deltas(method: str, n: int, kw: dict[str, Any],
                                               fams: dict[str, Family], tmp_path: Path) -> None:
    """At 40% the output is the paper reference on experts whose omitted blocks hold the base's
    values; no bound is claimed (the methods are not additive)."""
    fam = fams["float32"]
    cfg = config(fam, method, n, **kw)
    spec = write_spec(tmp_path, cfg, "b40", budget="40%")
    session = Session(load_spec(spec))
    try:
        assert session.plan.planned_bytes <= session.plan.budget_bytes
        assert session.plan.bound_tight is None and not session.spec.is_additive
        assert not session.plan.selected.all()  # something is omitted
        session.engine.materialise(tmp_path / "out")
        omit = plan_omit_masks(session, fam.base)
    finally:
        session.close()
    got = {k: read_tensor(tmp_path / "out", k) for k in tensor_names(tmp_path / "out")}
    assert_same_bytes(paper_merge_dir(fam, method, n, cfg, omit), got)


@pytest.mark.parametrize("method, n, kw", BUDGET_CASES)
def test_full_budget_is_the_unbudgeted_merge(method: str, n: int, kw: dict[str, Any],
                                             fams: dict[str, Family], tmp_path: Path) -> None:
    fam = fams["float32"]
    cfg = config(fam, method, n, **kw)
    outs = []
    for name, extra in (("none", {}), ("full", {"budget": "100%"})):
        assert cli.main(["merge", str(write_spec(tmp_path, cfg, name, **extra)),
                         str(tmp_path / name)]) == 0
        outs.append({k: read_tensor(tmp_path / name, k).tobytes()
                     for k in tensor_names(tmp_path / name)})
    assert outs[0] == outs[1]


def test_blockwise_declarations() -> None:
    """magmax is elementwise for any number of models (merged block by block, in bounded
    memory); consensus_ta as task arithmetic; consensus_ties reads whole tensors (top-k)."""
    rows = {r["name"]: r for r in describe_methods()}
    assert rows["magmax"]["blockwise"] == "yes" and rows["magmax"]["needs_torch"] == "no"
    assert rows["consensus_ta"]["blockwise"] == rows["task_arithmetic"]["blockwise"]
    assert rows["consensus_ties"]["blockwise"] == "no"
    assert rows["magmax"]["paper"]["url"] == "https://arxiv.org/abs/2407.06322"
    assert rows["consensus_ties"]["paper"]["url"] == "https://arxiv.org/abs/2405.07813"


# -- mount and replay -----------------------------------------------------------------------------

@pytest.mark.mount
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
@pytest.mark.parametrize("method, n, kw", BUDGET_CASES)
def test_mount_serves_the_merge(method: str, n: int, kw: dict[str, Any], fams: dict[str, Family],
                                tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    spec = write_spec(tmp_path, config(fams["float32"], method, n, **kw), "m", budget="60%")
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}


@pytest.mark.parametrize("method, n, kw", BUDGET_CASES)
def test_replay_verifies(method: str, n: int, kw: dict[str, Any], fams: dict[str, Family],
                         tmp_path: Path) -> None:
    spec = write_spec(tmp_path, config(fams["float32"], method, n, **kw), "r", budget="50%")
    manifest = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--manifest", str(manifest)]) == 0
    assert cli.main(["replay", str(manifest)]) == 0
