"""The stored block index: one piece per source and one per pair of experts, shared by families.

Under ``index_dir/pieces/`` (format ``PIECES_VERSION``), each a small safetensors file written
atomically (a temporary name, fsync, rename):

- ``base-<key>.safetensors``: the base's block hashes and squared block norms ``||W0_b||^2``
  (B,) each (the norms in :mod:`mergefs.index.stats`' order; they bound the merged norms, hence
  the output rounding, in the planner's bounds). Key: the base's identity and the block size.
- ``expert-<key>.safetensors``: one expert's block hashes, squared delta norms ``||D_ib||^2`` and
  zero flags relative to one base (B,) each. Key: base identity, expert identity, block size.
  With ``sketch`` (B, k) float32, the blocks' delta sketches (:mod:`mergefs.index.stats`; a
  piece of an earlier build without them, or of another ``sketch_version``, loads without).
  ``origin`` is ``read`` (computed from the bytes) or ``sidecar`` (taken from a published
  sidecar: accepted only when sidecars are).
- ``pair-<key>.safetensors``: the Gram cross terms ``<D_ib, D_jb>`` (B,) of two experts. Keyed by
  *content*: the digests of the base's and both experts' block hashes, so a pair stays valid
  whatever the experts' paths or order, and goes stale by itself when either expert's bytes do.
- ``source-<key>.json``: the identity a source had when its piece was last built (for the log
  line that says which source changed).

Base and expert pieces record the status-change times of their source's files: a piece whose
source was rewritten in place (size, mtime and header kept) is rebuilt. An index directory of
the earlier format (one file per family, ``family-*.json``) is not read: its families are
rebuilt as pieces, saying so. Blocking I/O; never on the trio thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors.numpy import load, save

from mergefs.core import format as fmt
from mergefs.index.stats import ORDER_VERSION, SKETCH_VERSION, sketch_buckets
from mergefs.sources.local import Checkpoint, write_beside
from mergefs.core.errors import SourceError
from mergefs.index.published import layout_hash
from mergefs.index.layout import BlockLayout


log = logging.getLogger(__name__)

PIECES_VERSION = "3"  # 3: blockstats' fixed summation order; base pieces hold norms
PIECES_DIR = "pieces"


@dataclass(frozen=True, eq=False)
class ExpertPiece:
    """One expert's statistics relative to one base: (B,) arrays."""

    expert_hash: np.ndarray  # uint64
    sq_norms: np.ndarray  # float64, ||D_ib||^2 (the Gram diagonal)
    norms: np.ndarray  # float64, ||D_ib|| (sqrt of sq_norms, or a sidecar's own figures)
    zero: np.ndarray  # bool
    origin: str = "read"  # or "sidecar": no Gram cross terms can be computed without reading
    #: (B, k) float32, the blocks' delta sketches (cross terms estimated without reading);
    #: None: not known (a sidecar's piece, or one of an earlier build)
    sketch: np.ndarray | None = None

    def digest(self) -> str:
        return content_digest(self.expert_hash)


@dataclass(frozen=True)
class ExpertLoad:
    """A stored expert piece, or why there is none usable. ``may_be_same``: the expert's bytes
    may be those of its stored pairs (touched, rewritten, piece lost), so its Gram pairs wait
    until its new block hashes show whether the stored ones still hold."""

    piece: ExpertPiece | None
    why: str | None = None
    may_be_same: bool = False


def content_digest(hashes: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(hashes, dtype="<u8").tobytes())


def _key(doc: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps({"v": PIECES_VERSION, **doc},
                                                sort_keys=True).encode())


def base_key(base: Checkpoint, block_size: int) -> str:
    return _key({"block_size": block_size, "base": base.identity_json()})


def expert_key(base: Checkpoint, expert: Checkpoint, block_size: int) -> str:
    return _key({"block_size": block_size, "base": base.identity_json(),
                 "expert": expert.identity_json()})


def dtype_digest(src: Checkpoint, tensors: Sequence[str]) -> str:
    """The dtypes ``src``'s bytes are decoded with, in layout order: the same bytes read as
    bf16 or as fp16 are other values, so Gram terms depend on them too."""
    return xxhash.xxh3_64_hexdigest(json.dumps([src.tensors[t].dtype for t in tensors]).encode())


def pair_key(base_hash: np.ndarray, a: ExpertPiece, b: ExpertPiece, block_size: int,
             dtypes: tuple[str, str, str] = ("", "", "")) -> str:
    """Key of the Gram terms of experts ``a`` and ``b``: their block contents, the base's, and
    ``dtypes`` (:func:`dtype_digest` of base, a, b)."""
    base_dt, a_dt, b_dt = dtypes
    pair = sorted([(a.digest(), a_dt), (b.digest(), b_dt)])
    return _key({"block_size": block_size, "base": [content_digest(base_hash), base_dt],
                 "pair": pair})


class PieceStore:
    """The pieces of one base and block layout under ``index_dir``."""

    def __init__(self, index_dir: str | Path, layout: BlockLayout) -> None:
        self.root = Path(index_dir)
        self.folder = self.root / PIECES_DIR
        self.layout = layout
        self.layout_xxh3 = layout_hash(layout)

    # -- reading ---------------------------------------------------------------------------
    def _read(self, path: Path, names: tuple[str, ...], optional: tuple[str, ...] = ()
              ) -> tuple[dict[str, np.ndarray], dict[str, str]] | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("ignoring unreadable index piece %s: %s", path, exc.strerror)
            return None
        try:
            meta = dict(fmt.parse_bytes(data).metadata or {})
            arrays = load(data)
        except Exception as exc:  # noqa: BLE001 (a corrupt piece is rebuilt, never trusted)
            log.warning("ignoring unreadable index piece %s: %s", path, exc)
            return None
        why = None
        if meta.get("mergefs_index_version") != PIECES_VERSION:
            why = f"format version {meta.get('mergefs_index_version')!r}"
        elif meta.get("summation_order") != ORDER_VERSION:
            why = f"summation order {meta.get('summation_order')!r}, not {ORDER_VERSION!r}"
        elif meta.get("layout_xxh3") != self.layout_xxh3:
            why = "block layout differs"
        elif not set(names) <= set(arrays) <= set(names) | set(optional) or any(
                a.shape[:1] != (self.layout.n_blocks,) or a.ndim != 1 + (name in optional)
                for name, a in arrays.items()):
            why = "arrays do not match the block layout"
        if why is not None:
            log.warning("ignoring index piece %s: %s", path, why)
            return None
        return arrays, meta

    def _ctime_moved(self, meta: dict[str, str], src: Checkpoint) -> str | None:
        try:
            recorded = json.loads(meta.get("ctime_ns", "{}"))
            if not isinstance(recorded, dict):
                raise TypeError("not a mapping")
        except (ValueError, TypeError) as exc:  # another writer's or version's: not trusted
            return f"its index piece has an unreadable ctime_ns record ({exc})"
        for path, now in src.file_ctimes().items():
            if recorded.get(path, now) != now:
                return (f"{path} was modified since the last index (its status-change time "
                        "moved while size, mtime and header stayed the same)")
        return None

    def load_base(self, key: str, base: Checkpoint
                  ) -> tuple[tuple[np.ndarray, np.ndarray] | None, str | None]:
        """((base block hashes, squared block norms) or None, why it must be rebuilt: None if
        it need not)."""
        got = self._read(self.folder / f"base-{key}.safetensors", ("base_hash", "base_sq_norms"))
        if got is None:
            return None, self.why_missing(base, "base")
        moved = self._ctime_moved(got[1], base)
        if moved:
            return None, moved
        return (got[0]["base_hash"].astype(np.uint64),
                got[0]["base_sq_norms"].astype(np.float64)), None

    def load_expert(self, key: str, expert: Checkpoint, base: Checkpoint,
                    base_hash: np.ndarray, accept_sidecar: bool) -> ExpertLoad:
        """The expert's piece, or why it must be built. A piece built against other base
        bytes (the base rewritten in place) is stale."""
        got = self._read(self.folder / f"expert-{key}.safetensors",
                         ("expert_hash", "sq_norms", "norms", "zero"), ("sketch",))
        if got is None:
            why = self.why_missing(expert, "expert")
            return ExpertLoad(None, why, may_be_same=not why.startswith("no index yet"))
        arrays, meta = got
        origin = meta.get("origin", "read")
        if origin != "read" and not accept_sidecar:
            return ExpertLoad(None, f"{expert.root} was indexed from its published sidecar only")
        if meta.get("base_xxh3") != content_digest(base_hash):
            return ExpertLoad(None, f"{base.root} changed since {expert.root} was indexed")
        moved = self._ctime_moved(meta, expert)
        if moved:
            return ExpertLoad(None, moved, may_be_same=True)
        return ExpertLoad(ExpertPiece(arrays["expert_hash"].astype(np.uint64),
                                      arrays["sq_norms"].astype(np.float64),
                                      arrays["norms"].astype(np.float64),
                                      arrays["zero"].astype(bool), origin,
                                      self._sketch(arrays, meta)))

    def _sketch(self, arrays: dict[str, np.ndarray], meta: dict[str, str]
                ) -> np.ndarray | None:
        """A piece's sketches, if of this sketch version and bucket count."""
        got = arrays.get("sketch")
        if got is None or meta.get("sketch_version") != SKETCH_VERSION or \
                got.shape[1] != sketch_buckets(self.layout.block_size):
            return None
        return got.astype(np.float32)

    def load_pair(self, key: str) -> np.ndarray | None:
        got = self._read(self.folder / f"pair-{key}.safetensors", ("gram",))
        return None if got is None else got[0]["gram"].astype(np.float64)

    def why_missing(self, src: Checkpoint, role: str) -> str:
        """Why ``src`` has no usable piece: the log line names the source that changed."""
        try:
            before = json.loads(self._record_path(src, role).read_text())
        except (OSError, ValueError):
            old = list(self.root.glob("family-*.json")) and not self.folder.is_dir()
            return f"no index yet for {src.root} (block size {self.layout.block_size})" + (
                f"; {self.root} holds an index of an earlier format (one file per family), "
                "which is not read" if old else "")
        if before != src.identity_json():
            return f"{src.root} changed since the last index (size, mtime or header differ)"
        return f"the index piece of {src.root} is missing"

    # -- writing ---------------------------------------------------------------------------
    def _write(self, path: Path, arrays: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SourceError(f"{self.root}: cannot write the index: {exc.strerror}") from None
        meta = {"mergefs_index_version": PIECES_VERSION, "summation_order": ORDER_VERSION,
                "layout_xxh3": self.layout_xxh3,
                "block_size": str(self.layout.block_size), **meta}
        write_beside(path, save(arrays, metadata=meta), "index")

    def _record_path(self, src: Checkpoint, role: str) -> Path:
        name = xxhash.xxh3_64_hexdigest(json.dumps([role, str(src.root),
                                                    self.layout.block_size]).encode())
        return self.folder / f"source-{name}.json"

    def _record(self, src: Checkpoint, role: str) -> None:
        write_beside(self._record_path(src, role), json.dumps(src.identity_json()).encode(),
                     "index")

    def save_base(self, key: str, base: Checkpoint, base_hash: np.ndarray,
                  base_sq: np.ndarray, ctimes: dict[str, int]) -> None:
        self._write(self.folder / f"base-{key}.safetensors",
                    {"base_hash": base_hash, "base_sq_norms": base_sq},
                    {"kind": "base", "root": str(base.root), "ctime_ns": json.dumps(ctimes)})
        self._record(base, "base")

    def save_expert(self, key: str, expert: Checkpoint, piece: ExpertPiece,
                    base_hash: np.ndarray, ctimes: dict[str, int]) -> None:
        sketch = {} if piece.sketch is None else {"sketch": piece.sketch}
        self._write(self.folder / f"expert-{key}.safetensors",
                    {"expert_hash": piece.expert_hash, "sq_norms": piece.sq_norms,
                     "norms": piece.norms, "zero": piece.zero, **sketch},
                    {"kind": "expert", "origin": piece.origin, "root": str(expert.root),
                     "sketch_version": SKETCH_VERSION,
                     "base_xxh3": content_digest(base_hash), "ctime_ns": json.dumps(ctimes)})
        self._record(expert, "expert")

    def save_pair(self, key: str, gram: np.ndarray) -> None:
        self._write(self.folder / f"pair-{key}.safetensors", {"gram": gram}, {"kind": "pair"})
