"""The block index: per (expert, block) delta norms, hashes and zero flags, built once, reused.

A *block* is a contiguous range of whole rows of one floating-point tensor, about ``block_size``
bytes (a tensor smaller than that is one block). Blocks are numbered in the base's file order.
For every block the index holds the xxh3 of the base bytes and, per expert, the xxh3 of the
expert bytes, the delta L2 norm ``||W_i - W0||`` (float32 deltas, float64 accumulation), a zero
flag (bytes identical to the base) and the Gram matrix ``<D_i, D_j>`` of the experts' deltas, which
gives the exact norm of any additive combination (bounds relative to the merge update, and the
exact error of a plan).

The index is stored under ``index_dir`` as a safetensors file keyed by every source's identity,
so it is reused while sources are unchanged and rebuilt when one changed. Building reads each
file once, in order, on two worker threads. Nothing here runs on the trio thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import xxhash
from safetensors.numpy import load_file, save_file

from .checkpoint import Checkpoint, ReadRange
from .dtypes import decode_f32
from .errors import SourceError
from .format import FLOAT_DTYPES

log = logging.getLogger(__name__)

INDEX_VERSION = "1"
CHUNK_BYTES = 16 << 20  # read granularity while indexing, per source


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Blocks of the mergeable (floating-point) tensors, in the base's file order.

    Block ``b`` covers elements ``[elem_start[b], elem_end[b])`` of tensor ``tensor_of[b]``;
    ``first_block[t]`` .. ``first_block[t + 1]`` are tensor ``t``'s blocks.
    """

    block_size: int
    tensors: tuple[str, ...]
    itemsize: tuple[int, ...]
    tensor_of: np.ndarray
    elem_start: np.ndarray
    elem_end: np.ndarray
    first_block: np.ndarray

    @property
    def n_blocks(self) -> int:
        return int(self.tensor_of.size)

    def tensor_index(self) -> dict[str, int]:
        return {name: t for t, name in enumerate(self.tensors)}

    def block_bytes(self) -> np.ndarray:
        items = np.asarray(self.itemsize, dtype=np.int64)[self.tensor_of]
        return (self.elem_end - self.elem_start) * items

    def blocks_of(self, t: int) -> range:
        return range(int(self.first_block[t]), int(self.first_block[t + 1]))


def build_layout(base: Checkpoint, block_size: int) -> BlockLayout:
    """Split every floating-point tensor of the base into row blocks of about block_size bytes."""
    file_rank = {f: k for k, f in enumerate(base.files)}
    locs = sorted(
        (loc for loc in base.tensors.values() if loc.dtype in FLOAT_DTYPES),
        key=lambda loc: (file_rank[loc.file], loc.start, loc.name),
    )
    names, items, tensor_of, starts, ends, first = [], [], [], [], [], [0]
    for t, loc in enumerate(locs):
        itemsize = loc.size_bytes // max(1, math.prod(loc.shape)) if loc.shape else loc.size_bytes
        numel = math.prod(loc.shape)
        if numel and itemsize == 0:
            itemsize = 1
        row = math.prod(loc.shape[1:]) if len(loc.shape) >= 2 else 1
        rows_per_block = max(1, block_size // max(1, row * max(1, itemsize)))
        step = rows_per_block * row
        names.append(loc.name)
        items.append(max(1, itemsize))
        for s in range(0, max(numel, 1), step):
            tensor_of.append(t)
            starts.append(s)
            ends.append(min(numel, s + step))
        first.append(len(tensor_of))
    return BlockLayout(
        block_size,
        tuple(names),
        tuple(items),
        np.asarray(tensor_of, dtype=np.int32),
        np.asarray(starts, dtype=np.int64),
        np.asarray(ends, dtype=np.int64),
        np.asarray(first, dtype=np.int64),
    )


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """Statistics of one family (base + experts in spec order) at one block size."""

    key: str
    layout: BlockLayout
    base_hash: np.ndarray  # (B,) uint64
    expert_hash: np.ndarray  # (N, B) uint64
    norms: np.ndarray  # (N, B) float64, ||D_ib||
    zero: np.ndarray  # (N, B) bool, expert bytes == base bytes
    gram: np.ndarray  # (B, N, N) float64, <D_ib, D_jb>

    @property
    def n_experts(self) -> int:
        return int(self.norms.shape[0])

    def tensor_norms(self) -> np.ndarray:
        """(N, T) per-tensor delta norms."""
        sq = self.norms**2
        out = np.zeros((self.n_experts, len(self.layout.tensors)))
        np.add.at(out.T, self.layout.tensor_of, sq.T)
        return np.sqrt(out)


def family_key(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int) -> str:
    blob = json.dumps(
        {
            "v": INDEX_VERSION,
            "block_size": block_size,
            "base": base.identity_json(),
            "experts": [e.identity_json() for e in experts],
        },
        sort_keys=True,
    ).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def _pointer_key(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int) -> str:
    blob = json.dumps([str(base.root), [str(e.root) for e in experts], block_size]).encode()
    return xxhash.xxh3_64_hexdigest(blob)


def _source_ranges(src: Checkpoint, layout: BlockLayout, b0: int, b1: int) -> ReadRange:
    t = int(layout.tensor_of[b0])
    loc = src.tensors[layout.tensors[t]]
    item = layout.itemsize[t]
    return ReadRange(loc.file, loc.start + int(layout.elem_start[b0]) * item,
                     loc.start + int(layout.elem_end[b1 - 1]) * item)


def _chunks(layout: BlockLayout) -> list[tuple[int, int]]:
    """Runs of consecutive blocks of one tensor, each at most about CHUNK_BYTES."""
    out = []
    sizes = layout.block_bytes()
    for t in range(len(layout.tensors)):
        blocks = layout.blocks_of(t)
        b0 = blocks.start
        acc = 0
        for b in blocks:
            if acc and acc + sizes[b] > CHUNK_BYTES:
                out.append((b0, b))
                b0, acc = b, 0
            acc += int(sizes[b])
        if blocks.stop > b0:
            out.append((b0, blocks.stop))
    return out


class _Builder:
    def __init__(self, base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                 on_bytes: Callable[[int], None] | None) -> None:
        self.base, self.experts, self.layout = base, experts, layout
        n, b = len(experts), layout.n_blocks
        self.base_hash = np.zeros(b, dtype=np.uint64)
        self.expert_hash = np.zeros((n, b), dtype=np.uint64)
        self.norms = np.zeros((n, b), dtype=np.float64)
        self.zero = np.zeros((n, b), dtype=bool)
        self.gram = np.zeros((b, n, n), dtype=np.float64)
        self.on_bytes = on_bytes
        self.lock = threading.Lock()

    def chunk(self, b0: int, b1: int) -> None:
        lay = self.layout
        t = int(lay.tensor_of[b0])
        dtype = self.base.tensors[lay.tensors[t]].dtype
        item = lay.itemsize[t]
        origin = int(lay.elem_start[b0])
        base_buf = self.base.read_ranges([_source_ranges(self.base, lay, b0, b1)])[0]
        bufs = [e.read_ranges([_source_ranges(e, lay, b0, b1)])[0] for e in self.experts]
        w0 = decode_f32(base_buf, dtype)
        n = len(self.experts)
        for b in range(b0, b1):
            lo = (int(lay.elem_start[b]) - origin) * item
            hi = (int(lay.elem_end[b]) - origin) * item
            bb = base_buf[lo:hi]
            self.base_hash[b] = xxhash.xxh3_64_intdigest(bb)
            deltas = np.zeros((n, (hi - lo) // item), dtype=np.float64)
            for i, buf in enumerate(bufs):
                eb = buf[lo:hi]
                h = xxhash.xxh3_64_intdigest(eb)
                self.expert_hash[i, b] = h
                if h == self.base_hash[b] and bytes(eb) == bytes(bb):
                    self.zero[i, b] = True
                    continue
                wi = decode_f32(eb, dtype)
                deltas[i] = wi - w0[lo // item : hi // item]
            g = deltas @ deltas.T
            self.gram[b] = g
            self.norms[:, b] = np.sqrt(np.diag(g))
        if self.on_bytes is not None:
            with self.lock:
                self.on_bytes(len(base_buf) + sum(len(x) for x in bufs))


def build_index(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                on_bytes: Callable[[int], None] | None = None, threads: int = 2) -> BlockIndex:
    """Read every base and expert block once and compute the statistics."""
    builder = _Builder(base, experts, layout, on_bytes)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mergefs-index") as pool:
        for fut in [pool.submit(builder.chunk, b0, b1) for b0, b1 in _chunks(layout)]:
            fut.result()
    return BlockIndex(family_key(base, experts, layout.block_size), layout, builder.base_hash,
                      builder.expert_hash, builder.norms, builder.zero, builder.gram)


def index_bytes_total(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout) -> int:
    return int(layout.block_bytes().sum()) * (1 + len(experts))


def _save(index: BlockIndex, path: Path, meta: dict[str, str]) -> None:
    lay = index.layout
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(
        {
            "base_hash": index.base_hash,
            "expert_hash": index.expert_hash,
            "norms": index.norms,
            "zero": index.zero,
            "gram": index.gram,
            "tensor_of": lay.tensor_of,
            "elem_start": lay.elem_start,
            "elem_end": lay.elem_end,
        },
        str(tmp),
        metadata=meta,
    )
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, key: str, layout: BlockLayout) -> BlockIndex | None:
    try:
        arrays = load_file(str(path))
    except Exception as exc:  # a corrupt index is rebuilt, never trusted
        log.warning("ignoring unreadable index %s: %s", path, exc)
        return None
    if not (
        np.array_equal(arrays["tensor_of"], layout.tensor_of)
        and np.array_equal(arrays["elem_start"], layout.elem_start)
        and np.array_equal(arrays["elem_end"], layout.elem_end)
    ):
        log.warning("ignoring index %s: block layout differs", path)
        return None
    return BlockIndex(key, layout, arrays["base_hash"], arrays["expert_hash"], arrays["norms"],
                      arrays["zero"], arrays["gram"])


def _why_rebuilt(pointer: Path, base: Checkpoint, experts: Sequence[Checkpoint]) -> str:
    try:
        old = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return "no index yet for this family and block size"
    for src in [base, *experts]:
        before = old.get("sources", {}).get(str(src.root))
        now = src.identity_json()
        if before != now:
            return f"{src.root} changed since the last index (size, mtime or header differ)"
    return "the previous index file is missing"


def load_or_build(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int,
                  index_dir: str | Path, on_bytes: Callable[[int], None] | None = None,
                  rebuild: bool = False) -> tuple[BlockIndex, bool]:
    """Return (index, built_now). Reuses a stored index while every source is unchanged."""
    layout = build_layout(base, block_size)
    key = family_key(base, experts, block_size)
    folder = Path(index_dir)
    path = folder / f"{key}.safetensors"
    pointer = folder / f"family-{_pointer_key(base, experts, block_size)}.json"
    if path.is_file() and not rebuild:
        index = _load(path, key, layout)
        if index is not None and index.n_experts == len(experts):
            return index, False
    log.info("building block index: %s", "rebuild requested" if rebuild
             else _why_rebuilt(pointer, base, experts))
    index = build_index(base, experts, layout, on_bytes)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _save(index, path, {"mergefs_index_version": INDEX_VERSION, "key": key,
                            "block_size": str(block_size)})
        sources = {str(s.root): s.identity_json() for s in [base, *experts]}
        tmp = pointer.with_name(pointer.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "sources": sources}, indent=1))
        os.replace(tmp, pointer)
    except OSError as exc:
        raise SourceError(f"{folder}: cannot write the index: {exc.strerror}") from None
    return index, True
