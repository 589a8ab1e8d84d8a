"""tsv_m, iso_c and iso_cts (mergefs/methods/subspace.py) against their reference, FusionBench
0.2.33, run in-process (its algorithm classes on transformers models): byte-identical outputs of
``mergefs merge`` on a mergekit-style YAML, at the full budget and under a budget (FusionBench
run on experts whose omitted blocks hold the base's values); against an independent numpy
reading of the papers' equations within a tolerance; under the mount; and replayed."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from engine_checks import plan_omit_masks
from families import Family, make_llama_family
from reference import read_tensor, tensor_names

from mergefs import cli
from mergefs.engine.session import Session
from mergefs.methods import get
from mergefs.methods.base import Unit
from mergefs.spec.load import load_spec

torch = pytest.importorskip("torch")
pytest.importorskip("fusion_bench")

METHODS = ("tsv_m", "iso_c", "iso_cts")

#: case -> (method, global parameters, per-model weights or None)
CASES: dict[str, tuple[str, dict[str, Any], list[float] | None]] = {
    "tsv_m": ("tsv_m", {}, None),
    "tsv_m-alpha": ("tsv_m", {"alpha": 0.7}, None),
    "tsv_m-weights": ("tsv_m", {}, [1.0, 0.5, 2.0]),
    "iso_c": ("iso_c", {"scaling_factor": 0.9}, None),
    "iso_cts": ("iso_cts", {}, None),
    "iso_cts-half": ("iso_cts", {"common_space_fraction": 0.5, "scaling_factor": 1.2}, None),
}


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_llama_family(tmp_path_factory.mktemp("subspace"), n_experts=3, seed=11)


def write(tmp_path: Path, fam: Family, method: str, params: dict[str, Any],
          weights: list[float] | None = None, **extra: Any) -> Path:
    """A mergekit-style spec over the family's experts."""
    models = [{"model": str(e), **({"parameters": {"weight": weights[i]}} if weights else {})}
              for i, e in enumerate(fam.experts)]
    doc = {"merge_method": method, "base_model": str(fam.base), "models": models,
           "dtype": "float32", "block_size": "2KiB", "index_dir": str(tmp_path / "index"),
           **({"parameters": params} if params else {}), **extra}
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def fusionbench(fam: Family, method: str, params: dict[str, Any],
                weights: list[float] | None = None,
                omit: dict[str, list[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """FusionBench's algorithm run on the family (float32); ``omit[name][i]`` True where expert
    i's values are replaced by the base's (a plan's omitted blocks)."""
    from fusion_bench import BaseModelPool
    from fusion_bench.method import ISO_C_Merge, ISO_CTS_Merge, TaskSingularVectorMerging
    from transformers import LlamaForCausalLM

    def load(path: Path) -> Any:
        return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)

    base = load(fam.base)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    experts = {}
    for i, path in enumerate(fam.experts):
        model = load(path)
        if omit is not None:
            state = model.state_dict()
            model.load_state_dict({
                k: torch.where(torch.from_numpy(omit[k][i].reshape(v.shape)), base_state[k], v)
                if k in omit else v for k, v in state.items()})
        experts[f"model_{i}"] = model
    pool = BaseModelPool({"_pretrained_": base, **experts})
    if method == "tsv_m":
        alpha = weights if weights is not None else params.get("alpha", 1)
        algo = TaskSingularVectorMerging(alpha=alpha)
    elif method == "iso_c":
        algo = ISO_C_Merge(scaling_factor=params.get("scaling_factor", 1.0))
    else:
        algo = ISO_CTS_Merge(scaling_factor=params.get("scaling_factor", 1.0),
                             common_space_fraction=params.get("common_space_fraction", 0.8))
    with contextlib.redirect_stdout(io.StringIO()):  # FusionBench prints per tensor
        merged = algo.run(pool)
    return {k: v.detach().numpy() for k, v in merged.state_dict().items()}


def assert_same_bytes(out: Path, want: dict[str, np.ndarray]) -> None:
    names = tensor_names(out)
    assert names and set(names) == set(want)
    bad = [n for n in names if read_tensor(out, n).tobytes() != want[n].tobytes()]
    assert not bad, bad


@pytest.mark.parametrize("case", CASES)
def test_merge_equals_fusionbench(case: str, llama3: Family, tmp_path: Path) -> None:
    """``mergefs merge`` on a mergekit-style YAML: FusionBench's bytes, every tensor (SVDs,
    multi_dot and sums are the same torch kernels in the same order)."""
    method, params, weights = CASES[case]
    spec = write(tmp_path, llama3, method, params, weights)
    assert cli.main(["merge", str(spec), str(tmp_path / "out")]) == 0
    assert_same_bytes(tmp_path / "out", fusionbench(llama3, method, params, weights))


@pytest.mark.parametrize("method", METHODS)
def test_budget_is_fusionbench_on_the_planned_reads(method: str, llama3: Family,
                                                    tmp_path: Path) -> None:
    """Under a budget the omitted blocks are zero deltas: FusionBench run on experts holding
    the base's values there gives the same bytes. The full budget is the full read."""
    spec = write(tmp_path, llama3, method, {}, budget="40%")
    session = Session(load_spec(spec))
    try:
        assert session.plan.planned_bytes <= session.plan.budget_bytes
        assert session.plan.bound_tight is None  # not additive: no bound
        session.engine.materialise(tmp_path / "out")
        masks = plan_omit_masks(session, llama3.base)
    finally:
        session.close()
    assert any(m.any() for ms in masks.values() for m in ms)
    assert_same_bytes(tmp_path / "out", fusionbench(llama3, method, {}, omit=masks))

    for budget in ("full", "100%"):
        spec = write(tmp_path, llama3, method, {}, budget=budget)
        assert cli.main(["merge", str(spec), str(tmp_path / budget)]) == 0
    full = {n: read_tensor(tmp_path / "full", n) for n in tensor_names(tmp_path / "full")}
    assert_same_bytes(tmp_path / "100%", full)
    assert_same_bytes(tmp_path / "full", fusionbench(llama3, method, {}))


# -- an independent reading of the papers' equations, in float64 numpy --------------------------

def _whiten(x: np.ndarray) -> np.ndarray:
    """``x (x^T x)^(-1/2)``: the orthonormal matrix nearest to ``x`` (full column rank)."""
    lam, q = np.linalg.eigh(x.T @ x)
    return x @ (q @ np.diag(lam ** -0.5) @ q.T)


def paper_tsv_m(deltas: list[np.ndarray], alpha: float) -> np.ndarray:
    """TSV-M (arXiv 2412.00081, eq. 5-7): each task's top k/T singular triplets, the
    concatenated U and V whitened, summed with their singular values."""
    r = min(deltas[0].shape) // len(deltas)
    svds = [np.linalg.svd(d, full_matrices=False) for d in deltas]
    u = np.concatenate([s[0][:, :r] for s in svds], axis=1)
    sig = np.concatenate([s[1][:r] for s in svds])
    v = np.concatenate([s[2][:r].T for s in svds], axis=1)
    return alpha * (_whiten(u) * sig) @ _whiten(v).T


def paper_iso_c(deltas: list[np.ndarray], scale: float) -> np.ndarray:
    """Iso-C (arXiv 2502.04959, eq. 5): the summed task matrix with a flat spectrum."""
    u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
    return scale * s.mean() * (u @ vt)


def paper_iso_cts(deltas: list[np.ndarray], scale: float, fraction: float) -> np.ndarray:
    """Iso-CTS (arXiv 2502.04959, sec. 4.2): the top common directions of the sum, each task's
    top directions orthogonal to them, whitened together, with a flat spectrum."""
    t, k = len(deltas), min(deltas[0].shape)
    common = k - round((k - int(k * fraction)) / t) * t
    d = (k - common) // t
    u, s, vt = np.linalg.svd(sum(deltas), full_matrices=False)
    uc = u[:, :common]
    us, ss, vs = [], [], []
    for delta in deltas:
        a, b, c = np.linalg.svd(delta - uc @ (uc.T @ delta), full_matrices=False)
        us.append(a[:, :d])
        ss.append(b[:d])
        vs.append(c[:d].T)
    big_u = _whiten(np.concatenate([*us, uc], axis=1))
    big_v = _whiten(np.concatenate([*vs, vt[:common].T], axis=1))
    sig = np.concatenate([*ss, s[:common]])
    return scale * sig.mean() * (big_u @ big_v.T)


def _unit(method: str, shape: tuple[int, ...], n: int, seed: int, **params: Any) -> Unit:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=shape).astype(np.float32)
    # low-rank-ish task deltas: a decaying spectrum, as fine-tuning deltas have
    inputs = []
    for _ in range(n):
        a = rng.normal(size=(shape[0], min(shape))) * np.geomspace(1, 0.05, min(shape))
        b = rng.normal(size=(min(shape), shape[-1]))
        d = (a @ b).reshape(shape) if len(shape) == 2 else rng.normal(size=shape)
        inputs.append((base + np.float32(0.01) * d.astype(np.float32)).astype(np.float32))
    m = get(method)
    assert m is not None
    g = {p.name: p.default for p in m.global_params} | params
    per = tuple({p.name: p.default for p in m.model_params} for _ in range(n))
    return Unit(tensor="w", shape=shape, elem_offset=0, base=base, inputs=tuple(inputs),
                params=g, input_params=per, expert_ids=tuple(range(n)))


# (200, 16): a tall matrix, which iso_cts projects without its rows x rows projector
@pytest.mark.parametrize("shape, n", [((48, 40), 4), ((40, 64), 2), ((36, 36), 3),
                                      ((200, 16), 3)])
@pytest.mark.parametrize("method", METHODS)
def test_matrices_follow_the_papers(method: str, shape: tuple[int, int], n: int) -> None:
    """Within 1e-4 of the float64 numpy reference (relative Frobenius error of the merged
    delta; measured 1.2e-6 to 5.0e-6 here): float32 SVDs against float64 ones, the whitening by
    SVD against eigh; the margin covers subspaces cut between close singular values."""
    kw = {"iso_c": {"scaling_factor": 0.8}, "iso_cts": {"common_space_fraction": 0.6},
          "tsv_m": {"alpha": 1.3}}[method]
    u = _unit(method, shape, n, seed=sum(shape) + n, **kw)
    got = np.asarray(get(method).merge(u), dtype=np.float64) - u.base  # type: ignore[union-attr]
    deltas = [x.astype(np.float64) - u.base for x in u.inputs]
    want = {"tsv_m": lambda: paper_tsv_m(deltas, 1.3),
            "iso_c": lambda: paper_iso_c(deltas, 0.8),
            "iso_cts": lambda: paper_iso_cts(deltas, 1.0, 0.6)}[method]()
    assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)


@pytest.mark.parametrize("method", METHODS)
def test_other_tensors_are_the_mean_delta(method: str) -> None:
    """Norms and biases (not 2-D): the mean of the deltas, scaled (FusionBench's fallback)."""
    u = _unit(method, (64,), 3, seed=1)
    got = np.asarray(get(method).merge(u)) - u.base  # type: ignore[union-attr]
    want = np.mean([x.astype(np.float64) - u.base for x in u.inputs], axis=0)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", METHODS)
def test_zero_deltas_give_the_base(method: str) -> None:
    """What the engine assumes (zero_delta_is_base) when a plan reads no block of a tensor."""
    u = _unit(method, (24, 16), 3, seed=2)
    u = Unit(tensor="w", shape=u.shape, elem_offset=0, base=u.base,
             inputs=(u.base, u.base, u.base), params=u.params, input_params=u.input_params,
             expert_ids=u.expert_ids)
    assert get(method).caps.zero_delta_is_base  # type: ignore[union-attr]
    got = np.asarray(get(method).merge(u))  # type: ignore[union-attr]
    assert got.tobytes() == u.base.tobytes()


# -- mount and replay ----------------------------------------------------------------------------

@pytest.mark.mount
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_mount_serves_the_merge(llama3: Family, tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    spec = write(tmp_path, llama3, "tsv_m", {"alpha": 0.7}, budget="60%")
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}


@pytest.mark.parametrize("method", METHODS)
def test_replay_verifies_the_manifest(method: str, llama3: Family, tmp_path: Path) -> None:
    spec = write(tmp_path, llama3, method, {}, budget="50%")
    manifest = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--manifest",
                     str(manifest)]) == 0
    assert cli.main(["replay", str(manifest)]) == 0


def test_methods_command_names_the_papers(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["methods", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tsv_m"]["paper"]["url"] == "https://arxiv.org/abs/2412.00081"
    assert rows["iso_cts"]["paper"]["url"] == "https://arxiv.org/abs/2502.04959"
    assert {p["name"]: p["default"] for p in rows["iso_cts"]["parameters"]} == \
        {"scaling_factor": 1.0, "common_space_fraction": 0.8}
    assert cli.main(["methods"]) == 0
    assert "paper: Iso-C (isotropic merging, common subspace) <https://arxiv.org/abs/2502.04959>" \
        in capsys.readouterr().out


# -- under a budget with delta sidecars ---------------------------------------------------------

@pytest.fixture(scope="module")
def lowrank3(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Three experts whose matrix deltas are rank 8 plus a little noise (as fine-tunes are)."""
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("lowrank")
    rng = np.random.default_rng(3)
    shapes = {"a.weight": (256, 128), "b.weight": (128, 256), "n.weight": (128,)}
    base = {k: rng.normal(0, 0.02, s).astype(np.float32) for k, s in shapes.items()}
    dirs = []
    for name in ("base", "e0", "e1", "e2"):
        model = base if name == "base" else {
            k: (w + (rng.normal(size=(w.shape[0], 8)) @ rng.normal(size=(8, w.shape[1])) * 2e-3
                     + rng.normal(size=w.shape) * 2e-4 if w.ndim == 2
                     else rng.normal(size=w.shape) * 2e-3)).astype(np.float32)
            for k, w in base.items()}
        (root / name).mkdir()
        save_file(model, str(root / name / "model.safetensors"))
        dirs.append(root / name)
    return Family(base=dirs[0], experts=dirs[1:], root=root, dtype="float32",
                  tensor_names=sorted(shapes))


def _deviation(out: Path, full: Path, base: Path) -> float:
    """||merged - full merge|| / ||full merge - base|| over every tensor."""
    names = tensor_names(full)
    dev = sum(float(np.sum((read_tensor(out, n) - read_tensor(full, n)) ** 2)) for n in names)
    upd = sum(float(np.sum((read_tensor(full, n) - read_tensor(base, n)) ** 2)) for n in names)
    return (dev / upd) ** 0.5


@pytest.mark.parametrize("method", METHODS)
def test_sidecar_budget_deviation(method: str, lowrank3: Family, tmp_path: Path) -> None:
    """With delta sidecars (``mergefs compress``) a 20% budget buys sidecar levels (low-rank
    factors first) instead of skipped blocks: the merge deviates from the full read by less
    than the exact-blocks-only plan at the same budget (measured on this family, as a share of
    the full merge's update norm: tsv_m 0.48 against 0.93, iso_c 0.35 against 0.97, iso_cts
    0.59 against 1.01; what remains is mostly the levels' residual noise, which TSV-M's 1/T of
    each spectrum and the isotropic methods' flattened spectra keep or amplify). The full budget
    still reads the experts: the same bytes as without sidecars."""
    full = write(tmp_path, lowrank3, method, {})
    assert cli.main(["merge", str(full), str(tmp_path / "full"), "--no-sidecars"]) == 0
    assert cli.main(["compress", str(full)]) == 0
    assert cli.main(["merge", str(full), str(tmp_path / "full-sc")]) == 0
    assert_same_bytes(tmp_path / "full-sc", {n: read_tensor(tmp_path / "full", n)
                                             for n in tensor_names(tmp_path / "full")})
    spec = write(tmp_path, lowrank3, method, {}, budget="20%")
    session = Session(load_spec(spec))
    try:
        assert session.plan.levels is not None and (session.plan.levels > 0).any()
        assert session.plan.planned_bytes <= session.plan.budget_bytes
    finally:
        session.close()
    assert cli.main(["merge", str(spec), str(tmp_path / "sc")]) == 0
    assert cli.main(["merge", str(spec), str(tmp_path / "exact"), "--no-sidecars"]) == 0
    with_sidecars = _deviation(tmp_path / "sc", tmp_path / "full", lowrank3.base)
    exact_only = _deviation(tmp_path / "exact", tmp_path / "full", lowrank3.base)
    assert with_sidecars < 0.75 * exact_only, (with_sidecars, exact_only)


def test_iso_cts_on_a_matrix_smaller_than_the_subspaces_is_fusionbench_s() -> None:
    """k = 2 singular values, 3 models, no common space: the common size comes out negative and
    FusionBench's slices drop the last task and the common space without an error; the same
    bytes here."""
    from fusion_bench.method.isotropic_merging.iso_utils import iso_cts

    u = _unit("iso_cts", (2, 8), 3, seed=4, common_space_fraction=0.0)
    tvs = [{"w": torch.from_numpy(x) - torch.from_numpy(u.base)} for x in u.inputs]
    with contextlib.redirect_stdout(io.StringIO()):
        want = torch.from_numpy(u.base) + 1.0 * iso_cts(tvs, 0.0, accelerator="cpu")["w"]
    got = np.asarray(get("iso_cts").merge(u))  # type: ignore[union-attr]
    assert got.tobytes() == want.numpy().tobytes()
