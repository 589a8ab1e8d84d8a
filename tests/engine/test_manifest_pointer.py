"""Issue 28 (B), item 1: the spec's manifest pointer names the last COMPLETE run.

A merge or mount writes its own timestamped manifest beside the spec's ``manifest`` path (the
pointer, a symlink); the pointer moves to it only once the run has written its totals. A run
that fails or is interrupted (an exception, Ctrl-C) removes its own manifest; one that is
killed (no ``finally`` runs) leaves a manifest without totals, which the next run beside the same
pointer removes. So the pointer always replays, and failed runs never accumulate.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from families import Family, make_family, write_spec

from mergefs import cli, ops
from mergefs.engine.manifest import ManifestWriter, read_manifest
from mergefs.engine.merger import Engine
from mergefs.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[2]

needs_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("pointer_family"), n_experts=2, seed=128,
                       dtype="bfloat16")


def spec_for(tmp_path: Path, fam: Family) -> Path:
    return write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.6, 0.4],
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx"),
                             "budget": "50%"})


def manifests(tmp_path: Path) -> set[str]:
    """The spec's run manifests (not the pointer)."""
    return {p.name for p in tmp_path.glob("spec.manifest.*.jsonl")}


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mergefs.cli", *argv], capture_output=True,
                          text=True, timeout=300, check=False, env=env)


def completed_merge(tmp_path: Path, spec: Path, name: str) -> Path:
    """Merge into ``tmp_path/name``; returns the manifest the pointer now names."""
    assert cli.main(["merge", str(spec), str(tmp_path / name)]) == 0
    pointer = tmp_path / "spec.manifest.jsonl"
    assert pointer.is_symlink()
    return pointer.resolve()


def test_a_completed_merge_moves_the_pointer(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    assert read_manifest(first).totals is not None
    time.sleep(1.1)  # a new timestamp
    second = completed_merge(tmp_path, spec, "out2")
    assert second != first and read_manifest(second).totals is not None
    assert manifests(tmp_path) == {first.name, second.name}  # completed runs keep theirs
    assert cli.main(["replay", str(tmp_path / "spec.manifest.jsonl")]) == 0


def test_a_failed_merge_leaves_the_pointer_and_no_manifest(tmp_path: Path, fam: Family) -> None:
    """The issue's case: an output directory that cannot be written (/proc/out)."""
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    before = manifests(tmp_path)
    proc = run_cli("merge", str(spec), "/proc/out")
    assert proc.returncode == 1 and "cannot write the merged model" in proc.stderr, proc.stderr
    pointer = tmp_path / "spec.manifest.jsonl"
    assert pointer.resolve() == first
    assert manifests(tmp_path) == before
    proc = run_cli("replay", str(pointer))
    assert proc.returncode == 0, proc.stderr


def test_a_failed_first_merge_leaves_nothing(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    proc = run_cli("merge", str(spec), "/proc/out")
    assert proc.returncode == 1, proc.stderr
    assert manifests(tmp_path) == set()
    assert not (tmp_path / "spec.manifest.jsonl").is_symlink()
    assert not (tmp_path / "spec.manifest.jsonl").exists()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_merge_leaves_the_pointer_and_no_manifest(
        tmp_path: Path, fam: Family, monkeypatch: pytest.MonkeyPatch,
        error: type[BaseException]) -> None:
    """Ctrl-C (or any exception) inside materialise, after the manifest was created."""
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    before = manifests(tmp_path)
    real = Engine.materialise
    seen: list[Any] = []

    def interrupted(self: Engine, *a: Any, **k: Any) -> Any:
        assert self.manifest is not None and self.manifest.path is not None
        seen.append(self.manifest.path)
        raise error("interrupted")

    monkeypatch.setattr(Engine, "materialise", interrupted)
    time.sleep(1.1)  # a new timestamp: a file left behind would be a new name
    with pytest.raises(error):
        ops.merge(load_spec(spec), tmp_path / "out2", progress=False)
    monkeypatch.setattr(Engine, "materialise", real)
    assert seen and not Path(seen[0]).exists()
    assert (tmp_path / "spec.manifest.jsonl").resolve() == first
    assert manifests(tmp_path) == before
    assert cli.main(["replay", str(tmp_path / "spec.manifest.jsonl")]) == 0


def test_sigint_during_a_merge_leaves_the_pointer(tmp_path: Path, fam: Family) -> None:
    """A real Ctrl-C: SIGINT to a merge waiting inside materialise."""
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    before = manifests(tmp_path)
    flag = tmp_path / "inside"
    code = textwrap.dedent(f"""
        import sys, time
        from mergefs import cli
        from mergefs.engine.merger import Engine

        def slow(self, *a, **k):
            open({str(flag)!r}, "w").close()
            time.sleep(60)

        Engine.materialise = slow
        sys.exit(cli.main(["merge", {str(spec)!r}, {str(tmp_path / "out2")!r}]))
    """)
    time.sleep(1.1)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(manifests(tmp_path)) == len(before) + 1  # the run's own, being written
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert (tmp_path / "spec.manifest.jsonl").resolve() == first
    assert manifests(tmp_path) == before


def test_a_killed_run_is_collected_by_the_next(tmp_path: Path, fam: Family) -> None:
    """kill -9 runs no cleanup: its manifest (no totals) stays until the next run beside the
    same pointer removes it; a foreign file and a live run's manifest are never removed."""
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    code = textwrap.dedent(f"""
        import os, signal, sys
        from mergefs import cli
        from mergefs.engine.merger import Engine

        def killed(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        Engine.materialise = killed
        sys.exit(cli.main(["merge", {str(spec)!r}, {str(tmp_path / "out2")!r}]))
    """)
    time.sleep(1.1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "spec.manifest.jsonl").resolve() == first
    stale = manifests(tmp_path) - {first.name}
    assert len(stale) == 1
    stale_path = tmp_path / stale.pop()
    assert read_manifest(stale_path).totals is None
    # beside them: a file of the user's with a manifest-like name, and a run still writing
    foreign = tmp_path / "spec.manifest.20000101T000000Z.jsonl"
    foreign.write_text("my notes\n")
    live = ManifestWriter(tmp_path / "spec.manifest.20000101T000001Z.jsonl")
    live.write({"type": "header", "schema": 1, "mergefs_version": "test"})
    try:
        time.sleep(1.1)
        third = completed_merge(tmp_path, spec, "out3")
        assert not stale_path.exists()
        assert foreign.read_text() == "my notes\n" and live.path is not None
        assert live.path.exists()
        assert manifests(tmp_path) == {first.name, third.name, foreign.name, live.path.name}
        assert json.loads(live.path.read_text().splitlines()[0])["type"] == "header"
    finally:
        live.close()
    # closed without totals (a failed run): its writer removes it, at an exact path too
    assert not live.path.exists()


@pytest.mark.mount
@needs_fuse
def test_a_mount_moves_the_pointer_when_it_completes(tmp_path: Path, fam: Family,
                                                     mounts: Any) -> None:
    """While mounted, the pointer still names the last complete run; the live manifest is the
    mount's ``.mergefs/manifest.jsonl`` (and its own file); a clean unmount moves the pointer."""
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    before = manifests(tmp_path)
    time.sleep(1.1)
    m = mounts.start(spec)
    (m.path / "model.safetensors").read_bytes()
    live = manifests(tmp_path) - before
    assert len(live) == 1
    live_path = tmp_path / live.pop()
    pointer = tmp_path / "spec.manifest.jsonl"
    assert pointer.resolve() == first
    served = (m.path / ".mergefs" / "manifest.jsonl").read_text()
    assert served and live_path.read_text().startswith(served)
    mounts.stop(m)
    assert m.proc is not None and m.proc.returncode == 0, m.log.read_text()
    assert pointer.resolve() == live_path
    assert read_manifest(pointer).totals is not None
    proc = run_cli("replay", str(pointer))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.mount
@needs_fuse
def test_a_killed_mount_leaves_the_pointer(tmp_path: Path, fam: Family, mounts: Any) -> None:
    spec = spec_for(tmp_path, fam)
    first = completed_merge(tmp_path, spec, "out1")
    before = manifests(tmp_path)
    time.sleep(1.1)
    m = mounts.start(spec)
    (m.path / "model.safetensors").read_bytes()
    assert m.proc is not None
    m.proc.kill()
    m.proc.wait(10)
    proc = run_cli("umount", str(m.path))
    assert proc.returncode == 0, proc.stderr
    pointer = tmp_path / "spec.manifest.jsonl"
    assert pointer.resolve() == first
    killed = manifests(tmp_path) - before
    assert len(killed) == 1
    killed_path = tmp_path / killed.pop()
    contents = read_manifest(killed_path)  # whole lines, no totals
    assert contents.torn_lines == 0 and contents.totals is None and contents.outputs
    time.sleep(1.1)
    third = completed_merge(tmp_path, spec, "out3")  # the next run collects it
    assert not killed_path.exists()
    assert manifests(tmp_path) == before | {third.name}
