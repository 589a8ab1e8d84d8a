"""Planning with delta sidecars: per (expert, row block) skip, sidecar levels 1..k, or exact.

Every non-zero ``(i, b)`` has options: skip (0 bytes, residual ``||D_ib||``), the first ``k`` levels
of its sidecar (the bytes of those block ranges, residual ``r_ibk`` as published) and exact (the
expert's block bytes, residual 0). The energy an option removes is
``c_i^2 (||D_ib||^2 - r^2)``. Per pair, the options on the upper convex hull of (bytes, energy
removed) give upgrades of decreasing energy per byte; all upgrades of all pairs are taken
greedily by energy per byte (ties: tensor, block, expert), each only if its pair is in the
upgrade's starting option and its bytes still fit. A level's *shared* range (the right factors
of a low-rank level, once per tensor; a vq codebook, once per sidecar) is amortised over the
non-zero blocks of the tensors that use it for the ranking and charged in full, once, by the
first block that needs it, so the running total, and the plan, never exceed the budget.

For additive methods the bound is ``||E|| <= sqrt(sum_b (sum_i |c_i| r_ib)^2)`` with ``r_ib``
the residual of the option taken (design.md, with ``D_ib`` replaced by the residual
``D_ib - D_hat_ib``, which is what a reconstructed block leaves out).

*Decode time* (:class:`DecodeCost`): for experts whose sidecars are local files, decoding a
plan's blocks should not take longer than reading the exact bytes they replace (else the
budget saves nothing on that disk). Each option's decode time is modelled per element from its
levels (a fixed model of :mod:`mergefs.deltas.decode` on the reference machine, so plans are the
same on every machine); when the byte-budget plan decodes for longer than ``ratio`` times the
modelled read of the replaced bytes, pairs are moved to shallower options, always the move that
saves the most decode time per unit of energy lost (ties: tensor, block, expert), until it
does not; the bytes that frees then go, by energy per byte, to deeper options or exact reads
where the limit allows (never beyond the budget). Remote sidecars are not limited (their
reads are 10-100x slower than decoding). Pure; no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergefs.deltas.sidecar import DeltaSidecar
from mergefs.deltas.codes import Level
from mergefs.deltas.reconstruct import exact_level
from mergefs.index.blocks import BlockIndex

EXACT = -1


@dataclass(frozen=True, eq=False)
class LevelChoice:
    """The outcome: ``selected`` (exact reads), ``levels`` (sidecar prefix per pair, 0 none)."""

    selected: np.ndarray  # (N, B) bool
    levels: np.ndarray  # (N, B) int16
    resid: np.ndarray  # (N, B) float64, residual norm of the option taken
    exact_bytes: int
    sidecar_bytes: int  # block ranges and shared ranges the plan reads
    sidecar_bytes_by_expert: tuple[int, ...]  # the same, per expert (sums to sidecar_bytes)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds per decoded element of :mod:`mergefs.deltas.decode`, by what a block's levels
    hold, and the exact read rate it is weighed against (measured on the reference machine,
    one thread, the int8 route of :mod:`mergefs.deltas.intgemm`: docs/benchmarks.md, issue 14; fixed,
    so that a plan does not depend on the machine). ``ratio``: a plan may decode for at most
    this many times the read time of the exact bytes it replaces."""

    ratio: float = 1.0
    #: the passes every decoded element pays (w0 + delta, the buffers; memory-bound on large
    #: tensors) and the calls' share
    element: float = 1.5e-9
    #: the exact low-rank product (versions 4 and 5): per oneDNN call (its output written and
    #: read back), per component (the codes unpacked, the int8 multiply-adds)
    product_call: float = 0.8e-9
    component: float = 0.003e-9
    #: oneDNN calls per exact product: version 5's W is one int8 digit, version 4's two or three
    calls: dict[str, float] = field(default_factory=lambda: {"4": 3.0, "5": 1.0})
    loop_component: float = 0.045e-9  # the fixed-order product (float16 levels, version 3)
    kind: dict[str, float] = field(default_factory=lambda: {
        "vq": 0.5e-9, "quant": 0.7e-9, "rows": 0.3e-9, "ulp": 0.5e-9, "sparse": 0.1e-9})
    read_bytes_per_second: float = 1.6e9  # cold pread of exact expert bytes, local disk

    def prefix_seconds(self, levels: tuple[Level, ...], version: str) -> list[float]:
        """Seconds per element of each level prefix (1 .. len(levels))."""
        out, t, product = [], self.element, False
        for lv in levels:
            if lv.kind == "lowrank":
                if exact_level(lv, version):
                    if not product:
                        t += self.product_call * self.calls.get(version, 1.0)
                        product = True
                    t += lv.k * self.component
                else:
                    t += lv.k * self.loop_component
            else:
                t += self.kind.get(lv.kind, self.kind["quant"])
            out.append(t)
        return out


@dataclass
class _Options:
    """Per (i, b) of an expert with a sidecar: prefix bytes, shared bytes per prefix, residuals."""

    block_cost: list[np.ndarray]  # per level: (B,) bytes of that level's block range
    shared_id: list[int]  # per level: range id of the shared part or -1
    resid: list[np.ndarray]  # per level: (B,) residual after levels 0..l (NaN: not available)


def _options(sc: DeltaSidecar, index: BlockIndex, i: int) -> tuple[np.ndarray, list]:
    """(n_levels (B,), per block the list of (level bytes, shared id, residual)) of expert i."""
    lay = index.layout
    n_levels = np.zeros(lay.n_blocks, dtype=np.int16)
    per_block: list = [None] * lay.n_blocks
    sizes = sc.range_bytes()
    for tl in sc.tensors.values():
        blocks = lay.blocks_of(tl.t)
        for j, b in enumerate(blocks):
            if index.zero[i, b]:
                continue
            per_block[b] = [(int(sizes[lv.first_range + j]), lv.shared,
                             float(sc.range_resid[lv.first_range + j])) for lv in tl.levels]
            n_levels[b] = len(tl.levels)
    return n_levels, per_block


def _squares(x: np.ndarray) -> np.ndarray:
    """``float(v) ** 2`` of each element, as the one-pair loop squared a norm: Python's power
    (libm ``pow``), which differs from numpy's ``x * x`` in the last bit of ~0.08% of
    doubles, enough to reorder tied upgrades and so change a plan."""
    return np.fromiter((v ** 2 for v in x.astype(np.float64).tolist()), np.float64, x.size)


def _hulls(cost: np.ndarray, gain: np.ndarray, opt: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Upper concave hull from ``(0, 0, 0)`` of each row of ``(R, P)`` (cost, gain, option)
    points, increasing in both (Andrew's monotone chain on the points sorted by cost, then
    gain descending, then option; a point that removes no more energy than the hull's last
    is dominated), every row at once: ``(hc, hg, ho, h)``, row ``r``'s hull ``hc[r, :h[r]]``
    (its gains and options likewise)."""
    n_rows, n_pts = cost.shape
    order = np.lexsort((opt, -gain, cost), axis=1)
    c = np.take_along_axis(cost, order, 1)
    g = np.take_along_axis(gain, order, 1)
    o = np.take_along_axis(opt, order, 1)
    hc = np.zeros((n_rows, n_pts + 1))
    hg = np.zeros((n_rows, n_pts + 1))
    ho = np.zeros((n_rows, n_pts + 1), np.int64)
    h = np.ones(n_rows, np.int64)
    rows = np.arange(n_rows)
    for q in range(n_pts):
        cq = np.maximum(c[:, q], 1e-9)  # an empty range still comes after skipping
        gq = g[:, q]
        # else: costs more and removes no more energy (a NaN gain, NaN weights, is kept)
        keep = ~(gq <= hg[rows, h - 1])
        pop = keep.copy()
        while True:
            pop &= h >= 2
            if not pop.any():
                break
            c1, g1 = hc[rows, h - 2], hg[rows, h - 2]
            c2, g2 = hc[rows, h - 1], hg[rows, h - 1]
            pop &= (g2 - g1) * (cq - c1) <= (gq - g1) * (c2 - c1)  # on or under the chord
            h -= pop
        at = rows[keep]
        hc[at, h[keep]], hg[at, h[keep]], ho[at, h[keep]] = cq[keep], gq[keep], o[keep, q]
        h += keep
    return hc, hg, ho, h


def _segments(hc: np.ndarray, hg: np.ndarray, ho: np.ndarray, h: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Upgrades along each row's hull: (row, -slope, from option, to option)."""
    step = np.arange(hc.shape[1] - 1)[None, :] < (h - 1)[:, None]
    r, q = np.nonzero(step)
    slope = (hg[r, q + 1] - hg[r, q]) / np.maximum(hc[r, q + 1] - hc[r, q], 1e-12)
    return r, -slope, ho[r, q], ho[r, q + 1]


def choose(index: BlockIndex, coeffs: np.ndarray, budget_bytes: int,
           sidecars: Mapping[int, DeltaSidecar], decode: DecodeCost | None = None
           ) -> LevelChoice:
    """The plan's option per pair (module docstring); ``decode``: the decode-time limit on
    experts with local sidecars (None: bytes only)."""
    lay = index.layout
    n, nb = index.norms.shape
    raw = index.expert_block_bytes()
    c2 = coeffs.astype(np.float64) ** 2
    opts: dict[int, tuple[np.ndarray, list]] = {i: _options(sc, index, i)
                                                 for i, sc in sidecars.items()}
    shared_bytes = {i: sc.range_bytes() for i, sc in sidecars.items()}
    # amortise shared ranges over the non-zero blocks of the tensors that use them (a vq
    # codebook serves every tensor of the sidecar)
    live_of: dict[tuple[int, int], int] = {}
    for i, sc in sidecars.items():
        for tl in sc.tensors.values():
            blocks = lay.blocks_of(tl.t)
            live = int((~index.zero[i, blocks.start:blocks.stop]).sum())
            for sid in {lv.shared for lv in tl.levels if lv.shared >= 0}:
                live_of[(i, sid)] = live_of.get((i, sid), 0) + live
    share_of = {(i, sid): float(shared_bytes[i][sid]) / max(1, live)
                for (i, sid), live in live_of.items()}
    block_cost: dict[tuple[int, int], list[int]] = {}
    #: per pair and prefix, the shared ranges its levels use (sorted, each once)
    block_sids: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    parts: list[tuple[np.ndarray, ...]] = []  # (block, expert, -slope, from, to) per batch
    for i in range(n):
        if c2[i] == 0:
            continue
        live = ~index.zero[i]
        with_levels = np.zeros(nb, bool)
        batches = []  # (blocks, (R, P) costs, gains, options): a tensor's pairs at once
        sc = sidecars.get(i)
        for tl in (sc.tensors.values() if sc is not None else ()):
            if not tl.levels:
                continue
            blocks = lay.blocks_of(tl.t)
            js = np.flatnonzero(live[blocks.start:blocks.stop])
            if js.size == 0:
                continue
            bs = blocks.start + js
            with_levels[bs] = True
            ids = np.asarray([lv.first_range for lv in tl.levels])[None, :] + js[:, None]
            cum = np.cumsum(shared_bytes[i][ids], axis=1)  # (R, L) bytes of each prefix
            counted: set[int] = set()  # two vq levels share one codebook: count it once
            amort, prefix_sids, total = [], [], 0.0
            for lv in tl.levels:
                if lv.shared >= 0 and lv.shared not in counted:
                    counted.add(lv.shared)
                    total += share_of.get((i, lv.shared), 0.0)
                amort.append(total)
                prefix_sids.append(tuple(sorted(counted)))
            full = c2[i] * _squares(index.norms[i, bs])
            r = sc.range_resid[ids].astype(np.float64)
            cost = np.hstack([raw[i, bs].astype(np.float64)[:, None],
                              cum + np.asarray(amort)[None, :]])
            gain = np.hstack([full[:, None], full[:, None] - c2[i] * r * r])
            opt = np.broadcast_to(np.arange(len(tl.levels) + 1), cost.shape).copy()
            opt[:, 0] = EXACT
            batches.append((bs, cost, gain, opt))
            for b, row in zip(bs.tolist(), cum.tolist()):
                block_cost[(i, b)] = row
                block_sids[(i, b)] = prefix_sids
        bs = np.flatnonzero(live & ~with_levels)  # exact reads only
        if bs.size:
            full = c2[i] * _squares(index.norms[i, bs])
            batches.append((bs, raw[i, bs].astype(np.float64)[:, None], full[:, None],
                            np.full((bs.size, 1), EXACT, np.int64)))
        for bs, cost, gain, opt in batches:
            row, key, oa, ob = _segments(*_hulls(cost, gain, opt))
            parts.append((bs[row], np.full(row.size, i), key, oa, ob))
    if parts:
        seg_b, seg_i, seg_key, seg_oa, seg_ob = (np.concatenate(x) for x in zip(*parts))
    else:
        seg_b = seg_i = seg_oa = seg_ob = np.zeros(0, np.int64)
        seg_key = np.zeros(0)
    seg_t = lay.tensor_of[seg_b.astype(np.int64)]
    # as tuples sort; a NaN slope (an expert with NaN weights) first: its merge is NaN
    # whatever else is read, and reading it shows that
    seg_key = np.where(np.isnan(seg_key), -np.inf, seg_key)
    order = np.lexsort((seg_ob, seg_oa, seg_i, seg_b, seg_t, seg_key))
    segments = list(zip(seg_key[order].tolist(), seg_t[order].tolist(),
                        seg_b[order].tolist(), seg_i[order].tolist(),
                        seg_oa[order].tolist(), seg_ob[order].tolist()))
    state = np.zeros((n, nb), dtype=np.int16)  # 0 skip, k levels, EXACT
    paid: set[tuple[int, int]] = set()
    raw_l = np.asarray(raw).tolist()  # Python ints: the loops below index them per move

    def bytes_of(i: int, b: int, o: int) -> int:
        """Block bytes of option o."""
        return 0 if o == 0 else raw_l[i][b] if o == EXACT else block_cost[(i, b)][o - 1]

    def cost_of(i: int, b: int, o: int) -> tuple[int, list[tuple[int, int]]]:
        """Block bytes of option o and the shared ranges it needs that are not paid yet."""
        if o == 0 or o == EXACT:
            return bytes_of(i, b, o), []
        need = [(i, sid) for sid in block_sids[(i, b)][o - 1]
                if (i, sid) not in paid]  # a shared range once
        return bytes_of(i, b, o), need

    def take(moves: list, used: int, table: _DecodeTable | None = None, total: float = 0.0
             ) -> None:
        """Apply moves ``(key, tensor, block, expert, from, to)`` in order, each if its pair
        is still at ``from`` and its bytes fit (and, with ``table``, the decode limit holds:
        ``total`` is the plan's sum of ``g``)."""
        st = state.tolist()
        for _, _, b, i, oa, ob in moves:
            if st[i][b] != oa:
                continue
            dg = table.g(i, b, ob) - table.g(i, b, oa) if table is not None else 0.0
            if total + dg > 0:
                continue
            before = bytes_of(i, b, oa)
            after, need = cost_of(i, b, ob)
            inc = after - before
            if need:
                inc += sum(int(shared_bytes[i][sid]) for _, sid in need)
            if used + inc <= budget_bytes:
                used += inc
                total += dg
                st[i][b] = ob
                if need:
                    paid.update(need)
        state[:] = st

    take(segments, 0)
    if decode is not None:
        table = _DecodeTable(index, coeffs, sidecars, decode, raw)
        total = table.limit(state)
        if total is not None:  # moved down: spend the bytes freed where decoding allows
            got = _outcome(index, state, opts, shared_bytes, raw)
            used = got.exact_bytes + got.sidecar_bytes
            paid.clear()
            paid.update((int(i), lv.shared) for i, bb in zip(*np.nonzero(got.levels))
                        for lv in _levels_of(sidecars[int(i)], lay,
                                             int(bb))[:int(got.levels[i, bb])]
                        if lv.shared >= 0)
            ups = []  # every pair's moves up from where it is, by energy gained per byte
            for i, b in zip(*np.nonzero(~index.zero & (c2[:, None] > 0))):
                i, b = int(i), int(b)
                k = int(state[i, b])
                if k == EXACT:
                    continue
                top = len(block_cost.get((i, b), ()))
                base_cost, base_e = cost_of(i, b, k)[0], table.energy(i, b, k)
                for o in [*range(k + 1, top + 1), EXACT]:
                    gain = table.energy(i, b, o) - base_e
                    if gain > 0:
                        ups.append((-gain / max(cost_of(i, b, o)[0] - base_cost, 1e-9),
                                    int(lay.tensor_of[b]), b, i, k, o))
            ups.sort()
            take(ups, used, table, total)
    return _outcome(index, state, opts, shared_bytes, raw)


def _levels_of(sc: DeltaSidecar, lay: Any, b: int) -> tuple[Level, ...]:
    return sc.tensors[lay.tensors[int(lay.tensor_of[b])]].levels


def decode_seconds(index: BlockIndex, levels: np.ndarray, sidecars: Mapping[int, DeltaSidecar],
                   decode: DecodeCost, local_only: bool = True) -> tuple[float, float]:
    """(modelled decode seconds, modelled read seconds of the exact bytes replaced) of a
    plan's ``levels`` (N, B), over experts with local sidecars (all: ``local_only`` False)."""
    lay = index.layout
    raw = index.expert_block_bytes()
    dec = read = 0.0
    for i, sc in sidecars.items():
        if local_only and sc.fetch is not None:
            continue
        for tl in sc.tensors.values():
            blocks = lay.blocks_of(tl.t)
            k = levels[i, blocks.start:blocks.stop].astype(np.int64)
            sel = np.flatnonzero(k > 0)
            if sel.size == 0:
                continue
            per = np.asarray([0.0, *decode.prefix_seconds(tl.levels, sc.meta["version"])])
            b = blocks.start + sel
            elems = (lay.elem_end[b] - lay.elem_start[b]).astype(np.float64)
            dec += float((elems * per[k[sel]]).sum())
            read += float(raw[i, b].sum()) / decode.read_bytes_per_second
    return dec, read


class _DecodeTable:
    """Per pair of a local sidecar and option ``o``: ``g = decode(o) - ratio * read(exact)``
    (modelled seconds; 0 for skip, exact and remote sidecars) and the energy it keeps; a plan
    is within the limit when the sum of ``g`` over its pairs is at most 0."""

    def __init__(self, index: BlockIndex, coeffs: np.ndarray,
                 sidecars: Mapping[int, DeltaSidecar], decode: DecodeCost, raw: np.ndarray
                 ) -> None:
        self.index, self.sidecars, self.decode, self.raw = index, sidecars, decode, raw
        self.c2 = coeffs.astype(np.float64) ** 2
        self._per: dict[tuple[int, int], list[float]] = {}

    def local(self, i: int) -> bool:
        sc = self.sidecars.get(i)
        return sc is not None and sc.fetch is None and self.c2[i] != 0

    def g(self, i: int, b: int, o: int) -> float:
        if o <= 0 or not self.local(i):
            return 0.0
        lay = self.index.layout
        t = int(lay.tensor_of[b])
        per = self._per.get((i, t))
        if per is None:
            sc = self.sidecars[i]
            per = self._per[(i, t)] = self.decode.prefix_seconds(
                sc.tensors[lay.tensors[t]].levels, sc.meta["version"])
        elems = float(lay.elem_end[b] - lay.elem_start[b])
        return elems * per[o - 1] - self.decode.ratio * float(self.raw[i, b]) \
            / self.decode.read_bytes_per_second

    def energy(self, i: int, b: int, o: int) -> float:
        if o == 0:
            return 0.0
        full = self.c2[i] * float(self.index.norms[i, b]) ** 2
        if o == EXACT:
            return full
        lay = self.index.layout
        lv = _levels_of(self.sidecars[i], lay, b)[o - 1]
        j = b - int(lay.first_block[int(lay.tensor_of[b])])
        return full - self.c2[i] * float(self.sidecars[i].range_resid[lv.first_range + j]) ** 2

    def limit(self, state: np.ndarray) -> float | None:
        """Move pairs down (in ``state``) until the sum of ``g`` is at most 0: each time the
        move that saves the most decode time per energy lost. Returns the sum of ``g`` after,
        or None when the plan was within the limit (nothing moved)."""
        lay = self.index.layout
        pairs = [(int(i), int(b)) for i, b in zip(*np.nonzero(state > 0)) if self.local(int(i))]
        total = sum(self.g(i, b, int(state[i, b])) for i, b in pairs)
        if total <= 0:
            return None

        def best(i: int, b: int) -> tuple[float, int] | None:
            """(decode saved per energy lost, target option) of the pair's best move down."""
            k = int(state[i, b])
            gk, ek = self.g(i, b, k), self.energy(i, b, k)
            top: tuple[float, int] | None = None
            for j in range(k):
                saved, lost = gk - self.g(i, b, j), ek - self.energy(i, b, j)
                if saved <= 0:
                    continue
                rate = saved / lost if lost > 0 else np.inf
                if top is None or rate > top[0]:
                    top = (rate, j)
            return top

        heap = []
        for i, b in pairs:
            got = best(i, b)
            if got is not None:
                heap.append((-got[0], int(lay.tensor_of[b]), b, i, got[1], int(state[i, b])))
        heapq.heapify(heap)
        while total > 0 and heap:
            _, t, b, i, j, k = heapq.heappop(heap)
            if int(state[i, b]) != k:
                continue  # stale
            total -= self.g(i, b, k) - self.g(i, b, j)
            state[i, b] = j
            got = best(i, b) if j > 0 else None
            if got is not None:
                heapq.heappush(heap, (-got[0], t, b, i, got[1], j))
        return total


def _outcome(index: BlockIndex, state: np.ndarray, opts: dict, shared_bytes: dict,
             raw: np.ndarray) -> LevelChoice:
    selected = state == EXACT
    levels = np.where(state > 0, state, 0).astype(np.int16)
    resid = np.where(selected | index.zero, 0.0, index.norms)
    sidecar = [0] * state.shape[0]
    needed: set[tuple[int, int]] = set()
    for i, b in zip(*np.nonzero(levels)):
        lv = opts[int(i)][1][int(b)][: int(levels[i, b])]
        sidecar[int(i)] += sum(size for size, _, _ in lv)
        needed.update((int(i), sid) for _, sid, _ in lv if sid >= 0)
        resid[i, b] = lv[-1][2]
    for i, sid in needed:
        sidecar[i] += int(shared_bytes[i][sid])
    return LevelChoice(selected, levels, resid, int((raw * selected).sum()), sum(sidecar),
                       tuple(sidecar))


def level_runs(levels: np.ndarray) -> list[list[list[int]]]:
    """Per expert, runs ``[b0, b1, k]`` of equal non-zero level counts (manifest form)."""
    out = []
    for row in levels:
        runs: list[list[int]] = []
        for b in np.flatnonzero(row):
            k = int(row[b])
            if runs and runs[-1][1] == b and runs[-1][2] == k:
                runs[-1][1] += 1
            else:
                runs.append([int(b), int(b) + 1, k])
        out.append(runs)
    return out


def levels_from_runs(runs: list[list[list[int]]], n_blocks: int) -> np.ndarray:
    out = np.zeros((len(runs), n_blocks), dtype=np.int16)
    for i, expert_runs in enumerate(runs):
        for b0, b1, k in expert_runs:
            out[i, b0:b1] = k
    return out
