"""Installing mergefs without torch, and into an environment that has its own torch.

- Every method merges, in a process where torch cannot be imported, exactly when its declared
  ``torch_use`` says it needs no torch (over input counts, flag settings and tensor sizes), and
  otherwise fails with the one line naming the extra; ``mergefs methods`` words agree.
- The command line without torch: task_arithmetic merges (the same bytes as with torch), ties
  exits 1 with that one line.
- pip's plan (``--dry-run --report``, real resolution against PyPI) for ``pip install mergefs``
  and ``mergefs[torch]`` in a fresh venv holding a stand-in torch newer than any mergefs was
  tested with: that torch is kept and every package to install is a wheel (no compiler); the
  ``mount`` extra plans pyfuse3, an sdist that needs ``apt install fuse3 libfuse3-dev
  pkg-config`` (pyproject.toml says so). Needs network access to PyPI.

This module imports neither torch nor anything that does: the child processes import it to run
the method grid without torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from families import make_family, write_spec

from mergefs.core.errors import DependencyMissing
from mergefs.methods import METHODS, BasePolicy, Method, Unit, get, require_torch

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]  # families.py and the other helpers
HERE = Path(__file__).resolve().parent  # this module, imported by the subprocesses


def missing_line(method: str) -> str:
    return (f"{method} needs torch (pip install 'mergefs[torch]', or any torch>=2.0 you "
            "already use)")


def without_torch(code: str, *args: str, cwd: Path | None = None
                  ) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter where ``import torch`` fails, as where it is not installed."""
    prelude = f"import sys; sys.modules['torch'] = None; sys.path[:0] = [{str(HERE)!r}, {str(TESTS)!r}]\n"
    return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300, check=False)


# -- which methods need torch, and when ----------------------------------------------------------

@dataclass(frozen=True)
class Case:
    method: str
    n: int  # inputs besides the base (all inputs when the base is ignored)
    params: Mapping[str, Any]  # global, defaults filled in
    size: int  # elements of the tensor (the unit is the whole tensor)


def grid() -> list[Case]:
    """Every method over input counts around its numpy kernels' limits (4, 7, 15 and 8 models
    on a one-element tensor), each global flag flipped in turn, and three tensor sizes."""
    cases = []
    for name in METHODS:
        m = get(name)
        assert m is not None
        c = m.caps
        ns = [n for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16)
              if n >= c.min_inputs and (c.max_inputs is None or n <= c.max_inputs)]
        g0 = {p.name: p.default for p in m.global_params if not p.required}
        g0.update({p.name: 0.5 for p in m.global_params if p.required})  # t (slerp, nearswap)
        variants = [g0] + [{**g0, p.name: not g0[p.name]} for p in m.global_params
                           if p.kind == "bool" and not p.no_op]
        cases += [Case(name, n, g, size) for n in ns for g in variants for size in (1, 5, 37)]
    return cases


def unit_of(case: Case) -> Unit:
    m = get(case.method)
    assert m is not None
    rng = np.random.default_rng(case.n * 1000 + case.size)
    base = (rng.standard_normal(case.size) * 0.02).astype(np.float32)
    inputs = tuple((base + rng.standard_normal(case.size).astype(np.float32) * np.float32(2e-3)
                    ).astype(np.float32) for _ in range(case.n))
    per = []
    for k in range(case.n):
        p = {q.name: q.default for q in m.model_params if not q.required}
        p["weight"] = 0.2 * (k + 1)
        if "density" in p:
            p["density"] = 0.5  # a sparsifier drops something
        per.append(p)
    has_base = m.caps.base is not BasePolicy.IGNORED
    return Unit(tensor="t", shape=(case.size,), elem_offset=0, base=base if has_base else None,
                inputs=inputs, params=dict(case.params), input_params=tuple(per),
                expert_ids=tuple(range(case.n)), tensor_size=case.size)


def merge_grid() -> list[str]:
    """Each case of :func:`grid` merged here: "ok" (a numpy array), the DependencyMissing line,
    or what else went wrong. Run without torch."""
    out = []
    for case in grid():
        m = get(case.method)
        assert m is not None
        try:
            got = m.merge(unit_of(case))
            out.append("ok" if isinstance(got, np.ndarray) and got.size == case.size
                       else f"returned {type(got).__name__}")
        except DependencyMissing as exc:
            out.append(str(exc))
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            out.append(f"unexpected {type(exc).__name__}: {exc}")
    return out


def test_each_method_needs_torch_exactly_when_it_declares() -> None:
    proc = without_torch("import json, test_install\n"
                         "assert sys.modules['torch'] is None\n"
                         "print(json.dumps(test_install.merge_grid()))")
    assert proc.returncode == 0, proc.stderr
    outcomes = json.loads(proc.stdout)
    cases = grid()
    assert len(outcomes) == len(cases)
    wrong = []
    for case, got in zip(cases, outcomes):
        m = get(case.method)
        assert m is not None
        want = missing_line(case.method) if m.needs_torch(case.n, case.params, case.size) \
            else "ok"
        if got != want:
            wrong.append((case.method, case.n, dict(case.params), case.size, got))
    assert not wrong, wrong[:10]
    free = {c.method for c, got in zip(cases, outcomes) if got == "ok"}
    assert {"task_arithmetic", "linear", "nearswap", "passthrough", "ram", "dare_linear",
            "dare_ties"} <= free  # the numpy kernels (mergefs/methods/exact.py)


def _declared(m: Method) -> set[bool]:
    return {m.needs_torch(c.n, c.params, c.size) for c in grid() if c.method == m.name}


@pytest.mark.parametrize("name", METHODS)
def test_methods_command_says_when_torch_is_needed(name: str) -> None:
    """The words of ``mergefs methods`` (and docs/operators.md) agree with the predicate."""
    from mergefs.methods import describe_methods

    m = get(name)
    assert m is not None
    note = next(r for r in describe_methods() if r["name"] == name)["needs_torch"]
    assert note == m.torch_use.note
    declared = _declared(m)
    if declared == {True}:
        assert note == "yes"
    elif declared == {False}:
        assert note == "no"
    else:
        assert note.startswith("only "), note


def test_require_torch_says_which_extra_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(DependencyMissing) as exc:
        require_torch("ties")
    assert str(exc.value) == missing_line("ties")
    old = types.ModuleType("torch")
    old.__version__ = "1.13.1+cu117"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", old)
    with pytest.raises(DependencyMissing) as exc:
        require_torch("slerp")
    assert str(exc.value) == ("slerp needs torch>=2.0, found 1.13.1+cu117 "
                              "(pip install 'mergefs[torch]')")
    new = types.ModuleType("torch")
    new.__version__ = "2.99.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", new)
    assert require_torch("slerp") is new


# -- the command line without torch --------------------------------------------------------------

CLI = "from mergefs.cli import main; sys.exit(main())"


def test_cli_without_torch(tmp_path: Path) -> None:
    fam = make_family(tmp_path / "fam", n_experts=2, seed=5)
    extra = {"index_dir": str(tmp_path / "idx")}
    ta = write_spec(tmp_path / "ta.yaml", fam, "task_arithmetic", weights=[0.7, -0.2],
                    parameters={"lambda": 0.9}, extra=extra)
    proc = without_torch(CLI, "merge", str(ta), str(tmp_path / "free"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "needs torch" not in proc.stderr

    from mergefs import cli

    assert cli.main(["merge", str(ta), str(tmp_path / "with")]) == 0
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "free" / f).read_bytes() == (tmp_path / "with" / f).read_bytes()

    ties = write_spec(tmp_path / "ties.yaml", fam, "ties", extra=extra,
                      model_parameters=[{"density": 0.5}] * 2)
    proc = without_torch(CLI, "merge", str(ties), str(tmp_path / "ties-out"), cwd=tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mergefs: error:")]
    assert errors == [f"mergefs: error: {missing_line('ties')}"], proc.stderr
    assert proc.stderr.splitlines()[-1] == errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "ties-out").exists()

    proc = without_torch(CLI, "methods", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r["needs_torch"] for r in json.loads(proc.stdout)}
    assert rows["passthrough"] == "no" and rows["ties"] == "yes"


# -- pip's plan: an existing torch is kept, wheels only ------------------------------------------

STAND_IN = "2.99.0"  # newer than the machine-wide cap (torch<=2.14.1, /etc/xdg/pip)


def stand_in_torch(folder: Path, version: str) -> Path:
    """A minimal torch wheel: ``torch/__init__.py`` with ``__version__``, and its dist-info."""
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f'"""A stand-in torch."""\n__version__ = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: mergefs-tests\n"
                          "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()
                                                    ).rstrip(b"=").decode()

    record = "".join(f"{p},{digest(t.encode())},{len(t.encode())}\n" for p, t in files.items())
    path = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
        z.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return path


Plan = dict[str, dict[str, Any]]  # package name -> pip's report item


@dataclass(frozen=True)
class Venv:
    python: Path
    project: Path  # the package's source, copied: the build writes egg-info and build/ there
    root: Path
    env: Mapping[str, str]

    def pip(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pip", "--python", str(self.python), *args]

    def plan(self, extra: str = "") -> Plan:
        """``pip install --dry-run --report`` of the package (with ``extra``) into the venv:
        what pip would install, by package name. The build backend (setuptools) runs in the
        venv (``--no-build-isolation``: the same metadata, twice as fast as an isolated build)."""
        report = self.root / f"{extra or 'core'}.json"
        target = f"{self.project}[{extra}]" if extra else str(self.project)
        proc = subprocess.run(self.pip("install", "--dry-run", "--quiet", "--no-build-isolation",
                                       "--report", str(report), target),
                              env=dict(self.env), capture_output=True, text=True, timeout=600,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        items = json.loads(report.read_text())["install"]
        return {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i for i in items}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv holding the stand-in torch, installed past the machine's cap, and the
    package's build backend."""
    root = tmp_path_factory.mktemp("install")
    no_constraints = root / "no-constraints.txt"
    no_constraints.write_text("")
    env = {**os.environ, "PIP_CONSTRAINT": str(no_constraints), "PIP_NO_INPUT": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    project = root / "mergefs-src"
    project.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / f, project / f)
    shutil.copytree(REPO / "mergefs", project / "mergefs",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build_requires = tomllib.loads((REPO / "pyproject.toml").read_text()
                                   )["build-system"]["requires"]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    v = Venv(root / "venv" / "bin" / "python", project, root, env)
    for args in (["--no-index", str(stand_in_torch(root, STAND_IN))], build_requires):
        proc = subprocess.run(v.pip("install", "--quiet", *args), env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr
    got = subprocess.run([str(v.python), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == STAND_IN
    return v


def assert_wheels_only(plan: Plan, *sdists: str) -> None:
    for name, item in plan.items():
        info = item["download_info"]
        if name == "mergefs":
            assert "dir_info" in info, info  # the local source directory
        elif name in sdists:
            assert info["url"].endswith(".tar.gz"), (name, info["url"])
        else:
            assert info["url"].endswith(".whl"), (name, info["url"])  # no build, no compiler


def test_install_keeps_the_users_torch_and_needs_no_compiler(venv: Venv) -> None:
    plan = venv.plan()
    assert "mergefs" in plan and {"numpy", "safetensors", "numba"} <= set(plan)
    assert not {"torch", "pyfuse3", "trio"} & set(plan), sorted(plan)
    assert not [n for n in plan if n.startswith(("nvidia-", "triton"))], sorted(plan)
    assert_wheels_only(plan)


def test_torch_extra_keeps_a_newer_torch(venv: Venv) -> None:
    plan = venv.plan("torch")
    assert "mergefs" in plan and "torch" not in plan, sorted(plan)  # 2.99.0 satisfies >=2.0
    assert not [n for n in plan if n.startswith(("nvidia-", "triton"))], sorted(plan)
    assert_wheels_only(plan)


def test_mount_extra_plans_pyfuse3_from_source(venv: Venv) -> None:
    """pyfuse3 ships no wheels: it builds against libfuse3 (pyproject.toml names the apt
    packages in the extra's comment); everything else is a wheel."""
    plan = venv.plan("mount")
    assert {"pyfuse3", "trio"} <= set(plan) and "torch" not in plan, sorted(plan)
    assert_wheels_only(plan, "pyfuse3")
    assert "libfuse3-dev" in (REPO / "pyproject.toml").read_text()
