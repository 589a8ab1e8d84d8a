"""Issue 28 (A): the mount is an extra (``pip install 'mergefs[mount]'``: pyfuse3 and trio).

Without pyfuse3 and trio, ``import mergefs`` and every command but ``mount`` work, and ``mount``
(the CLI and the API's ``Merge.mount``) fails with one line saying how to get it, exit 1, no
traceback. Each case runs in a subprocess in which both modules cannot be imported: either
``sys.modules[name] = None`` (the issue's recipe), or, where the subprocess starts another
Python (the API's mount server), a directory on ``PYTHONPATH`` whose ``pyfuse3.py`` and
``trio.py`` raise ``ModuleNotFoundError`` as a missing package would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from families import Family, make_family, write_spec

ROOT = Path(__file__).resolve().parents[2]
EXTRA_LINE = ("mergefs: error: mergefs mount needs the mount extra: apt install fuse3 "
              "libfuse3-dev pkg-config, then pip install 'mergefs[mount]'")

# the CLI with pyfuse3 and trio unimportable (None in sys.modules: ``import`` raises)
WITHOUT = textwrap.dedent("""
    import sys
    sys.modules["pyfuse3"] = None
    sys.modules["trio"] = None
    from mergefs.cli import main
    code = main(sys.argv[1:])
    assert "pyfuse3" not in [m for m in sys.modules if sys.modules[m] is not None]
    assert "trio" not in [m for m in sys.modules if sys.modules[m] is not None]
    sys.exit(code)
""")


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("extra_family"), n_experts=2, seed=28,
                       dtype="bfloat16")


def spec_for(tmp_path: Path, fam: Family) -> Path:
    return write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.6, 0.4],
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx"),
                             "budget": "50%"})


def env_with(path_first: Path | None = None) -> dict[str, str]:
    parts = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    if path_first is not None:
        parts.insert(0, str(path_first))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def without_mount(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT, *argv], capture_output=True,
                          text=True, timeout=300, check=False, env=env_with())


def test_every_command_but_mount_works_without_the_mount_extra(tmp_path: Path,
                                                               fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['pyfuse3'] = None; "
                           "sys.modules['trio'] = None; import mergefs; print(mergefs.__version__)"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=env_with())
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    for argv in (["--help"], ["methods"], ["index", str(spec)], ["plan", str(spec), "--json"]):
        proc = without_mount(*argv)
        assert proc.returncode == 0, (argv, proc.stderr)
    out = tmp_path / "out"
    proc = without_mount("merge", str(spec), str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file()
    proc = without_mount("replay", str(tmp_path / "spec.manifest.jsonl"))
    assert proc.returncode == 0 and "replay OK" in proc.stdout, proc.stderr
    # umount and stats need only /proc and the mount's files: their own one-line errors here
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, needle in ((["umount", str(empty)], "not mounted"),
                         (["stats", str(empty)], "not a mergefs mount")):
        proc = without_mount(*argv)
        assert proc.returncode == 1 and needle in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and "extra" not in proc.stderr


def test_mount_says_how_to_get_the_extra_in_one_line(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for extra in ([], ["--foreground"]):
        proc = without_mount("mount", str(spec), str(mnt), *extra)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert proc.stderr.splitlines() == [EXTRA_LINE], proc.stderr
        assert "Traceback" not in proc.stderr
    # nothing was started, indexed or recorded for the mount that could not run
    assert os.listdir(mnt) == []
    assert not (tmp_path / "idx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt", "spec.yaml"]


def test_api_mount_raises_the_same_line(tmp_path: Path, fam: Family) -> None:
    """``Merge.mount`` starts ``python -m mergefs.cli mount``: both processes lack the extra."""
    shim = tmp_path / "no-extra"
    shim.mkdir()
    for name in ("pyfuse3", "trio"):
        (shim / f"{name}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    spec = spec_for(tmp_path, fam)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = textwrap.dedent(f"""
        import json, sys
        import mergefs
        try:
            mergefs.open({str(spec)!r}).mount({str(mnt)!r})
        except mergefs.MergefsError as exc:
            print(json.dumps(str(exc)))
            sys.exit(0)
        sys.exit("mounted without the extra")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, env=env_with(shim))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == EXTRA_LINE[len("mergefs: error: "):]
