"""The stored block index: one piece per source and one per pair of experts, shared by families.

Under ``index_dir/pieces/`` (format ``PIECES_VERSION``), each a small safetensors file written
atomically (a temporary name, fsync, rename):

- ``base-<key>.safetensors``: the base's block hashes and squared block norms ``||W0_b||^2``
  (B,) each (the norms in :mod:`mergefs.index.stats`' order; they bound the merged norms, hence
  the output rounding, in the planner's bounds). Key: the digest of its block hashes, its dtypes.
- ``expert-<key>.safetensors``: one expert's block hashes, squared delta norms ``||D_ib||^2`` and
  zero flags relative to one base (B,) each. Key: the base's and the expert's digests and dtypes.
  With ``sketch`` (B, k) float32, the blocks' delta sketches (:mod:`mergefs.index.stats`; a
  piece of an earlier build without them, or of another ``sketch_version``, loads without).
  ``origin`` is ``read`` (computed from the bytes) or ``sidecar`` (taken from a published
  sidecar: accepted only when sidecars are).
- ``pair-<key>.safetensors``: the Gram cross terms ``<D_ib, D_jb>`` (B,) of two experts. Keyed by
  *content*: the digests of the base's and both experts' block hashes, so a pair stays valid
  whatever the experts' paths or order, and goes stale by itself when either expert's bytes do.
- ``source-<kind>-<stamp>.json``: which content a source on disk holds (below).

Pieces are keyed by content, never by paths or times: a base piece by the digest of the base's
block hashes, an expert piece by the base's and the expert's digests (and their dtypes). What
connects a source on disk to a digest is a *source record*, ``source-<kind>-<stamp>.json``:
``stamp`` hashes each weight file's size, mtime, device, inode and header hash (no path: a
renamed model directory keeps it), ``kind`` only the sizes and header hashes (what fine-tunes of
one base share); the record holds the digest and the files' status-change times. A source whose
stamp has a record with the same status-change times is known without reading. Any other
(touched, copied, rewritten in place, or a record without times) is *verified*: its bytes are
hashed once and compared with the stored pieces of its kind (:mod:`mergefs.index.verify`); a
match reuses the piece and its pairs and records the new stamp, a mismatch rebuilds it.

Each load records what a family assembled, ``usage-<key>.json`` (the piece names, the time,
the sources' roots): what ``mergefs index gc`` (:mod:`mergefs.index.collect`) keeps. An index
directory of the earlier format (one file per family, ``family-*.json``) is not read: its
families are rebuilt as pieces, saying so. Blocking I/O; never on the trio thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
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

PIECES_VERSION = "4"  # 4: pieces keyed by content (digests), source records; 3: fixed
# summation order, base pieces hold norms
PIECES_DIR = "pieces"
SOURCE_PREFIX = "source-"
USAGE_PREFIX = "usage-"


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
    may be those of its stored pairs (its piece lost), so its Gram pairs wait until its new
    block hashes show whether the stored ones still hold."""

    piece: ExpertPiece | None
    why: str | None = None
    may_be_same: bool = False


@dataclass(frozen=True)
class SourceId:
    """What a source on disk is, taken before reading it (a change during a build shows at
    the next load). ``stamp``: sizes, mtimes, devices, inodes and header hashes of its weight
    files (no path); ``kind``: sizes and header hashes only (sources that may hold the same
    bytes); ``ctimes``: the files' status-change times in file order (None: not local files,
    whose identity is the stamp: a remote object's ETag)."""

    stamp: str
    kind: str
    ctimes: tuple[int, ...] | None
    root: str
    paths: tuple[str, ...] = ()  # the files, for messages only


def content_digest(hashes: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(hashes, dtype="<u8").tobytes())


def _key(doc: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps({"v": PIECES_VERSION, **doc},
                                                sort_keys=True).encode())


def _h64(doc: object) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True).encode())


def source_id(src: Checkpoint, layout_xxh3: str) -> SourceId:
    """The source's :class:`SourceId` now (local weight files are stat'ed; anything else is
    known by its identity, as opened)."""
    ident = src.identity_json()
    extra = {k: v for k, v in ident.items() if k not in ("root", "files")}  # adapter, recipe
    stats = []
    for f in src.files if not src.is_remote and src.file_ctimes() else []:
        try:
            st = os.stat(src.path_of(f))
        except (OSError, ValueError):
            stats = []
            break
        stats.append(st)
    local = bool(stats)
    if not local:
        whole = _h64([layout_xxh3, ident])
        return SourceId(whole, whole, None, str(src.root))
    paths = tuple(str(src.path_of(f)) for f in src.files)
    heads = [(src.identities[f].size_bytes, src.identities[f].header_xxh3) for f in src.files]
    stamp = [[st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, h]
             for st, (_, h) in zip(stats, heads)]
    return SourceId(_h64([layout_xxh3, stamp, extra]), _h64([layout_xxh3, heads, extra]),
                    tuple(st.st_ctime_ns for st in stats), str(src.root), paths)


def base_key(base_digest: str, dtypes: str, block_size: int) -> str:
    """Key of the base piece of the base bytes whose block hashes have ``base_digest``."""
    return _key({"block_size": block_size, "base": [base_digest, dtypes]})


def expert_key(base_digest: str, base_dtypes: str, expert_digest: str, expert_dtypes: str,
               block_size: int) -> str:
    """Key of an expert's piece: its block contents and the base's, and both dtypes."""
    return _key({"block_size": block_size, "base": [base_digest, base_dtypes],
                 "expert": [expert_digest, expert_dtypes]})


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


def piece_name(kind: str, key: str) -> str:
    """The file name of a piece (``kind``: base, expert or pair)."""
    return f"{kind}-{key}.safetensors"


class PieceStore:
    """The pieces of one base and block layout under ``index_dir``."""

    def __init__(self, index_dir: str | Path, layout: BlockLayout) -> None:
        self.root = Path(index_dir)
        self.folder = self.root / PIECES_DIR
        self.layout = layout
        self.layout_xxh3 = layout_hash(layout)
        self.used: set[str] = set()  # piece file names loaded or written by this store

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

    def _source_path(self, sid: SourceId) -> Path:
        return self.folder / f"{SOURCE_PREFIX}{sid.kind}-{sid.stamp}.json"

    def lookup(self, sid: SourceId) -> tuple[str | None, str | None]:
        """(the digest ``sid``'s source is known to hold, or None; why it is not known: None
        for a source never indexed)."""
        try:
            rec = json.loads(self._source_path(sid).read_text())
            digest, ctimes = rec["digest"], rec.get("ctime_ns")
            if not isinstance(digest, str):
                raise TypeError("digest is not a string")
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, TypeError, KeyError) as exc:  # never trusted
            return None, f"its source record is unreadable ({exc})"
        if ctimes is not None and sid.ctimes is not None and list(ctimes) != list(sid.ctimes):
            moved = [p for p, a, b in zip(sid.paths, ctimes, sid.ctimes) if a != b]
            return None, (f"{moved[0] if moved else sid.root} was modified since the last "
                          "index (its status-change time moved while size, mtime and header "
                          "stayed the same)")
        return digest, None

    def kin(self, sid: SourceId) -> list[tuple[str, str]]:
        """(digest, root) of each record of a source of ``sid``'s kind (same sizes and
        headers): what a verifying read compares with. Sources known by identity only (remote)
        have none."""
        if sid.ctimes is None:
            return []
        out = []
        for path in sorted(self.folder.glob(f"{SOURCE_PREFIX}{sid.kind}-*.json")):
            try:
                rec = json.loads(path.read_text())
                digest, root = rec["digest"], rec.get("root", "")
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if isinstance(digest, str) and (digest, root) not in out:
                out.append((digest, str(root)))
        return out

    def remember(self, sid: SourceId, digest: str) -> None:
        """Record that ``sid``'s source holds the content ``digest`` (after reading it)."""
        rec: dict[str, object] = {"digest": digest, "root": sid.root}
        if sid.ctimes is not None:
            rec["ctime_ns"] = list(sid.ctimes)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_beside(self._source_path(sid), json.dumps(rec).encode(), "index")

    def load_base(self, key: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(base block hashes, squared block norms) of the base piece ``key``, or None."""
        got = self._read(self.folder / piece_name("base", key), ("base_hash", "base_sq_norms"))
        if got is None:
            return None
        return (got[0]["base_hash"].astype(np.uint64),
                got[0]["base_sq_norms"].astype(np.float64))

    def load_expert(self, key: str, expert: Checkpoint, base_hash: np.ndarray,
                    accept_sidecar: bool) -> ExpertLoad:
        """The expert piece ``key``, or why it cannot be used (None: there is none)."""
        got = self._read(self.folder / piece_name("expert", key),
                         ("expert_hash", "sq_norms", "norms", "zero"), ("sketch",))
        if got is None:
            return ExpertLoad(None)
        arrays, meta = got
        origin = meta.get("origin", "read")
        if origin != "read" and not accept_sidecar:
            return ExpertLoad(None, f"{expert.root} was indexed from its published sidecar only")
        if meta.get("base_xxh3") != content_digest(base_hash):  # keys hold it: a damaged piece
            return ExpertLoad(None, f"the index piece of {expert.root} names another base")
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
        got = self._read(self.folder / piece_name("pair", key), ("gram",))
        if got is None:
            return None
        self.use("pair", key)
        return got[0]["gram"].astype(np.float64)

    def use(self, kind: str, key: str) -> None:
        """Count the piece ``kind``-``key`` as one the family assembles (its usage record)."""
        self.used.add(piece_name(kind, key))

    def has(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def first_time(self, src: Checkpoint) -> str:
        """The log line's reason for a source never indexed here."""
        old = list(self.root.glob("family-*.json")) and not self.folder.is_dir()
        return f"no index yet for {src.root} (block size {self.layout.block_size})" + (
            f"; {self.root} holds an index of an earlier format (one file per family), "
            "which is not read" if old else "")

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
        self.used.add(path.name)

    def save_base(self, key: str, base: Checkpoint, base_hash: np.ndarray,
                  base_sq: np.ndarray) -> None:
        self._write(self.folder / piece_name("base", key),
                    {"base_hash": base_hash, "base_sq_norms": base_sq},
                    {"kind": "base", "root": str(base.root), "digest": content_digest(base_hash)})

    def save_expert(self, key: str, expert: Checkpoint, piece: ExpertPiece,
                    base_hash: np.ndarray) -> None:
        sketch = {} if piece.sketch is None else {"sketch": piece.sketch}
        self._write(self.folder / piece_name("expert", key),
                    {"expert_hash": piece.expert_hash, "sq_norms": piece.sq_norms,
                     "norms": piece.norms, "zero": piece.zero, **sketch},
                    {"kind": "expert", "origin": piece.origin, "root": str(expert.root),
                     "sketch_version": SKETCH_VERSION,
                     "base_xxh3": content_digest(base_hash), "digest": piece.digest()})

    def save_pair(self, key: str, gram: np.ndarray) -> None:
        self._write(self.folder / piece_name("pair", key), {"gram": gram}, {"kind": "pair"})

    def note_use(self, roots: Sequence[str]) -> None:
        """Record which pieces this family assembled, and when (``usage-<key>.json``, keyed
        by the piece names: one record per distinct family content). Best effort: an index
        directory that cannot be written still serves reads (logged)."""
        names = sorted(self.used)
        if not names:
            return
        doc = {"pieces": names, "used_unix": time.time(), "roots": list(roots)}
        path = self.folder / f"{USAGE_PREFIX}{xxhash.xxh3_128_hexdigest(json.dumps(names).encode())}.json"
        try:
            write_beside(path, json.dumps(doc).encode(), "index usage record")
        except SourceError as exc:
            log.debug("not recording the index's use: %s", exc)
