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

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergefs.core.errors import MergefsError
from mergefs.spec.budget import Budget, parse_budget
from mergefs.spec.model import Spec
from mergefs.spec.load import load_spec

__all__ = ["Merge", "MergeResult", "Mounted", "open", "replay"]


@dataclass(frozen=True)
class MergeResult:
    """What ``Merge.merge`` wrote: the output directory, its manifest and the run's totals
    (the manifest's ``totals`` record: bytes read per source, bounds, wall time)."""

    outdir: Path
    manifest: Path
    totals: dict[str, Any]


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

    def _check_writes(self, **paths: Any) -> None:
        from mergefs.engine.output import check_writes

        check_writes(self.spec.model_paths, **paths)

    def index(self, rebuild: bool = False) -> Any:
        """Build (or reuse) the block index; returns the :class:`mergefs.index.blocks.BlockIndex`."""
        from mergefs.engine.session import prepare_family
        from mergefs.index.blocks import load_or_build

        self._check_writes(index_dir=self.spec.index_dir)
        base, experts = prepare_family(self.spec)
        try:
            index, _ = load_or_build(base, experts, self.spec.block_size, self.spec.index_dir,
                                     None, rebuild=rebuild)
            return index
        finally:
            for c in [base, *experts]:
                c.close()

    def plan(self, budget: str | float | Budget | None = None) -> Any:
        """The :class:`mergefs.plan.planner.Plan` for ``budget`` (default: the spec's): which expert
        blocks are read, planned bytes, bounds; ``.report()`` gives the CLI's JSON."""
        from mergefs.engine.session import Session

        self._check_writes(index_dir=self.spec.index_dir)
        session = Session(self._spec(budget))
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
        from mergefs.methods import kernels
        from mergefs.engine.session import Session, prepare_family
        from mergefs.engine.merger import may_use_kernels
        from mergefs.engine.manifest import ManifestWriter
        from mergefs.engine.output import check_outdir, check_outside, check_source_files

        spec = self._spec(budget)
        out = Path(outdir)
        manifest = Path(manifest) if manifest else None
        self._check_writes(outdir=out, index_dir=spec.index_dir,
                           manifest=manifest or spec.manifest)
        check_outside(out, spec=spec.source, manifest=manifest or spec.manifest,
                      index_dir=spec.index_dir, cache_dir=spec.cache_dir)
        check_outdir(out, force)
        if may_use_kernels(spec):  # numba and the kernel module load while the family opens
            kernels.start_warm_up(full=False)
        family = prepare_family(spec)
        try:
            check_source_files(out, [family[0], *family[1]])
            writer = ManifestWriter(manifest) if manifest else \
                ManifestWriter.for_run(spec.manifest)
        except BaseException:
            for c in [family[0], *family[1]]:
                c.close()
            raise
        try:
            session = Session(spec, manifest=writer, family=family)
            try:
                session.engine.materialise(out, threads=threads, overwrite=force)
                totals = session.finish()
            finally:
                session.close()
        finally:
            writer.close()
        assert writer.path is not None
        return MergeResult(out, writer.path, totals)

    def mount(self, mountpoint: str | os.PathLike[str], budget: str | float | Budget | None = None,
              *, cache_size: str | None = None, cache_dir: str | None = None,
              manifest: str | None = None, timeout_seconds: float = 600) -> Mounted:
        """Mount the merge at ``mountpoint`` (an empty directory) in a background server
        process, returning once it answers. Use as a context manager, or call ``unmount()``.
        The spec file is read again by the server, so ``budget`` is passed to it as an
        override."""
        argv = [sys.executable, "-m", "mergefs.cli.main", "mount", self.spec.source, str(mountpoint)]
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
        from mergefs.mount.control import read_stats

        return read_stats(self.path)

    def unmount(self, lazy: bool = False) -> None:
        """Unmount (refused while a process still uses it, unless ``lazy``)."""
        import argparse

        from mergefs.mount.lifecycle import is_mounted, run_umount

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
        from mergefs.spec.load import parse_spec

        return Merge(parse_spec(json.loads(json.dumps(spec)), Path(base_dir or ".").resolve()))
    return Merge(load_spec(Path(spec)))


def replay(manifest: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
           force: bool = False) -> Any:
    """Re-execute a manifest and verify every byte; returns
    :class:`mergefs.engine.replay.ReplayResult`, raises on any difference."""
    from mergefs.engine.replay import replay as _replay

    return _replay(Path(manifest), Path(out) if out is not None else None, overwrite=force)
