"""The merge engine: executes a plan, one merge unit (a run of blocks, or a whole tensor) at a time.

``Session`` opens a spec's family, loads or builds the index and makes the plan. ``Engine`` then
reads the base range and only the planned expert ranges of a unit (each run of adjacent planned
blocks is one pread), checks every block's bytes against the index hashes (a changed source is
refused, never merged), merges in float32 (the spec's method from ``methods``) and casts to the
output dtype. Every range read and every unit produced is recorded in the manifest.
``materialise`` writes a Hugging Face directory whose files are byte-identical to what the mount
serves (same ``output_layout``).

Merging and reading block on disk and CPU: call from worker threads, never the trio thread.

Longer than ~500 lines on purpose: :class:`Engine` is one pipeline (plan a unit's reads, read,
verify, decode sidecar levels, merge, cast, record) whose steps share the unit's buffers and
counters; its output layout, session and output staging live beside it (:mod:`.layout`,
:mod:`.session`, :mod:`.output`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import yaml

from mergefs.methods import kernels, needs
from mergefs.core import memory
from mergefs.recipe import tokenizer as tokenizers
from mergefs.sources.base import INDEX_NAME, GapAllowance, ReadRange
from mergefs.sources import read_many
from mergefs.sources.local import Checkpoint
from mergefs.core.dtypes import decode_f32, encode
from mergefs.core.errors import MemoryCapError, SourceChanged
from mergefs.core.format import DTYPES
from mergefs.index.blocks import BlockIndex
from mergefs.engine import working_set
from mergefs.engine.manifest import ManifestWriter
from mergefs.methods.base import require_torch, Fused, Unit
from mergefs.engine.output import Staging
from mergefs.plan.planner import Plan
from mergefs.recipe.outputs import Recipe
from mergefs.spec.model import REFERENCE, Spec
from mergefs.spec.slices import spec_error
from mergefs.sources.base import CONFIG_NAME
from mergefs.engine.card import CARD_NAME, CONFIG_COPY_NAME, model_card
from mergefs.engine.layout import (
    OutFile, OutputOptions, OutTensor, output_extra_files, output_layout, sliced_layout,
)
from mergefs.engine.output import _atomic_write, _clear_temp, write_error
from mergefs.recipe.family import expert_labels, recipe_of
from mergefs.deltas.decode import Payloads, read_payloads
from mergefs.deltas.decode import decode_blocks

log = logging.getLogger(__name__)

UNIT_ELEMS = needs.UNIT_ELEMS  # materialise merges about this many elements per unit (elementwise)
PREFETCH_UNITS = 8  # materialise asks the kernel for this many units' ranges ahead of the workers
WRITEBACK_BYTES = 64 << 20  # materialise starts writing its output back every this many bytes


#: at most this many planned sidecar bytes of tensors are held for their units at once; beyond,
#: units read their own ranges (see Engine._unit_payloads)
TENSOR_LEVELS_MAX_BYTES = 128 << 20


@dataclass(eq=False)
class _HeldLevels:
    """One tensor's planned sidecar ranges of one expert, read once for all its units."""

    planned: np.ndarray  # the tensor's planned blocks (relative to its first block)
    depths: np.ndarray  # their level depths
    left: int  # planned blocks not decoded yet: the entry is dropped at 0
    nbytes: int  # the planned bytes (counted against TENSOR_LEVELS_MAX_BYTES)
    payloads: Any = None  # mergefs.deltas.decode.Payloads once read
    lock: threading.Lock = field(default_factory=threading.Lock)


class Engine:
    """Merges units of a plan. Thread-safe: units may be merged concurrently."""

    def __init__(self, spec: Spec, base: Checkpoint, experts: Sequence[Checkpoint],
                 index: BlockIndex, plan: Plan, manifest: ManifestWriter | None = None,
                 verify_index: bool = True, recipe: Recipe | None = None,
                 deltas: dict[int, Any] | None = None,
                 gap_allowance: GapAllowance | None = None,
                 output: OutputOptions | None = None, memory_bytes: int | None = None,
                 staged_block_elems: int = needs.STAGED_BLOCK_ELEMS) -> None:
        """``gap_allowance``: where remote reads of the experts (exact blocks and delta
        sidecar ranges) take the gap bytes they coalesce over; default the plan's
        (:attr:`mergefs.plan.planner.Plan.gap_allowance_bytes`). ``output``: the weight
        files' layout and the files beside them (default: as mergekit-yaml writes them).
        ``memory_bytes``: the cap on the working set of the units in flight (default the
        spec's ``memory``, else :func:`.working_set.default_cap_bytes`); raises
        :class:`MemoryCapError` (a SpecError when the spec set it) if one tensor needs more.
        ``staged_block_elems``: the staged path's block (tests split tensors with it)."""
        self.spec = spec
        self.output = output if output is not None else OutputOptions()
        self.recipe = recipe if recipe is not None else recipe_of(spec, base)
        self.unit_outputs = self.recipe.units  # unit key -> its first output tensor
        #: output tensor name -> the unit it is made of (several names for a repeated unit)
        self.unit_of = {o.name: o.key for o in self.recipe.outputs}
        self.tokenizer = getattr(base, "tokenizer", None)
        #: units read whole, not in the index (vocabulary units of a tokenizer merge, optional
        #: weights some models lack), merged from whole tensors
        self.derived = frozenset(o.key for o in self.recipe.outputs if o.whole)
        self.base = base
        self.experts = list(experts)
        self.index = index
        self.layout = index.layout
        self.plan = plan
        self.method = spec.method_def
        self.manifest = manifest
        self.verify_index = verify_index
        self.tindex = self.layout.tensor_index()
        # the recipe's outputs, not the base's files: slices, whole units, or a tensor some
        # model reads under another name (a tied weight of a models: spec, mergefs.recipe)
        if self.recipe.layers is not None or self.derived or not self.recipe.identity:
            self.out_files, self.index_json = sliced_layout(
                spec, self.recipe, base, self.tindex, self._whole_shapes(),
                shard_bytes=self.output.shard_bytes)
        else:
            self.out_files, self.index_json = output_layout(spec, base, self.tindex,
                                                            self.output.shard_bytes)
        self.out_tensors = {t.name: t for f in self.out_files for t in f.tensors}
        self.extra_overrides = output_extra_files(spec, base, self.recipe)
        #: non-weight files of the base not in the output: its model card, its tokenizer when
        #: one is built or not copied (OutputOptions.hidden)
        self.extra_hidden: frozenset[str] = self.output.hidden(base.extra_files)
        if self.tokenizer is not None:
            self.extra_hidden |= frozenset(r for r in base.extra_files
                                           if r in tokenizers.TOKENIZER_FILES)
            self.extra_overrides.update(self.tokenizer.files)
            if self.derived and (CONFIG_NAME in self.extra_overrides
                                 or CONFIG_NAME in base.extra_files):
                cfg = json.loads(self.extra_overrides.get(CONFIG_NAME)
                                 or base.read_extra(CONFIG_NAME))
                self.extra_overrides[CONFIG_NAME] = tokenizers.json_bytes(
                    tokenizers.update_config(cfg, self.tokenizer))
        self.labels = expert_labels([e.path for e in spec.experts])
        # delta sidecars (issue 14): blocks the plan reads as reconstructed levels
        self.deltas = dict(deltas or {}) if plan.levels is not None else {}
        #: the gap bytes every remote expert read of this merge shares (issue 14)
        self.gap_allowance = gap_allowance if gap_allowance is not None else \
            GapAllowance(plan.gap_allowance_bytes)
        for i, sc in self.deltas.items():
            sc.recorder = functools.partial(self._record_sidecar, self.labels[i], sc.name)
            sc.gap_allowance = self.gap_allowance
        #: a tensor's planned sidecar ranges, read once for units smaller than the tensor
        #: (the mount's row-block units), by (expert, tensor); dropped when every planned
        #: block was decoded
        self._tensor_levels: dict[tuple[int, str], _HeldLevels] = {}
        self._tensor_levels_bytes = 0  # their planned bytes, at most TENSOR_LEVELS_MAX_BYTES
        self._tensor_levels_lock = threading.Lock()
        self._lock = threading.Lock()
        #: set when a materialise stops early (Ctrl-C, an error): units still running in
        #: worker threads record nothing more in the manifest (it is being removed)
        self.stopped = threading.Event()
        #: expert bytes of units read whole (vocabulary tensors of a tokenizer merge, optional
        #: weights some models lack), outside the plan
        self.vocab_expert_bytes_read = 0
        #: expert bytes the staged path read a second time (phase 2; the page cache usually
        #: holds them), counted in the sources' physical reads, not in the plan's
        self.expert_bytes_reread = 0
        self.blocks_merged = 0
        self.units_merged = 0
        self.units_fused = 0  # of units_merged: by the compiled kernel (mergefs.methods.kernels)
        self._fused: dict[str, Fused | None] = {}
        #: some unit's arithmetic has a compiled kernel form (used when numba is available)
        self.fusable = any(self._fused_form(name) is not None for name in self.unit_outputs)
        if self.fusable:
            kernels.note_unavailable()
        memory.keep_freed_memory()  # reuse freed unit buffers: no page faults per unit
        #: elements per block of the staged path's phase 2
        self.staged_block_elems = staged_block_elems
        #: the working set of each unit's tensor (mergefs.methods.needs), checked against
        #: the cap now: a tensor that cannot be merged under it is refused before any work
        self.memory = working_set.MemoryCap(
            memory_bytes if memory_bytes is not None else
            spec.memory_bytes if spec.memory_bytes is not None else
            working_set.default_cap_bytes())
        self.needs = self._needs()
        try:
            working_set.check(list(self.needs.values()), self.memory.cap_bytes)
        except working_set.CapExceeded as exc:
            given = memory_bytes is not None or spec.memory_bytes is not None
            if memory_bytes is None and spec.memory_bytes is not None and not spec.memory_flag:
                raise spec_error(spec.source, "memory", str(exc)) from None
            where = "--memory" if given else "the default: half of RAM or of the cgroup limit"
            raise MemoryCapError(f"{exc} ({where}; raise it with --memory SIZE or the spec's "
                                 "memory: key)") from None

    def _needs(self) -> dict[str, needs.Need]:
        """Each unit's working set at its peak (mergefs.methods.needs), by unit key."""
        shapes = self._whole_shapes()
        k = len(self.spec.input_order)
        out: dict[str, needs.Need] = {}
        for name in self.unit_outputs:
            if name in self.derived:
                dtype, shape = shapes[name]
                dtypes = [dtype]
            elif name in self.base.tensors and self.out_tensors.get(name) is not None:
                shape = tuple(self.out_tensors[name].shape)
                dtypes = [src.tensors[name].dtype for src in [self.base, *self.experts]
                          if name in src.tensors]
            else:
                continue
            if any(d not in needs.MERGED_DTYPES for d in dtypes) or \
                    self.out_tensors[name].layout_index is None and name not in self.derived:
                continue  # passed through as it is
            u = self.unit_outputs[name]
            if name in self.derived or self.deltas or u.ref_only:
                path = "whole"  # (a base-only unit has no method parameters: it reads the base)
            elif self._elementwise(name):
                path = "blocks"
            elif self.method.staged is not None and k > 0 and self._fused_form(name) is None:
                path = "staged"
            else:
                path = "whole"
            out[name] = needs.tensor_need(
                self.method, name, int(np.prod(shape, dtype=np.int64)), k,
                max(working_set.item_bytes(d) for d in dtypes),
                working_set.item_bytes(self.out_tensors[name].dtype), path,
                self.staged_block_elems)
        return out

    def _whole_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """(source dtype, output shape) of each unit read whole, from the first role that
        has it (a vocabulary tensor has the output tokenizer's rows)."""
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for key in self.derived:
            u = self.unit_outputs[key]
            role = next(r for r in range(1 + len(self.experts)) if r not in u.absent)
            _, loc = [self.base, *self.experts][role].whole_locs[key]  # type: ignore[attr-defined]
            rows = self.tokenizer.rows if u.vocab and self.tokenizer is not None \
                else loc.shape[0]
            out[key] = (loc.dtype, (rows, *loc.shape[1:]))
        return out

    def _whole_unit(self, name: str) -> bytes:
        """A unit read whole: every input's whole tensor (a vocabulary tensor's rows permuted
        to the output's tokens, mergefs.recipe.tokenizer.permute), then merged by the method as
        one unit over the roles that have it (an optional weight some models lack, as
        mergekit merges it), or one role's tensor as it is (:attr:`OutputTensor.single`)."""
        u = self.unit_outputs[name]
        loaded: dict[str, Any] = {}
        for role, src in enumerate([self.base, *self.experts]):
            if role in u.absent:
                continue
            c, loc = src.whole_locs[name]  # type: ignore[attr-defined]
            buf = c.read_ranges([ReadRange(loc.file, loc.start, loc.end)])[0]
            if role:
                with self._lock:
                    self.vocab_expert_bytes_read += len(buf)
            if self.manifest is not None and not self.stopped.is_set():
                label = "base" if role == 0 else self.labels[role - 1]
                self.manifest.write({"type": "read", "source": label, "file": loc.file,
                                     "tensor": name, "start": loc.start, "end": loc.end,
                                     "xxh3": xxhash.xxh3_64_hexdigest(buf)})
            loaded[u.models[role]] = decode_f32(buf, loc.dtype).copy().reshape(loc.shape)

        def role_of(k: int) -> int:
            return 0 if k == REFERENCE else k + 1

        present = [k for k in self.spec.input_order if role_of(k) not in u.absent]
        has_base = self.spec.has_base and 0 not in u.absent
        if u.vocab:
            torch = require_torch("a tokenizer merge")
            assert self.tokenizer is not None and self.spec.tokenizer is not None
            order = [u.models[role_of(k)] for k in present]
            if has_base:
                order = [u.models[0], *order]
            permuted = tokenizers.permute(self.tokenizer, self.spec.tokenizer,
                                          u.models[0] if self.spec.has_base else None,
                                          {m: torch.from_numpy(loaded[m]) for m in order})
            # the methods take numpy arrays (and use torch themselves where they need it)
            arrays = {m: np.ascontiguousarray(t.numpy(), dtype=np.float32)
                      for m, t in permuted.items()}
        else:
            arrays = loaded
        single = 0 if u.ref_only else u.single
        if single is not None:  # one input's tensor as it is, as mergekit passes it through
            out: Any = arrays[u.models[single]]
        else:
            inputs = tuple(arrays[u.models[role_of(k)]] for k in present)
            ref = arrays[u.models[0]] if has_base else inputs[0]
            unit = Unit(tensor=name, shape=tuple(ref.shape), elem_offset=0,
                        base=ref if has_base else None, inputs=inputs, params=u.params,
                        input_params=tuple(p for k, p in zip(self.spec.input_order,
                                                             u.input_params)
                                           if role_of(k) not in u.absent),
                        expert_ids=tuple(i for i, k in enumerate(self.spec.input_order)
                                         if role_of(k) not in u.absent))
            out = self.method.merge(unit)
        if not isinstance(out, np.ndarray):
            out = out.detach().numpy()
        merged = np.ascontiguousarray(out.reshape(-1), dtype=np.float32)
        size = self.out_tensors[name].end - self.out_tensors[name].start
        data = encode(merged, self.out_tensors[name].dtype)
        assert len(data) == size
        return self._output(name, 0, 0, data)

    # -- units ---------------------------------------------------------------------------
    def units(self, name: str, unit_elems: int = 0) -> list[tuple[int, int]]:
        """Merge units of tensor ``name`` as block runs ``(b0, b1)``.

        Whole-tensor methods: one unit. Elementwise: single blocks, or runs of about
        ``unit_elems`` elements when given.
        """
        name = self.unit_of.get(name, name)
        if name in self.derived:
            return [(0, 0)]
        t = self.tindex[name]
        blocks = self.layout.blocks_of(t)
        if not self._elementwise(name) or not blocks:
            return [(blocks.start, blocks.stop)]
        out = []
        b0 = blocks.start
        for b in blocks:
            if b > b0 and self.layout.elem_end[b] - self.layout.elem_start[b0] > unit_elems:
                out.append((b0, b))
                b0 = b
        out.append((b0, blocks.stop))
        return out

    def unit_out_range(self, name: str, b0: int, b1: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of a unit within the tensor's output bytes."""
        name = self.unit_of.get(name, name)
        if name in self.derived:
            return 0, self.out_tensors[name].end - self.out_tensors[name].start
        item = DTYPES[self.out_tensors[name].dtype][0]
        return int(self.layout.elem_start[b0]) * item, int(self.layout.elem_end[b1 - 1]) * item

    # -- reading -------------------------------------------------------------------------
    def _range(self, src: Checkpoint, name: str, e0: int, e1: int) -> ReadRange:
        loc = src.tensors[name]
        item = DTYPES[loc.dtype][0]  # the source's own dtype (experts may differ from the base)
        return ReadRange(loc.file, loc.start + e0 * item, loc.start + e1 * item)

    def _check(self, src: Checkpoint, label: str, name: str, rng: ReadRange, buf: memoryview,
               b0: int, b1: int, hashes: np.ndarray, record: bool = True) -> memoryview:
        """Verify the bytes of blocks [b0, b1) read for ``rng`` and record the read (unless
        ``record`` is False: bytes read again, recorded once already)."""
        item = DTYPES[src.tensors[name].dtype][0]
        origin = int(self.layout.elem_start[b0])
        for b in range(b0, b1) if self.verify_index else ():
            lo = (int(self.layout.elem_start[b]) - origin) * item
            hi = (int(self.layout.elem_end[b]) - origin) * item
            if xxhash.xxh3_64_intdigest(buf[lo:hi]) != int(hashes[b]):
                raise SourceChanged(
                    f"{src.path_of(rng.file)}: bytes of {name!r} differ from the index "
                    f"(source changed since it was indexed); run `mergefs index` again"
                )
        if record and self.manifest is not None and not self.stopped.is_set():
            self.manifest.write({"type": "read", "source": label, "file": rng.file,
                                 "tensor": name, "start": rng.start, "end": rng.end,
                                 "xxh3": xxhash.xxh3_64_hexdigest(buf)})
        return buf

    # -- merging -------------------------------------------------------------------------
    def merge_unit(self, name: str, b0: int, b1: int) -> bytes:
        """Merged output bytes of blocks ``[b0, b1)`` of tensor ``name`` (or of its unit), once
        the unit's working set fits under the memory cap beside the units in flight."""
        name = self.unit_of.get(name, name)
        need = self.needs.get(name)
        held = self.memory.acquire(need.size_bytes) if need is not None else 0
        try:
            if name in self.derived:
                return self._whole_unit(name)
            if need is not None and need.path == "staged":
                return self._merge_staged(name, b0, b1)
            return self._merge_read(name, b0, b1)
        finally:
            self.memory.release(held)

    def _merge_read(self, name: str, b0: int, b1: int) -> bytes:
        """``merge_unit`` with every input's range of the unit read at once."""
        lay = self.layout
        e0, e1 = int(lay.elem_start[b0]), int(lay.elem_end[b1 - 1])
        src_dtype = self.base.tensors[name].dtype
        # One batch per unit: the base range and every planned expert run, fetched together
        # (remote sources concurrently; local ones in this order, one pread per run).
        base_rng = self._range(self.base, name, e0, e1)
        runs = [_runs(row, b0, b1) for row in self.plan.selected]
        ranges = [[self._range(src, name, int(lay.elem_start[r0]), int(lay.elem_end[r1 - 1]))
                   for r0, r1 in src_runs] for src, src_runs in zip(self.experts, runs)]
        requests = [(src, rs) for src, rs in zip(self.experts, ranges) if rs]
        got = read_many([(self.base, [base_rng]), *requests],
                        [None] + [self.gap_allowance] * len(requests))
        base_buf = self._check(self.base, "base", name, base_rng, got[0][0], b0, b1,
                               self.index.base_hash)
        fetched = iter(got[1:])
        expert_bufs = [next(fetched) if rs else [] for rs in ranges]
        out_dtype = self.out_tensors[name].dtype
        u = self.unit_outputs.get(name)
        if u is not None and u.ref_only:  # the base alone: cast, as mergekit returns it
            data = bytes(base_buf) if out_dtype == src_dtype else \
                encode(decode_f32(base_buf, src_dtype), out_dtype)
            return self._output(name, b0, b1, data)
        levels = [self._level_blocks(i, b0, b1) for i in range(len(self.experts))]
        if not any(runs) and not any(levels) and self._unread_is_base(src_dtype, out_dtype,
                                                                      base_buf):
            return self._output(name, b0, b1, bytes(base_buf))
        form = self._fused_form(name)
        size = int(np.prod(self.out_tensors[name].shape, dtype=np.int64))
        if not any(levels) and kernels.supports(
                form, [src_dtype, *(e.tensors[name].dtype for e, r in zip(self.experts, runs)
                                    if r)], out_dtype, size):
            assert form is not None
            data = self._merge_fused(name, form, base_buf, src_dtype, runs, ranges,
                                     expert_bufs, e0, out_dtype, size)
            return self._output(name, b0, b1, data, fused=True)
        w0 = decode_f32(base_buf, src_dtype)
        values: list[np.ndarray | None] = []  # per expert; None: the reference's values
        for i, src in enumerate(self.experts):
            if not runs[i] and not levels[i]:
                values.append(None)
                continue
            whole = runs[i] == [(b0, b1)]
            full = None if whole else w0.copy()  # omitted blocks: W_i := W0 (zero delta)
            for (r0, r1), rng, raw in zip(runs[i], ranges[i], expert_bufs[i]):
                buf = self._check(src, self.labels[i], name, rng, raw, r0, r1,
                                  self.index.expert_hash[i])
                wi = decode_f32(buf, src.tensors[name].dtype)  # promoted to float32
                if full is None:
                    full = wi
                else:
                    full[int(lay.elem_start[r0]) - e0:int(lay.elem_end[r1 - 1]) - e0] = wi
            if levels[i]:
                assert full is not None
                self._reconstruct(i, name, e0, w0, full, levels[i])
            values.append(full)
        if any(levels) and kernels.supports(form, [src_dtype, "F32"], out_dtype, size):
            # reconstructed units: the compiled kernel on the float32 values, the same
            # arithmetic as the method's numpy path on them (tests/test_deltadecode.py)
            assert form is not None
            inputs = [None if k == REFERENCE or values[k] is None
                      else [(0, values[k], "F32")] for k in self.spec.input_order]
            data = kernels.fused_merge(form, base_buf, src_dtype, inputs, out_dtype,
                                       elem_offset=e0, tensor_size=size)
            return self._output(name, b0, b1, data, fused=True)
        merged = self._merge(name, e0, w0, values)
        return self._output(name, b0, b1, encode(merged, out_dtype))

    # -- the staged path (whole-tensor methods in two phases) ------------------------------
    def _input_values(self, role: int, name: str, b0: int, b1: int, w0: np.ndarray | None,
                      s: int, e: int, record: bool = True) -> np.ndarray | None:
        """float32 values of flat elements ``[s, e)`` of tensor ``name`` (within blocks
        ``[b0, b1)``, which are read and verified whole, and recorded unless ``record`` is
        False, as ``merge_unit`` reads them): the base's (``role`` 0), or expert
        ``role - 1``'s planned runs with the base's values ``w0`` (of ``[s, e)``) elsewhere
        (None: none planned there)."""
        lay = self.layout
        if role == 0:
            src, label, hashes, runs = self.base, "base", self.index.base_hash, [(b0, b1)]
        else:
            i = role - 1
            src, label, hashes = self.experts[i], self.labels[i], self.index.expert_hash[i]
            runs = _runs(self.plan.selected[i], b0, b1)
            if not runs:
                return None
        ranges = [self._range(src, name, int(lay.elem_start[r0]), int(lay.elem_end[r1 - 1]))
                  for r0, r1 in runs]
        bufs = read_many([(src, ranges)], [None if role == 0 else self.gap_allowance])[0]
        if role and not record:
            with self._lock:
                self.expert_bytes_reread += sum(len(b) for b in bufs)
        dtype = src.tensors[name].dtype
        item = DTYPES[dtype][0]
        out = None if runs == [(b0, b1)] else w0.copy()  # type: ignore[union-attr]
        for (r0, r1), rng, raw in zip(runs, ranges, bufs):
            buf = self._check(src, label, name, rng, raw, r0, r1, hashes, record)
            lo, hi = max(s, int(lay.elem_start[r0])), min(e, int(lay.elem_end[r1 - 1]))
            if lo >= hi:
                continue
            r_start = int(lay.elem_start[r0])
            wi = decode_f32(buf[(lo - r_start) * item:(hi - r_start) * item], dtype)
            if out is None:
                return wi
            out[lo - s:hi - s] = wi
        return out

    def _merge_staged(self, name: str, b0: int, b1: int) -> bytes:
        """A whole-tensor unit by the method's two phases (:class:`mergefs.methods.base.Staged`):
        what each input keeps, from its whole delta, one input at a time; then the merge by
        blocks of about ``staged_block_elems`` elements, each input's blocks read again (the
        page cache usually holds them). The same bytes as the whole-tensor merge; between
        steps a stopped merge (Ctrl-C) ends the unit."""
        torch = require_torch(self.method.name)
        staged = self.method.staged
        assert staged is not None
        out_t = self.unit_outputs[name]
        out_dtype = self.out_tensors[name].dtype
        shape = tuple(self.out_tensors[name].shape)
        n = int(np.prod(shape, dtype=np.int64))
        roles = [0 if k == REFERENCE else k + 1 for k in self.spec.input_order]
        g = out_t.params
        e0 = int(self.layout.elem_start[b0])
        w0 = self._input_values(0, name, b0, b1, None, e0, e0 + n)
        assert w0 is not None
        base_t = torch.from_numpy(w0).reshape(shape)
        kept = []
        for k, role in enumerate(roles):  # phase 1: one input's whole tensor at a time
            self._stop_point()
            x = w0 if role == 0 else self._input_values(role, name, b0, b1, w0, e0, e0 + n)
            d = (torch.from_numpy(x).reshape(shape) if x is not None else base_t) - base_t
            del x
            kept.append(staged.keep(d, out_t.input_params[k], g, name, k))
            del d
        del base_t, w0
        lay = self.layout
        blocks = self.layout.blocks_of(self.tindex[name])
        pieces: list[bytes] = []
        for s, e in _aligned_blocks(n, self.staged_block_elems):  # phase 2
            self._stop_point()
            # the index blocks holding [s, e): read and verified whole
            c0 = blocks.start + int(np.searchsorted(lay.elem_end[blocks.start:blocks.stop],
                                                    e0 + s, side="right"))
            c1 = blocks.start + int(np.searchsorted(lay.elem_start[blocks.start:blocks.stop],
                                                    e0 + e, side="left"))
            # (phase 1 recorded the whole tensors' reads, the same records as the whole-tensor
            # merge's: a manifest lists each byte read once, and replays either way)
            wb = self._input_values(0, name, c0, c1, None, e0 + s, e0 + e, record=False)
            assert wb is not None
            base_blk = torch.from_numpy(wb)
            xs = [wb if role == 0 else
                  self._input_values(role, name, c0, c1, wb, e0 + s, e0 + e, record=False)
                  for role in roles]

            def delta(k: int, xs: list[np.ndarray | None] = xs, base_blk: Any = base_blk,
                      s: int = s) -> Any:
                x = xs[k]
                xk = base_blk if x is None else torch.from_numpy(x)
                d = kept[k].apply(xk - base_blk, s)
                xs[k] = None  # read once: free it
                return d

            merged = staged.combine(base_blk, delta, out_t.input_params, g)
            pieces.append(encode(np.ascontiguousarray(merged.numpy(), dtype=np.float32),
                                 out_dtype))
            del xs, merged, wb, base_blk
        data = b"".join(pieces)
        del pieces
        return self._output(name, b0, b1, data)

    def _stop_point(self) -> None:
        """Between the steps of a long unit: end it when the merge stopped (Ctrl-C)."""
        if self.stopped.is_set():
            raise _Stopped()

    def _fused_form(self, name: str) -> Fused | None:
        """The unit arithmetic of tensor ``name`` as a compiled kernel's form, or None (whole
        tensors, vocabulary units, methods or parameters the kernel does not reproduce)."""
        if name not in self._fused:
            out_t = self.unit_outputs.get(name)
            form = None
            if out_t is not None and name not in self.derived:
                form = self.method.fused(out_t.params, out_t.input_params)
                if form is not None and form.order == "sequential" \
                        and not self._elementwise(name):
                    form = None  # a sequential form needs elementwise units
            self._fused[name] = form
        return self._fused[name]

    def _merge_fused(self, name: str, form: Fused, base_buf: memoryview, src_dtype: str,
                     runs: list[list[tuple[int, int]]], ranges: list[list[ReadRange]],
                     expert_bufs: list[list[memoryview]], e0: int, out_dtype: str,
                     tensor_size: int) -> bytes:
        """``merge_unit`` by :func:`mergefs.methods.kernels.fused_merge`: the same reads, checks and
        manifest records, then one pass per input over the raw bytes."""
        lay = self.layout
        planned: list[kernels.Runs] = []
        for i, src in enumerate(self.experts):
            dtype = src.tensors[name].dtype
            planned.append([
                (int(lay.elem_start[r0]) - e0,
                 self._check(src, self.labels[i], name, rng, raw, r0, r1,
                             self.index.expert_hash[i]), dtype)
                for (r0, r1), rng, raw in zip(runs[i], ranges[i], expert_bufs[i])])
        inputs = [None if k == REFERENCE or not planned[k] else planned[k]
                  for k in self.spec.input_order]
        return kernels.fused_merge(form, base_buf, src_dtype, inputs, out_dtype,
                                   elem_offset=e0, tensor_size=tensor_size)

    # -- delta sidecars (issue 14) ---------------------------------------------------------
    def _level_blocks(self, i: int, b0: int, b1: int) -> list[tuple[int, int]]:
        """(block, levels) of expert i in [b0, b1) that the plan reconstructs from its sidecar."""
        if i not in self.deltas or self.plan.levels is None:
            return []
        row = self.plan.levels[i, b0:b1]
        return [(b0 + int(j), int(row[j])) for j in np.flatnonzero(row)]

    def _reconstruct(self, i: int, name: str, e0: int, w0: np.ndarray, full: np.ndarray,
                     blocks: list[tuple[int, int]]) -> None:
        """Write ``W_hat`` of the given blocks into ``full`` (float32, the unit's elements)."""

        sc = self.deltas[i]
        tl = sc.tensors[name]
        lay = self.layout
        b = np.asarray([b for b, _ in blocks], np.int64)
        depths = np.asarray([k for _, k in blocks], np.int64)
        starts = lay.elem_start[b] - e0
        n_rows = (lay.elem_end[b] - lay.elem_start[b]) // tl.cols
        first = int(lay.first_block[tl.t])
        payloads = self._unit_payloads(i, tl, b - first)
        decode_blocks(sc, tl, b - first, depths, starts, n_rows, w0, full, name,
                      payloads=payloads)

    def _unit_payloads(self, i: int, tl: Any, js: np.ndarray) -> Any:
        """The sidecar payloads of blocks ``js`` of tensor ``tl`` (relative to its first block)
        when the unit holds only some of the tensor's planned blocks: every planned block's
        ranges are read once, one pread per run per level as for a whole tensor, instead of
        one pread per level per unit (64 KiB units: ~7 levels x 3 experts per unit). None: the
        unit holds all of them, or they are too large to keep; the caller reads its own. The
        bytes are the plan's either way: only when they are read changes."""

        key = (i, tl.name)
        with self._tensor_levels_lock:
            held = self._tensor_levels.get(key)
            if held is None:
                held = self._hold_levels(i, tl, len(js))
                if held is None:
                    return None
        with held.lock:  # one reader per tensor; the others wait for its bytes
            if held.payloads is None:
                held.payloads = read_payloads(self.deltas[i], tl, held.planned, held.depths,
                                              tl.name)
            got: Payloads = held.payloads
        with self._tensor_levels_lock:
            held.left -= len(js)
            if held.left <= 0 and self._tensor_levels.get(key) is held:
                del self._tensor_levels[key]
                self._tensor_levels_bytes -= held.nbytes
        sel = np.searchsorted(held.planned, js)
        return Payloads(got.data, got.off[:, sel], got.size[:, sel])

    def _hold_levels(self, i: int, tl: Any, unit_blocks: int) -> _HeldLevels | None:
        """A new entry of ``_tensor_levels`` for expert i's tensor ``tl`` (under its lock), or
        None: a unit of ``unit_blocks`` blocks holds every planned block, or the cap is
        reached (entries of tensors a reader left half read stay until their blocks are
        decoded: a cap on them all, not only per tensor)."""
        assert self.plan.levels is not None
        lay = self.layout
        row = self.plan.levels[i, int(lay.first_block[tl.t]):int(lay.first_block[tl.t + 1])]
        planned = np.flatnonzero(row)
        if len(planned) <= unit_blocks:
            return None
        depths = row[planned].astype(np.int64)
        sizes = self.deltas[i].range_bytes()
        nbytes = sum(int(sizes[lv.first_range + planned[depths > lvl]].sum())
                     for lvl, lv in enumerate(tl.levels[:int(depths.max())]))
        if self._tensor_levels_bytes + nbytes > TENSOR_LEVELS_MAX_BYTES:
            return None
        self._tensor_levels_bytes += nbytes
        held = self._tensor_levels[(i, tl.name)] = _HeldLevels(planned, depths, len(planned),
                                                              nbytes)
        return held

    def _record_sidecar(self, label: str, file: str, tensor: str, start: int, end: int,
                        buf: memoryview) -> None:
        if self.manifest is not None and not self.stopped.is_set():
            self.manifest.write({"type": "read", "source": label, "file": file,
                                 "tensor": tensor, "start": start, "end": end,
                                 "xxh3": xxhash.xxh3_64_hexdigest(buf)})

    def _merge(self, name: str, e0: int, w0: np.ndarray, values: list[np.ndarray | None]
               ) -> np.ndarray:
        """Run the method on one unit: float32 in, float32 out (flat)."""
        shape = (w0.size,) if self._elementwise(name) else self.out_tensors[name].shape
        ref = w0.reshape(shape)
        out_t = self.unit_outputs[name]
        inputs = tuple(ref if k == REFERENCE or values[k] is None
                       else values[k].reshape(shape)  # type: ignore[union-attr]
                       for k in self.spec.input_order)
        unit = Unit(tensor=name, shape=tuple(shape), elem_offset=e0,
                    base=ref if self.spec.has_base else None, inputs=inputs,
                    params=out_t.params, input_params=out_t.input_params,
                    expert_ids=tuple(range(len(inputs))),
                    tensor_size=int(np.prod(self.out_tensors[name].shape, dtype=np.int64)))
        out = self.method.merge(unit)  # numpy, or torch (methods import torch when they need it)
        if not isinstance(out, np.ndarray):
            out = out.detach().numpy()
        return np.ascontiguousarray(out.reshape(-1), dtype=np.float32)

    def _elementwise(self, name: str) -> bool:
        u = self.unit_outputs.get(name)
        return self.method.elementwise(len(self.spec.input_order),
                                       u.params if u is not None else self.spec.parameters)

    def _unread_is_base(self, src_dtype: str, out_dtype: str, base_buf: memoryview) -> bool:
        """True when a unit that reads no expert is exactly the base's bytes (see
        :func:`_is_identity`): for methods whose output is the base when every delta is 0."""
        return (self.method.caps.zero_delta_is_base and self.spec.has_base
                and _is_identity(src_dtype, out_dtype, base_buf))

    def add_merged(self, blocks: int, units: int, fused: int = 0) -> None:
        """Count blocks and units merged (here, or by another process for this engine)."""
        with self._lock:
            self.blocks_merged += blocks
            self.units_merged += units
            self.units_fused += fused

    def _output(self, name: str, b0: int, b1: int, out: bytes, fused: bool = False) -> bytes:
        self.add_merged(b1 - b0, 1, int(fused))
        if self.manifest is not None and not self.stopped.is_set():
            start, end = self.unit_out_range(name, b0, b1)
            self.manifest.write({"type": "output", "tensor": name, "b0": b0, "b1": b1,
                                 "start": start, "end": end,
                                 "xxh3": xxhash.xxh3_64_hexdigest(out)})
        return out

    def passthrough(self, name: str) -> bytes:
        """Bytes of a non-merged tensor (non-float): the base's, unchanged."""
        name = self.unit_of.get(name, name)
        loc = self.base.tensors[name]
        return bytes(self.base.read_ranges([ReadRange(loc.file, loc.start, loc.end)])[0])

    def tensor_pieces(self, name: str, unit_elems: int) -> list[Callable[[], bytes]]:
        if self.unit_of.get(name, name) in self.derived:
            return [functools.partial(self.merge_unit, name, 0, 0)]
        if self.out_tensors[name].layout_index is None:
            return [functools.partial(self.passthrough, name)]
        return [functools.partial(self.merge_unit, name, b0, b1)
                for b0, b1 in self.units(name, unit_elems)]

    def prefetch(self, name: str, b0: int, b1: int) -> None:
        """Ask the kernel to start reading a unit's base range and planned expert runs
        (``Checkpoint.will_need``: no wait, no bytes beyond the plan; nothing for remote
        sources)."""
        name = self.unit_of.get(name, name)  # a repeated unit first met under a later name
        if name not in self.tindex:  # read whole, outside the plan (vocabulary, optional
            return                   # weights some models lack): no planned ranges to hint
        lay = self.layout
        wanted = [(self.base, self._range(self.base, name, int(lay.elem_start[b0]),
                                          int(lay.elem_end[b1 - 1])))]
        for src, row in zip(self.experts, self.plan.selected):
            wanted += [(src, self._range(src, name, int(lay.elem_start[r0]),
                                         int(lay.elem_end[r1 - 1])))
                       for r0, r1 in _runs(row, b0, b1)]
        for src, rng in wanted:
            src.will_need([rng])

    # -- materialising ---------------------------------------------------------------------
    def materialise(self, outdir: str | Path, on_bytes: Callable[[int], None] | None = None,
                    threads: int = 2, overwrite: bool = False) -> dict[str, str]:
        """Write the merged model to ``outdir`` (its model card named for its base name);
        returns {tensor: xxh3 of its output bytes}."""
        hashes: dict[str, str] = {}
        staging = Staging(outdir, force=overwrite)  # checks the directory before any work
        self.stopped = threading.Event()  # (a fresh one: an earlier run's pool keeps its own)
        try:
            with staging:
                out = staging.tmp
                with _Workers(threads, "mergefs-merge", self.stopped) as pool:
                    for f in self.out_files:
                        self._write_file(out, f, pool, hashes, on_bytes)
                self.write_extras(out, Path(outdir).name)
                staging.commit(self.marker())
        except OSError as exc:
            # e.g. ENOSPC: the temporary tree was removed; the output directory is untouched.
            raise write_error(exc, outdir) from None
        return hashes

    def card_files(self, name: str) -> dict[str, bytes]:
        """The model card (README.md, mergekit's plus what mergefs read) and mergekit_config.yml
        (the spec file's text) of an output named ``name``, when the output options ask for
        them (mergekit-yaml's ``--write-model-card``)."""
        if not self.output.model_card:
            return {}
        text = self.output.config_text
        manifest = getattr(self.manifest, "path", None)  # (a mount's recorder has none)
        # the manifest by its file name (it lies beside the spec): a card is published, and
        # its absolute path would name a private directory that mergekit's card never shows
        card = model_card(self.spec, self.plan, name, text,
                          Path(manifest).name if manifest is not None else None)
        return {CARD_NAME: card, CONFIG_COPY_NAME: (text if text is not None else yaml.safe_dump(
            dict(self.spec.raw), sort_keys=False)).encode()}

    def write_extras(self, out: Path, name: str) -> None:
        """The shard index, the non-weight files (copied, or as the merge rewrites them) and
        the model card of an output named ``name`` (each card file recorded in the manifest
        with its text, for replay to write the same)."""
        if self.index_json is not None:
            _atomic_write(out / INDEX_NAME, [self.index_json])
        for rel, data in self.card_files(name).items():
            _atomic_write(out / rel, [data])
            if self.manifest is not None:
                self.manifest.write({"type": "file", "path": rel,
                                     "xxh3": xxhash.xxh3_64_hexdigest(data),
                                     "text": data.decode()})
        added = [r for r in self.extra_overrides if r not in self.base.extra_files]
        for rel in [*self.base.extra_files, *added]:
            if rel in self.extra_hidden and rel not in self.extra_overrides:
                continue
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            rewritten = self.extra_overrides.get(rel)
            if rewritten is not None:
                _atomic_write(dst, [rewritten])
            else:
                self.base.copy_extra(rel, dst)

    def marker(self) -> dict[str, Any]:
        """What the output directory's marker records about the merge that wrote it."""
        manifest_path = getattr(self.manifest, "path", None)
        return {"spec": self.spec.source, "plan_hash": self.plan.plan_hash,
                "manifest": str(manifest_path) if manifest_path else None}

    def record_tensors(self, f: OutFile, file_hashes: dict[str, str],
                       hashes: dict[str, str]) -> None:
        """Add output file ``f``'s tensor hashes to ``hashes``; one manifest record each."""
        for t in f.tensors:
            digest = file_hashes[t.name]
            hashes[t.name] = digest
            if self.manifest is not None:
                self.manifest.write({"type": "tensor", "name": t.name, "file": f.name,
                                     "size_bytes": t.end - t.start, "xxh3": digest})

    def _write_file(self, out: Path, f: OutFile, pool: Executor,
                    hashes: dict[str, str], on_bytes: Callable[[int], None] | None) -> None:
        tmp = out / f".{f.name}.partial"
        file_hashes = self.write_shard(tmp, f, pool, on_bytes)
        os.replace(tmp, out / f.name)
        self.record_tensors(f, file_hashes, hashes)

    def write_shard(self, tmp: Path, f: OutFile, pool: Executor,
                    on_bytes: Callable[[int], None] | None = None) -> dict[str, str]:
        """Write output file ``f`` whole at ``tmp`` (created exclusively, fsynced; removed on
        any failure); returns {tensor: xxh3 of its bytes} for each of its tensors."""
        # A unit the output repeats (a self-stack) is merged once, where it first appears in
        # the file; its later copies are read back from the file written so far.
        first: dict[str, OutTensor] = {}
        pieces: list[tuple[str, Callable[[], bytes] | OutTensor]] = []
        for t in f.tensors:
            key = self.unit_of.get(t.name, t.name)
            if key in first:
                pieces.append((t.name, first[key]))
            else:
                first[key] = t
                pieces += [(t.name, fn) for fn in self.tensor_pieces(t.name, UNIT_ELEMS)]
        # The same merge units in the same order, for reading ahead of the workers.
        ahead = iter([(t.name, b0, b1) for t in first.values() if t.layout_index is not None
                      for b0, b1 in self.units(t.name, UNIT_ELEMS)])
        for unit in islice(ahead, PREFETCH_UNITS):
            self.prefetch(*unit)
        hashers: dict[str, Any] = {}
        try:
            _clear_temp(tmp)
            with open(tmp, "xb+") as fh:  # read back: repeated units
                fh.write(f.header)
                window: deque[tuple[str, Future[bytes] | OutTensor]] = deque()
                it = iter(pieces)

                def fill() -> None:
                    while len(window) < 3:
                        nxt = next(it, None)
                        if nxt is None:
                            return
                        job = nxt[1]
                        window.append((nxt[0], job if isinstance(job, OutTensor)
                                       else pool.submit(job)))
                        for unit in islice(ahead, 1):
                            self.prefetch(*unit)

                fill()
                written = synced = 0
                while window:
                    name, fut = window.popleft()
                    if isinstance(fut, OutTensor):  # a repeated unit: its bytes written earlier
                        fh.flush()
                        data = os.pread(fh.fileno(), fut.end - fut.start, fut.start)
                    else:
                        data = fut.result()
                    fill()
                    fh.write(data)
                    written += len(data)
                    if written - synced >= WRITEBACK_BYTES:  # start writeback now, not at fsync
                        fh.flush()
                        os.posix_fadvise(fh.fileno(), synced, written - synced,
                                         os.POSIX_FADV_DONTNEED)
                        synced = written
                    hashers.setdefault(name, xxhash.xxh3_64()).update(data)
                    if on_bytes is not None:
                        on_bytes(len(data))
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return {t.name: hashers[t.name].hexdigest() if t.name in hashers
                else xxhash.xxh3_64_hexdigest(b"") for t in f.tensors}


class _Stopped(BaseException):
    """Raised inside a worker running a unit when its merge stops early (Ctrl-C, an error)."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: withdraw a pending
    one): ``PyThreadState_SetAsyncExc``; a C call in progress (a torch op) ends first."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc else None)


class _Workers(Executor):
    """``materialise``'s worker threads, which stop within one numpy or torch call on Ctrl-C.

    A ``ThreadPoolExecutor`` leaving its ``with`` block on an exception waits for its running
    and queued units, and the interpreter joins its threads at exit: a KeyboardInterrupt then
    waited for whole-tensor merges (ties: seconds each, inside torch). Here leaving on an
    exception sets ``stopped``, cancels the queued units and raises :class:`_Stopped` in the
    workers running one, then returns at once; a worker ends when its current C call (one
    torch op) returns, so the interpreter's exit waits for no more than that. (Not daemon
    threads: one killed at exit while inside torch aborts the process.) Units hand their
    bytes to the main thread, which wrote and removed every file (``Staging``); once
    stopped they record nothing more in the manifest (``Engine.stopped``)."""

    def __init__(self, workers: int, name: str, stopped: threading.Event) -> None:
        self.stopped = stopped
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: set[int] = set()  # ids of the threads inside a unit
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}")
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.stopped.is_set():
            raise RuntimeError("cannot schedule new units after the merge stopped")
        fut: Future[Any] = Future()
        self._jobs.put((fut, functools.partial(fn, *args, **kwargs)))
        return fut

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            try:
                job = self._jobs.get()
                if job is None:
                    return
                fut, fn = job
                if self.stopped.is_set():
                    fut.cancel()
                if not fut.set_running_or_notify_cancel():
                    continue
                with self._lock:
                    self._running.add(me)
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    fut.set_exception(exc)
                finally:
                    with self._lock:
                        self._running.discard(me)
                        _raise_in(me, None)  # a stop that came as the unit ended
            except _Stopped:  # (delivered between units: nothing to undo)
                continue

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            self.stopped.set()
            with self._lock:
                for tid in self._running:
                    _raise_in(tid, _Stopped)
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        # an exception (Ctrl-C): stop now, without waiting for the running units
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)


# Bit patterns that ``W0 + (+0.0)`` changes: -0.0 (becomes +0.0) and NaN (may be quietened).
_IDENTITY_CHECK = {"BF16": ("<u2", 0x8000, 0x7FFF, 0x7F80),
                   "F16": ("<u2", 0x8000, 0x7FFF, 0x7C00),
                   "F32": ("<u4", 0x80000000, 0x7FFFFFFF, 0x7F800000)}


def _is_identity(src_dtype: str, out_dtype: str, base_buf: memoryview) -> bool:
    """True when a unit whose deltas are all zero is exactly the base's bytes.

    Such a unit is ``M = W0 + S`` with ``S`` all zeros (of either sign), and ``w + 0.0 == w``
    bit for bit except for -0.0 and NaN; the cast back to the source dtype is exact. So the
    base's bytes are the output when the dtype is unchanged and the unit holds neither.
    """
    check = _IDENTITY_CHECK.get(src_dtype)
    if check is None or out_dtype != src_dtype:
        return False
    kind, neg_zero, magnitude, inf = check
    u = np.frombuffer(base_buf, dtype=kind)
    return not (np.any(u == neg_zero) or np.any((u & magnitude) > inf))


def may_use_kernels(spec: Spec) -> bool:
    """Whether merging ``spec`` will likely run the compiled kernels (numba installed and the
    spec-level parameters give a kernel form), without opening anything: to load them early."""
    if not kernels.available():
        return False
    try:
        return spec.method_def.fused(spec.parameters, spec.input_parameters()) is not None
    except (TypeError, ValueError, KeyError):  # per-tensor parameters: known per unit only
        return False


def _runs(row: np.ndarray, b0: int, b1: int) -> list[tuple[int, int]]:
    """Runs of True in row[b0:b1] as absolute block ranges."""
    seg = row[b0:b1]
    if not seg.any():
        return []
    padded = np.concatenate([[False], seg, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(b0 + int(a), b0 + int(b)) for a, b in zip(edges[::2], edges[1::2])]




def _aligned_blocks(n: int, block_elems: int) -> list[tuple[int, int]]:
    """``[start, end)`` blocks of ``n`` flat elements for the staged path: every start a
    multiple of 32 (``block_elems`` is rounded to one), and the last block, which holds the
    tensor's last ``n % 32`` elements, holds at least 32 before them (torch sums a block of
    fewer than 32 elements in another order)."""
    step = max(32, block_elems // 32 * 32)
    cuts = [s for s in range(step, n, step) if n - s >= 32 + n % 32]
    starts = [0, *cuts]
    return [(a, b) for a, b in zip(starts, [*cuts, n])] if n else []
