"""Smoke test of the benchmark script: ``scripts/bench.py --quick`` produces its table and files.

Timing is never asserted here (that is the benchmark's job); this only checks that a quick run
completes and reports every section with the expected rows. Takes one to three minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

EXPECTED_SWEEP = [f"task_arithmetic budget {b}"
                  for b in ("1%", "2%", "5%", "10%", "25%", "50%", "full")]


def test_quick_bench_writes_table_json_csv(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          check=False,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 1
    run = runs[0]
    for name in ("table.txt", "results.json", "results.csv"):
        assert (run / name).is_file(), name
    assert "mergefs benchmarks" in proc.stdout

    doc = json.loads((run / "results.json").read_text())
    rows = doc["rows"]
    sections = {r["section"] for r in rows}
    assert {"index", "sweep", "mergekit", "load", "serving", "memory", "real"} <= sections
    cases = {(r["section"], r["case"], r["cache"]) for r in rows}
    for case in EXPECTED_SWEEP:
        assert ("sweep", case, "cold") in cases, case
    assert ("sweep", "ties budget 10%", "cold") in cases
    assert ("sweep", "task_arithmetic budget 10%", "warm") in cases
    assert any(r["section"] == "index" and r["case"].startswith("index build") for r in rows)

    by_case = {(r["section"], r["case"], r["cache"]): r for r in rows}
    full = by_case[("sweep", "task_arithmetic budget full", "cold")]["metrics"]
    tenth = by_case[("sweep", "task_arithmetic budget 10%", "cold")]["metrics"]
    assert full["rel_weights"] == 0.0  # the full budget is the reference
    assert 0 < tenth["expert_bytes_read"] <= 0.10 * tenth["total_expert_bytes"]
    assert tenth["err_norm"] > 0 and tenth["bound_tight"] >= tenth["error_exact_index"] * 0.999
    # every row is either measured or says why it was not run
    for r in rows:
        assert r["result"], r
        assert r["cache"] in ("cold", "warm", "-"), r

    table = (run / "table.txt").read_text()
    assert "task_arithmetic budget 10%" in table and "cold" in table and "warm" in table
    csv_lines = (run / "results.csv").read_text().splitlines()
    assert len(csv_lines) == len(rows) + 1
