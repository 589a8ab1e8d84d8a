"""The mount's start: the family and index are opened once per mount (in ``ensure_index``) and
handed to the session, also across the daemon's fork; the kernels load in the background and
a merge that needs them waits for that load. No FUSE here: the serving loop is replaced by one
that only says "ready" (what it serves is tested through real mounts in test_mount*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_family
from viewcases import write_case_spec

from mergefs import cli
from mergefs.index import blocks
from mergefs.methods import kernels
from mergefs.methods.base import Fused
from mergefs.mount import lifecycle as mount
from mergefs.recipe import family
from mergefs.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("mount_start_family"), dtype="bfloat16", n_experts=2,
                       seed=4)


def base_bytes(fam: Family) -> int:
    return sum(p.stat().st_size for p in fam.base.glob("*.safetensors"))


def patch_everywhere(name: str, real: Any, fake: Any, setattr: Any) -> None:
    """Replace ``real`` by ``fake`` under ``name`` in every mergefs module that imported it."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("mergefs") and \
                getattr(mod, name, None) is real:
            setattr(mod, name, fake)


class Counted:
    """Counts the calls of open_family and load_or_build wherever a mount can call them, and
    what the session sees when the mount says ready."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opens = 0
        self.loads = 0
        self.at_ready: dict[str, Any] = {}
        real_open, real_load = family.open_family, blocks.load_or_build

        def open_family(spec: Any) -> Any:
            self.opens += 1
            return real_open(spec)

        def load_or_build(*a: Any, **k: Any) -> Any:
            self.loads += 1
            return real_load(*a, **k)

        patch_everywhere("open_family", real_open, open_family, monkeypatch.setattr)
        patch_everywhere("load_or_build", real_load, load_or_build, monkeypatch.setattr)

        async def serve_fuse(view: Any, cfg: Any, ready: Any) -> None:
            sessions = [st.session for st in view.mount.variants.values()]
            self.at_ready = {
                "sessions": len(sessions),
                "bytes_read": sum(c.counters.bytes_read for s in sessions
                                  for c in [s.base, *s.experts]),
            }
            ready()

        monkeypatch.setattr(mount, "_serve_fuse", serve_fuse)


def mount_and_count(tmp_path: Path, fam: Family, spec: Path, monkeypatch: pytest.MonkeyPatch,
                    sessions: int) -> None:
    """Mount ``spec`` in the foreground: one family open, one index load, ``sessions`` sessions
    at readiness, and at most 1 KiB read by then."""
    counted = Counted(monkeypatch)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert cli.main(["mount", str(spec), str(mnt), "--foreground"]) == 0
    assert (counted.opens, counted.loads) == (1, 1)
    assert counted.at_ready["sessions"] == sessions
    assert counted.at_ready["bytes_read"] < 1024 < base_bytes(fam)


@pytest.mark.parametrize("index_exists", [False, True])
def test_the_family_is_opened_once_per_mount(tmp_path: Path, fam: Family,
                                             monkeypatch: pytest.MonkeyPatch,
                                             index_exists: bool) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "index")
    if index_exists:
        assert cli.main(["index", str(spec)]) == 0
    # the index build read every source byte; the session's counters were reset after it and
    # after the variant's opening reads (hashes of pass-through tensors): they hold ~nothing
    mount_and_count(tmp_path, fam, spec, monkeypatch, sessions=1)


def test_a_sweep_mount_opens_the_family_once(tmp_path: Path, fam: Family,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_case_spec(tmp_path / "sweep.yaml", fam, "task_arithmetic", tmp_path / "index")
    doc = yaml.safe_load(spec.read_text())
    doc.pop("manifest")
    doc["sweep"] = {"budget": ["20%", "full"]}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    mount_and_count(tmp_path, fam, spec, monkeypatch, sessions=2)


DAEMON = """
    import json, sys
    from mergefs import cli
    from mergefs.index import blocks
    from mergefs.mount import lifecycle as mount
    from mergefs.recipe import family
    log = sys.argv[1]
    real_open, real_load = family.open_family, blocks.load_or_build

    def note(what):
        with open(log, "a") as f:
            f.write(json.dumps([what, __import__("os").getpid()]) + "\\n")

    def open_family(spec):
        note("open")
        return real_open(spec)

    def load_or_build(*a, **k):
        note("load")
        return real_load(*a, **k)

    for mod in list(sys.modules.values()):  # every mergefs module that imported them
        if getattr(mod, "__name__", "").startswith("mergefs"):
            for name, real, fake in [("open_family", real_open, open_family),
                                     ("load_or_build", real_load, load_or_build)]:
                if getattr(mod, name, None) is real:
                    setattr(mod, name, fake)

    async def serve_fuse(view, cfg, ready):
        note(["ready", sum(c.counters.bytes_read for c in [view.mount.base,
                                                           *view.mount.experts])])
        ready()

    mount._serve_fuse = serve_fuse
    sys.exit(cli.main(["mount", sys.argv[2], sys.argv[3]]))
"""


def test_the_daemon_uses_the_family_opened_before_the_fork(tmp_path: Path, fam: Family) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "index")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "calls.jsonl"
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(DAEMON), str(log), str(spec),
                          str(mnt)], check=False, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    assert "mounted at" in res.stdout
    deadline = time.monotonic() + 20  # the daemon notes "ready" before it answers, but poll
    calls: list[Any] = []
    while time.monotonic() < deadline:
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        if any(isinstance(c[0], list) for c in calls):
            break
        time.sleep(0.05)
    parent = calls[0][1]
    assert [c[0] for c in calls[:2]] == ["open", "load"] and len(calls) == 3
    assert calls[2][0][0] == "ready" and calls[2][0][1] < 1024  # counters reset after the build
    assert calls[0][1] == calls[1][1] == parent != calls[2][1]  # opened in the parent only


def test_remote_sources_are_not_handed_across_the_fork(tmp_path: Path, fam: Family) -> None:
    local = load_spec(write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                                      tmp_path / "index"))
    assert mount.forks_safely(local)
    doc = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    doc["models"][0]["model"] = "http://127.0.0.1:9/expert"  # parsed, never opened here
    (tmp_path / "remote.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    remote = load_spec(tmp_path / "remote.yaml")
    assert remote.remote_sources and not mount.forks_safely(remote)


@pytest.mark.skipif(not kernels.available(), reason=kernels.UNAVAILABLE_REASON or "numba")
def test_a_merge_waits_for_a_warm_up_that_turns_the_kernels_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """numba broken -> numpy, also when the warm-up runs in the background: ``supports`` waits
    for it, so no unit starts on a kernel the warm-up is about to find broken."""
    assert kernels._usable()  # loaded now: without the wait, supports would say True
    monkeypatch.setattr(kernels, "_warming", None)
    monkeypatch.setattr(kernels, "UNAVAILABLE_REASON", "")  # restored after the test

    def failing_warm_up() -> None:
        time.sleep(0.5)
        kernels.UNAVAILABLE_REASON = "the numba kernels failed to compile (test)"

    monkeypatch.setattr(kernels, "warm_up", failing_warm_up)
    thread = kernels.start_warm_up()
    assert kernels.start_warm_up() is thread  # once per process
    assert not kernels.supports(Fused("delta", (0.5, 0.25)), ["BF16", "BF16"], "BF16", 64)
    assert not thread.is_alive()
