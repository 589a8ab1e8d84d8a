"""Decoding many row blocks of one tensor's delta sidecar levels at once (issue 14).

The engine reconstructs ``W_hat`` of every planned block of a unit, and the publisher measures
every level prefix of every block, with :func:`decode_into`: one call per tensor (or run of
blocks), each block with its own level depth, written straight into the caller's float32
buffer. Versions 4 and 5: the quantised low-rank components of every block with the same
number of them are one exact product of integers on the grid of :func:`mergefs.deltas.reconstruct.grid_of`
(oneDNN's int8 matmul where :mod:`mergefs.deltas.intgemm` takes it, else a float32 BLAS product; the
same bits either way, whatever the threads), unpacked and then combined with the other levels
by compiled loops (row by row where a block has no looped level; vq codewords and the values
of a byte's codes added as one vector operation each); version 3: the compiled loop sums the
components in a fixed order (no fused multiply-add: numba without ``fastmath`` does not
contract). The loops are defined, or loaded from numba's disk cache, at the first call
(importing numba costs ~0.15 s, which a merge without sidecars need not pay; numba's first
call in a process ~0.25 s more); without numba, or for ``ulp`` levels of float16 experts,
:func:`mergefs.deltas.reconstruct.reconstruct` decodes block by block. Both compute exactly the arithmetic
of :mod:`mergefs.deltas.sidecar`, so the bits do not depend on which ran; sidecars of versions 1 and 2
(a BLAS low-rank product) are decoded block by block as before.

:func:`read_payloads` reads the block ranges of a tensor's levels, one span per adjacent run
per level, into one buffer (a remote sidecar: spans and the levels' shared ranges coalesced
into a few requests). Blocking; worker threads only, never the trio thread.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergefs.deltas.codes import BLAS_VERSIONS, DELTA_VERSION, DeltaError, Level, TensorLevels

from mergefs.deltas.reconstruct import exact_level, grid_of, one_blas_thread, reconstruct

from mergefs.deltas.sidecar import DeltaSidecar
from mergefs.deltas import intgemm
#: level kind -> the compiled loop's code
KIND_CODE = {"lowrank": 0, "quant": 1, "rows": 2, "vq": 3, "ulp": 4, "sparse": 5}


@dataclass(frozen=True)
class Payloads:
    """Block ranges of levels ``0 .. L-1`` of some blocks: level ``l`` of block ``j`` is
    ``data[off[l, j]:off[l, j] + size[l, j]]`` (size 0 where the block's depth is ``<= l``)."""

    data: np.ndarray  # uint8
    off: np.ndarray  # (L, n_blocks) int64
    size: np.ndarray  # (L, n_blocks) int64

    def block(self, lvl: int, j: int) -> memoryview:
        o = int(self.off[lvl, j])
        return memoryview(self.data)[o:o + int(self.size[lvl, j])]


@dataclass(frozen=True)
class Packed:
    """A level prefix's parameters and shared values, as the compiled loop takes them."""

    kind: np.ndarray  # (L,) int64, KIND_CODE
    bits: np.ndarray  # (L,) int64
    k: np.ndarray  # (L,) int64
    first: np.ndarray  # (L,) int64: looped lowrank, first row of ``v``/``uscale``; vq, of ``book``
    loop: np.ndarray  # (L,) int64: 1 for lowrank levels summed component by component
    uscale: np.ndarray  # (K,) float32: every looped lowrank level's U column scales, in order
    v: np.ndarray  # (K, cols) float32: every looped lowrank level's V rows, in order
    book: np.ndarray  # (W, dim) float32: every vq level's codebook, in order
    compiled_ok: bool  # False: a level the compiled loop does not decode (float16 ulp)
    #: versions 4 and 5: exact low-rank components within depth d (d = 0 .. L)
    n_exact: np.ndarray
    #: versions 4 and 5: per number of exact components n > 0 of some depth, (2**-G, W) of
    #: :func:`mergefs.deltas.reconstruct.grid_of` over those components (computed on first use)
    grids: Grids
    #: versions 4 and 5: per number of exact components, ``W`` prepacked for
    #: :func:`mergefs.deltas.intgemm.product` (filled on first use)
    int_weights: dict[int, Any] = field(default_factory=dict)
    #: per number of exact components, :func:`mergefs.deltas.intgemm.digits_of` its ``W`` (the
    #: route's test runs on every call: ~0.03-1 ms for the mount's single blocks otherwise)
    n_digits: dict[int, int] = field(default_factory=dict)

    def eight(self, nk: int) -> np.ndarray:
        """(nk,) bool: which of the first ``nk`` exact components have 8-bit codes."""
        m = [bool(b == 8) for kd, lp, b, k in zip(self.kind, self.loop, self.bits, self.k)
             if kd == 0 and not lp for _ in range(int(k))]
        return np.asarray(m[:nk], bool)


class Grids(Mapping[int, tuple[np.float32, np.ndarray]]):
    """Per number of exact components of some level prefix, its grid ``(2**-G, W)``, each
    computed on first use (a plan reaches a few of a tensor's prefixes: at 10% of the MiniLM
    family's bytes 245 of 431, at 20% 114 of 456; ~0.3 ms each) into ``cache`` (shared by the
    packings of one tensor at several depths; a grid depends only on its prefix)."""

    def __init__(self, prefix: dict[int, int], levels: tuple[Level, ...],
                 shared: list[tuple[np.ndarray, np.ndarray] | None], version: str,
                 cache: dict[int, tuple[np.float32, np.ndarray]]) -> None:
        self._prefix = prefix  # number of exact components -> levels in its prefix
        self._levels, self._shared, self._version, self._cache = levels, shared, version, cache

    def __getitem__(self, nk: int) -> tuple[np.float32, np.ndarray]:
        got = self._cache.get(nk)
        if got is None:  # two threads may both compute it: the same values
            n = self._prefix[nk]
            grid, w = grid_of(self._levels[:n], self._shared[:n], self._version)
            got = self._cache[nk] = (np.float32(math.ldexp(1.0, -grid)), w)
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(self._prefix)

    def __len__(self) -> int:
        return len(self._prefix)


def pack(levels: tuple[Level, ...], shared: list[tuple[np.ndarray, np.ndarray] | None],
         cols: int, version: str = DELTA_VERSION,
         grid_cache: dict[int, tuple[np.float32, np.ndarray]] | None = None,
         int_cache: dict[int, Any] | None = None) -> Packed:
    """``grid_cache``: the grids of this tensor's exact prefixes computed before, by number of
    components (the engine packs a tensor once per depth its units ask for; a grid depends only
    on its prefix), filled as they are used; ``int_cache``: likewise their oneDNN weights
    (:attr:`Packed.int_weights`, filled on first use)."""
    n = len(levels)
    first = np.zeros(n, np.int64)
    loop = np.zeros(n, np.int64)
    us, vs, books = [], [], []
    rows_v = rows_b = 0
    n_exact = np.zeros(n + 1, np.int64)
    prefix: dict[int, int] = {}
    for lvl, (lv, sh) in enumerate(zip(levels, shared)):
        n_exact[lvl + 1] = n_exact[lvl]
        if exact_level(lv, version):
            n_exact[lvl + 1] += lv.k
            prefix[int(n_exact[lvl + 1])] = lvl + 1
        elif lv.kind == "lowrank":
            assert sh is not None
            first[lvl] = rows_v
            loop[lvl] = 1
            us.append(sh[0])
            vs.append(sh[1])
            rows_v += lv.k
        elif lv.kind == "vq":
            assert sh is not None
            first[lvl] = rows_b
            books.append(sh[0])
            rows_b += len(sh[0])
    dim = max([b.shape[1] for b in books], default=1)
    return Packed(
        np.asarray([KIND_CODE[lv.kind] for lv in levels], np.int64),
        np.asarray([lv.bits for lv in levels], np.int64),
        np.asarray([lv.k for lv in levels], np.int64), first, loop,
        np.ascontiguousarray(np.concatenate(us) if us else np.zeros(1), dtype=np.float32),
        np.ascontiguousarray(np.vstack(vs) if vs else np.zeros((1, cols)), dtype=np.float32),
        np.ascontiguousarray(np.vstack([_pad(b, dim) for b in books]) if books
                             else np.zeros((1, 1)), dtype=np.float32),
        not any(lv.kind == "ulp" and lv.k != 1 for lv in levels), n_exact,
        Grids(prefix, levels, shared, version, {} if grid_cache is None else grid_cache),
        {} if int_cache is None else int_cache)


def _pad(book: np.ndarray, dim: int) -> np.ndarray:
    """A codebook (words, k) as (words, dim), zero columns after its own: one row per codeword
    whatever the dimension of the other vq levels (the loop indexes ``first + code``)."""
    out = np.zeros((len(book), dim), np.float32)
    out[:, :book.shape[1]] = book
    return out


#: versions 4 and 5: blocks are decoded in chunks of at most this many elements (the exact
#: products of a chunk are held at once)
CHUNK_ELEMENTS = 1 << 20


def decode_into(out: np.ndarray, w0: np.ndarray, levels: tuple[Level, ...], cols: int,
                starts: np.ndarray, rows: np.ndarray, depths: np.ndarray, payloads: Payloads,
                shared: list[tuple[np.ndarray, np.ndarray] | None],
                packed: Packed | None = None, version: str = DELTA_VERSION) -> None:
    """``out[s:s + rows[j] * cols] = W_hat`` of block ``j`` (``s = starts[j]``: element offsets
    into ``out`` and ``w0``, both flat float32) from its first ``depths[j]`` levels, by the
    arithmetic of sidecar ``version`` (3 or 4).

    ``shared`` and ``packed`` cover ``levels[:max(depths)]`` (``packed``: :func:`pack` of them,
    computed here when None). Raises :class:`mergefs.deltas.codes.DeltaError` when a block's ranges
    do not have the sizes its levels imply.
    """
    if len(starts) == 0:
        return
    depth = int(depths.max())
    if packed is None:
        packed = pack(levels[:depth], shared[:depth], cols, version)
    kernel = _compiled() if packed.compiled_ok else None
    if kernel is None:
        for j in range(len(starts)):
            s, n, k = int(starts[j]), int(rows[j]) * cols, int(depths[j])
            out[s:s + n] = reconstruct(w0[s:s + n], levels[:k],
                                          [payloads.block(lvl, j) for lvl in range(k)],
                                          shared[:k], int(rows[j]), cols, version=version)
        return
    ends = np.asarray(starts) + np.asarray(rows) * cols
    if int(np.min(starts)) < 0 or int(ends.max()) > min(out.size, w0.size):
        raise ValueError("decode_into: a block lies outside out or w0")  # unchecked in the loop
    off, size = payloads.off, payloads.size
    if depth > len(packed.kind) or off.shape != size.shape or off.shape[0] < depth \
            or off.shape[1] != len(starts):
        raise ValueError("decode_into: depths or payload tables do not match the levels")
    if off.size and (int(size.min()) < 0 or int(off.min()) < 0
                     or int((off + size).max()) > payloads.data.size):
        raise DeltaError("a level range lies outside the bytes read (a damaged range "
                            "table)")  # unchecked in the loop
    w0 = np.ascontiguousarray(w0)
    starts = np.ascontiguousarray(starts, np.int64)
    rows = np.ascontiguousarray(rows, np.int64)
    depths = np.ascontiguousarray(depths, np.int64)
    if not packed.grids or len(starts) == 1 \
            or int(rows.sum()) * cols <= CHUNK_ELEMENTS:  # one call
        chunks = [(0, len(starts))]
    else:
        cum = np.cumsum(rows * cols)
        cut = np.searchsorted(cum, np.arange(1, int(cum[-1]) // CHUNK_ELEMENTS + 1)
                              * CHUNK_ELEMENTS, side="right")
        edges = np.unique(np.concatenate([[0], cut, [len(starts)]]))
        chunks = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
    for a, b in chunks:
        cs, cr, cd = starts[a:b], rows[a:b], depths[a:b]
        coff, csize = off, size
        if len(chunks) > 1 or not (off.flags.c_contiguous and size.flags.c_contiguous):
            coff, csize = np.ascontiguousarray(off[:, a:b]), np.ascontiguousarray(size[:, a:b])
        groups, bad = _exact_products(packed, cols, cr, cd, payloads.data, coff, csize)
        if bad < 0:
            for g in groups:
                whole = len(g.sel) == len(cs)
                gs, gr, gd = (cs, cr, cd) if whole else (cs[g.sel], cr[g.sel], cd[g.sel])
                goff, gsize = ((coff, csize) if whole else
                               (np.ascontiguousarray(coff[:, g.sel]),
                                np.ascontiguousarray(csize[:, g.sel])))
                got = kernel(out.view(np.uint32), w0.view(np.uint32), out, w0, gs, gr, gd, cols,
                             packed.kind, packed.bits, packed.k, packed.first, packed.loop,
                             packed.uscale, packed.v, packed.book, payloads.data, goff, gsize,
                             g.p, g.prow, g.pscale, g.wgrid, g.qmode)
                if got >= 0:
                    bad = int(got) if whole else int(g.sel[got])
                    break
        if bad >= 0:
            raise DeltaError(f"block {a + bad} of the call: its level ranges do not have "
                                "the sizes its levels imply (a damaged level table)")


_NO_P = np.zeros((1, 1), np.float32)
_LUTS: dict[bool, np.ndarray] = {}


def _q_luts(u8: bool = False) -> np.ndarray:
    got = _LUTS.get(u8)
    if got is None:
        from mergefs.deltas._numba_decode import q_luts
        got = _LUTS[u8] = q_luts(u8)
    return got


@dataclass(frozen=True)
class _Group:
    """Blocks ``sel`` (indices into a chunk) decoded by one call of the compiled loop, with
    their exact products: rows ``prow[i] ..`` of ``p`` (-1: none; ``qmode`` 1: those rows are
    the block's ``Q``, multiplied by ``wgrid`` in the loop), scaled by ``pscale[i]``."""

    sel: np.ndarray
    p: np.ndarray
    prow: np.ndarray
    pscale: np.ndarray
    wgrid: np.ndarray = field(default_factory=lambda: _NO_P)
    qmode: int = 0


def _exact_products(packed: Packed, cols: int, rows: np.ndarray, depths: np.ndarray,
                    data: np.ndarray, off: np.ndarray, size: np.ndarray
                    ) -> tuple[list[_Group], int]:
    """Versions 4 and 5: ``Q W`` of every block with exact low-rank components, exact, as the
    compiled loop takes them: ``(groups, bad)``, ``bad`` the first block whose ranges have the
    wrong sizes or -1. Blocks with the same number of components are one product: oneDNN's
    int8 matmul where :func:`mergefs.deltas.intgemm.available` and the product is large enough
    (each such product its own group), else one float32 BLAS product (all of them one group).
    One block too small for oneDNN: the group's ``p`` is its ``Q`` and ``wgrid`` its ``W``
    (``qmode`` 1), which the compiled loop multiplies (a BLAS call and the grouping cost more
    than that product)."""
    n = len(rows)
    every = np.arange(n)
    prow = np.full(n, -1, np.int64)
    pscale = np.zeros(n, np.float32)
    if not packed.grids:
        return [_Group(every, _NO_P, prow, pscale)], -1
    from mergefs.deltas._numba_decode import unpack_exact
    nk = packed.n_exact[depths]
    fast = _int_route()
    if n == 1 and not _pays(fast, packed, int(nk[0]), int(rows[0]) * int(nk[0]) * cols):
        # one block (the mount's units), too small for a oneDNN call to pay: Q only, the
        # compiled loop multiplies
        k = int(nk[0])
        if k == 0:
            return [_Group(every, _NO_P, prow, pscale)], -1
        uq = np.empty((int(rows[0]), k), np.float32)
        prow[0] = 0
        bad = unpack_exact(uq, prow, rows, depths, cols, packed.kind, packed.bits, packed.k,
                           packed.loop, data, off, size, _q_luts(), 0)
        scale, w = packed.grids[k]
        pscale[0] = scale
        return [_Group(every, uq, prow, pscale, w, 1)], int(bad)
    sel = np.flatnonzero(nk > 0)
    if len(sel) == 0:
        return [_Group(every, _NO_P, prow, pscale)], -1
    order = sel[np.argsort(nk[sel], kind="stable")]
    ks = nk[order]
    bounds = np.flatnonzero(np.diff(ks)) + 1
    runs = list(zip([0, *bounds.tolist()], [*bounds.tolist(), len(order)]))
    groups: list[_Group] = []
    blas: list[tuple[int, int]] = []
    for g0, g1 in runs:
        k = int(ks[g0])
        members = order[g0:g1]
        if not _pays(fast, packed, k, int(rows[members].sum()) * k * cols):
            blas.append((g0, g1))
            continue
        w = packed.grids[k][1]
        iw = packed.int_weights.get(k)
        if iw is None:
            iw = packed.int_weights[k] = fast.prepare(w, packed.eight(k))
        members = np.sort(members)
        r = rows[members]
        grow = np.full(n, -1, np.int64)
        grow[members] = np.cumsum(r) - r
        x = np.empty((int(r.sum()), k), np.uint8)
        bad = unpack_exact(x, grow, rows, depths, cols, packed.kind, packed.bits, packed.k,
                           packed.loop, data, off, size, _q_luts(True), 128)
        if bad >= 0:
            return [], int(bad)
        gscale = np.full(len(members), packed.grids[k][0], np.float32)
        groups.append(_Group(members, fast.product(x, iw), grow[members], gscale))
    taken = np.zeros(n, bool)  # blocks of the int8 groups; the rest share one call
    for g in groups:
        taken[g.sel] = True
    rest = np.flatnonzero(~taken)
    p = _NO_P
    if blas:
        border = np.concatenate([order[g0:g1] for g0, g1 in blas])
        r = rows[border]
        prow[border] = np.cumsum(r) - r
        total = int(r.sum())
        uq = np.empty((total, int(nk[border].max())), np.float32)
        bad = unpack_exact(uq, prow, rows, depths, cols, packed.kind, packed.bits, packed.k,
                           packed.loop, data, off, size, _q_luts(), 0)
        if bad >= 0:
            return [], int(bad)
        p = np.empty((total, cols), np.float32)
        with one_blas_thread():
            for g0, g1 in blas:
                k = int(ks[g0])
                scale, w = packed.grids[k]
                r0 = int(prow[order[g0]])
                r1 = int(prow[order[g1 - 1]] + rows[order[g1 - 1]])
                np.matmul(uq[r0:r1, :k], w, out=p[r0:r1])  # exact: integers below 2**24
                pscale[order[g0:g1]] = scale
                _blas_macs[0] += (r1 - r0) * k * cols  # a racy sum: only a threshold reads it
    if len(rest):
        groups.append(_Group(rest, p, prow[rest], pscale[rest]))
    return groups, -1


def _pays(fast: Any, packed: Packed, k: int, macs: int) -> bool:
    """Whether a product of ``k`` exact components and ``macs`` multiply-adds takes the int8
    route (``fast``: :func:`_int_route`): at most ``MAX_DIGITS`` oneDNN calls (a call per
    digit of ``W``, counted once per number of components), each of at least ``MIN_MACS``."""
    if fast is None or not 0 < k <= fast.MAX_K or macs < fast.MIN_MACS:
        return False
    iw = packed.int_weights.get(k)
    ndig = iw.ndig if iw is not None else packed.n_digits.get(k)
    if ndig is None:
        ndig = packed.n_digits[k] = fast.digits_of(packed.grids[k][1], packed.eight(k))
    return ndig <= fast.MAX_DIGITS and macs >= fast.MIN_MACS * ndig


#: float32 BLAS multiply-adds of exact products after which the int8 route is taken even if it
#: must import torch (~1 s): by then the BLAS has spent about that long (~50 GMAC/s here), so
#: the import costs at most as much as the decoding it follows (a one-shot merge of a small
#: model never pays it; the mount and large merges switch early)
SWITCH_MACS = 50 * 10**9
_blas_macs = [0]


def _int_route() -> Any:
    """:mod:`mergefs.deltas.intgemm` when its route is on and torch is imported already, or once the
    BLAS has done :data:`SWITCH_MACS` multiply-adds; else None (the same bits either way)."""
    if "torch" not in sys.modules and _blas_macs[0] < SWITCH_MACS:
        return None
    return intgemm if intgemm.available() else None


def read_payloads(sc: DeltaSidecar, tl: TensorLevels, js: np.ndarray, depths: np.ndarray,
                  tensor: str = "") -> Payloads:
    """Level ``l`` of the tensor's blocks ``js`` (ascending, relative to its first block) whose
    depth exceeds ``l``: one span per run of adjacent blocks per level, as ``read_runs``, all
    read by one :meth:`~mergefs.deltas.sidecar.DeltaSidecar.read_spans` with (remote sidecars) the shared
    ranges of those levels no thread has read yet, which it caches: a remote sidecar fetches
    them all in a few requests."""
    depth = int(depths.max()) if len(js) else 0
    off = np.zeros((depth, len(js)), np.int64)
    size = np.zeros((depth, len(js)), np.int64)
    spans: list[tuple[int, int]] = []
    runs: list[tuple[int, np.ndarray, np.ndarray]] = []  # (level, columns, range ids)
    for lvl, lv in enumerate(tl.levels[:depth]):
        sel = np.flatnonzero(depths > lvl)
        ranges = lv.first_range + np.asarray(js, np.int64)[sel]
        cuts = np.flatnonzero(np.diff(ranges) != 1) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ranges)]):
            spans.append((int(ranges[a]), int(ranges[b - 1]) + 1))
            runs.append((lvl, sel[a:b], ranges[a:b]))
    levels = tl.levels[:depth]
    shared_ids = sc.claim_shared(levels) if sc.fetch is not None else []
    try:
        bufs = sc.read_spans(spans + [(r, r + 1) for r in shared_ids], tensor)
        for r, buf in zip(shared_ids, bufs[len(spans):]):
            sc.keep_shared(next(lv for lv in levels if lv.shared == r), tl.cols, buf)
    finally:
        sc.release_shared(shared_ids)
    pos = 0
    for (lvl, cols, run), (r0, _), buf in zip(runs, spans, bufs):
        off[lvl, cols] = pos + sc.range_start[run] - sc.range_start[r0]
        size[lvl, cols] = sc.range_end[run] - sc.range_start[run]
        pos += len(buf)
    data = (np.frombuffer(b"".join(bufs[:len(spans)]), dtype=np.uint8) if spans
            else np.zeros(0, np.uint8))
    return Payloads(data, off, size)


def decode_blocks(sc: DeltaSidecar, tl: TensorLevels, js: np.ndarray, depths: np.ndarray,
                  starts: np.ndarray, n_rows: np.ndarray, w0: np.ndarray, out: np.ndarray,
                  tensor: str = "", payloads: Payloads | None = None) -> None:
    """Read blocks ``js`` of tensor ``tl`` (relative to its first block; ascending) and decode
    them at ``depths`` into ``out`` (see :func:`decode_into`: ``starts`` index ``w0`` and
    ``out``, block ``j`` has ``n_rows[j]`` rows). ``payloads``: their ranges, already read
    (column ``j`` for block ``js[j]``, at least ``depths[j]`` levels)."""
    if len(js) == 0:
        return
    if payloads is None:
        payloads = read_payloads(sc, tl, js, depths, tensor)
    depth = int(depths.max())
    shared = [sc.shared(lv, tl.cols, tensor) for lv in tl.levels[:depth]]
    if sc.meta["version"] in BLAS_VERSIONS:
        with one_blas_thread():
            for j in range(len(js)):
                s, n, k = int(starts[j]), int(n_rows[j]) * tl.cols, int(depths[j])
                out[s:s + n] = reconstruct(w0[s:s + n], tl.levels[:k],
                                              [payloads.block(lvl, j) for lvl in range(k)],
                                              shared[:k], int(n_rows[j]), tl.cols,
                                              version=sc.meta["version"])
        return
    version = sc.meta["version"]
    with sc._shared_lock:
        packed = sc._packed.get((tl.name, depth))
        if packed is None:
            cache = sc._packed.setdefault((tl.name, -1), {})  # no depth is -1: the grids
            icache = sc._packed.setdefault((tl.name, -2), {})  # nor -2: their int8 weights
            packed = sc._packed[(tl.name, depth)] = pack(tl.levels[:depth], shared, tl.cols,
                                                         version, cache, icache)
    decode_into(out, w0, tl.levels, tl.cols, starts, n_rows, depths, payloads, shared, packed,
                version)


_LAZY: Any = object()
#: the compiled loop, defined on first use; None: numba is missing (tests set None to force
#: the numpy path)
_decode_nb: Any = _LAZY
_nb_lock = threading.Lock()


def _compiled() -> Any:
    global _decode_nb
    if _decode_nb is _LAZY:
        with _nb_lock:
            if _decode_nb is _LAZY:
                _decode_nb = _define_compiled()
    return _decode_nb


def _define_compiled() -> Any:
    try:
        import numba

        if numba.config.DISABLE_JIT:  # the loop would run as Python: the numpy path is faster
            return None
        from mergefs.deltas._numba_decode import decode
    except ImportError:  # numba is missing
        return None
    return decode
