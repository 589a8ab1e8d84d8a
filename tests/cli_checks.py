"""Helpers of the command-line tests: the mergefs command line of this interpreter, and the one-line-error check."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
import subprocess
import sys


def mergefs_argv() -> list[str]:
    exe = REPO / ".venv" / "bin" / "mergefs"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from mergefs.cli import main; sys.exit(main())"]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mergefs: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
