"""The operations: load, index, plan, merge, compress, mount and replay, each step written once.

The CLI (:mod:`mergefs.cli`) and the Python API (:mod:`mergefs.api`) are thin faces over these
functions: the guards (outputs never inside a source, manifests never overwritten, an output
directory only when complete), the index build with its progress bar, the manifest and the
staging exist here and nowhere else. Progress bars go to stderr and only when ``progress`` is
true and stderr is a terminal (:func:`mergefs.core.progress.byte_progress`).

Blocking: call from an ordinary thread, never from a trio or asyncio event loop thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mergefs.core.errors import ManifestError, MergefsError
from mergefs.core.progress import byte_progress
from mergefs.core.sizes import human_bytes
from mergefs.deltas.publish import publish as publish_deltas
from mergefs.engine import ray_index, ray_merge
from mergefs.engine.layout import OutputOptions
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.merger import may_use_kernels
from mergefs.engine.output import check_outdir, check_outside, check_source_files, check_writes
from mergefs.engine.replay import ReplayResult
from mergefs.engine.replay import replay as replay_manifest
from mergefs.engine.session import Session, prepare_family
from mergefs.index.blocks import BlockIndex, load_or_build, reached_pieces
from mergefs.index.collect import Collected, collect
from mergefs.index.published import publish as publish_index
from mergefs.methods import kernels
from mergefs.mount.lifecycle import check_mountpoint, ensure_index, require_mount_extra, run_mount
from mergefs.recipe.family import open_family
from mergefs.sources.local import Checkpoint
from mergefs.spec.budget import Budget
from mergefs.spec.load import load_spec, read_spec_docs
from mergefs.spec.model import Spec
from mergefs.spec.variants import Variant, is_sweep, load_variant, load_variants, read_doc

log = logging.getLogger(__name__)

Family = tuple[Checkpoint, list[Checkpoint]]


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote: the output directory, its manifest and the run's totals (the
    manifest's ``totals`` record: bytes read per source, bounds, wall time)."""

    outdir: Path
    manifest: Path
    totals: dict[str, Any]


def load(path: str | os.PathLike[str], *, strict: bool = False, variant: str | None = None,
         any_variant: bool = False, budget: Budget | None = None,
         intermediate_dir: str | os.PathLike[str] | None = None,
         seed: int | None = None) -> Spec:
    """The spec at ``path``; of a sweep spec, the ``variant`` named (or, with ``any_variant``,
    the first: every variant has the same family and index). Refuses an index directory inside a
    source; ``budget`` overrides the spec's; ``intermediate_dir`` a multi-document spec's
    (mergekit-multi's ``--intermediate-dir``); ``seed``: :func:`with_seed`."""
    if is_sweep(read_doc(path)):
        if variant is not None:
            spec = load_variant(path, variant, strict)
        elif any_variant:
            spec = load_variants(path, strict)[0][1]
        else:
            names = [v.name for v, _ in load_variants(path, strict)]
            raise MergefsError(f"{path} is a sweep of {len(names)} variants: choose one with "
                               f"--variant NAME ({', '.join(names[:6])}"
                               f"{', ...' if len(names) > 6 else ''}), or mount them all")
    elif variant is not None:
        raise MergefsError(f"--variant: {path} has no sweep or variants")
    else:
        spec = load_spec(path, strict=strict, intermediate_dir=intermediate_dir)
    if intermediate_dir is not None and not spec.intermediates:
        raise MergefsError(f"--intermediate-dir: {path} is not a multi-document spec (it has "
                           "no named merges)")
    check_index_dir(spec)
    if seed is not None:
        spec = with_seed(spec, seed)
    return spec if budget is None else spec.with_budget(budget)


def with_seed(spec: Spec, seed: int) -> Spec:
    """``spec`` (and its intermediate merges) with the global ``seed`` parameter set, for the
    methods that draw random masks (dare_*, della*: what mergekit's ``--random-seed`` changes);
    other methods take no seed and are returned as they are. Recorded in the resolved spec, so
    a replay draws the same masks."""
    inter = tuple((n, with_seed(s, seed), d) for n, s, d in spec.intermediates)
    if not any(p.name == "seed" for p in spec.method_def.params):
        return replace(spec, intermediates=inter)
    raw = dict(spec.raw)
    raw["parameters"] = {**(raw.get("parameters") or {}), "seed": seed}
    return replace(spec, parameters={**spec.parameters, "seed": seed},
                   settings={**spec.settings, "seed": seed}, raw=raw, intermediates=inter)


def config_text(spec: Spec) -> str | None:
    """The spec file's text, for the merge's mergekit_config.yml and card (mergekit's
    ``config_source``); None for a spec not read from a file, and for a sweep's variant (its
    configuration is its resolved spec), and for a spec with ``storage_options`` (credentials
    never reach an output: the resolved spec, which redacts them, is shown instead)."""
    try:
        text = Path(spec.source).read_text(encoding="utf-8")
        if "storage_options" in text:
            return None
        return None if is_sweep(read_doc(spec.source)) else text
    except (OSError, UnicodeDecodeError, MergefsError):
        return None


def check_index_dir(spec: Spec) -> None:
    """Refuse an index directory that is, contains or lies inside a source of the spec."""
    check_writes(spec.model_paths, index_dir=spec.index_dir)


def close_family(family: Family) -> None:
    for c in [family[0], *family[1]]:
        c.close()


def chunk_runner(ray: str | None, spec: Spec, family: Family) -> ray_index.RayChunkRunner | None:
    """Where an index build computes its chunks: None (local threads), or the Ray cluster at
    ``ray`` ("" for the default one)."""
    return None if ray is None else ray_index.RayChunkRunner(spec, family[0], family[1], ray or None)


def build_index(spec: Spec, family: Family, *, ray: str | None = None, progress: bool = True,
                **options: Any) -> tuple[BlockIndex, bool]:
    """Build or reuse the family's block index (``options``: :func:`load_or_build`'s), with a
    progress bar; returns (index, built)."""
    base, experts = family
    runner = chunk_runner(ray, spec, family)
    with byte_progress("indexing", enabled=progress) as tick:  # total: what it will read
        got = load_or_build(base, experts, spec.block_size, spec.index_dir, tick, runner=runner,
                            on_total=tick.set_total, max_size_bytes=spec.index_max_size_bytes,
                            **options)
    if runner is not None and runner.parts and progress:
        nodes = {p["worker"]["node"] for p in runner.parts}
        print(f"indexed on Ray: {len(runner.parts)} tasks on {len(nodes)} node(s)")
    return got


def open_session(spec: Spec, *, manifest: ManifestWriter | None = None, progress: bool = True,
                 family: Family | None = None, ray: str | None = None,
                 sidecars: bool = True, output: OutputOptions | None = None) -> Session:
    """A :class:`Session` (family, index, plan, engine), the index built with a progress bar if
    it must be. ``family``: opened already by the caller (the session owns it from here).
    ``sidecars``: plan with the delta sidecars that match (False: exact blocks only).
    ``output``: the output's layout and files (:class:`OutputOptions`)."""
    family = family if family is not None else prepare_family(spec)
    try:
        runner = chunk_runner(ray, spec, family)
    except BaseException:
        close_family(family)
        raise
    with byte_progress("indexing", enabled=progress) as tick:  # total: what it will read
        session = Session(spec, manifest=manifest, on_index_bytes=tick, family=family,
                          on_index_total=tick.set_total,
                          index_runner=runner, sidecars=sidecars, output=output)
    say_budget_capped(spec, session.plan.total_expert_bytes)
    return session


def say_budget_capped(spec: Spec, total_expert_bytes: int) -> None:
    """One warning when a budget in bytes is more than all expert bytes (the plan reads them
    all: the budget was likely meant for another family, or as a share)."""
    if spec.budget.kind == "bytes" and spec.budget.value > total_expert_bytes:
        log.warning("budget %s is more than all expert bytes (%s): reading everything",
                    human_bytes(spec.budget.value), human_bytes(total_expert_bytes))


def require_ray(ray: str | None) -> None:
    """With ``--ray``, fail first (one line saying how to install it) if Ray is missing."""
    if ray is not None:
        ray_merge.require_ray()
        ray_merge.check_reachable(ray or None)


def open_manifest(spec: Spec, explicit: str | os.PathLike[str] | None) -> ManifestWriter:
    """The run's manifest writer: ``explicit`` exactly (refused if it exists), else a new
    timestamped file beside the spec's ``manifest`` path, which points at it once the run
    completes. A run that fails or is interrupted removes its manifest (ManifestWriter.close)."""
    return ManifestWriter(explicit) if explicit else ManifestWriter.for_run(spec.manifest)


def merge(spec: Spec, outdir: str | os.PathLike[str], *, force: bool = False,
          manifest: str | os.PathLike[str] | None = None, ray: str | None = None,
          threads: int = 2, progress: bool = True, sidecars: bool = True,
          output: OutputOptions | None = None, lazy: bool | None = None) -> MergeResult:
    """Materialise the merge into ``outdir`` (new or empty; ``force`` replaces an earlier merge
    output as a whole; ``sidecars`` False: read exact blocks only, never delta sidecars).
    ``output``: the weight files' layout and the files beside them (default: mergekit-yaml's,
    the card showing the spec file's text); ``lazy``: which intermediate merges of a
    multi-document spec to skip (:func:`mergefs.engine.session.ensure_intermediates`).
    Everything is validated before the manifest or any output exists."""
    if output is None:
        output = OutputOptions(config_text=config_text(spec))
    require_ray(ray)
    out = Path(outdir)
    manifest_path = manifest or spec.manifest
    check_writes(spec.model_paths, outdir=out, index_dir=spec.index_dir, manifest=manifest_path)
    check_outside(out, spec=spec.source, manifest=manifest_path, index_dir=spec.index_dir,
                  cache_dir=spec.cache_dir)
    check_outdir(out, force)
    if ray is None and may_use_kernels(spec):  # numba loads while the family opens
        kernels.start_warm_up(full=False)
    family = prepare_family(spec, output=output, lazy=lazy)
    try:
        check_source_files(out, [family[0], *family[1]])
        writer = open_manifest(spec, manifest)
    except BaseException:
        close_family(family)
        raise
    try:
        session = open_session(spec, manifest=writer, family=family, ray=ray, progress=progress,
                               sidecars=sidecars, output=output)
        try:
            out_bytes = sum(f.size_bytes for f in session.engine.out_files)
            with byte_progress("merging", out_bytes, enabled=progress) as tick:
                if ray is not None:
                    ray_merge.materialise(session, out, ray or None, on_bytes=tick,
                                          overwrite=force)
                else:
                    session.engine.materialise(out, on_bytes=tick, threads=threads,
                                               overwrite=force)
            totals = session.finish()
        finally:
            session.close()
    finally:
        writer.close()
    assert writer.path is not None
    return MergeResult(out, Path(writer.path), totals)


@dataclass(frozen=True)
class IndexResult:
    index: BlockIndex
    built: bool  # False: reused
    experts: int
    published: list[Any]  # index sidecars written beside the experts (``publish``)


def index(spec: Spec, *, rebuild: bool = False, publish: bool = False, ray: str | None = None,
          progress: bool = True, exact: bool = False) -> IndexResult:
    """Build or reuse the block index; ``publish`` (asked for explicitly) also writes each
    expert's index sidecar beside it, into the source. ``rebuild`` and ``publish`` read every
    source (sidecars are never built from sidecars). ``exact``: also build the exact Gram
    cross terms the stored pieces lack (else they are estimated from sketches)."""
    require_ray(ray)
    family = prepare_family(spec)
    try:
        got, built = build_index(spec, family, ray=ray, progress=progress, rebuild=rebuild,
                                 sidecars=not (rebuild or publish), exact=exact)
        published = publish_index(family[0], family[1], got) if publish else []
    finally:
        close_family(family)
    return IndexResult(got, built, len(family[1]), published)


def _reached(spec: Spec) -> set[str]:
    """The pieces ``spec``'s merges assemble now: a multi-document spec's named merges too,
    from their outputs as they are (never made here: gc writes no model); a merge whose inputs
    are not made yet has no pieces to keep."""
    unmade = [out for _, _, out in spec.intermediates if not os.path.isdir(out)]
    reached: set[str] = set()
    for sub in [*(sub for _, sub, _ in spec.intermediates), spec]:
        try:
            family = open_family(sub)
        except MergefsError as exc:
            if not unmade:
                raise
            log.info("index gc: %s: skipped, its inputs are not merged yet (%s)", sub.source,
                     exc)
            continue
        try:
            reached |= reached_pieces(family[0], family[1], sub.block_size, sub.index_dir)
        finally:
            close_family(family)
    return reached


def index_gc(specs: Sequence[str], *, index_dir: str | None = None,
             max_size_bytes: int | None = None, keep_days: float = 30.0,
             dry_run: bool = False, strict: bool = False) -> Collected:
    """Collect an index directory (:mod:`mergefs.index.collect`): ``specs`` given, keep the
    pieces their families assemble now (touched or copied sources are hashed to find them;
    nothing is built) and remove the others; without, keep those used in the last
    ``keep_days``. Every spec must use the one index directory collected."""
    if not specs and index_dir is None:
        raise MergefsError("index gc: name the specs whose pieces to keep, or --index-dir DIR")
    reached: set[str] | None = None
    dirs: dict[str, str] = {}
    if specs:
        reached = set()
        for path in specs:
            spec = load(path, strict=strict, any_variant=True)
            dirs.setdefault(os.path.realpath(spec.index_dir), path)
            if index_dir is not None and os.path.realpath(spec.index_dir) != \
                    os.path.realpath(index_dir):
                raise MergefsError(f"{path}: its index_dir is {spec.index_dir}, not "
                                   f"--index-dir {index_dir}")
            reached |= _reached(spec)
        if len(dirs) > 1:
            raise MergefsError("index gc: the specs use different index directories ("
                               + ", ".join(f"{d} by {p}" for d, p in dirs.items())
                               + "); collect one at a time")
    target = index_dir if index_dir is not None else next(iter(dirs))
    if not os.path.isdir(target):  # a mistyped directory is not "0 B freed"
        raise MergefsError(f"index gc: {target}: no such index directory")
    return collect(target, reached=reached, keep_seconds=keep_days * 86400.0,
                   max_size_bytes=max_size_bytes, dry_run=dry_run)


def compress(spec: Spec, *, publish: bool = False, ray: str | None = None,
             progress: bool = True) -> list[Any]:
    """Write delta sidecars of every expert into mergefs's store under the spec's
    ``index_dir`` (nothing is written into a source), or, with ``publish``, beside each expert
    for others to use; returns where each was written."""
    require_ray(ray)
    family = prepare_family(spec)
    try:
        got, _ = build_index(spec, family, ray=ray, progress=progress, sidecars=False)
        if ray is not None:
            return ray_index.publish_deltas(spec, family[0], family[1], got, ray or None,
                                            publish=publish)
        return publish_deltas(family[0], family[1], got,
                              store=None if publish else spec.index_dir)
    finally:
        close_family(family)


def mount(args: argparse.Namespace, spec_path: str, *, strict: bool = False,
          budget: Budget | None = None, memory_bytes: int | None = None) -> int:
    """Mount a spec, or every variant of a sweep spec (``args``: the mount's options, as the
    CLI's ``mount`` command takes them; ``memory_bytes``: ``--memory``)."""
    require_mount_extra()  # first: one line saying how to install pyfuse3 and trio
    if not is_sweep(read_doc(spec_path)):
        spec = load(spec_path, strict=strict, budget=budget)
        if memory_bytes is not None:
            spec = spec.with_memory(memory_bytes)
        if spec.budget.kind == "bytes":  # is it more than all expert bytes? (the index knows)
            check_mountpoint(args.mountpoint)  # first: no index built for a mount that fails
            opened = ensure_index(spec)  # built here if missing; the mount then reuses it
            try:
                say_budget_capped(spec, int(opened.index.expert_block_bytes().sum()))
            finally:
                opened.close()
        return run_mount(args, spec)
    if budget is not None:
        raise MergefsError("--budget: a sweep spec sets its budgets (sweep: budget: [...]); "
                           "mount it without --budget")
    found: Sequence[tuple[Variant, Spec]] = load_variants(os.path.abspath(spec_path),
                                                          strict=strict)
    if memory_bytes is not None:
        found = [(v, s.with_memory(memory_bytes)) for v, s in found]
    check_writes(found[0][1].model_paths, index_dir=found[0][1].index_dir)
    return run_mount(args, found[0][1], variants=found)


def replay(manifest: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
           force: bool = False) -> ReplayResult:
    """Re-execute a manifest and verify every byte; raises on any difference."""
    refuse_spec(Path(manifest))
    return replay_manifest(Path(manifest), Path(out) if out is not None else None,
                           overwrite=force)


#: a spec is small; a larger file that is not a manifest is left to the manifest reader
_SPEC_BYTES_MAX = 1 << 20


def refuse_spec(path: Path) -> None:
    """A merge spec given where a manifest belongs: say so, and name the manifest its runs
    write (the spec's ``manifest`` key, default ``<spec stem>.manifest.jsonl`` beside it)."""
    try:
        if path.stat().st_size > _SPEC_BYTES_MAX:
            return
        with open(path, "rb") as f:
            first = f.readline()
    except OSError:
        return  # the manifest reader names the file and the reason
    try:
        json.loads(first)
        return  # a JSON first line: a manifest (or a broken one, for the manifest reader)
    except ValueError:
        pass
    try:
        docs = read_spec_docs(path)
    except MergefsError:
        return
    doc = next((d for d in docs if isinstance(d, dict)), None)
    if doc is None or not any(k in doc for k in ("merge_method", "base_model", "models",
                                                  "slices", "modules")):
        return
    given = doc.get("manifest")
    where = path.parent / (given if isinstance(given, str) and given
                           else f"{path.stem}.manifest.jsonl")
    state = "" if where.exists() or where.is_symlink() else \
        " (none there yet: merge or mount the spec first)"
    raise ManifestError(f"{path}: is a merge spec, not a manifest; replay the manifest its "
                        f"merge or mount wrote: {where}{state}")
