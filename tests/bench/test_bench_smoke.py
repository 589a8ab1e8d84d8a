"""Smoke tests of the benchmark tool (``python -m bench``, the package ``bench/`` beside mergefs).

Timing is never asserted here (that is the benchmark's job). Fast: the tool lists its sections,
every section imports (so a name mergefs moved breaks here, not in a long run) and answers
``--help``, and its small families are the test suite's, byte for byte. Slow (one to three
minutes): ``python -m bench table --quick`` produces its table and files with every section
and the expected rows.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from families import make_family

from bench import families as bench_families
from bench.sections import SECTIONS, entry

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_SWEEP = [f"task_arithmetic budget {b}"
                  for b in ("1%", "2%", "5%", "10%", "25%", "50%", "full")]


def test_help_lists_every_section() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in SECTIONS:
        assert f"  {name} " in proc.stdout, name
    bad = subprocess.run([sys.executable, "-m", "bench", "no-such-section"],
                         capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "unknown section" in bad.stderr


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_imports_and_has_help(name: str) -> None:
    main = entry(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(["--help"], prog=f"python -m bench {name}")
        except SystemExit as exc:  # argparse's --help
            rc = exc.code
    assert rc in (0, None)
    assert f"python -m bench {name}" in out.getvalue()


def test_small_family_is_the_test_suites(tmp_path: Path) -> None:
    """bench.families.make_small_family writes the bytes tests/families.py's make_family does
    (``python -m bench pairindex`` measures those families)."""
    shapes = {f"model.layers.{k}.w.weight": (40, 24) for k in range(4)}
    for kw in ({}, {"shapes": shapes, "zero_tensors": tuple(list(shapes)[:3]), "seed": 3},
               {"dtype": "bfloat16", "seed": 5, "n_experts": 2}):
        ours = bench_families.make_small_family(tmp_path / "bench", **kw)  # type: ignore[arg-type]
        theirs = make_family(tmp_path / "tests", **kw)  # type: ignore[arg-type]
        for a, b in zip([ours.base, *ours.experts], [theirs.base, *theirs.experts], strict=True):
            for f in ("model.safetensors", "config.json", "tokenizer.json"):
                assert (a / f).read_bytes() == (b / f).read_bytes(), (kw, a.name, f)


@pytest.mark.bench
def test_quick_table_writes_table_json_csv(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "table", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(runs) == 1
    run = runs[0]
    for name in ("table.txt", "table.md", "results.json", "results.csv"):
        assert (run / name).is_file(), name
    assert "mergefs benchmarks" in proc.stdout

    doc = json.loads((run / "results.json").read_text())
    rows = doc["rows"]
    sections = {r["section"] for r in rows}
    assert {"index", "sweep", "mergekit", "load", "serving", "memory", "real", "sweepmount",
            "remote"} <= sections
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
    # every row is either measured or says why it was not run, and has its command if measured
    for r in rows:
        assert r["result"], r
        assert r["cache"] in ("cold", "warm", "-"), r
    assert all(r["command"].startswith("mergefs ") for r in rows
               if r["section"] == "sweep"), "sweep rows reproduce with the mergefs command"

    table = (run / "table.txt").read_text()
    assert "task_arithmetic budget 10%" in table and "cold" in table and "warm" in table
    csv_lines = (run / "results.csv").read_text().splitlines()
    assert len(csv_lines) == len(rows) + 1
