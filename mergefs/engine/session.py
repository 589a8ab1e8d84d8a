"""A spec opened for work: family (with a multi-document spec's intermediate merges made first), index, plan, engine and the manifest header. Blocking I/O; never on the trio thread."""

from __future__ import annotations

import logging
import json
import time
from dataclasses import replace
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from mergefs.core.version import __version__
from mergefs.sources.local import Checkpoint
from mergefs.index.blocks import BlockIndex, load_or_build
from mergefs.engine.manifest import SCHEMA_VERSION, ManifestWriter
from mergefs.plan.planner import Plan, make_plan, selected_runs
from mergefs.spec.model import Spec
from mergefs.engine.merger import Engine
from mergefs.engine.layout import OutputOptions
from mergefs.engine.output import MARKER, check_writes
from mergefs.recipe.family import recipe_of
from mergefs.recipe.family import open_family
from mergefs.deltas.match import find
from mergefs.deltas.reconstruct import one_blas_thread
from mergefs.plan.levels import level_runs


log = logging.getLogger(__name__)


class Session:
    """A spec opened for work: family, index, plan, engine and the manifest header."""

    def __init__(self, spec: Spec, *, budget_bytes: int | None = None,
                 manifest: ManifestWriter | None = None,
                 on_index_bytes: Callable[[int], None] | None = None,
                 on_index_total: Callable[[int], None] | None = None,
                 plan: Plan | None = None,
                 family: tuple[Checkpoint, list[Checkpoint]] | None = None,
                 sidecars: bool = True, index: BlockIndex | None = None,
                 index_runner: Any = None, reset_counters: bool | None = None,
                 output: OutputOptions | None = None) -> None:
        """``family``: the spec's (base, experts) if the caller opened them already (the
        session then owns and closes them). ``sidecars``: plan with the experts' delta
        sidecars when they have matching ones (:mod:`mergefs.deltas.sidecar`). ``index``: the family's
        index, loaded by the caller (a sweep's variants share one; counters are then left
        alone, as other sessions may be counting on the same sources). ``index_runner``:
        where an index build computes its chunks (:data:`mergefs.index.blocks.ChunkRunner`).
        ``reset_counters``: zero the sources' counters once the session is open, so that they
        count its merge reads only (default: when the session loaded the index itself; a
        mount that loaded it for this session alone passes True). ``output``: the output's
        layout and files (default mergekit-yaml's), recorded in the manifest header."""
        self.spec = spec
        self.started = time.monotonic()
        self.base, self.experts = family if family is not None else prepare_family(
            spec, output=output)
        if index is not None:
            self.index, self.index_built = index, False
        else:
            self.index, self.index_built = load_or_build(
                self.base, self.experts, spec.block_size, spec.index_dir, on_index_bytes,
                runner=index_runner, on_total=on_index_total,
                max_size_bytes=spec.index_max_size_bytes)
        self.recipe = recipe_of(spec, self.base)
        self.deltas = find_deltas(self.base, self.experts, self.index, spec.index_dir) \
            if sidecars else {}
        if reset_counters is None:  # a shared index: other sessions may count on the sources
            reset_counters = index is None
        if reset_counters:
            for c in [self.base, *self.experts]:  # count merge reads only, not indexing or
                c.counters.reset()  # looking for sidecars
        self.plan = plan if plan is not None else make_plan(
            spec, self.index, budget_bytes,
            coefficients=self.recipe.coefficients(spec, self.index.layout.tensors),
            sidecars=self.deltas)
        self.manifest = manifest
        self.engine = Engine(spec, self.base, self.experts, self.index, self.plan, manifest,
                             recipe=self.recipe, deltas=self.deltas, output=output)
        #: BLAS held at one thread while sidecars are decoded (the workers use the cores):
        #: once per session, not per decode call, which set and restored OpenBLAS's thread
        #: count per unit (the mount's 64 KiB units: seconds per file)
        if manifest is not None:
            manifest.write(self.header_record())
        self._one_blas: Any = None  # taken last: nothing after it can fail before close()
        if self.engine.deltas:

            self._one_blas = one_blas_thread()
            self._one_blas.__enter__()

    def header_record(self) -> dict[str, Any]:
        return {
            "type": "header",
            "schema": SCHEMA_VERSION,
            "mergefs_version": __version__,
            "spec": dict(self.spec.raw),
            "spec_file": self.spec.source,
            "sources": {"base": self.base.identity_json(),
                        **{lab: e.identity_json()
                           for lab, e in zip(self.engine.labels, self.experts)}},
            "index_key": self.index.key,
            "plan_hash": self.plan.plan_hash,
            "budget_bytes": self.plan.budget_bytes,
            "selected": selected_runs(self.plan.selected),
            **self._levels_record(),
            "output": self.engine.output.to_json(),
            "created_unix": time.time(),
        }

    def _levels_record(self) -> dict[str, Any]:
        """Header keys of a plan that reads delta sidecars (absent otherwise)."""
        if self.plan.levels is None:
            return {}

        return {"levels": level_runs(self.plan.levels),
                "sidecars": {self.engine.labels[i]: str(sc.path)
                             for i, sc in sorted(self.deltas.items())}}

    def source_bytes(self) -> dict[str, int]:
        return {"base": self.base.counters.bytes_read,
                **{lab: e.counters.bytes_read for lab, e in zip(self.engine.labels, self.experts)}}

    def sidecar_bytes(self) -> dict[str, int]:
        """Delta sidecar payload bytes read per expert (expert I/O, issue 14): fetched, the
        gaps between coalesced ranges included."""
        return {self.engine.labels[i]: sc.bytes_read for i, sc in sorted(self.deltas.items())}

    def sidecar_gap_bytes(self) -> dict[str, int]:
        """Of :meth:`sidecar_bytes`, those between the ranges a remote read coalesced (fetched
        and dropped, in no plan)."""
        return {self.engine.labels[i]: sc.gap_bytes for i, sc in sorted(self.deltas.items())}

    def gap_bytes_record(self) -> dict[str, Any]:
        """Totals keys of a merge with experts whose reads may fetch gap bytes (remote ones:
        ``reads_gap_bytes``): ``expert_gap_bytes_allowed``, the gap bytes coalesced reads of
        experts and their sidecars may fetch beyond the plan (the budget's slack; None: no
        limit, a full budget), and ``expert_gap_bytes_read``, those they fetched (in
        ``expert_bytes_read``; dropped, in no plan)."""
        allowance = self.engine.gap_allowance
        return {"expert_gap_bytes_allowed": allowance.limit_bytes,
                "expert_gap_bytes_read": allowance.spent_bytes}

    def sidecar_requests(self) -> dict[str, int]:
        """Delta sidecar payload fetches per expert (preads, or ranged GETs of a remote one)."""
        return {self.engine.labels[i]: sc.reads for i, sc in sorted(self.deltas.items())}

    def source_requests(self) -> dict[str, int]:
        """Read requests per source: preads (local) or requests sent, retries included (remote)."""
        return {label: getattr(c.counters, "requests", c.counters.reads)
                for label, c in [("base", self.base),
                                 *zip(self.engine.labels, self.experts)]}

    def totals_record(self) -> dict[str, Any]:
        read = self.source_bytes()
        expert_read = sum(v for k, v in read.items() if k != "base")
        extra: dict[str, Any] = {}
        if self.plan.levels is not None:
            extra = {"sidecar_bytes_read": self.sidecar_bytes(),
                     "sidecar_gap_bytes_read": self.sidecar_gap_bytes(),
                     "sidecar_reads": self.sidecar_requests(),
                     "sidecar_bytes_planned": self.plan.sidecar_bytes}
            expert_read += sum(extra["sidecar_bytes_read"].values())
        reread = self.engine.expert_bytes_reread  # the staged path's second reads
        if reread:
            expert_read -= reread
            extra["expert_bytes_reread"] = reread
        vocab = self.engine.vocab_expert_bytes_read  # read whole, outside the plan
        if vocab:
            extra["expert_bytes_vocabulary"] = vocab
        if any(e.reads_gap_bytes for e in self.experts):  # see gap_bytes_record
            extra.update(self.gap_bytes_record())
        return {
            **extra,
            "type": "totals",
            "physical_bytes_read": read,
            "physical_requests": self.source_requests(),
            "expert_bytes_read": expert_read,
            "expert_bytes_planned": self.plan.planned_bytes,
            "expert_bytes_skipped": self.plan.total_expert_bytes - self.plan.planned_bytes,
            "total_expert_bytes": self.plan.total_expert_bytes,
            "blocks_merged": self.engine.blocks_merged,
            "bound_tight": self.plan.bound_tight,
            "bound_loose": self.plan.bound_loose,
            "bound_output_tight": self.plan.bound_output_tight,
            "bound_output_loose": self.plan.bound_output_loose,
            "error_exact": self.plan.error_exact,
            "update_norm": self.plan.update_norm,
            "wall_seconds": round(time.monotonic() - self.started, 6),
        }

    def finish(self) -> dict[str, Any]:
        totals = self.totals_record()
        if self.manifest is not None:
            self.manifest.write(totals)
            self.manifest.close()
        return totals

    def close(self) -> None:
        for c in [self.base, *self.experts]:
            c.close()
        for sc in self.deltas.values():
            sc.close()
        if self._one_blas is not None:
            self._one_blas, held = None, self._one_blas
            held.__exit__(None, None, None)


def find_deltas(base: Checkpoint, experts: Sequence[Checkpoint], index: BlockIndex,
                index_dir: str) -> dict[int, Any]:
    """The experts' delta sidecars that match: in mergefs's store under ``index_dir`` first,
    then beside each expert (:func:`mergefs.deltas.match.find`)."""
    return find(base, experts, index, index_dir)
def _done(outdir: Path, plan_hash: str) -> bool:
    try:
        marker = json.loads((outdir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("plan_hash") == plan_hash


def _sources_of(spec: Spec, outdir: str) -> list[str]:
    """Every model the spec's merges read, but the intermediate ``outdir`` itself (a later
    merge reads it)."""
    return [p for p in spec.model_paths if p != outdir]


#: files whose presence (with config.json) makes mergekit-multi's ``--lazy`` skip a merge
MODEL_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")


def _exists(outdir: Path) -> bool:
    """mergekit-multi's test of an existing merge: config.json and a weight file or index."""
    return (outdir / "config.json").exists() and any((outdir / f).exists() for f in MODEL_FILES)


def ensure_intermediates(spec: Spec, *, output: OutputOptions | None = None,
                         lazy: bool | None = None) -> None:
    """Merge each of a multi-document spec's named merges into its output directory, in
    dependency order, as ``mergefs merge`` would (its own manifest beside the spec), with the
    ``output`` options of the final merge (the config text: each merge's own resolved spec).

    ``lazy`` None: skip one whose directory already holds a mergefs merge of the same plan
    (plan hash in its marker); True: skip any directory holding a model (config.json and a
    weight file), as mergekit-multi's ``--lazy``; False: merge every one again."""
    sub_output = replace(output, config_text=None) if output is not None else None
    for name, sub, outdir in spec.intermediates:
        if lazy is True and _exists(Path(outdir)):
            log.info("intermediate merge %s: a model exists in %s, skipped (--lazy)", name,
                     outdir)
            continue
        # an intermediate is an output: never inside a source of any merge of the spec
        check_writes(_sources_of(spec, outdir), outdir=outdir,
                     manifest=sub.manifest, index_dir=sub.index_dir)
        probe = Session(sub)  # the index is built (or reused) here; the plan hash is cheap
        try:
            done = lazy is None and _done(Path(outdir), probe.plan.plan_hash)
        finally:
            probe.close()
        if done:
            log.info("intermediate merge %s is up to date in %s", name, outdir)
            continue
        log.info("merging intermediate %s into %s", name, outdir)
        writer = ManifestWriter.for_run(sub.manifest)
        try:
            session = Session(sub, manifest=writer, output=sub_output)
            try:
                session.engine.materialise(outdir, overwrite=True)
                session.finish()
            finally:
                session.close()
        finally:
            writer.close()


def prepare_family(spec: Spec, *, output: OutputOptions | None = None,
                   lazy: bool | None = None) -> tuple[Checkpoint, list[Checkpoint]]:
    """:func:`~mergefs.recipe.family.open_family`, after making a multi-document spec's
    intermediate merges (the models its final merge reads; ``output`` and ``lazy``: as
    :func:`ensure_intermediates` takes them)."""
    if spec.intermediates:
        ensure_intermediates(spec, output=output, lazy=lazy)
    return open_family(spec)
