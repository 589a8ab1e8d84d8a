"""Published index sidecars: one expert's block statistics, kept beside the expert.

``mergefs index SPEC --publish`` writes, for every expert, a small safetensors file
``mergefs-index.<base-key>.<block_size>.safetensors`` in the expert's directory (beside a bare
``x.safetensors`` file: ``x.mergefs-index.<base-key>.<block_size>.safetensors``). Per block of
the layout that the base defines at that block size it holds the xxh3 of the base bytes and of
the expert bytes, the delta norm ``||D_ib||`` and the zero flag. ``<base-key>`` hashes the base's
weight file names, sizes and header hashes, so a copy of the base anywhere (local, S3) finds it.

The Gram cross terms ``<D_ib, D_jb>`` need two experts at once and are not published: an index
assembled from sidecars keeps only the Gram diagonal (``BlockIndex.has_gram`` is False), and the
planner then reports ``error_exact`` and ``update_norm`` as null. The bounds and the plan itself
need only the norms and are unchanged.

Planning uses a remote expert's sidecar when its format version, base key, block size and block
layout match, its expert identity (file names, sizes, header hashes, and the ETags when both
sides have one) matches the expert as opened, and its base block hashes equal those of the base
being merged. Anything else is ignored with a log line saying why, and the expert is read in
full instead. Blocking I/O; never on the trio thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors.numpy import load, save

from mergefs.core import format as fmt
from mergefs.index.stats import ORDER_VERSION
from mergefs.sources.local import Checkpoint
from mergefs.core.errors import MergefsError

log = logging.getLogger(__name__)

#: 2: norms in blockstats' fixed summation order (version 1's, of an older order, differ in
#: the last bits from an index built now, so they are ignored, with a log line naming the file)
SIDECAR_VERSION = "2"


@dataclass(frozen=True, eq=False)
class ExpertStats:
    """One expert's per-block statistics relative to one base, as published."""

    base_hash: np.ndarray  # (B,) uint64
    expert_hash: np.ndarray  # (B,) uint64
    norms: np.ndarray  # (B,) float64
    zero: np.ndarray  # (B,) bool


def base_key(base: Checkpoint) -> str:
    """Where-independent key of a base: weight file names, sizes and header hashes."""
    blob = json.dumps([[f, base.identities[f].size_bytes, base.identities[f].header_xxh3]
                       for f in base.files]).encode()
    return xxhash.xxh3_64_hexdigest(blob)


def layout_hash(layout: Any) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps([layout.block_size, list(layout.tensors)]).encode())
    for arr in (layout.tensor_of, layout.elem_start, layout.elem_end):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def expert_identity(expert: Checkpoint) -> list[list[Any]]:
    """File names, sizes, header hashes and ETags: no path, so the sidecar survives a copy."""
    return [[f, expert.identities[f].size_bytes, expert.identities[f].header_xxh3,
             expert.identities[f].etag] for f in expert.files]


#: the folder under a spec's ``index_dir`` where mergefs keeps the files it derives from the
#: experts (``mergefs compress`` without ``--publish``): never inside a source
STORE_FOLDER = "sidecars"


def stored_path(index_dir: str | Path, expert_content: str, name: str) -> Path:
    """Where mergefs's own store under ``index_dir`` keeps an expert's derived file ``name``
    (the name it would have beside the expert): in a folder named for ``expert_content``, the
    digest of the expert's block hashes (a delta sidecar's ``expert_content``), so that the
    same expert bytes anywhere find it and other bytes never do (experts of one family often
    share file names, sizes and headers)."""
    return Path(index_dir) / STORE_FOLDER / expert_content[:32] / name


def sidecar_name(expert: Checkpoint, key: str, block_size: int) -> str:
    name = f"mergefs-index.{key}.{block_size}.safetensors"
    if expert.is_dir:
        return name
    stem = str(expert.path_of(expert.files[0])).rsplit("/", 1)[-1].removesuffix(".safetensors")
    return f"{stem}.{name}"


def encode(stats: ExpertStats, key: str, layout: Any, expert: Checkpoint) -> bytes:
    meta = {"mergefs_sidecar_version": SIDECAR_VERSION, "summation_order": ORDER_VERSION,
            "base_key": key,
            "block_size": str(layout.block_size), "layout_xxh3": layout_hash(layout),
            "expert": json.dumps(expert_identity(expert))}
    return save({"base_hash": stats.base_hash, "expert_hash": stats.expert_hash,
                 "norms": stats.norms, "zero": stats.zero}, metadata=meta)


def publish(base: Checkpoint, experts: Sequence[Checkpoint], index: Any) -> list[str]:
    """Write every expert's sidecar beside it; returns where each went.

    ``index`` must be a full index (read from the sources, not assembled from sidecars).
    """
    if not index.has_gram:
        raise MergefsError("refusing to publish an index assembled from sidecars; rebuild it")
    for e in experts:  # fail before writing anything
        e.check_writable_aux("an index sidecar",
                             "publish from a local, file:// or s3:// copy of the model")
    key = base_key(base)
    written = []
    for i, e in enumerate(experts):
        stats = ExpertStats(index.base_hash, index.expert_hash[i], index.norms[i], index.zero[i])
        data = encode(stats, key, index.layout, e)
        written.append(e.write_aux(sidecar_name(e, key, index.layout.block_size), data,
                                   "index sidecar"))
    return written


def _decode(where: str, data: bytes, key: str, layout: Any, expert: Checkpoint
            ) -> ExpertStats | None:
    try:
        meta = dict(fmt.parse_bytes(data).metadata or {})
        arrays = load(data)
    except Exception as exc:  # noqa: BLE001 (a corrupt sidecar is ignored, never trusted)
        log.warning("ignoring index sidecar %s: unreadable: %s", where, exc)
        return None
    why = None
    if meta.get("mergefs_sidecar_version") != SIDECAR_VERSION:
        why = (f"format version {meta.get('mergefs_sidecar_version')!r}, this mergefs reads "
               f"{SIDECAR_VERSION!r} (republish it: mergefs index SPEC --publish)")
    elif meta.get("summation_order") != ORDER_VERSION:
        why = (f"norms summed in order {meta.get('summation_order')!r}, this mergefs sums in "
               f"{ORDER_VERSION!r} (republish it: mergefs index SPEC --publish)")
    elif meta.get("base_key") != key or meta.get("block_size") != str(layout.block_size):
        why = "published for another base or block size"
    elif meta.get("layout_xxh3") != layout_hash(layout):
        why = "block layout differs"
    else:
        why = _identity_mismatch(meta.get("expert", "[]"), expert)
    if why is None:
        shapes = {k: arrays[k].shape for k in ("base_hash", "expert_hash", "norms", "zero")
                  if k in arrays}
        if len(shapes) != 4 or set(shapes.values()) != {(layout.n_blocks,)}:
            why = "arrays do not match the block layout"
    if why is not None:
        log.warning("ignoring stale index sidecar %s: %s", where, why)
        return None
    return ExpertStats(arrays["base_hash"].astype(np.uint64),
                       arrays["expert_hash"].astype(np.uint64),
                       arrays["norms"].astype(np.float64), arrays["zero"].astype(bool))


def _identity_mismatch(recorded_json: str, expert: Checkpoint) -> str | None:
    try:
        recorded = json.loads(recorded_json)
    except ValueError:
        return "expert identity unreadable"
    now = expert_identity(expert)
    if [r[:3] for r in recorded] != [n[:3] for n in now]:
        return "the expert changed since it was published (files, sizes or headers differ)"
    for r, n in zip(recorded, now):
        if r[3] and n[3] and r[3] != n[3]:
            return f"the expert's {n[0]} was replaced since it was published (ETag differs)"
    return None


def find(base: Checkpoint, experts: Sequence[Checkpoint], layout: Any) -> dict[int, ExpertStats]:
    """Sidecars of the experts worth them (``prefers_published_index``: remote ones) that match
    base key, layout and expert identity.

    The base block hashes are not checked here (that needs the base's bytes): see
    :func:`mergefs.index.blocks.load_or_build`.
    """
    key = base_key(base)

    def one(i: int) -> ExpertStats | None:
        e = experts[i]
        name = sidecar_name(e, key, layout.block_size)
        data = e.read_aux(name)
        if data is None:
            log.info("no index sidecar for %s (%s): reading it in full to plan", e.root, name)
            return None
        return _decode(f"{e.root} ({name})", data, key, layout, e)

    wanted = [i for i, e in enumerate(experts) if e.prefers_published_index]
    if not wanted:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(wanted)),
                            thread_name_prefix="mergefs-sidecar") as pool:
        found = list(pool.map(one, wanted))
    return {i: s for i, s in zip(wanted, found) if s is not None}
