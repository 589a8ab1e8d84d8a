"""Matching published delta sidecars to a family: which expert has a sidecar for this base, block size and layout, and whether its recorded hashes still hold. Reads headers only; blocking I/O."""

from __future__ import annotations
import logging
import math
from collections.abc import Sequence
from typing import Any
import numpy as np
import xxhash
from mergefs.deltas.codes import DELTA_VERSION, DeltaError, EXACT_VERSIONS, TensorLevels
from mergefs.deltas.sidecar import DeltaSidecar, delta_name, open_beside
from mergefs.index import published as sidecar
from mergefs.sources.lora import LoraCheckpoint

log = logging.getLogger(__name__)


def _digest(arr: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arr, dtype="<u8").tobytes())


def find(base: Any, experts: Sequence[Any], index: Any) -> dict[int, DeltaSidecar]:
    """Delta sidecars beside the experts (``aux_reader``) that match this base, layout and
    expert bytes.

    A sidecar matches when its base key, block size, layout hash and expert identity match and
    the content hashes of the base blocks and of the expert's blocks equal the index's (so it
    was computed from exactly these bytes). Anything else is ignored with a log line saying why.
    """

    key = sidecar.base_key(base)
    lay = index.layout
    found: dict[int, DeltaSidecar] = {}

    for i, e in enumerate(experts):
        if isinstance(e, LoraCheckpoint):
            continue  # adapters are read as exact factors
        name = delta_name(sidecar.sidecar_name(e, key, lay.block_size))
        try:
            aux = e.aux_reader(name)
            if aux is None:
                continue
            path = aux.where
            sc = open_beside(aux)
        except (DeltaError, OSError, KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring delta sidecar %s: unreadable: %s", name, exc)
            continue
        m = sc.meta
        why = None
        if m.get("base_key") != key or m.get("block_size") != lay.block_size:
            why = "published for another base or block size"
        elif m.get("layout_xxh3") != sidecar.layout_hash(lay):
            why = "block layout differs"
        elif [r[:3] for r in m.get("expert", [])] != [r[:3] for r in sidecar.expert_identity(e)]:
            why = "the expert changed since it was published"
        elif m.get("base_content") != _digest(index.base_hash):
            why = "published against a base whose bytes differ"
        elif m.get("expert_content") != _digest(index.expert_hash[i]):
            why = "published from expert bytes that differ from the indexed ones"
        elif any(tl.t >= len(lay.tensors) or lay.tensors[tl.t] != tl.name
                 for tl in sc.tensors.values()):
            why = "tensor table does not match the layout"
        elif any(_shape_problem(base, lay, sc, tl) for tl in sc.tensors.values()):
            why = "tensor shapes or range counts do not match the base"
        if why is not None:
            log.warning("ignoring delta sidecar %s: %s", path, why)
            continue
        if m["version"] not in EXACT_VERSIONS:
            log.info("delta sidecar %s is of version %s: it decodes with the slower product of "
                     "that version; `mergefs compress` writes version %s", path, m["version"],
                     DELTA_VERSION)
        found[i] = sc
    return found


def _shape_problem(base: Any, lay: Any, sc: DeltaSidecar, tl: TensorLevels) -> bool:
    """Whether ``tl`` disagrees with the base tensor's (rows, cols), or a level's block ranges
    run past the range table (the decoder sizes blocks by ``tl.cols``)."""
    shape = base.tensors[tl.name].shape
    if len(shape) < 2 or tl.rows != shape[0] or tl.cols != math.prod(shape[1:]):
        return True
    n_blocks = len(lay.blocks_of(tl.t))
    return any(lv.first_range + n_blocks > len(sc.range_start) for lv in tl.levels)
