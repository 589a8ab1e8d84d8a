"""The method registry: declarations equal mergekit's, every method under a budget (against the
mergekit oracle with omitted blocks as zero deltas), under the mount (bytes equal to ``mergefs
merge``), ``mergefs methods`` and the generated docs/operators.md."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_llama_family
from reference import reference_merge_dir
from engine_checks import assert_matches, plan_omit_masks
from mergekit_runs import CASES, config

from mergefs import cli
from mergefs.engine.session import Session
from mergefs.methods import METHODS, describe_methods, get
from mergefs.methods.base import REQUIRED, Scope
from mergefs.methods.docs import render
from mergefs.spec.load import load_spec

mergekit = pytest.importorskip("mergekit")

#: one representative parity case per method (CASES holds several for some)
ONE_CASE = {method: case for case, (method, *_rest) in sorted(CASES.items(), reverse=True)}
#: the registry's mergekit methods (the others are tested against their own references)
MERGEKIT_METHODS = tuple(m for m in METHODS if m in ONE_CASE)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_llama_family(tmp_path_factory.mktemp("methods"), n_experts=4, seed=5)


def write(tmp_path: Path, cfg: dict[str, Any], name: str = "spec", **extra: Any) -> Path:
    path = tmp_path / f"{name}.yaml"
    doc = {**cfg, "block_size": "2KiB", "index_dir": str(tmp_path.parent / "index"), **extra}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_registry_is_mergekit_s() -> None:
    from mergekit import merge_methods
    from mergekit.merge_methods.base import MISSING, ParameterScope

    theirs = {m.spec.name: m.spec for m in merge_methods.registered_methods()}
    assert set(MERGEKIT_METHODS) == set(theirs)
    scopes = {ParameterScope.SHARED: Scope.GLOBAL, ParameterScope.INPUT: Scope.MODEL,
              ParameterScope.NON_BASE: Scope.NON_BASE}
    for name, spec in theirs.items():
        ours = {p.name: p for p in get(name).params if not p.mergefs_only}  # type: ignore[union-attr]
        assert set(ours) == {p.name for p in spec.parameters}, name
        for p in spec.parameters:
            mine = ours[p.name]
            assert mine.scope == scopes[p.scope], (name, p.name)
            want = REQUIRED if p.default is MISSING else p.default
            assert mine.default == want or (mine.default is want), (name, p.name)


@pytest.mark.parametrize("method", MERGEKIT_METHODS)
def test_budget_is_zero_delta_in_omitted_blocks(method: str, llama4: Family,
                                                tmp_path: Path) -> None:
    _, _, n, kw = CASES[ONE_CASE[method]]
    spec_path = write(tmp_path, config(llama4, method, n, **kw), budget="40%")
    session = Session(load_spec(spec_path))
    try:
        assert session.plan.planned_bytes <= session.plan.budget_bytes
        assert (session.plan.bound_tight is None) != session.spec.is_additive
        session.engine.materialise(tmp_path / "out")
        masks = plan_omit_masks(session, llama4.base)
    finally:
        session.close()
    assert_matches(tmp_path / "out", reference_merge_dir(spec_path, omit_masks=masks))


@pytest.mark.mount
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
@pytest.mark.parametrize("method", MERGEKIT_METHODS)
def test_mount_equals_merge(method: str, llama4: Family, tmp_path: Path, mounts: Any) -> None:
    from mounting import merge, sha256
    from viewcases import tree

    _, _, n, kw = CASES[ONE_CASE[method]]
    spec = write(tmp_path, config(llama4, method, n, **kw), budget="60%")
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}


def test_methods_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(METHODS) and rows == describe_methods()
    ties = next(r for r in rows if r["name"] == "ties")
    assert {p["name"]: p["default"] for p in ties["parameters"]}["normalize"] is True
    assert cli.main(["methods"]) == 0
    assert "breadcrumbs_ties" in capsys.readouterr().out


def test_operators_md_is_rendered_from_the_registry() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "operators.md"
    assert doc.read_text() == render(), "regenerate docs/operators.md (see mergefs.methods.docs)"


# -- the numpy kernels equal torch's, bit for bit -------------------------------------------------

def _bits(a: Any) -> Any:
    import numpy as np

    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_fma32_equals_torch_addcmul() -> None:
    import numpy as np
    import torch

    from mergefs.methods import exact

    rng = np.random.default_rng(0)
    n = 200_000
    scale = np.exp2(rng.integers(-40, 40, size=(3, n))).astype(np.float32)
    x, acc, _ = (rng.normal(size=(3, n)).astype(np.float32) * scale)
    x[:100] = np.float32(1e-40)  # subnormals
    acc[100:200] = -x[100:200] * np.float32(0.75)  # cancellation
    for c in (0.3, -1.7, 1e-3, 3.0):
        c32 = np.float32(c)
        want = torch.from_numpy(acc.copy()).addcmul_(torch.from_numpy(x),
                                                      torch.tensor(c32).reshape(1))
        assert np.array_equal(_bits(exact.fma32(x, c32, acc)), _bits(want.numpy())), c


@pytest.mark.parametrize("n", range(1, 8))
def test_small_sum_equals_torch_sum(n: int) -> None:
    import numpy as np
    import torch

    from mergefs.methods import exact

    rng = np.random.default_rng(n)
    for _ in range(200):
        v = (rng.normal(size=n) * np.exp2(rng.integers(-30, 30, size=n))).astype(np.float32)
        want = torch.from_numpy(v).reshape(1, n).sum(dim=1)[0].item()
        assert _bits(exact.small_sum(v.tolist())) == _bits(np.float32(want))


def test_elementwise_methods_need_no_torch_import(llama4: Family, tmp_path: Path) -> None:
    """The elementwise methods merge without importing torch (it costs a mount ~230 MiB)."""
    import subprocess
    import sys

    for method, kw in [("linear", {"weights": [0.5, 0.5], "base": "none"}),
                       ("task_arithmetic", {"weights": [0.5, 0.5]}),
                       ("dare_ties", {"weights": [0.5, 0.5],
                                      "parameters": {"density": 0.5, "rescale": False}}),
                       ("ram", {}), ("nearswap", {"parameters": {"t": 1e-3}, "n": 1}),
                       ("passthrough", {"base": "none", "n": 1})]:
        n = kw.pop("n", 2)
        spec = write(tmp_path, config(llama4, method, n, **kw), name=method)
        code = ("import sys; from mergefs import cli; rc = cli.main(['merge', sys.argv[1], "
                "sys.argv[2]]); assert 'torch' not in sys.modules, 'torch imported'; "
                "sys.exit(rc)")
        res = subprocess.run([sys.executable, "-c", code, str(spec), str(tmp_path / method)],
                             capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("method, kw", [
    ("karcher", {"base": "none"}),
    ("linear", {"weights": [0.6, 0.4], "parameters": {"weight": 0.2}}),  # base appended
    ("dare_ties", {"weights": [0.6, 0.4], "parameters": {"density": 0.5}}),
])
def test_replay_reproduces_every_method(method: str, kw: dict[str, Any], llama4: Family,
                                        tmp_path: Path) -> None:
    spec = write(tmp_path, config(llama4, method, 2, **kw), budget="50%")
    manifest = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--manifest", str(manifest)]) == 0
    assert cli.main(["replay", str(manifest)]) == 0


def _random_unit(rng: Any, n: int, size: int, params: dict[str, Any],
                 per: list[dict[str, Any]], base: bool = True) -> Any:
    """A unit of bfloat16-like values (many equal magnitudes), zeros, -0.0 and zero deltas."""
    import ml_dtypes
    import numpy as np

    from mergefs.methods.base import Unit

    def values() -> Any:
        v = rng.normal(scale=0.02, size=size).astype(ml_dtypes.bfloat16).astype(np.float32)
        v[rng.random(size) < 0.05] = np.float32(-0.0)
        return v

    w0 = values()
    xs = []
    for _ in range(n):
        x = w0 + (rng.normal(scale=2e-4, size=size).astype(ml_dtypes.bfloat16)
                  .astype(np.float32))
        same = rng.random(size) < 0.2
        x[same] = w0[same]  # zero deltas
        xs.append(x)
    return Unit(tensor="t", shape=(size,), elem_offset=17, base=w0 if base else None,
                inputs=tuple(xs), params=params, input_params=tuple(per),
                expert_ids=tuple(range(n)))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("row", ["task_arithmetic", "dare_linear", "dare_ties"])
def test_gta_numpy_kernel_equals_torch(row: str, n: int) -> None:
    import numpy as np

    from mergefs.methods import gta

    rng = np.random.default_rng(n)
    sparsifier = None if row == "task_arithmetic" else "random"
    consensus = row == "dare_ties"
    for normalize in (False, True):
        for lam in (1.0, 0.7):
            per = [{"weight": float(w), "density": d}
                   for w, d in zip(rng.normal(size=n), (0.5, 1.0, 0.3, 0.9))]
            g = {"normalize": normalize, "lambda": lam, "rescale": False, "seed": 3}
            u = _random_unit(rng, n, 5003, g, per)
            a = gta._merge_numpy(u, sparsifier, consensus)
            b = gta._merge_torch(u, sparsifier, consensus).numpy()
            assert np.array_equal(_bits(a), _bits(b)), (normalize, lam)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_linear_numpy_kernel_equals_torch(n: int) -> None:
    import numpy as np

    from mergefs.methods import linear

    rng = np.random.default_rng(n)
    for normalize in (False, True):
        per = [{"weight": float(w)} for w in rng.uniform(0.1, 1.0, size=n)]
        u = _random_unit(rng, n, 5003, {"normalize": normalize}, per, base=False)
        a = linear._merge(u)
        b = linear._merge_torch(u.torch()).numpy()
        assert np.array_equal(_bits(a), _bits(b)), normalize


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ram_and_nearswap_numpy_kernels_equal_torch(n: int) -> None:
    import numpy as np

    from mergefs.methods import ram, simple

    rng = np.random.default_rng(10 + n)
    for eps in (1e-5, 1e-4):
        u = _random_unit(rng, n, 5003, {"epsilon": eps}, [{}] * n)
        assert np.array_equal(_bits(ram._ram(u)), _bits(ram._ram_torch(u).numpy()))
    for t in (0.0, 1e-4, 3e-4):
        u = _random_unit(rng, 1, 5003, {"t": t}, [{}])
        assert np.array_equal(_bits(simple._nearswap(u)),
                              _bits(simple._nearswap_torch(u).numpy())), t
