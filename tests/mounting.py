"""Helpers of the tests that mount: run the CLI, mount and always unmount, merge, hash files."""

from __future__ import annotations
import json
from typing import Any
import logging
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
import pytest
from mergefs import cli

log = logging.getLogger(__name__)


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mergefs.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, check=False)


@dataclass
class Mounts:
    """Starts mounts; ``cleanup`` (the fixture finalizer) always unmounts every one of them."""

    tmp: Path
    started: list[Mount] = field(default_factory=list)

    def start(self, spec: Path, *args: str, foreground: bool = True, name: str = "mnt") -> Mount:
        mnt = self.tmp / name
        mnt.mkdir(exist_ok=True)
        log = self.tmp / f"{name}.log"
        if not foreground:
            m = Mount(mnt, None, log)
            self.started.append(m)
            res = run_cli("mount", str(spec), str(mnt), *args)
            log.write_text(res.stdout + res.stderr)
            assert res.returncode == 0, res.stderr
            m.pid = m.stats()["pid"]
            return m
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "mergefs.cli", "mount", str(spec),
                                     str(mnt), "--foreground", *args], stdout=out,
                                    stderr=subprocess.STDOUT)
        m = Mount(mnt, proc, log, proc.pid)
        self.started.append(m)
        deadline = time.monotonic() + READY_SECONDS
        while not (mnt / ".mergefs" / "stats.json").exists():
            if proc.poll() is not None:
                raise AssertionError(f"mount exited {proc.returncode}: {log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"mount not ready: {log.read_text()}")
            time.sleep(0.05)
        return m

    def stop(self, m: Mount) -> None:
        """SIGTERM a foreground server and wait for it; unmount lazily in any case."""
        if m.proc is not None and m.proc.poll() is None:
            m.proc.terminate()
            m.proc.wait(30)
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True, check=False)

    def cleanup(self) -> None:
        for m in self.started:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
                try:
                    m.proc.wait(20)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True,
                           check=False)
            if m.proc is None and m.pid:
                wait_gone(m.pid)


def wait_gone(pid: int, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def merge(spec: Path, out: Path) -> Path:
    """``mergefs merge`` (in process) with its own manifest, so the mount's stays separate."""
    assert cli.main(["merge", str(spec), str(out), "--manifest", str(out) + ".manifest.jsonl"]
                    ) == 0
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assert_mount_serves_the_merge(doc: dict[str, Any], tmp_path: Path, mounts: Any,
                                  **keys: Any) -> None:
    """Write ``doc`` (plus ``keys``) as a spec, merge it, mount it and assert the mount serves
    the merged directory's files byte for byte (``mounts``: the ``mounts`` fixture)."""
    import yaml
    from viewcases import tree

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**doc, "index_dir": str(tmp_path / "index"), **keys}))
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    assert {r: sha256(p) for r, p in tree(m.path).items()} == \
        {r: sha256(p) for r, p in tree(out).items()}


#: the marks of every test module that mounts: ``pytestmark = MOUNT_MARKS``
MOUNT_MARKS = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                       reason="needs /dev/fuse and fusermount3"),
]


READY_SECONDS = 60.0


@dataclass
class Mount:
    path: Path
    proc: subprocess.Popen[bytes] | None  # the foreground server (None: daemonized)
    log: Path
    pid: int = 0

    def stats(self) -> dict[str, Any]:
        return json.loads((self.path / ".mergefs" / "stats.json").read_text())
