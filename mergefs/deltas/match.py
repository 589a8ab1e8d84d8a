"""Matching delta sidecars to a family: which expert has a sidecar (in mergefs's store under the
index directory, or published beside it) for this base, block size and layout, and whether its
recorded hashes still hold. Reads headers only; blocking I/O."""

from __future__ import annotations
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
import numpy as np
import xxhash
from mergefs.deltas.codes import DELTA_VERSION, DeltaError, EXACT_VERSIONS, TensorLevels
from mergefs.deltas.sidecar import DeltaSidecar, delta_name, open_beside
from mergefs.index import published as sidecar
from mergefs.sources.base import AuxFile
from mergefs.sources.lora import LoraCheckpoint

log = logging.getLogger(__name__)


def _digest(arr: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arr, dtype="<u8").tobytes())


def find(base: Any, experts: Sequence[Any], index: Any,
         store: str | Path | None = None) -> dict[int, DeltaSidecar]:
    """Delta sidecars that match this base, layout and expert bytes: for each expert, the one in
    mergefs's store under ``store`` (a spec's ``index_dir``,
    :func:`mergefs.index.published.stored_path`) first, then the one published beside it
    (``aux_reader``).

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
        for where in ("store", "beside"):
            if where == "store" and store is None:
                continue
            sc = _open(e, name, _digest(index.expert_hash[i]), store if where == "store" else None)
            if sc is None:
                continue
            why = _mismatch(base, e, index, i, key, sc)
            if why is not None:
                log.warning("ignoring delta sidecar %s: %s", sc.path, why)
                sc.close()
                continue
            if sc.meta["version"] not in EXACT_VERSIONS:
                log.info("delta sidecar %s is of version %s: it decodes with the slower product "
                         "of that version; `mergefs compress` writes version %s", sc.path,
                         sc.meta["version"], DELTA_VERSION)
            found[i] = sc
            break
    return found


def _open(expert: Any, name: str, content: str, store: str | Path | None
          ) -> DeltaSidecar | None:
    """``expert``'s sidecar ``name`` in the store under ``store`` (the folder of the expert's
    ``content`` digest), or (``store`` None) beside the expert; None if there is none or it is
    unreadable (logged)."""
    try:
        if store is not None:
            path = sidecar.stored_path(store, content, name)
            return open_beside(AuxFile(str(path), path=path)) if path.is_file() else None
        aux = expert.aux_reader(name)
        return None if aux is None else open_beside(aux)
    except (DeltaError, OSError, KeyError, ValueError, TypeError) as exc:
        log.warning("ignoring delta sidecar %s: unreadable: %s", name, exc)
        return None


def _mismatch(base: Any, e: Any, index: Any, i: int, key: str, sc: DeltaSidecar) -> str | None:
    """Why ``sc`` is not expert ``i``'s sidecar for this base and index, or None."""
    lay = index.layout
    m = sc.meta
    if m.get("base_key") != key or m.get("block_size") != lay.block_size:
        return "published for another base or block size"
    if m.get("layout_xxh3") != sidecar.layout_hash(lay):
        return "block layout differs"
    if [r[:3] for r in m.get("expert", [])] != [r[:3] for r in sidecar.expert_identity(e)]:
        return "the expert changed since it was published"
    if m.get("base_content") != _digest(index.base_hash):
        return "published against a base whose bytes differ"
    if m.get("expert_content") != _digest(index.expert_hash[i]):
        return "published from expert bytes that differ from the indexed ones"
    if any(tl.t >= len(lay.tensors) or lay.tensors[tl.t] != tl.name
           for tl in sc.tensors.values()):
        return "tensor table does not match the layout"
    if any(_shape_problem(base, lay, sc, tl) for tl in sc.tensors.values()):
        return "tensor shapes or range counts do not match the base"
    return None


def _shape_problem(base: Any, lay: Any, sc: DeltaSidecar, tl: TensorLevels) -> bool:
    """Whether ``tl`` disagrees with the base tensor's (rows, cols), or a level's block ranges
    run past the range table (the decoder sizes blocks by ``tl.cols``)."""
    shape = base.tensors[tl.name].shape
    if len(shape) < 2 or tl.rows != shape[0] or tl.cols != math.prod(shape[1:]):
        return True
    n_blocks = len(lay.blocks_of(tl.t))
    return any(lv.first_range + n_blocks > len(sc.range_start) for lv in tl.levels)
