"""The models a mount serves, opened together: one family, one index, one source read path.

A mount serves *variants*: every variant of a sweep spec (``sweep:`` or ``variants:``), each in
a directory of its name, or the one model of a plain spec, served at the mount's root (a sweep
of one variant named ``""``, :data:`ROOT`). :class:`MountSession` opens the base and experts
once, loads (or builds) the block index once, and opens each variant as an ordinary
:class:`~mergefs.engine.session.Session` over those shared sources with its own plan and
engine, so each variant's bytes are exactly those of ``mergefs merge`` of that variant alone.

Two things differ by kind, and only these (:meth:`MountSession._open`):

- *recording*. A plain spec's session writes the mount's manifest itself: a plain merge
  manifest (header, reads, outputs, totals) that ``mergefs replay`` verifies as it verifies a
  ``mergefs merge``. A sweep's manifest (schema 2, docs/manifest.md) is one file for the whole
  mount: a ``sweep`` header, then each variant's records tagged with ``"variant"`` by its
  :class:`VariantRecorder` (its own header with the variant's full resolved spec and plan,
  reads, outputs, totals), then the sweep's totals. A unit served to a variant from another
  variant's merge is recorded for that variant as an output with ``"shared": true``; replay
  re-merges it under the variant's own plan and checks the hash.
- *unit keys*. A plain spec's units are keyed by their place in its one plan (tensor and block
  run: :class:`~mergefs.mount.files.Segment`), its disk cache by the plan hash. A sweep's
  variants share one unit cache keyed by *content* (:func:`unit_key_of`): the family's index
  key, the variant's resolved spec without its budget (method, coefficients, dtype, ...), the
  unit's tensor and block run, and which blocks of the unit the plan reads from each expert
  (and at which sidecar level). Two variants whose units agree on all of that produce the same
  bytes, so a unit is merged once for all of them (e.g. variants that differ only in budget,
  for the units where their plans read the same blocks). Units whose coefficients differ are
  never shared, even where no expert block is read: the output then still depends on the
  coefficients in general. A sweep also installs one
  :class:`~mergefs.sources.blockcache.SourceBlockCache` as the ``range_cache`` of every local
  safetensors source, cut at the index's block boundaries: a source block read for one variant
  is served from memory to every other variant while it stays cached. (A plain spec has no
  other variant to share with: no content keys, no source cache.)

Everything here blocks (opening sources, planning, merging): main or worker threads, never the
trio thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mergefs.core.errors import MergefsError, SpecError
from mergefs.core.format import DTYPES
from mergefs.core.version import __version__
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.layout import OutputOptions
from mergefs.engine.session import Session, prepare_family
from mergefs.index.blocks import BlockIndex, load_or_build
from mergefs.recipe.family import expert_labels
from mergefs.sources.base import ReadRange
from mergefs.sources.blockcache import SourceBlockCache
from mergefs.sources.local import Checkpoint
from mergefs.spec.model import Spec
from mergefs.spec.variants import Variant, load_variants

log = logging.getLogger(__name__)

SWEEP_SCHEMA = 2
ROOT = ""  # the name of a plain spec's one variant: served at the mount's root

PASSTHROUGH_CHUNK = 1 << 20  # pass-through tensors are hashed and verified in chunks this big

KeyFn = Callable[[str, int, int], str]  # (tensor, b0, b1) -> a merge unit's cache key


def passthrough_hashes(session: Session) -> dict[str, list[int]]:
    """Chunk hashes of the tensors a variant passes through from the base: they have no index
    hashes, so they are hashed when the variant opens, and bytes changed later fail their read
    instead of being served beside units merged from the old bytes (usually a few small
    integer buffers)."""
    engine, base = session.engine, session.base
    out = {}
    for t in engine.out_tensors.values():
        if t.layout_index is None and t.end > t.start and \
                engine.unit_of.get(t.name, t.name) not in engine.derived:
            loc = base.tensors[t.name]
            out[t.name] = [xxhash.xxh3_64_intdigest(base.read_ranges([ReadRange(
                loc.file, loc.start + c0, min(loc.end, loc.start + c0 + PASSTHROUGH_CHUNK))])[0])
                for c0 in range(0, loc.size_bytes, PASSTHROUGH_CHUNK)]
    return out


def unit_key_of(session: Session) -> KeyFn:
    """The content key function of a sweep variant's merge units (see the module docstring)."""
    raw = {k: v for k, v in session.spec.raw.items() if k != "budget"}
    digest = xxhash.xxh3_128_hexdigest(json.dumps(
        {"raw": raw, "index": session.index.key, "mergefs": __version__}, sort_keys=True,
        default=str).encode())
    selected = session.plan.selected
    levels = session.plan.levels

    def key_of(tensor: str, b0: int, b1: int) -> str:
        h = xxhash.xxh3_128()
        h.update(np.ascontiguousarray(selected[:, b0:b1]).tobytes())
        if levels is not None:
            h.update(np.ascontiguousarray(levels[:, b0:b1]).tobytes())
        return f"unit\x00{digest}\x00{tensor}\x00{b0}\x00{b1}\x00{h.hexdigest()}"

    return key_of


class VariantRecorder:
    """The manifest writer a sweep variant's session writes to: tags every record with the
    variant, adds its settings to its header, counts the source bytes its merges asked for, and
    notes which units are recorded for it. Records are held back until :meth:`publish` (a
    reload publishes new variants only once every one of them opened)."""

    def __init__(self, name: str, settings: dict[str, Any], writer: ManifestWriter,
                 merged_here: set[str] | None = None) -> None:
        self.name = name
        #: keys of the units some variant's engine merged in this mount (shared by all of a
        #: sweep's recorders): only those are recorded as shared; a unit from the on-disk
        #: cache of an earlier mount was neither read nor merged here, and is not recorded
        #: (as a plain mount does not record it), so the manifest stays replayable
        self.merged_here = merged_here if merged_here is not None else set()
        self.units_from_disk = 0
        self.settings = settings
        self.writer = writer
        self.path = writer.path
        self.key_of: KeyFn | None = None
        self.requested: dict[str, int] = {}
        self.recorded: set[str] = set()
        self.units_shared = 0
        self._lock = threading.Lock()
        self._held: list[dict[str, Any]] | None = []

    def write(self, record: dict[str, Any]) -> None:
        rec = {**record, "variant": self.name}
        kind = rec.get("type")
        if kind == "header":
            rec["settings"] = self.settings
        with self._lock:
            if kind == "read":
                src = rec["source"]
                self.requested[src] = self.requested.get(src, 0) + rec["end"] - rec["start"]
            elif kind == "output" and self.key_of is not None:
                key = self.key_of(rec["tensor"], rec["b0"], rec["b1"])
                self.recorded.add(key)
                self.merged_here.add(key)
            if self._held is not None:
                self._held.append(rec)
                return
        self.writer.write(rec)

    def publish(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
        for rec in held:
            self.writer.write(rec)

    def note_served(self, key: str, tensor: str, b0: int, b1: int, start: int, end: int,
                    data: bytes) -> None:
        """A unit was served to this variant: record it as shared if another variant's merge
        produced it (this variant's own merges record themselves)."""
        if key in self.recorded:
            return
        with self._lock:
            if key in self.recorded:
                return
            self.recorded.add(key)
            if key not in self.merged_here:
                self.units_from_disk += 1
                return
            self.units_shared += 1
        self.write({"type": "output", "tensor": tensor, "b0": b0, "b1": b1, "start": start,
                    "end": end, "xxh3": xxhash.xxh3_64_hexdigest(data), "shared": True})

    def close(self) -> None:
        """The session's finish closes its manifest: the shared writer stays open."""


@dataclass
class VariantState:
    """One variant a mount serves. ``passthrough``: :func:`passthrough_hashes`. ``recorder``
    and ``key_of`` are a sweep variant's (None for a plain spec's: its session records itself,
    its units have positional keys)."""

    name: str
    settings: dict[str, Any]
    spec: Spec
    session: Session
    passthrough: dict[str, list[int]]
    recorder: VariantRecorder | None = None
    key_of: KeyFn | None = None
    removed: bool = False  # gone from the spec file at a reload; served until unmounted
    added_unix: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        plan = self.session.plan
        return {"name": self.name, "settings": self.settings, "spec": dict(self.spec.raw),
                "method": self.spec.method, "plan_hash": plan.plan_hash,
                "budget_bytes": plan.budget_bytes, "planned_expert_bytes": plan.planned_bytes,
                "total_expert_bytes": plan.total_expert_bytes, "bound_tight": plan.bound_tight,
                "bound_output_tight": plan.bound_output_tight,
                "error_exact": plan.error_exact, "update_norm": plan.update_norm,
                "removed": self.removed}


def _block_bounds(index: BlockIndex, src: Checkpoint) -> dict[str, np.ndarray]:
    """Per file of ``src``: the absolute byte offsets of every block boundary of the layout."""
    lay = index.layout
    out: dict[str, list[np.ndarray]] = {}
    for t, name in enumerate(lay.tensors):
        loc = src.tensors.get(name)
        if loc is None:
            continue
        blocks = lay.blocks_of(t)
        item = DTYPES[loc.dtype][0]
        starts = loc.start + lay.elem_start[blocks.start:blocks.stop].astype(np.int64) * item
        out.setdefault(loc.file, []).append(np.append(starts, loc.end))
    return {f: np.concatenate(parts) for f, parts in out.items()}


class MountSession:
    """Every variant a mount serves, over one shared family and index (see the module doc)."""

    def __init__(self, spec_path: str | Path, found: Sequence[tuple[Variant, Spec]],
                 manifest: ManifestWriter | None, *, sweep: bool, source_cache_bytes: int = 0,
                 strict: bool = False,
                 family: tuple[Checkpoint, list[Checkpoint]] | None = None,
                 index: BlockIndex | None = None, output: OutputOptions | None = None) -> None:
        """``found``: the variants (a plain spec: one, named :data:`ROOT`). ``sweep``: record
        and key them as a sweep's. ``manifest``: where records go (None: nowhere, a plain spec
        only). ``source_cache_bytes``: a sweep's shared source-block cache (0: none; a
        plain spec has none). ``family`` and ``index``: the first variant's, if the caller opened them already (the
        mount's ``ensure_index``; the session then owns and closes them). ``output``: the
        files every variant serves (default: as ``mergefs merge`` writes them)."""
        self.output = output
        found = list(found)
        if not found or (not sweep and [v.name for v, _ in found] != [ROOT]):
            if family is not None:
                for c in [family[0], *family[1]]:
                    c.close()
            raise MergefsError(f"{spec_path}: no variants" if not found else
                               f"{spec_path}: a plain mount serves one model at its root")
        first = found[0][1]
        self._attach(spec_path, first, manifest,
                     family if family is not None else prepare_family(first),
                     sweep=sweep, strict=strict)
        try:
            self.index = index if index is not None else load_or_build(
                self.base, self.experts, self.first.block_size, self.first.index_dir,
                max_size_bytes=self.first.index_max_size_bytes)[0]
            if sweep:
                self._write(self._header())
            for v, spec in found:
                self.publish(self._open(v, spec))
            if sweep:  # after the opening reads (pass-through hashes): they are not kept
                self.source_cache = self._install_cache(source_cache_bytes)
            for c in [self.base, *self.experts]:  # count serving reads only, not indexing,
                c.counters.reset()  # looking for delta sidecars or hashing pass-through tensors
        except BaseException:
            self.close()
            raise

    @classmethod
    def of(cls, session: Session) -> MountSession:
        """A plain mount's session over a :class:`Session` the caller opened and keeps (and
        finishes and closes): a view without a mount, for tests and tools."""
        self = cls.__new__(cls)
        self._attach(session.spec.source, session.spec, session.manifest,
                     (session.base, session.experts), sweep=False, strict=False)
        self.index = session.index
        self.output = session.engine.output
        self.variants[ROOT] = VariantState(ROOT, {}, session.spec, session,
                                           passthrough_hashes(session))
        for c in [self.base, *self.experts]:  # as a mount: serving reads from here on
            c.counters.reset()
        return self

    def _attach(self, spec_path: str | Path, first: Spec, manifest: ManifestWriter | None,
                family: tuple[Checkpoint, list[Checkpoint]], *, sweep: bool, strict: bool
                ) -> None:
        """The state both constructors set before opening variants."""
        self.spec_path = Path(spec_path)
        self.sweep = sweep
        self.strict = strict
        self.started = time.monotonic()
        self._lock = threading.Lock()  # serialises reloads
        self._merged_here: set[str] = set()  # unit keys merged in this mount (VariantRecorder)
        self.variants: dict[str, VariantState] = {}
        self.first = first
        self.manifest = manifest
        self.source_cache: SourceBlockCache | None = None
        self.base, self.experts = family
        self.labels = expert_labels([e.path for e in first.experts])

    # -- opening ---------------------------------------------------------------------------
    def _install_cache(self, capacity_bytes: int) -> SourceBlockCache | None:
        if capacity_bytes <= 0:
            return None
        cache = SourceBlockCache(capacity_bytes)
        for c in [self.base, *self.experts]:
            if type(c) is not Checkpoint:  # remote, LoRA: read as before (not shared yet)
                log.info("%s: not a local safetensors source: its reads are not shared",
                         c.name)
                continue
            for f, offsets in _block_bounds(self.index, c).items():
                cache.add_boundaries(c.name, f, offsets)
            c.range_cache = cache
        return cache

    def _header(self) -> dict[str, Any]:
        return {"type": "header", "schema": SWEEP_SCHEMA, "kind": "sweep",
                "mergefs_version": __version__, "spec_file": str(self.spec_path),
                "sources": {"base": self.base.identity_json(),
                            **{lab: e.identity_json()
                               for lab, e in zip(self.labels, self.experts)}},
                "index_key": self.index.key, "created_unix": time.time()}

    def _write(self, record: dict[str, Any]) -> None:
        if self.manifest is not None:
            self.manifest.write(record)

    def _open(self, v: Variant, spec: Spec) -> VariantState:
        """Open one variant: a sweep's records through its recorder, with content keys; a plain
        spec's session writes the manifest itself."""
        recorder = None
        if self.sweep:
            if self.manifest is None:
                raise MergefsError(f"{self.spec_path}: a sweep mount needs a manifest")
            recorder = VariantRecorder(v.name, dict(v.settings), self.manifest,
                                       self._merged_here)
        session = Session(spec, manifest=recorder or self.manifest,  # type: ignore[arg-type]
                          family=(self.base, self.experts), index=self.index,
                          output=self.output)
        state = VariantState(v.name, dict(v.settings), spec, session,
                             passthrough_hashes(session), recorder)
        if recorder is not None:
            state.key_of = recorder.key_of = unit_key_of(session)
        self.variants[v.name] = state
        return state

    @staticmethod
    def publish(state: VariantState) -> None:
        """Write a variant's records held since it opened (a sweep's; a plain spec's session
        writes its own as they come)."""
        if state.recorder is not None:
            state.recorder.publish()

    def reload(self) -> tuple[list[VariantState], list[str]]:
        """Re-read a sweep's spec file: open its new variants (returned, not yet published: the
        caller publishes them with :meth:`publish` once they are served) and mark the variants
        it no longer lists as removed. All or nothing: an invalid spec, or a variant whose
        resolved spec changed under the same name, raises SpecError and changes nothing."""
        if not self.sweep:
            raise MergefsError(f"{self.spec_path}: not a sweep mount: nothing to reload")
        with self._lock:
            found = load_variants(self.spec_path, self.strict)
            first = found[0][1]
            if (first.base, [e.path for e in first.experts], first.block_size) != \
                    (self.first.base, [e.path for e in self.first.experts],
                     self.first.block_size):
                raise SpecError(f"{self.spec_path}: the base, experts or block size changed; a "
                                "mounted sweep serves one family (unmount and mount again)")
            new = [(v, s) for v, s in found if v.name not in self.variants]
            for v, s in found:
                old = self.variants.get(v.name)
                if old is not None and dict(old.spec.raw) != dict(s.raw):
                    raise SpecError(f"{self.spec_path}: variant {v.name} changed (its files are "
                                    "being served as they are); give the changed variant a new "
                                    "name")
            names = {v.name for v, _ in found}
            opened: list[VariantState] = []
            try:
                for v, s in new:
                    opened.append(self._open(v, s))
            except BaseException:
                for st in opened:
                    del self.variants[st.name]
                    for sc in st.session.deltas.values():
                        sc.close()
                raise
            removed = [n for n, st in self.variants.items() if n not in names and not st.removed]
            for n, st in self.variants.items():
                st.removed = n not in names  # listed again: no longer flagged
            return opened, removed

    @property
    def cache_namespace(self) -> str:
        """Where the unit cache's disk tier keeps this mount's units: a plain spec's, keyed by
        position in its plan, under its plan hash; a sweep's, keyed by content, under one name
        for the family's index (valid for any variant, across reloads and mounts)."""
        if not self.sweep:
            return self.variants[ROOT].session.plan.plan_hash
        return xxhash.xxh3_64_hexdigest(f"sweep\x00{self.index.key}".encode())

    # -- counters --------------------------------------------------------------------------
    def source_bytes(self) -> dict[str, int]:
        """Physical bytes read per source since the session opened (all variants)."""
        return {"base": self.base.counters.bytes_read,
                **{lab: e.counters.bytes_read for lab, e in zip(self.labels, self.experts)}}

    def variant_totals(self, st: VariantState) -> dict[str, Any]:
        plan = st.session.plan
        engine = st.session.engine
        recorder = st.recorder
        return {"type": "totals", "variant": st.name,
                "requested_bytes_read": dict(recorder.requested) if recorder else {},
                "expert_bytes_planned": plan.planned_bytes,
                "total_expert_bytes": plan.total_expert_bytes,
                "units_merged": engine.units_merged, "blocks_merged": engine.blocks_merged,
                "units_shared": recorder.units_shared if recorder else 0,
                "units_from_disk_cache": recorder.units_from_disk if recorder else 0,
                "bound_tight": plan.bound_tight, "bound_loose": plan.bound_loose,
                "bound_output_tight": plan.bound_output_tight,
                "bound_output_loose": plan.bound_output_loose,
                "error_exact": plan.error_exact, "update_norm": plan.update_norm}

    def totals_record(self) -> dict[str, Any]:
        read = self.source_bytes()
        return {"type": "totals", "kind": "sweep", "variants": sorted(self.variants),
                "physical_bytes_read": read,
                "expert_bytes_read": sum(v for k, v in read.items() if k != "base"),
                "source_cache": self.source_cache.stats() if self.source_cache else None,
                "units_merged": sum(st.session.engine.units_merged
                                    for st in self.variants.values()),
                "wall_seconds": round(time.monotonic() - self.started, 6)}

    def finish(self) -> dict[str, Any]:
        """Write the totals and close the manifest; returns the totals: a plain spec's merge
        totals (its session's), or each sweep variant's then the sweep's."""
        if not self.sweep:
            return self.variants[ROOT].session.finish()
        for st in self.variants.values():
            self._write(self.variant_totals(st))
        totals = self.totals_record()
        self._write(totals)
        if self.manifest is not None:
            self.manifest.close()
        return totals

    def close(self) -> None:
        """Close every variant's session (its delta sidecars; the shared family, once)."""
        for st in self.variants.values():
            st.session.close()
        for c in [self.base, *self.experts]:  # (closing twice is harmless)
            c.close()
