"""A sweep's variants opened together: one family, one index, one source read path, one cache.

:class:`SweepSession` opens the base and experts once, loads (or builds) the block index once,
and installs one :class:`~mergefs.sources.blockcache.SourceBlockCache` as the ``range_cache`` of every local
safetensors source, cut at the index's block boundaries: a source block read for one variant is
served from memory to every other variant while it stays cached. Each variant is an ordinary
:class:`~mergefs.engine.session.Session` over those shared sources with its own plan and engine, so each
variant's bytes are exactly those of ``mergefs merge`` of that variant alone.

Merge units are cached by a *content key* (:func:`unit_key_of`): the family's index key, the
variant's resolved spec without its budget (method, coefficients, dtype, ...), the unit's tensor
and block run, and which blocks of the unit the plan reads from each expert (and at which
sidecar level). Two variants whose units agree on all of that produce the same bytes, so a unit
is merged once for all of them (e.g. variants that differ only in budget, for the units where
their plans read the same blocks). Units whose coefficients differ are never shared, even where
no expert block is read: the output then still depends on the coefficients in general.

The manifest (schema 2, docs/manifest.md) is one file for the whole mount: a ``sweep`` header,
then each variant's records tagged with ``"variant"`` (its own header with the variant's full
resolved spec and plan, reads, outputs, totals), then the sweep's totals. A unit served to a
variant from another variant's merge is recorded for that variant as an output with
``"shared": true``; replay re-merges it under the variant's own plan and checks the hash.

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

from mergefs.core.version import __version__
from mergefs.sources.local import Checkpoint
from mergefs.engine.session import Session, prepare_family
from mergefs.core.errors import MergefsError, SpecError
from mergefs.core.format import DTYPES
from mergefs.index.blocks import BlockIndex, load_or_build
from mergefs.engine.manifest import ManifestWriter
from mergefs.sources.blockcache import SourceBlockCache
from mergefs.spec.model import Spec
from mergefs.spec.variants import Variant, load_variants

log = logging.getLogger(__name__)

SWEEP_SCHEMA = 2


def unit_key_of(session: Session) -> Callable[[str, int, int], str]:
    """The content key function of a variant's merge units (see the module docstring)."""
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
    """The manifest writer a variant's session writes to: tags every record with the variant,
    adds its settings to its header, counts the source bytes its merges asked for, and notes
    which units are recorded for it. Records are held back until :meth:`publish` (a reload
    publishes new variants only once every one of them opened)."""

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
        self.key_of: Callable[[str, int, int], str] | None = None
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
    name: str
    settings: dict[str, Any]
    spec: Spec
    session: Session
    recorder: VariantRecorder
    key_of: Callable[[str, int, int], str]
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


class SweepSession:
    """Every variant of a sweep spec over one shared family, index and source cache."""

    def __init__(self, spec_path: str | Path, manifest: ManifestWriter,
                 source_cache_bytes: int, strict: bool = False,
                 found: Sequence[tuple[Variant, Spec]] | None = None,
                 family: tuple[Checkpoint, list[Checkpoint]] | None = None,
                 index: BlockIndex | None = None) -> None:
        """``family`` and ``index``: the first variant's, if the caller opened them already
        (the mount's ``ensure_index``; the session then owns and closes them)."""
        self.spec_path = Path(spec_path)
        self.strict = strict
        self.started = time.monotonic()
        self._lock = threading.Lock()  # serialises add/reload
        self._merged_here: set[str] = set()  # unit keys merged in this mount (VariantRecorder)
        self.variants: dict[str, VariantState] = {}
        try:
            found = list(found) if found is not None else load_variants(spec_path, strict)
        except BaseException:
            if family is not None:
                for c in [family[0], *family[1]]:
                    c.close()
            raise
        first = found[0][1]
        self.first = first
        self.manifest = manifest
        self.base, self.experts = family if family is not None else prepare_family(first)
        try:
            if index is not None:
                self.index, self.index_built = index, False
            else:
                self.index, self.index_built = load_or_build(
                    self.base, self.experts, first.block_size, first.index_dir)
            self.source_cache = self._install_cache(source_cache_bytes)
            manifest.write(self._header())
            for v, spec in found:
                self._open(v, spec).recorder.publish()
            for c in [self.base, *self.experts]:  # count serving reads only, not indexing or
                c.counters.reset()  # looking for delta sidecars
        except BaseException:
            self.close()
            raise

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
        labels = self.labels
        return {"type": "header", "schema": SWEEP_SCHEMA, "kind": "sweep",
                "mergefs_version": __version__, "spec_file": str(self.spec_path),
                "sources": {"base": self.base.identity_json(),
                            **{lab: e.identity_json() for lab, e in zip(labels, self.experts)}},
                "index_key": self.index.key, "created_unix": time.time()}

    @property
    def labels(self) -> list[str]:
        from mergefs.recipe.family import expert_labels

        return expert_labels([e.path for e in self.first.experts])

    def _open(self, v: Variant, spec: Spec) -> VariantState:
        recorder = VariantRecorder(v.name, dict(v.settings), self.manifest, self._merged_here)
        session = Session(spec, manifest=recorder,  # type: ignore[arg-type]
                          family=(self.base, self.experts), index=self.index)
        key_of = unit_key_of(session)
        recorder.key_of = key_of
        state = VariantState(v.name, dict(v.settings), spec, session, recorder, key_of)
        self.variants[v.name] = state
        return state

    def reload(self) -> tuple[list[VariantState], list[str]]:
        """Re-read the spec file: open its new variants (returned, not yet published: the caller
        publishes them once they are served) and mark the variants it no longer lists as
        removed. All or nothing: an invalid spec, or a variant whose resolved spec changed under
        the same name, raises SpecError and changes nothing."""
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

    # -- counters --------------------------------------------------------------------------
    def source_bytes(self) -> dict[str, int]:
        """Physical bytes read per source since the mount started (all variants)."""
        return {"base": self.base.counters.bytes_read,
                **{lab: e.counters.bytes_read for lab, e in zip(self.labels, self.experts)}}

    def variant_totals(self, st: VariantState) -> dict[str, Any]:
        plan = st.session.plan
        engine = st.session.engine
        return {"type": "totals", "variant": st.name,
                "requested_bytes_read": dict(st.recorder.requested),
                "expert_bytes_planned": plan.planned_bytes,
                "total_expert_bytes": plan.total_expert_bytes,
                "units_merged": engine.units_merged, "blocks_merged": engine.blocks_merged,
                "units_shared": st.recorder.units_shared,
                "units_from_disk_cache": st.recorder.units_from_disk,
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
        for st in self.variants.values():
            self.manifest.write(self.variant_totals(st))
        totals = self.totals_record()
        self.manifest.write(totals)
        self.manifest.close()
        return totals

    def close(self) -> None:
        for st in self.variants.values():
            for sc in st.session.deltas.values():
                sc.close()
        for c in [self.base, *self.experts]:
            c.close()


def check_sweep_spec(path: str | Path, strict: bool = False) -> list[tuple[Variant, Spec]]:
    """The variants of a sweep spec file, validated (MergefsError naming the problem)."""
    found = load_variants(path, strict)
    if not found:
        raise MergefsError(f"{path}: no variants")
    return found
