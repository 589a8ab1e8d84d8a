"""`mergefs sweep`: what budgets, methods and coefficient grids buy, from the index alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from families import Family, make_family, write_spec

from mergefs import cli
from mergefs.sources.local import Checkpoint
from mergefs.plan.report import run_sweep


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("sweep_family"), n_experts=3, seed=4)


def plan_json(spec: Path, budget: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "mergefs.cli", "plan", str(spec), "--budget",
                           budget, "--json"], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_sweep_equals_plans_and_reads_no_expert_bytes(tmp_path: Path, fam: Family,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.5, 0.3, -0.2],
                      parameters={"lambda": 1.0},
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx")})
    assert cli.main(["index", str(spec)]) == 0

    def no_reads(self: Checkpoint, *a: object, **k: object) -> None:
        raise AssertionError(f"sweep read tensor bytes of {self.root}")

    monkeypatch.setattr(Checkpoint, "read_ranges", no_reads)
    budgets = ["1%", "10%", "50%", "full"]
    rows = run_sweep(spec, budgets, grid=[("parameters.lambda", [0.5, 1.0])], progress=False)
    monkeypatch.undo()
    assert [r.budget for r in rows] == budgets * 2
    assert [r.variant for r in rows] == ["lambda=0.5"] * 4 + ["lambda=1.0"] * 4
    for r in rows[4:]:  # lambda=1.0 is the spec itself: the same plan as `mergefs plan`
        want = plan_json(spec, r.budget if r.budget != "full" else "full")
        assert r.planned_bytes == want["planned_expert_bytes"]
        assert r.bound_tight == pytest.approx(want["bound_tight"], rel=1e-12, abs=1e-15)
        assert r.error_exact == pytest.approx(want["error_exact"], rel=1e-12, abs=1e-15)
    for half, one in zip(rows[:4], rows[4:]):  # lambda scales the update and every error
        assert half.planned_bytes == one.planned_bytes
        assert half.update_norm == pytest.approx(one.update_norm / 2)
    kept = [r.energy_kept for r in rows[4:]]
    assert kept == sorted(kept) and kept[-1] == pytest.approx(1.0)
    assert all(0 <= k <= 1 for k in kept)


def test_sweep_cli_methods_table_and_plot(tmp_path: Path, fam: Family) -> None:
    spec = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx")})
    png = tmp_path / "sweep.png"
    proc = subprocess.run([sys.executable, "-m", "mergefs.cli", "sweep", str(spec), "--budgets",
                           "5%,full", "--methods", "task_arithmetic,ties", "--plot", str(png),
                           "--json"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("task_arithmetic", "5%"), ("task_arithmetic", "full"), ("ties", "5%"), ("ties", "full")]
    assert rows[2]["bound_tight"] is None  # ties has no bound
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "mergefs.cli", "sweep", str(spec), "--budgets",
                          "5%,10"], capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "ambiguous" in bad.stderr
