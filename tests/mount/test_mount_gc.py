"""``mergefs index gc`` never removes a piece a running mount uses: the mount registers its
pieces while it serves (daemon and foreground), and they go once it is unmounted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from families import Family, write_spec
from mounting import MOUNT_MARKS, Mounts, run_cli, wait_gone

pytestmark = MOUNT_MARKS


def _age_everything(idx: Path, days: float) -> None:
    t = time.time() - days * 86400
    for p in (idx / "pieces").iterdir():
        if p.name.startswith("usage-"):
            doc = json.loads(p.read_text())
            doc["used_unix"] = t
            p.write_text(json.dumps(doc))
        os.utime(p, (t, t))


def _pieces(idx: Path) -> set[str]:
    return {p.name for p in (idx / "pieces").glob("*.safetensors")}


@pytest.mark.parametrize("foreground", [False, True])
def test_gc_keeps_the_pieces_of_a_running_mount(tmp_path: Path, family_f32: Family,
                                                mounts: Mounts, foreground: bool) -> None:
    idx = tmp_path / "idx"
    spec = write_spec(tmp_path / "spec.yaml", family_f32,
                      extra={"block_size": 4096, "index_dir": str(idx)})
    m = mounts.start(spec, foreground=foreground)
    used = _pieces(idx)
    assert used and any(n.startswith("expert-") for n in used)
    live = list((idx / "pieces").glob("live-*.json"))
    assert len(live) == 1 and json.loads(live[0].read_text())["pid"] == m.pid
    _age_everything(idx, 100)  # unused for 100 days, as far as usage records tell
    res = run_cli("index", "gc", "--index-dir", str(idx), "--max-size", "0")
    assert res.returncode == 0, res.stderr
    assert _pieces(idx) == used, res.stdout
    assert f"kept {len(used)} pieces" in res.stdout and "used by running mounts" in res.stdout
    assert (m.path / "model.safetensors").stat().st_size > 0  # still serving
    mounts.stop(m)
    if m.pid:
        wait_gone(m.pid)
    assert not list((idx / "pieces").glob("live-*.json"))  # removed as the mount ended
    res = run_cli("index", "gc", "--index-dir", str(idx))
    assert res.returncode == 0, res.stderr
    assert _pieces(idx) == set() and f"removed {len(used)} pieces no recent" in res.stdout
