"""The block index: per (expert, block) delta norms, hashes and zero flags, built once, reused.

A *block* is a contiguous range of whole rows of one floating-point tensor, about ``block_size``
bytes (a tensor smaller than that is one block). Blocks are numbered in the base's file order.
For every block the index holds the xxh3 of the base bytes, the base norm ``||W0_b||`` and, per
expert, the xxh3 of the
expert bytes, the delta L2 norm ``||W_i - W0||`` (float32 deltas, float64 accumulation), a zero
flag (bytes identical to the base) and the Gram matrix ``<D_i, D_j>`` of the experts' deltas, which
gives the norm of any additive combination (bounds relative to the merge update, and the error
of a plan): exact where its cross terms are, else an estimate with a stated error bar.

The index is stored as pieces (:mod:`mergefs.index.store`): one per base, one per (base,
expert), and one per pair of experts for the exact Gram cross terms. An expert's piece also
holds per-block sketches of its delta (:mod:`mergefs.index.stats`), from which the cross terms
of two experts are *estimated* without reading either (``BlockIndex.gram_exact`` says which
pairs are exact). A family's :class:`BlockIndex` is assembled from the pieces in spec order
(:func:`assemble`): adding an expert reads only it and the base (a delta needs the base's
values), never the other experts; removing or reordering experts builds nothing, and specs
sharing experts share pieces. Exact pairs are built only on request (``exact``: ``mergefs
index --exact``), reading each pair's experts where both deltas are non-zero; stored exact
pairs are always used. Building reads files in order on two worker threads
(:mod:`mergefs.index.build`); the statistics themselves are pure functions of bytes (:mod:`mergefs.index.stats`). A remote expert with a
matching published sidecar (:mod:`mergefs.index.published`) is not read at all: its piece comes from
the sidecar, and an index with such an expert has no Gram cross terms for it (``has_gram``
False). Nothing here runs on the trio thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from mergefs.index import published as sidecar
from mergefs.sources.local import Checkpoint
from mergefs.core.errors import SourceError
from mergefs.core.format import DTYPES
from mergefs.core.sizes import human_bytes
from mergefs.index.build import BuildReport, ChunkRunner, Pass
from mergefs.index.store import (
    ExpertPiece, PieceStore, SourceId, base_key, content_digest, dtype_digest, expert_key,
    pair_key, source_id,
)
from mergefs.index.collect import collect
from mergefs.index.verify import match_content
from mergefs.index.published import ExpertStats
from mergefs.index.layout import BlockLayout, build_layout
from mergefs.index.stats import sketch_buckets

log = logging.getLogger(__name__)

INDEX_VERSION = "2"  # of the family key (plan hashes, manifests); pieces: PIECES_VERSION
# 2: norms and Gram terms in blockstats' fixed order, base norms (bounds with the rounding term)


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
    has_gram: bool = True  # False: only the diagonal is known (statistics from sidecars)
    #: (N, T) bytes per element of each expert's tensors; None: the base's (``layout.itemsize``)
    expert_itemsize: np.ndarray | None = None
    #: (B,) float64 ``||W0_b||``, the base's block norms (the output-rounding term of the
    #: planner's bounds); None: not known (an index built elsewhere), no rounding term
    base_norms: np.ndarray | None = None
    #: the stored pieces it was assembled from (file names under ``index_dir/pieces``; what a
    #: live mount registers, :func:`mergefs.index.collect.register_live`); empty: not stored
    pieces: tuple[str, ...] = ()
    #: (N, N) bool: the pair's Gram terms are exact (stored pair, or the same expert twice);
    #: False: estimated from the two pieces' sketches. None: every known term is exact
    gram_exact: np.ndarray | None = None
    #: buckets of the sketches the estimated terms come from (blocks of at most this many
    #: elements are sketched whole: exact); 0 without estimates
    sketch_buckets: int = 0

    @property
    def n_experts(self) -> int:
        return int(self.norms.shape[0])

    def expert_block_bytes(self) -> np.ndarray:
        """(N, B) bytes of each expert's blocks: what reading them costs."""
        if self.expert_itemsize is None:
            return np.broadcast_to(self.layout.block_bytes(), self.norms.shape)
        elems = self.layout.elem_end - self.layout.elem_start
        return elems[None, :] * self.expert_itemsize[:, self.layout.tensor_of]

    def tensor_norms(self) -> np.ndarray:
        """(N, T) per-tensor delta norms."""
        sq = self.norms**2
        out = np.zeros((self.n_experts, len(self.layout.tensors)))
        np.add.at(out.T, self.layout.tensor_of, sq.T)
        return np.sqrt(out)


def family_key(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int) -> str:
    """The family's name: base and experts' identities in spec order, and the block size."""
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


def build_index(base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                on_bytes: Callable[[int], None] | None = None, threads: int = 2,
                runner: ChunkRunner | None = None) -> BlockIndex:
    """Read every base and expert block once and compute the statistics (nothing stored)."""
    keys = [e.identity_key() for e in experts]
    first = [keys.index(k) for k in keys]  # the same expert twice is read once
    uniq = sorted(set(first))
    pairs = [(i, j) for a, i in enumerate(uniq) for j in uniq[a:]]
    p = Pass(base, experts, layout, uniq, pairs, {}, True, on_bytes, BuildReport())
    p.run(threads, runner)
    pieces = {i: _piece(p, k, pairs) for k, i in enumerate(uniq)}
    grams = {(i, j): p.gram[k] for k, (i, j) in enumerate(pairs) if i != j}
    return assemble(family_key(base, experts, layout.block_size), layout, p.base_hash,
                    [pieces[f] for f in first], _expand(grams, first),
                    _expert_itemsize(experts, layout), np.sqrt(p.base_sq))


def _piece(p: Pass, k: int, pairs: list[tuple[int, int]]) -> ExpertPiece:
    i = p.own[k]
    sq = p.gram[pairs.index((i, i))]
    return ExpertPiece(p.expert_hash[k], sq, np.sqrt(sq), p.zero[k], sketch=p.sketch[k])


def _expand(grams: dict[tuple[int, int], np.ndarray], first: list[int]
            ) -> dict[tuple[int, int], np.ndarray]:
    """Gram terms by family position from those by unique expert (``first[i]``: i's)."""
    out = {}
    for i in range(len(first)):
        for j in range(i + 1, len(first)):
            a, b = sorted((first[i], first[j]))
            if a != b and (a, b) in grams:
                out[(i, j)] = grams[(a, b)]
    return out


def assemble(key: str, layout: BlockLayout, base_hash: np.ndarray,
             pieces: Sequence[ExpertPiece], grams: dict[tuple[int, int], np.ndarray],
             expert_itemsize: np.ndarray | None = None,
             base_norms: np.ndarray | None = None) -> BlockIndex:
    """The family's index from stored pieces in spec order: ``pieces[i]`` is expert i's,
    ``grams[(i, j)]`` (i < j) their exact cross terms. The same expert twice has its squared
    norms as cross terms; a pair left out is estimated from the two pieces' sketches
    (``gram_exact`` False there), or, where a piece has none (an expert known from a sidecar
    only), makes ``has_gram`` False.
    """
    n, nb = len(pieces), layout.n_blocks
    gram = np.zeros((nb, n, n), dtype=np.float64)
    exact = np.ones((n, n), dtype=bool)
    complete = True
    for i, pi in enumerate(pieces):
        gram[:, i, i] = pi.sq_norms
        for j in range(i + 1, n):
            g = pi.sq_norms if pieces[j] is pi else grams.get((i, j))
            if g is None:
                g = _estimate(pi, pieces[j])
                exact[i, j] = exact[j, i] = False
            if g is None:
                complete = False
                continue
            gram[:, i, j] = gram[:, j, i] = g
    stack = (lambda name, dt: np.stack([getattr(p, name) for p in pieces]).astype(dt)
             if pieces else np.zeros((0, nb), dtype=dt))
    return BlockIndex(key, layout, base_hash, stack("expert_hash", np.uint64),
                      stack("norms", np.float64), stack("zero", bool), gram,
                      has_gram=complete, expert_itemsize=expert_itemsize,
                      base_norms=base_norms, gram_exact=exact,
                      sketch_buckets=0 if exact.all() else sketch_buckets(layout.block_size))


def _estimate(a: ExpertPiece, b: ExpertPiece) -> np.ndarray | None:
    """(B,) the cross terms ``<D_ab, D_bb>`` estimated from the two pieces' sketches (float64
    products of the float32 buckets, summed in bucket order), or None without sketches."""
    if a.sketch is None or b.sketch is None:
        return None
    return np.einsum("bk,bk->b", a.sketch.astype(np.float64), b.sketch.astype(np.float64))


def _expert_itemsize(experts: Sequence[Checkpoint], layout: BlockLayout) -> np.ndarray:
    """(N, T) bytes each expert reads per element of its tensors (their dtypes may differ from
    the base's; a LoRA expert computes its adapted tensors from the base's bytes: 0)."""
    out = np.zeros((len(experts), len(layout.tensors)), dtype=np.int64)
    for i, e in enumerate(experts):
        out[i] = [e.read_itemsize(name) for name in layout.tensors]
    return out


def load_or_build(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int,
                  index_dir: str | Path, on_bytes: Callable[[int], None] | None = None,
                  rebuild: bool = False, sidecars: bool = True,
                  report: BuildReport | None = None,
                  runner: ChunkRunner | None = None, exact: bool = False,
                  on_total: Callable[[int], None] | None = None,
                  max_size_bytes: int | None = None) -> tuple[BlockIndex, bool]:
    """Return (index, built_now): the family's index assembled from stored pieces, building
    only the pieces that are missing or stale (each rebuild logged with the source's name).

    With ``sidecars`` (the default), remote experts with a matching published sidecar are not
    read; without, only pieces read from every source (hence the full Gram) are accepted.
    ``rebuild`` reads every source again. ``report`` (optional) receives the counters.
    ``runner``: where the build passes compute their chunks (default: two local threads).
    ``exact``: also build the exact Gram cross terms of every pair of read experts that has
    none stored (reading both where both deltas are non-zero); otherwise pairs without stored
    terms are estimated from the pieces' sketches. ``on_total`` is told, before any read, the
    bytes this build will read (``on_bytes`` then counts up to it; with ``exact``, pairs of a
    new expert are counted as if its every block were non-zero, and the total is set to what
    was read once done). ``max_size_bytes`` (the spec's ``index_max_size``): after a build,
    remove the least recently used pieces of other families until ``index_dir`` fits
    (:func:`mergefs.index.collect.collect`).
    """
    layout = build_layout(base, block_size)
    store = PieceStore(index_dir, layout)
    b = _Family(base, experts, layout, store, report if report is not None else BuildReport(),
                on_bytes, runner, exact, on_total)
    b.load(rebuild, sidecars)
    b.build(sidecars)
    index = dataclasses.replace(b.assemble(), pieces=tuple(sorted(store.used)))
    store.note_use([str(base.root), *(str(e.root) for e in experts)])
    if b.built and max_size_bytes is not None:
        got = collect(index_dir, keep_seconds=math.inf, max_size_bytes=max_size_bytes,
                      protect=frozenset(index.pieces))
        if got.removed:
            log.info("index_max_size %s: removed %d least recently used index pieces and "
                     "files (%s); %s left", human_bytes(max_size_bytes), len(got.removed),
                     human_bytes(got.freed_bytes()), human_bytes(got.kept_bytes))
    return index, b.built


def reached_pieces(base: Checkpoint, experts: Sequence[Checkpoint], block_size: int,
                   index_dir: str | Path, on_bytes: Callable[[int], None] | None = None
                   ) -> set[str]:
    """The stored pieces the family's index is assembled from now, building nothing (a
    touched or copied source is hashed to find its pieces, as :func:`load_or_build` does)."""
    layout = build_layout(base, block_size)
    store = PieceStore(index_dir, layout)
    b = _Family(base, experts, layout, store, BuildReport(), on_bytes)
    b.load(False, True)
    read = b._read_from_bytes()
    for a, i in enumerate(read):
        for j in read[a + 1:]:
            b._wanted(i, j)  # marks the stored pair as used
    return set(store.used)


class _Family:
    """One load_or_build: which pieces exist, which to build, and the build passes."""

    def __init__(self, base: Checkpoint, experts: Sequence[Checkpoint], layout: BlockLayout,
                 store: PieceStore, report: BuildReport,
                 on_bytes: Callable[[int], None] | None,
                 runner: ChunkRunner | None = None, exact: bool = False,
                 on_total: Callable[[int], None] | None = None) -> None:
        self.base, self.experts, self.layout, self.store = base, experts, layout, store
        self.report, self.on_bytes, self.runner = report, on_bytes, runner
        self.exact, self.on_total = exact, on_total
        # before reading: a change during the build shows at the next load
        self.base_sid = source_id(base, store.layout_xxh3)
        self.sids = [source_id(e, store.layout_xxh3) for e in experts]
        stamps = [sid.stamp for sid in self.sids]
        self.first = [stamps.index(k) for k in stamps]  # the same expert twice: once
        self.uniq = sorted(set(self.first))
        self.base_dt = dtype_digest(base, layout.tensors)
        self.dts = [dtype_digest(e, layout.tensors) for e in experts]
        self.base_hash: np.ndarray | None = None
        self.base_sq: np.ndarray | None = None
        self.pieces: dict[int, ExpertPiece] = {}
        self.grams: dict[tuple[int, int], np.ndarray] = {}  # by unique expert, i < j
        self.fresh: set[int] = set()  # built now, from the bytes
        self.changed: set[int] = set()  # content known, piece missing: its pairs may hold
        #: the chunk a verifying read stopped in, by source (-1: the base), for the rebuild
        self.handed: dict[int, tuple[tuple[int, int], memoryview]] = {}
        self.built = False

    def _expert_key(self, i: int, digest: str) -> str:
        assert self.base_hash is not None
        return expert_key(content_digest(self.base_hash), self.base_dt, digest, self.dts[i],
                          self.layout.block_size)

    def load(self, rebuild: bool, sidecars: bool) -> None:
        """The stored pieces that hold; without the base's, none do (all are rebuilt). A
        source not known by its stamp is verified: its bytes hashed and compared with the
        stored pieces of its kind."""
        whys: list[str] = []
        if rebuild:
            whys.append("rebuild requested")
        else:
            self._load_base(whys)
        for i in self.uniq if self.base_hash is not None else []:
            self._load_expert(i, sidecars, whys)
        for why in dict.fromkeys(whys):
            log.info("building block index: %s", why)

    def _verified(self, src: Checkpoint, sid: SourceId, digest: str) -> None:
        """``src`` (stamp ``sid``) was hashed and holds ``digest``: record it, best effort (an
        index directory that cannot be written still serves; the next run hashes again)."""
        self.report.verified.append(str(src.root))
        log.info("block index: %s holds the bytes it was indexed with (its files were touched, "
                 "copied or moved): pieces reused", src.root)
        try:
            self.store.remember(sid, digest)
        except SourceError as exc:
            log.warning("not recording that %s was verified (it will be hashed again): %s",
                        src.root, exc)

    def _load_base(self, whys: list[str]) -> None:
        bs = self.layout.block_size
        digest, why = self.store.lookup(self.base_sid)
        if digest is not None:
            got = self.store.load_base(base_key(digest, self.base_dt, bs))
            if got is not None:
                self.store.use("base", base_key(digest, self.base_dt, bs))
                self.base_hash, self.base_sq = got
                return
            whys.append(f"the index piece of {self.base.root} is missing")
            return
        kin = self.store.kin(self.base_sid)
        cands = {d: got for d, _ in kin
                 if (got := self.store.load_base(base_key(d, self.base_dt, bs))) is not None}
        if cands:
            m = match_content(self.base, self.layout, {d: h for d, (h, _) in cands.items()},
                              self.report, self.on_bytes)
            if m.digest is not None:
                self.store.use("base", base_key(m.digest, self.base_dt, bs))
                self.base_hash, self.base_sq = cands[m.digest]
                self._verified(self.base, self.base_sid, m.digest)
                return
            if m.last is not None:
                self.handed[-1] = m.last
        whys.append(why or self._unknown(self.base, kin))

    def _unknown(self, src: Checkpoint, kin: list[tuple[str, str]]) -> str:
        if any(root == str(src.root) for _, root in kin):
            return f"{src.root} changed since the last index (size, mtime or header differ)"
        return self.store.first_time(src)

    def _load_expert(self, i: int, sidecars: bool, whys: list[str]) -> None:
        e = self.experts[i]
        assert self.base_hash is not None
        digest, why = self.store.lookup(self.sids[i])
        if digest is not None:
            got = self.store.load_expert(self._expert_key(i, digest), e, self.base_hash,
                                         sidecars)
            if got.piece is not None:
                self.store.use("expert", self._expert_key(i, digest))
                self.pieces[i] = got.piece
            elif got.why is not None:
                whys.append(got.why)
            else:
                whys.append(f"{self.base.root} changed since {e.root} was indexed (or its "
                            "index piece was removed)")
                self.changed.add(i)  # same content: its stored pairs may still hold
            return
        kin = self.store.kin(self.sids[i])
        cands: dict[str, ExpertPiece] = {}
        for d, _ in kin:
            got = self.store.load_expert(self._expert_key(i, d), e, self.base_hash, sidecars)
            if got.piece is not None:
                cands[d] = got.piece
        if cands:
            m = match_content(e, self.layout, {d: p.expert_hash for d, p in cands.items()},
                              self.report, self.on_bytes)
            if m.digest is not None:
                self.store.use("expert", self._expert_key(i, m.digest))
                self.pieces[i] = cands[m.digest]
                self._verified(e, self.sids[i], m.digest)
                return
            if m.last is not None:
                self.handed[i] = m.last
        whys.append(why or self._unknown(e, kin))

    def build(self, sidecars: bool) -> None:
        """Build the missing pieces: from sidecars, by reading, then the missing pairs."""
        missing = [i for i in self.uniq if i not in self.pieces]
        found: dict[int, ExpertStats] = {}
        if sidecars and any(self.experts[i].prefers_published_index for i in missing):
            got = sidecar.find(self.base, [self.experts[i] for i in missing], self.layout)
            found = {missing[k]: s for k, s in got.items()}
        to_read = [i for i in missing if i not in found]
        if self.on_total is not None:
            self.on_total(self._planned_bytes(to_read, set(to_read) - self.changed))
        if to_read or self.base_hash is None:
            self._describe(to_read, first_time=set(to_read) - self.changed)
        assert self.base_hash is not None
        stale = [i for i, s in found.items() if not np.array_equal(s.base_hash, self.base_hash)]
        for i in stale:
            log.warning("ignoring index sidecar of %s: published against a base whose bytes "
                        "differ from %s", self.experts[i].root, self.base.root)
            del found[i]
        if stale:
            if self.on_total is not None:  # read too, after all
                self.on_total(sum(self.report.bytes_read.values())
                              + self._planned_bytes(stale, set(stale)))
            self._describe(stale, first_time=set(stale))
        for i, s in found.items():
            piece = ExpertPiece(s.expert_hash, s.norms**2, s.norms, s.zero, origin="sidecar")
            self._save_expert(i, piece)
        if found:
            log.info("block index: %d of %d experts from published sidecars (not read)",
                     sum(self.first[i] in found for i in range(len(self.experts))),
                     len(self.experts))
        self._pairs()
        if self.on_total is not None and self.exact:  # the upper bound, made exact
            self.on_total(sum(self.report.bytes_read.values()))

    def _source_bytes(self, src: Checkpoint, blocks: np.ndarray | None = None) -> int:
        """Bytes of ``src``'s blocks (``blocks``: (B,) bool, those only; default all) in its
        own dtypes."""
        lay = self.layout
        item = np.asarray([DTYPES[src.tensors[t].dtype][0] for t in lay.tensors], np.int64)
        per_block = (lay.elem_end - lay.elem_start) * item[lay.tensor_of]
        return int(per_block.sum() if blocks is None else per_block[blocks].sum())

    def _planned_bytes(self, own: list[int], first_time: set[int]) -> int:
        """What :meth:`build` will read: the base and ``own`` in full (if anything is read),
        and with ``exact`` the other experts' non-zero blocks that missing pairs need (an upper
        bound where a pair has a new expert: its zero flags are not known yet)."""
        full = bool(own) or self.base_hash is None
        total = (self._source_bytes(self.base) if full else 0) + sum(
            self._source_bytes(self.experts[i]) for i in own)
        if not self.exact:
            return total
        old = self._read_from_bytes()
        need: dict[int, np.ndarray] = {}
        for i, j in [(i, j) for i in own if i in first_time for j in old] + [
                (i, j) for a, i in enumerate(old) for j in old[a + 1:] if self._wanted(i, j)]:
            both = ~self.pieces[j].zero & (~self.pieces[i].zero if i in self.pieces else True)
            for x in (i, j):
                if x not in own:
                    need[x] = need.get(x, np.zeros_like(both)) | both
        total += sum(self._source_bytes(self.experts[x], m) for x, m in need.items())
        if not full and need:
            total += self._source_bytes(self.base, np.logical_or.reduce(list(need.values())))
        return total

    def _read_from_bytes(self) -> list[int]:
        return [i for i in self.uniq if i in self.pieces and self.pieces[i].origin == "read"]

    def _pair_key(self, i: int, j: int) -> str:
        assert self.base_hash is not None
        names = self.layout.tensors
        dt = (dtype_digest(self.base, names), dtype_digest(self.experts[i], names),
              dtype_digest(self.experts[j], names))
        return pair_key(self.base_hash, self.pieces[i], self.pieces[j], self.layout.block_size,
                        dt)

    def _wanted(self, i: int, j: int) -> bool:
        """The pair of (read) experts i < j has no Gram terms yet, stored or computed now."""
        if (i, j) in self.grams:
            return False
        g = self.store.load_pair(self._pair_key(i, j))
        if g is not None:
            self.grams[(i, j)] = g
        return g is None

    def _describe(self, own: list[int], first_time: set[int]) -> None:
        """Read the base and ``own`` experts in full: their pieces, their mutual Gram terms,
        and those of first-time experts with the experts already indexed (those read only
        where both deltas are non-zero: a changed expert's pairs wait until its new hashes
        show whether stored ones still hold)."""
        old = self._read_from_bytes()
        pairs = [(i, i) for i in own]
        if self.exact:
            pairs += [(i, j) for a, i in enumerate(own) for j in own[a + 1:]]
            pairs += [tuple(sorted((i, j))) for i in own if i in first_time  # type: ignore
                      for j in old]
            pairs += [(i, j) for a, i in enumerate(old) for j in old[a + 1:]
                      if self._wanted(i, j)]
        p = Pass(self.base, self.experts, self.layout, own, pairs,
                  {j: self.pieces[j].zero for j in old}, self.base_hash is None,
                  self.on_bytes, self.report)
        for src, q in [(-1, 0), *((i, 1 + k) for k, i in enumerate(own))]:
            if src in self.handed and (src >= 0 or self.base_hash is None):
                chunk, buf = self.handed.pop(src)
                p.handed.setdefault(chunk, {})[q] = buf
        p.run(2, self.runner)
        if self.base_hash is None:
            self.base_hash, self.base_sq = p.base_hash, p.base_sq
            digest = content_digest(p.base_hash)
            self.store.save_base(base_key(digest, self.base_dt, self.layout.block_size),
                                 self.base, p.base_hash, p.base_sq)
            self.store.remember(self.base_sid, digest)
            self.report.base_built = self.built = True
        for k, i in enumerate(own):
            self._save_expert(i, _piece(p, k, pairs))
            self.fresh.add(i)
        self._save_pairs(p, pairs)

    def _save_expert(self, i: int, piece: ExpertPiece) -> None:
        self.pieces[i] = piece
        assert self.base_hash is not None
        self.store.save_expert(self._expert_key(i, piece.digest()), self.experts[i], piece,
                               self.base_hash)
        self.store.remember(self.sids[i], piece.digest())
        self.report.experts_built.append(str(self.experts[i].root))
        self.built = True

    def _save_pairs(self, p: Pass, pairs: list[tuple[int, int]]) -> None:
        for k, (i, j) in enumerate(pairs):
            if i != j:
                self.grams[(i, j)] = p.gram[k]
                self.store.save_pair(self._pair_key(i, j), p.gram[k])
                self.report.pairs_built += 1
                self.built = True

    def _pairs(self) -> None:
        """The stored exact Gram terms of every pair of read experts; with ``exact``, those
        still missing (a new or changed expert's with the others, or experts merged together
        for the first time) are built: read the base and both experts where both deltas are
        non-zero. Without, they are estimated from sketches when assembled."""
        read = self._read_from_bytes()
        pairs = [(i, j) for a, i in enumerate(read) for j in read[a + 1:] if self._wanted(i, j)]
        if not pairs or not self.exact:
            return
        named = sorted({str(self.experts[x].root) for p in pairs for x in p if x in self.fresh})
        log.info("building block index: Gram terms of %d expert pairs %s", len(pairs),
                 f"of {', '.join(named)} with the others" if named
                 else "(experts indexed before, merged together for the first time)")
        p = Pass(self.base, self.experts, self.layout, [], pairs,
                  {j: self.pieces[j].zero for j in {x for q in pairs for x in q}}, False,
                  self.on_bytes, self.report)
        p.run(2, self.runner)
        self._save_pairs(p, pairs)

    def assemble(self) -> BlockIndex:
        assert self.base_hash is not None
        return assemble(family_key(self.base, self.experts, self.layout.block_size),
                        self.layout, self.base_hash,
                        [self.pieces[self.first[i]] for i in range(len(self.experts))],
                        _expand(self.grams, self.first),
                        _expert_itemsize(self.experts, self.layout),
                        None if self.base_sq is None else np.sqrt(self.base_sq))
