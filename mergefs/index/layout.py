"""The block layout: every floating tensor of the base split into blocks of whole rows, numbered in file order. Pure."""

from __future__ import annotations
import math
from dataclasses import dataclass
import numpy as np
from mergefs.sources.local import Checkpoint
from mergefs.core.format import FLOAT_DTYPES


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
        step = max(1, rows_per_block * row)  # row is 0 for a (n, 0) tensor: one empty block
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
