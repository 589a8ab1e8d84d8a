"""The Python API: the CLI's jobs as functions, for notebooks, sweeps and serving scripts.

    import mergefs

    m = mergefs.open("spec.yaml")             # validate the spec (no tensor bytes read)
    plan = m.plan("10%")                      # index once (reused), plan: bytes, bounds, hash
    print(plan.planned_bytes, plan.report()["bound_relative_to_update"])
    result = m.merge("out/", budget="10%")    # materialise; returns the manifest and totals
    mergefs.replay(result.manifest)           # re-read and verify every recorded byte
    with m.mount("/mnt/merged", budget="full") as mnt:   # a lazy merged HF directory
        model = AutoModelForCausalLM.from_pretrained(mnt.path)

Every function raises :class:`mergefs.core.errors.MergefsError` subclasses with the CLI's one-line
messages. The same safety rules hold as on the command line: outputs never land in a source,
manifests are never overwritten, an output directory appears only when complete. Blocking; call
from ordinary threads (never from a trio or asyncio event loop thread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergefs import ops
from mergefs.core.errors import MergefsError
from mergefs.index.blocks import BlockIndex
from mergefs.mount.control import read_stats
from mergefs.mount.lifecycle import is_mounted, run_umount
from mergefs.ops import MergeResult
from mergefs.plan.planner import Plan
from mergefs.spec.load import parse_spec
from mergefs.spec.budget import Budget, parse_budget
from mergefs.spec.model import Spec
from mergefs.spec.load import load_spec

__all__ = ["Merge", "MergeResult", "Mounted", "open", "replay"]


def _budget(value: str | float | Budget | None) -> Budget | None:
    if value is None or isinstance(value, Budget):
        return value
    return parse_budget(value)


class Merge:
    """A validated spec, ready to index, plan, merge or mount."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"mergefs.Merge({self.spec.source!r}, method={self.spec.method!r})"

    def _spec(self, budget: str | float | Budget | None) -> Spec:
        b = _budget(budget)
        return self.spec if b is None else self.spec.with_budget(b)

    def index(self, rebuild: bool = False) -> BlockIndex:
        """Build (or reuse) the block index; returns the :class:`mergefs.index.blocks.BlockIndex`."""
        ops.check_index_dir(self.spec)
        return ops.index(self.spec, rebuild=rebuild, progress=False).index

    def plan(self, budget: str | float | Budget | None = None) -> Plan:
        """The :class:`mergefs.plan.planner.Plan` for ``budget`` (default: the spec's): which expert
        blocks are read, planned bytes, bounds; ``.report()`` gives the CLI's JSON."""
        ops.check_index_dir(self.spec)
        session = ops.open_session(self._spec(budget), progress=False)
        try:
            return session.plan
        finally:
            session.close()

    def merge(self, outdir: str | os.PathLike[str], budget: str | float | Budget | None = None,
              *, force: bool = False, manifest: str | os.PathLike[str] | None = None,
              threads: int = 2) -> MergeResult:
        """Materialise the merge into ``outdir`` (new or empty; ``force`` replaces an earlier
        merge output as a whole). ``manifest``: an exact path that must not exist; default a
        new timestamped manifest beside the spec's ``manifest`` path."""
        return ops.merge(self._spec(budget), outdir, force=force, manifest=manifest,
                         threads=threads, progress=False)

    def mount(self, mountpoint: str | os.PathLike[str], budget: str | float | Budget | None = None,
              *, cache_size: str | None = None, cache_dir: str | None = None,
              manifest: str | None = None, timeout_seconds: float = 600) -> Mounted:
        """Mount the merge at ``mountpoint`` (an empty directory) in a background server
        process, returning once it answers. Use as a context manager, or call ``unmount()``.
        The spec file is read again by the server, so ``budget`` is passed to it as an
        override."""
        argv = [sys.executable, "-m", "mergefs.cli", "mount", self.spec.source, str(mountpoint)]
        if self.spec.source == "<inline>":
            raise MergefsError("mount needs a spec file (the server process reads it)")
        b = _budget(budget)
        if b is not None:
            argv += [f"--budget={b.to_spec()}"]
        if manifest is not None:
            manifest = os.path.abspath(manifest)  # the server runs in /
        for flag, value in (("--cache-size", cache_size), ("--cache-dir", cache_dir),
                            ("--manifest", manifest)):
            if value is not None:
                argv += [f"{flag}={value}"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds,
                              check=False)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mergefs: error: ")]
            raise MergefsError(lines[-1][len("mergefs: error: "):] if lines
                               else proc.stderr.strip() or "mount failed")
        return Mounted(Path(os.path.abspath(mountpoint)))


@dataclass
class Mounted:
    """A running mount started by :meth:`Merge.mount`."""

    path: Path

    def stats(self) -> dict[str, Any]:
        """The live ``.mergefs/stats.json`` (bytes served and read, cache, errors)."""
        return read_stats(self.path)

    def unmount(self, lazy: bool = False) -> None:
        """Unmount (refused while a process still uses it, unless ``lazy``)."""
        if is_mounted(self.path):
            run_umount(argparse.Namespace(mountpoint=str(self.path), lazy=lazy))

    def __enter__(self) -> Mounted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmount()


def open(spec: str | os.PathLike[str] | dict[str, Any],  # noqa: A001 - mergefs.open(spec)
         base_dir: str | os.PathLike[str] | None = None) -> Merge:
    """Open a spec file (or a spec already loaded as a dict, paths relative to ``base_dir``)."""
    if isinstance(spec, dict):
        return Merge(parse_spec(json.loads(json.dumps(spec)), Path(base_dir or ".").resolve()))
    return Merge(load_spec(Path(spec)))


def replay(manifest: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
           force: bool = False) -> Any:
    """Re-execute a manifest and verify every byte; returns
    :class:`mergefs.engine.replay.ReplayResult`, raises on any difference."""
    return ops.replay(manifest, out, force=force)
