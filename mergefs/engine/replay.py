"""Replay: re-execute exactly the plan a manifest recorded and verify every byte.

No re-planning and no index: the block layout comes from the base's headers and the recorded block
size, the plan from the recorded selection. Every source range is re-read and its xxh3 compared
with the recorded one (a changed source fails naming it, before anything is written under its
final name), and every output unit (and, with ``--out``, every tensor) must reproduce its hash.
Tensors are cut into the merge units the manifest recorded (a mount's single blocks, or the
writer's ``materialise`` units), so the recorded reads recur; ``--out`` needs every merged tensor
recorded in full (a mount's manifest holds only what was read: replay it without ``--out``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mergefs.sources.local import Checkpoint
from mergefs.engine.layout import OutputOptions
from mergefs.engine.merger import Engine
from mergefs.recipe.family import expert_labels
from mergefs.engine.session import prepare_family
from mergefs.core.errors import ManifestError, SourceChanged
from mergefs.index.blocks import BlockIndex
from mergefs.index.layout import build_layout
from mergefs.engine.manifest import (
    SWEEP_SCHEMA_VERSION, ManifestContents, manifest_schema, read_manifest, read_sweep_manifest,
)
from mergefs.engine.output import check_writes
from mergefs.plan.planner import Plan, selected_from_runs
from mergefs.spec.load import parse_spec
from mergefs.deltas.codes import DeltaError
from mergefs.deltas.sidecar import open_beside, open_sidecar
from mergefs.plan.levels import levels_from_runs

log = logging.getLogger(__name__)


class _Checker:
    """Stands in for a ManifestWriter: compares each record the engine produces to the manifest."""

    def __init__(self, reads: list[dict[str, Any]], outputs: list[dict[str, Any]],
                 tensors: list[dict[str, Any]], sources: dict[str, Checkpoint]) -> None:
        self.reads = {(r["source"], r["file"], r["start"], r["end"]): r["xxh3"] for r in reads}
        self.outputs = {(o["tensor"], o["b0"], o["b1"]): o["xxh3"] for o in outputs}
        self.tensors = {t["name"]: t["xxh3"] for t in tensors}
        self.sources = sources
        self.checked_reads = 0
        self.checked_read_bytes = 0
        self.checked_outputs = 0
        self.checked_output_tensors: set[str] = set()
        self.checked_tensors = 0

    def write(self, rec: dict[str, Any]) -> None:
        kind = rec["type"]
        if kind == "read":
            key = (rec["source"], rec["file"], rec["start"], rec["end"])
            want = self.reads.get(key)
            if want is None and rec["start"] == rec["end"]:
                return  # an empty range has nothing to verify (mounts do not record them)
            if want is None:
                raise ManifestError(f"replay read {key} that the manifest does not record")
            if want != rec["xxh3"]:
                src = self.sources.get(rec["source"])
                path = src.path_of(rec["file"]) if src is not None else rec["source"]
                raise SourceChanged(
                    f"{path}: changed since the manifest was written: bytes [{rec['start']}, "
                    f"{rec['end']}) ({rec['tensor']}) differ")
            self.checked_reads += 1
            self.checked_read_bytes += rec["end"] - rec["start"]
        elif kind == "output":
            want = self.outputs.get((rec["tensor"], rec["b0"], rec["b1"]))
            if want is not None:
                if want != rec["xxh3"]:
                    raise ManifestError(f"output of {rec['tensor']} blocks [{rec['b0']}, "
                                        f"{rec['b1']}) does not reproduce its recorded hash")
                self.checked_outputs += 1
                self.checked_output_tensors.add(rec["tensor"])
        elif kind == "tensor":
            want = self.tensors.get(rec["name"])
            if want is not None:
                if want != rec["xxh3"]:
                    raise ManifestError(f"tensor {rec['name']} does not reproduce its hash")
                self.checked_tensors += 1


class _ReplayEngine(Engine):
    """An engine that cuts each tensor into the merge units the manifest recorded.

    Units depend on who merged (a mount merges single blocks, ``materialise`` runs of about
    ``UNIT_ELEMS`` elements, which may differ between versions), and recorded reads and outputs
    are per unit: only the recorded split reproduces them.
    """

    def __init__(self, *args: Any, recorded_units: dict[str, list[tuple[int, int]]],
                 recorded_files: dict[str, bytes] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded_units = recorded_units
        self.recorded_files = recorded_files or {}

    def units(self, name: str, unit_elems: int = 0) -> list[tuple[int, int]]:
        return self.recorded_units.get(name) or super().units(name, unit_elems)

    def card_files(self, name: str) -> dict[str, bytes]:
        """The model card as the run wrote it (its figures come from the index, which replay
        does not read; its name from the run's output directory)."""
        return dict(self.recorded_files)


# field -> type, per record kind (bool is refused where an int is expected)
_FIELDS: dict[str, dict[str, type]] = {
    "header": {"spec": dict, "sources": dict, "selected": list, "index_key": str,
               "plan_hash": str, "budget_bytes": int},
    "read": {"source": str, "file": str, "tensor": str, "start": int, "end": int, "xxh3": str},
    "output": {"tensor": str, "b0": int, "b1": int, "xxh3": str},
    "tensor": {"name": str, "xxh3": str},
}


def _check_fields(path: str | Path, kind: str, rec: dict[str, Any]) -> None:
    for key, typ in _FIELDS[kind].items():
        value = rec.get(key)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ManifestError(f"{path}: a {kind!r} record has no valid {key!r} "
                                f"(expected {typ.__name__})")


def _check_runs(path: str | Path, runs: Any, n_blocks: int) -> None:
    """``selected``: per expert, a list of block runs ``[b0, b1)`` within the layout."""
    for expert_runs in runs:
        if not isinstance(expert_runs, list):
            raise ManifestError(f"{path}: 'selected' must list block runs per expert")
        for run in expert_runs:
            if not (isinstance(run, list) and len(run) == 2
                    and all(isinstance(b, int) and not isinstance(b, bool) for b in run)
                    and 0 <= run[0] <= run[1] <= n_blocks):
                raise ManifestError(f"{path}: 'selected' holds {run!r}, not a block run "
                                    f"within [0, {n_blocks}]")


def _recorded_units(path: str | Path, engine: Engine, outputs: list[dict[str, Any]]
                    ) -> dict[str, list[tuple[int, int]]]:
    """The distinct recorded units of each tensor, in block order (each checked to be a run of
    that tensor's blocks)."""
    units: dict[str, set[tuple[int, int]]] = {}
    for o in outputs:
        if o["tensor"] in engine.derived and (o["b0"], o["b1"]) == (0, 0):
            units.setdefault(o["tensor"], set()).add((0, 0))  # a vocabulary tensor: one unit
            continue
        t = engine.tindex.get(o["tensor"])
        if t is None:
            raise ManifestError(f"{path}: output of {o['tensor']!r}, which is not a merged "
                                "tensor of the base")
        blocks = engine.layout.blocks_of(t)
        if not blocks.start <= o["b0"] < o["b1"] <= blocks.stop:
            raise ManifestError(f"{path}: output of {o['tensor']!r} names blocks "
                                f"[{o['b0']}, {o['b1']}), outside the tensor's "
                                f"[{blocks.start}, {blocks.stop})")
        units.setdefault(o["tensor"], set()).add((o["b0"], o["b1"]))
    return {name: sorted(u) for name, u in units.items()}


def _check_tiling(path: str | Path, engine: Engine,
                  units: dict[str, list[tuple[int, int]]]) -> None:
    """With --out every tensor is written, so every merged tensor's recorded units must cover
    it exactly once (a mount's manifest records only the units that were read)."""
    for name, t in engine.tindex.items():
        out = engine.out_tensors[name]
        if out.end == out.start:
            continue  # nothing to write; a mount records nothing for it
        blocks = engine.layout.blocks_of(t)
        pos = blocks.start
        for b0, b1 in units.get(name, []):
            if b0 != pos:
                break
            pos = b1
        if pos != blocks.stop:
            raise ManifestError(f"{path}: the manifest records only part of the merge "
                                f"({name!r} is not fully recorded, as when a mount read only "
                                "some tensors); replay it without --out to verify what it "
                                "records")


@dataclass(frozen=True)
class ReplayResult:
    """What a replay checked: source ranges re-read (and their bytes), merged units (outputs)
    reproduced and the tensors they belong to, and whole tensors reproduced (only with
    ``out``: a merge's manifest records them, a mount's does not)."""

    reads_verified: int
    outputs_verified: int
    tensors_verified: int
    torn_lines: int
    plan_hash: str
    #: a sweep manifest: each verified variant's result (the fields above are their sums)
    variants: tuple[tuple[str, ReplayResult], ...] = ()
    #: a sweep manifest: variants from which nothing was read (nothing to verify)
    unread_variants: tuple[str, ...] = ()
    bytes_verified: int = 0  # the source bytes of the ranges re-read
    output_tensors: int = 0  # how many tensors the reproduced units belong to


def replay(manifest_path: str | Path, out: str | Path | None = None,
           overwrite: bool = False) -> ReplayResult:
    """Verify a manifest: a merge's or mount's (schema 1), or a sweep mount's (schema 2: every
    variant from which something was read, each under its own recorded spec and plan)."""
    if manifest_schema(manifest_path) == SWEEP_SCHEMA_VERSION:
        if out is not None:
            raise ManifestError(f"{manifest_path}: a sweep manifest records several variants; "
                                "--out writes one merge (merge a variant with `mergefs merge "
                                "--variant NAME`)")
        return _replay_sweep(manifest_path)
    return _replay(manifest_path, read_manifest(manifest_path), out, overwrite)


def _replay_sweep(manifest_path: str | Path) -> ReplayResult:
    sweep = read_sweep_manifest(manifest_path)
    if sweep.totals is None:
        raise ManifestError(f"{manifest_path}: has no sweep totals record: the mount that wrote "
                            "it was interrupted (or is still serving); nothing to verify as a "
                            "whole")
    # a unit one variant served from another's merge was read under the other's records:
    # source ranges are facts about the sources, so every variant checks against all of them
    reads = [r for c in sweep.variants.values() for r in c.reads]
    seen: dict[tuple[Any, ...], str] = {}
    for rec in reads:
        _check_fields(manifest_path, "read", rec)
        key = (rec["source"], rec["file"], rec["start"], rec["end"])
        if seen.setdefault(key, rec["xxh3"]) != rec["xxh3"]:  # one range, two contents
            raise ManifestError(f"{manifest_path}: the read {key} is recorded twice with "
                                "different hashes (the manifest was altered or corrupted)")
    listed = sweep.totals.get("variants")
    if isinstance(listed, list) and sorted(listed) != sorted(sweep.variants):
        missing = sorted(set(listed) - set(sweep.variants))
        raise ManifestError(f"{manifest_path}: the totals list variants the manifest has no "
                            f"records of: {', '.join(missing) or '(none)'}; extra: "
                            f"{', '.join(sorted(set(sweep.variants) - set(listed))) or '(none)'}")
    done: list[tuple[str, ReplayResult]] = []
    unread: list[str] = []
    for name, contents in sorted(sweep.variants.items()):
        if not contents.outputs:
            unread.append(name)
            continue
        try:
            res = _replay(manifest_path, contents, None, False, reads=reads)
        except (ManifestError, SourceChanged) as exc:
            raise type(exc)(f"variant {name}: {exc}") from None
        done.append((name, res))
    if not done:
        raise ManifestError(f"{manifest_path}: no variant of the sweep was read; nothing to "
                            "verify")
    return ReplayResult(sum(r.reads_verified for _, r in done),
                        sum(r.outputs_verified for _, r in done),
                        sum(r.tensors_verified for _, r in done), sweep.torn_lines,
                        str(sweep.header.get("index_key", "")), tuple(done), tuple(unread),
                        sum(r.bytes_verified for _, r in done),
                        sum(r.output_tensors for _, r in done))


def _replay(manifest_path: str | Path, contents: ManifestContents, out: str | Path | None,
            overwrite: bool, reads: list[dict[str, Any]] | None = None) -> ReplayResult:
    h = contents.header
    _check_fields(manifest_path, "header", h)
    for kind, records in (("read", contents.reads), ("output", contents.outputs),
                          ("tensor", contents.tensors)):
        for rec in records:
            _check_fields(manifest_path, kind, rec)
    if contents.totals is None:
        raise ManifestError(f"{manifest_path}: has no totals record: the run that wrote it was "
                            "interrupted or failed (or its mount is still serving), so its merge "
                            "is incomplete; nothing to verify as a whole")
    if not contents.outputs:
        raise ManifestError(f"{manifest_path}: records no merged output (the run merged "
                            "nothing, e.g. a mount from which no weights were read); nothing to "
                            "verify")
    spec = parse_spec(dict(h["spec"]), base_dir=Path(manifest_path).resolve().parent,
                      source=f"{manifest_path} (recorded spec)")
    if out is not None:
        check_writes(spec.model_paths, outdir=out)
    base, experts = prepare_family(spec)
    try:
        recorded = h["sources"]
        labels = expert_labels([e.path for e in spec.experts])
        labelled = {"base": base, **dict(zip(labels, experts))}
        for label, c in labelled.items():
            now_files = [c.identities[f].to_json() for f in c.files]
            was = recorded.get(label)
            was_files = was.get("files") if isinstance(was, dict) else None
            if not isinstance(was_files, list) or len(was_files) != len(now_files):
                raise SourceChanged(f"{c.root}: its weight files differ from those the "
                                    "manifest recorded")
            for f_now, f_was in zip(now_files, was_files):
                if not isinstance(f_was, dict) or (f_now["size_bytes"], f_now["header_xxh3"]) \
                        != (f_was.get("size_bytes"), f_was.get("header_xxh3")):
                    raise SourceChanged(f"{f_now['path']}: changed since the manifest was "
                                        "written (size or header differ)")
        layout = build_layout(base, spec.block_size)
        n = len(experts)
        _check_runs(manifest_path, h["selected"], layout.n_blocks)
        selected = selected_from_runs(h["selected"], layout.n_blocks)
        if selected.shape[0] != n:
            raise ManifestError(f"{manifest_path}: plan lists {selected.shape[0]} experts, "
                                f"spec has {n}")
        index = BlockIndex(h["index_key"], layout, np.zeros(layout.n_blocks, np.uint64),
                           np.zeros((n, layout.n_blocks), np.uint64),
                           np.zeros((n, layout.n_blocks)), np.zeros((n, layout.n_blocks), bool),
                           np.zeros((layout.n_blocks, n, n)))
        levels, sidecars = _recorded_levels(manifest_path, h, labels, layout.n_blocks,
                                            experts)
        plan = Plan(selected, h["budget_bytes"], 0, 0, 0, int(selected.sum()), selected.size, 0,
                    None, None, None, None, h["plan_hash"], levels=levels)
        checker = _Checker(contents.reads if reads is None else reads, contents.outputs,
                           contents.tensors, labelled)
        engine = _ReplayEngine(spec, base, experts, index, plan,
                               manifest=checker,  # type: ignore[arg-type]
                               verify_index=False, recorded_units={}, deltas=sidecars,
                               output=_recorded_output(manifest_path, h),
                               recorded_files=_recorded_files(manifest_path, contents.files))
        units = engine.recorded_units = _recorded_units(manifest_path, engine, contents.outputs)
        if out is not None:
            _check_tiling(manifest_path, engine, units)
            engine.materialise(out, overwrite=overwrite)
        else:
            for name, name_units in units.items():  # each distinct unit once
                for b0, b1 in name_units:
                    engine.merge_unit(name, b0, b1)
        if checker.checked_outputs < len(checker.outputs):
            raise ManifestError(f"{manifest_path}: only {checker.checked_outputs} of "
                                f"{len(checker.outputs)} recorded outputs were reproduced")
        if contents.torn_lines:
            log.warning("%s: ignored %d torn line(s) (an interrupted write)", manifest_path,
                        contents.torn_lines)
        return ReplayResult(checker.checked_reads, checker.checked_outputs,
                            checker.checked_tensors, contents.torn_lines, h["plan_hash"],
                            bytes_verified=checker.checked_read_bytes,
                            output_tensors=len(checker.checked_output_tensors))
    finally:
        for c in [base, *experts]:
            c.close()


def _recorded_output(path: str | Path, h: dict[str, Any]) -> OutputOptions:
    """The output options the run recorded (absent: as mergefs wrote outputs before)."""
    doc = h.get("output")
    if doc is not None and not isinstance(doc, dict):
        raise ManifestError(f"{path}: header 'output' is not a JSON object")
    try:
        return OutputOptions.from_json(doc)
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"{path}: header 'output': {exc}") from None


def _recorded_files(path: str | Path, records: list[dict[str, Any]]) -> dict[str, bytes]:
    """The generated files (model card) the run recorded, checked against their hashes."""
    out: dict[str, bytes] = {}
    for rec in records:
        rel, text = rec.get("path"), rec.get("text")
        if not isinstance(rel, str) or not isinstance(text, str) or "/" in rel \
                or xxhash.xxh3_64_hexdigest(text.encode()) != rec.get("xxh3"):
            raise ManifestError(f"{path}: a 'file' record is invalid ({rel!r})")
        out[rel] = text.encode()
    return out


def _recorded_levels(path: str | Path, h: dict[str, Any], labels: list[str], n_blocks: int,
                     experts: Sequence[Checkpoint]) -> tuple[np.ndarray | None, dict[int, Any]]:
    """The delta sidecar levels a plan read (issue 14) and the sidecars, opened by their
    recorded paths (a URL: beside the remote expert, by ranges); every range read is then
    checked against its recorded xxh3."""
    if "levels" not in h:
        return None, {}

    def one(i: int, where: str) -> Any:
        if "://" not in where:
            return open_sidecar(Path(where))
        e = experts[i]
        got = e.aux_reader(where.rsplit("/", 1)[-1])
        if got is None or got.where != where:
            raise DeltaError(f"{where}: not found beside {e.root}")
        return open_beside(got)

    try:
        levels = levels_from_runs(h["levels"], n_blocks)
        where = {labels.index(lab): str(p) for lab, p in dict(h["sidecars"]).items()}
        return levels, {i: one(i, p) for i, p in where.items()}
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ManifestError(f"{path}: invalid 'levels' or 'sidecars': {exc}") from None
    except (DeltaError, OSError) as exc:
        raise SourceChanged(f"{path}: a delta sidecar the plan read cannot be opened: {exc}"
                            ) from None

