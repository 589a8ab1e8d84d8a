"""Which stored content a source's bytes are: one hashing-only read, compared block by block
with the block hashes of stored pieces.

A source whose files were touched, copied or renamed across devices is not known by its stamp
(:mod:`mergefs.index.store`); its bytes are hashed once (xxh3, as the index hashes blocks) and
compared with every stored candidate of its kind at once. The read stops in the first chunk
where no candidate matches, and hands that chunk's bytes to the rebuild: a source rewritten in
full (or a new fine-tune of a known kind) is read once; one that differs only from a later chunk
on has its equal chunks read twice. Blocking I/O; never on
the trio thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mergefs.index.build import BuildReport, chunks, source_ranges
from mergefs.index.layout import BlockLayout
from mergefs.index.stats import hash_blocks
from mergefs.sources.local import Checkpoint


@dataclass(frozen=True)
class Match:
    """``digest``: the candidate whose every block hash equals the source's (None: none
    does); ``bytes_read``: what the comparison read; ``last``: where no candidate matched, the
    chunk ``(b0, b1)`` (one of :func:`mergefs.index.build.chunks`) it stopped in and its bytes,
    for the rebuild to take instead of reading them again (``Pass.handed``)."""

    digest: str | None
    bytes_read: int
    last: tuple[tuple[int, int], memoryview] | None = None


def match_content(src: Checkpoint, layout: BlockLayout, candidates: dict[str, np.ndarray],
                  report: BuildReport, on_bytes: Callable[[int], None] | None = None) -> Match:
    """Hash ``src``'s blocks chunk by chunk in order and compare with each candidate's (B,)
    block hashes (``candidates``: digest -> hashes), until one matches in full or none can.
    Bytes read are counted in ``report.bytes_read`` and ``report.verify_bytes`` (by root)
    and passed to ``on_bytes``."""
    alive = dict(candidates)
    read = 0
    root = str(src.root)
    for b0, b1 in chunks(layout) if alive else []:
        name = layout.tensors[int(layout.tensor_of[b0])]
        origin = int(layout.elem_start[b0])
        spans = [(int(layout.elem_start[b]) - origin, int(layout.elem_end[b]) - origin)
                 for b in range(b0, b1)]
        [buf] = src.read_ranges([source_ranges(src, layout, b0, b1)])
        read += len(buf)
        report.bytes_read[root] = report.bytes_read.get(root, 0) + len(buf)
        report.verify_bytes[root] = report.verify_bytes.get(root, 0) + len(buf)
        if on_bytes is not None:
            on_bytes(len(buf))
        got = hash_blocks(spans, buf, src.tensors[name].dtype)
        alive = {d: h for d, h in alive.items() if np.array_equal(h[b0:b1], got)}
        if not alive:
            return Match(None, read, ((b0, b1), buf))
    # equal block hashes are the same digest: at most one candidate is left
    return Match(next(iter(alive), None), read)
