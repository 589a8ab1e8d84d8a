"""Version 4's exact low-rank product (issue 14): every float32 product of the grid's integers
is exact, so the decoded bits do not depend on the BLAS, its thread count or the summation
order; the grid is the largest that keeps every partial sum below 2**24; damaged values are
refused; version-3 sidecars still decode with their fixed-order product."""

from __future__ import annotations

import math

import numpy as np
import pytest
import threadpoolctl
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_cases import relabelled_lowrank_tensors

from mergefs.deltas import publish as compress, decode as deltadecode, intgemm
from mergefs.deltas.codes import DeltaError, Level, lowrank_block_size, packed_size
from mergefs.deltas.reconstruct import _uq, exact_level, grid_of, reconstruct, shared_value
def _built(w0: np.ndarray, wi: np.ndarray):
    """One tensor's levels as the publisher builds them, 37-row blocks: (rows, built, levels,
    decoded shared values)."""
    m, n = w0.shape
    rows = [(r, min(m, r + 37)) for r in range(0, m, 37)]
    built = compress.build_levels(w0, wi, rows)
    levels = tuple(Level(kind, bits, k, 0 if s is not None else -1)
                   for (kind, bits, k), s in zip(built.kinds, built.shared))
    shared = [shared_value(lv, memoryview(s), n) if s is not None else None
              for s, lv in zip(built.shared, levels)]
    return rows, built, levels, shared


def _dense_tensor(seed: int, m: int = 300, n: int = 96):
    """One dense tensor's levels (the low-rank ladder, vq, quant) as the publisher builds them."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 0.05, (m, n)).astype(np.float32)
    spectrum = np.exp(-np.arange(n) / 12.0)
    d = (rng.normal(0, 1, (m, n)) * spectrum) @ rng.normal(0, 1, (n, n)) * 1e-3 / np.sqrt(n)
    wi = (w0 + d).astype(np.float32)
    rows, built, levels, shared = _built(w0, wi)
    return w0, wi, rows, built, levels, shared


def test_the_grid_product_is_exact_in_any_order() -> None:
    """Q W by BLAS (1 and 2 threads), by a float32 sum in reversed component order, and in
    int64: the same integers, all below 2**24."""
    _, _, rows, built, levels, shared = _dense_tensor(1)
    exact = [lvl for lvl, lv in enumerate(levels) if exact_level(lv, "4")]
    assert len(exact) >= 3, [(lv.kind, lv.bits, lv.k) for lv in levels]
    _, w = grid_of(levels, shared)
    r0, r1 = rows[2]
    q = np.hstack([_uq(levels[lvl], r1 - r0, memoryview(built.blocks[lvl][2]))
                   for lvl in exact])
    assert q.shape[1] == w.shape[0] and (np.abs(q) % 2 == 1).all()  # odd integers
    want = q.astype(np.int64) @ w.astype(np.int64)
    assert np.abs(want).max() < 1 << 24 and np.abs(want).max() > 1 << 20  # the grid is used
    with threadpoolctl.threadpool_limits(1):
        one = q @ w
    with threadpoolctl.threadpool_limits(2):
        two = q @ w
    backwards = np.zeros_like(one)
    for c in reversed(range(q.shape[1])):
        backwards += q[:, c:c + 1] * w[c:c + 1]
    for got in (one, two, backwards):
        assert np.array_equal(got.astype(np.int64), want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 3, 4, 8]), st.integers(1, 9),
                          st.floats(1e-30, 1e30)), min_size=1, max_size=4),
       st.integers(0, 2**32 - 1))
def test_grid_is_the_largest_that_keeps_partial_sums_exact(spec, seed) -> None:
    """For any scales: ``sum_c (2**bits - 1) max|W_c| < 2**24`` at the grid chosen, and one step
    finer would break the bound the grid is chosen by (``total * 2**G < 2**23``)."""
    rng = np.random.default_rng(seed)
    cols = 5
    levels, shared, tops, peaks = [], [], [], []
    for bits, k, scale in spec:
        us = (rng.uniform(0.1, 1, k) * scale).astype(np.float32)
        v = (rng.normal(0, 1, (k, cols)) * scale).astype(np.float32)
        levels.append(Level("lowrank", bits, k, 0))
        shared.append((us, v))
        x = v.astype(np.float64) * us.astype(np.float64)[:, None]
        tops += [(1 << bits) - 1] * k
        peaks += list(np.abs(x).max(axis=1))
    total = math.fsum(t * p for t, p in zip(tops, peaks)) / 2
    if 23 - math.frexp(total)[1] < -100:
        with pytest.raises(DeltaError):
            grid_of(levels, shared)
        return
    grid, w = grid_of(levels, shared)
    assert sum(t * int(np.abs(row).max()) for t, row in zip(tops, w)) < 1 << 24
    assert total * 2.0 ** grid < 2**23
    if grid < 149:
        assert 2**23 <= total * 2.0 ** (grid + 1)
    else:  # tiny values: the finest grid a float32 scale has (2**-149)
        assert grid == 149 and np.float32(2.0 ** -grid) > 0


@pytest.mark.parametrize("scale", [1e-41, 1e-42])
def test_a_subnormal_delta_publishes_and_decodes(scale: float) -> None:
    """An expert whose tensor moved by subnormal amounts only is not a damaged sidecar: the
    publisher builds its levels (the grid is capped at the finest float32 scale, 2**-149), the
    low-rank levels still reduce the residual, and the batched decoder equals the numpy one."""
    rng = np.random.default_rng(7)
    m, n = 120, 32
    w0 = np.zeros((m, n), np.float32)
    d = rng.normal(0, 1, (m, 6)) @ rng.normal(0, 1, (6, n)) * scale
    wi = d.astype(np.float32)
    assert np.abs(wi).max() < np.finfo(np.float32).tiny and np.count_nonzero(wi) > m * n // 2
    rows, built, levels, shared = _built(w0, wi)
    assert exact_level(levels[0], "4"), levels
    grid, _ = grid_of(levels, shared)
    assert grid == 149
    first = sum(built.resid[0][j] ** 2 for j in range(len(rows))) ** 0.5
    assert first < 0.9 * float(np.linalg.norm(wi.astype(np.float64)))
    sizes = np.asarray([[len(b) for b in bl] for bl in built.blocks], np.int64)
    off = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(sizes.shape)
    data = np.frombuffer(b"".join(b for bl in built.blocks for b in bl), np.uint8)
    starts = np.asarray([r0 * n for r0, _ in rows], np.int64)
    n_rows = np.asarray([r1 - r0 for r0, r1 in rows], np.int64)
    out = np.full(m * n, np.nan, np.float32)
    deltadecode.decode_into(out, w0.reshape(-1), levels, n, starts, n_rows,
                            np.full(len(rows), len(levels)), deltadecode.Payloads(data, off, sizes),
                            shared)
    for j, (r0, r1) in enumerate(rows):
        want = reconstruct(w0[r0:r1].reshape(-1), levels,
                                  [memoryview(bl[j]) for bl in built.blocks], shared, r1 - r0, n)
        assert np.array_equal(out[r0 * n:r1 * n].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_a_damaged_lowrank_scale_is_refused(bad: float) -> None:
    """A non-finite (or absurd) U scale: a DeltaError from both decoders, nothing written."""
    w0, _, rows, built, levels, shared = _dense_tensor(2)
    us, v = shared[0]
    us = us.copy()
    us[0] = bad
    shared = [(us, v), *shared[1:]]
    r0, r1 = rows[0]
    n = w0.shape[1]
    blocks = [memoryview(built.blocks[lvl][0]) for lvl in range(len(levels))]
    with pytest.raises(DeltaError, match="damaged sidecar"):
        reconstruct(w0[r0:r1].reshape(-1), levels, blocks, shared, r1 - r0, n)
    sizes = np.asarray([[len(b)] for b in blocks], np.int64)
    off = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(sizes.shape)
    payloads = deltadecode.Payloads(np.frombuffer(b"".join(bytes(b) for b in blocks), np.uint8),
                                    off, sizes)
    out = np.full((r1 - r0) * n, np.nan, np.float32)
    with pytest.raises(DeltaError, match="damaged sidecar"):
        deltadecode.decode_into(out, w0[r0:r1].reshape(-1), levels, n, np.array([0]),
                                np.array([r1 - r0]), np.array([len(levels)]), payloads, shared)
    assert np.isnan(out).all()


def test_float16_levels_keep_the_fixed_order_product() -> None:
    """A float16 low-rank level (exact low-rank deltas: adapter factors) is not on the grid:
    version 4 adds it component by component after the grid's product, like version 3."""
    rng = np.random.default_rng(3)
    cols, rb = 16, 5
    us = rng.uniform(0.5, 1, 3).astype(np.float32)
    v = rng.normal(0, 1, (3, cols)).astype(np.float32)
    lv = Level("lowrank", 16, 3, 0)
    block = rng.normal(0, 1, rb * 3).astype("<f2").tobytes()
    w0 = rng.normal(0, 1, rb * cols).astype(np.float32)
    got = reconstruct(w0, (lv,), [memoryview(block)], [(us, v)], rb, cols)
    u = np.frombuffer(block, "<f2").astype(np.float32).reshape(rb, 3) * us
    acc = np.zeros((rb, cols), np.float32)
    for c in range(3):
        acc = acc + u[:, c:c + 1] * v[c:c + 1]
    assert np.array_equal(got, w0 + acc.reshape(-1))
    assert np.array_equal(got, reconstruct(w0, (lv,), [memoryview(block)], [(us, v)],
                                                  rb, cols, version="3"))


def test_version_3_sidecar_decodes_with_its_fixed_order_product(tmp_path) -> None:
    """A version-3 file (a version-4 one relabelled) decodes, through the engine's batched
    decoder, with version 3's component-by-component product, which rounds differently."""
    sc, cases = relabelled_lowrank_tensors(tmp_path, 34, "3")
    checked = differ = 0
    for tl, w0, js, starts, n_rows in cases:
        depth = len(tl.levels)
        out = np.full_like(w0, np.nan)
        deltadecode.decode_blocks(sc, tl, js, np.full(js.size, depth), starts, n_rows, w0, out)
        shared = [sc.shared(lv, tl.cols) for lv in tl.levels]
        for j, s, r in zip(js, starts, n_rows):
            bufs = [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in tl.levels]
            args = (w0[s:s + r * tl.cols], tl.levels, bufs, shared, int(r), tl.cols)
            v3, v4 = reconstruct(*args, version="3"), reconstruct(*args)
            assert np.array_equal(out[s:s + r * tl.cols].view(np.uint32), v3.view(np.uint32))
            differ += not np.array_equal(v3.view(np.uint32), v4.view(np.uint32))
            checked += 1
    assert checked > 5
    assert differ > 0  # the two products round differently: the version decides the route


def _lowrank_case(seed: int) -> tuple:
    """Low-rank levels at 2/3/4/8/16 bits with k in 1..17 (3 bits: also k = 8 and 16, the
    eight-codes-per-three-bytes unpacker), quant levels between them, blocks of random heights
    (some empty) at every depth from 0, and their ranges."""
    rng = np.random.default_rng(seed)
    cols = int(rng.integers(1, 24))
    levels, shared = [], []
    for lvl in range(int(rng.integers(2, 6))):
        if lvl and rng.random() < 0.3:
            levels.append(Level("quant", int(rng.integers(1, 5)), 0))
            shared.append(None)
            continue
        bits = int(rng.choice([2, 3, 3, 4, 8, 16]))
        k = int(rng.integers(1, 18))
        if bits == 3 and rng.random() < 0.6:
            k = int(rng.choice([8, 16]))
        us = (rng.uniform(0.1, 1, k) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
        levels.append(Level("lowrank", bits, k, 0))
        shared.append((us, rng.normal(0, 1, (k, cols)).astype(np.float32)))
    n_rows = rng.integers(0, 20, 9)
    depths = rng.integers(0, len(levels) + 1, n_rows.size)
    depths[0] = len(levels) - 1  # the call never reaches the last level

    def blob(lv: Level, rb: int) -> bytes:
        if lv.kind == "quant":
            return (rng.uniform(1e-4, 1e-3, rb).astype("<f4").tobytes()
                    + rng.bytes(packed_size(rb * cols, lv.bits)))
        if lv.bits == 16:
            return rng.normal(0, 1, rb * lv.k).astype("<f2").tobytes()
        return rng.bytes(lowrank_block_size(rb, lv.k, lv.bits))

    blocks = [[blob(lv, int(rb)) for rb in n_rows] for lv in levels]
    size = np.asarray([[len(b) for b in row] for row in blocks], np.int64)
    off = (np.cumsum(size.reshape(-1)) - size.reshape(-1)).reshape(size.shape)
    data = np.frombuffer(b"".join(b for row in blocks for b in row), np.uint8)
    starts = np.concatenate([[0], np.cumsum(n_rows * cols)[:-1]]).astype(np.int64)
    w0 = rng.normal(0, 0.05, int((n_rows * cols).sum())).astype(np.float32)
    return (tuple(levels), shared, cols, starts, n_rows, depths, blocks,
            deltadecode.Payloads(data, off, size), w0)


def _route(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blas``: every exact product a float32 BLAS product; ``onednn``: every one of more than
    one block oneDNN's int8 matmul (:mod:`mergefs.deltas.intgemm`), however small."""
    if route == "blas":
        monkeypatch.setattr(deltadecode, "_int_route", lambda: None)
    else:
        if not intgemm.available():
            pytest.skip("this CPU has neither AMX nor VNNI: no oneDNN int8 route")
        monkeypatch.setattr(intgemm, "MIN_MACS", 0)
        monkeypatch.setattr(intgemm, "MAX_DIGITS", 9)  # version 4's three-digit weights too


@pytest.mark.parametrize("version", ["4", "5"])
@pytest.mark.parametrize("route", ["blas", "onednn"])
@pytest.mark.parametrize("seed", range(8))
def test_batched_exact_decode_does_not_depend_on_chunks_or_packing(
        seed: int, route: str, version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks at every depth (some without quantised low-rank components), float16 and
    quantised low-rank levels mixed, decoded in chunks of a few blocks and with a packing of
    more levels than the call reaches, by either route of the exact product, sidecar versions 4
    and 5: the same bits as :func:`reconstruct` block by block, whose grid is that of
    the block's own prefix."""
    _route(route, monkeypatch)
    levels, shared, cols, starts, n_rows, depths, blocks, payloads, w0 = _lowrank_case(seed)
    want = np.empty_like(w0)
    for j, (s, rb, d) in enumerate(zip(starts, n_rows, depths)):
        want[s:s + rb * cols] = reconstruct(
            w0[s:s + rb * cols], levels[:d], [memoryview(blocks[lvl][j]) for lvl in range(d)],
            shared[:d], int(rb), cols, version=version)
    assert deltadecode._compiled() is not None, "numba is a dependency of these tests"
    deep = deltadecode.pack(levels, shared, cols, version)
    assert deep.grids, [(lv.kind, lv.bits, lv.k) for lv in levels]
    for chunk, packed in ((deltadecode.CHUNK_ELEMENTS, None), (2 * cols, deep), (1, None)):
        monkeypatch.setattr(deltadecode, "CHUNK_ELEMENTS", chunk)
        got = np.full_like(w0, np.nan)
        deltadecode.decode_into(got, w0, levels, cols, starts, n_rows, depths, payloads, shared,
                                packed, version)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), chunk


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 3, 4, 8]), st.integers(1, 9),
                          st.floats(1e-12, 1e12)), min_size=1, max_size=4),
       st.integers(0, 2**32 - 1))
def test_version_5_grid_is_int8_and_the_finest_such(spec, seed) -> None:
    """Version 5: ``|W| <= 127`` (63 on 8-bit rows, whose int8 weights are ``2 W``), so the
    int8 route makes one call; one step finer would break that or the partial-sum bound; the
    grid is never finer than version 4's."""
    rng = np.random.default_rng(seed)
    cols = 5
    levels, shared = [], []
    for bits, k, scale in spec:
        us = (rng.uniform(0.1, 1, k) * scale).astype(np.float32)
        v = (rng.normal(0, 1, (k, cols)) * scale).astype(np.float32)
        levels.append(Level("lowrank", bits, k, 0))
        shared.append((us, v))
    g4, _ = grid_of(levels, shared, "4")
    g5, w5 = grid_of(levels, shared, "5")
    assert g5 <= g4
    lim = np.concatenate([np.full(lv.k, 63 if lv.bits == 8 else 127) for lv in levels])
    assert (np.abs(w5).max(axis=1) <= lim).all()
    assert intgemm.digits_of(w5, lim == 63) == 1  # one oneDNN call
    if g5 < g4:  # the int8 limit bound it: one step finer exceeds it on some row
        x = np.vstack([sh[1].astype(np.float64) * sh[0].astype(np.float64)[:, None]
                       for sh in shared])
        assert (np.abs(np.rint(x * math.ldexp(1.0, g5))).max(axis=1) > lim).any()


def test_version_5_products_take_one_onednn_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of version 5: ``W`` is one int8 digit, so the int8 route makes one call."""
    if not intgemm.available():
        pytest.skip("this CPU has neither AMX nor VNNI: no oneDNN int8 route")
    *_, levels, shared = _dense_tensor(3)
    for version, most in (("4", 3), ("5", 1)):
        packed = deltadecode.pack(levels, shared, 96, version)
        digits = []
        for k, (_, w) in packed.grids.items():
            digits.append(intgemm.prepare(w, packed.eight(k)).ndig)
        assert max(digits) <= most and (version == "5" or max(digits) > 1), (version, digits)


def test_the_route_counts_a_products_digits_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's test (one oneDNN call per digit of ``W``) is computed once per number of
    components, not on every call: single blocks (the mount's units) decoded again and again
    paid it each time (~0.03-1 ms, more than their decode), whichever route they took."""
    if not intgemm.available():
        pytest.skip("this CPU has neither AMX nor VNNI: no oneDNN int8 route")
    rng = np.random.default_rng(3)
    cols, rb = 40, 9
    levels = (Level("lowrank", 4, 6, 0), Level("lowrank", 2, 10, 0))
    shared = [(rng.uniform(0.1, 1, lv.k).astype(np.float32),
               rng.normal(0, 1, (lv.k, cols)).astype(np.float32)) for lv in levels]
    blocks = [rng.bytes(lowrank_block_size(rb, lv.k, lv.bits)) for lv in levels]
    size = np.asarray([[len(b)] for b in blocks], np.int64)
    payloads = deltadecode.Payloads(np.frombuffer(b"".join(blocks), np.uint8),
                                    np.asarray([[0], [len(blocks[0])]], np.int64), size)
    w0 = rng.normal(0, 0.05, rb * cols).astype(np.float32)
    want = reconstruct(w0, levels, [memoryview(b) for b in blocks], shared, rb, cols)
    packed = deltadecode.pack(levels, shared, cols)
    calls = []
    real = intgemm.digits_of
    monkeypatch.setattr(intgemm, "digits_of", lambda w, e: calls.append(1) or real(w, e))
    for min_macs in (10**9, 10**9, 0, 0):  # the compiled loop twice, then the int8 route
        monkeypatch.setattr(intgemm, "MIN_MACS", min_macs)
        got = np.full_like(w0, np.nan)
        deltadecode.decode_into(got, w0, levels, cols, np.zeros(1, np.int64), np.array([rb]),
                                np.array([2]), payloads, shared, packed)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), min_macs
    assert len(calls) == 1, len(calls)
    assert 16 in packed.int_weights  # the int8 route was taken


@pytest.mark.parametrize("route", ["blas", "onednn"])
def test_the_publishers_ladder_decodes_by_either_route_at_every_depth(
        route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ladder ``mergefs compress`` writes (4-, 3- and 2-bit low-rank levels whose
    components start on multiples of four, then vq and quant levels), every block at every
    depth in one call: the same bits as :func:`reconstruct` block by block (the int8
    route unpacks whole bytes of 2-bit codes as words; the vq codewords and the per-byte code
    values are added as vectors)."""
    _route(route, monkeypatch)
    w0, _, rows, built, levels, shared = _dense_tensor(1)
    kinds = [(lv.kind, lv.bits) for lv in levels]
    assert ("lowrank", 2) in kinds and ("vq", 1) in kinds and ("quant", 2) in kinds, kinds
    starts_c = np.cumsum([0] + [lv.k for lv in levels if lv.kind == "lowrank"])
    assert any(lv.bits == 2 and lv.k % 4 == 0 and c % 4 == 0 and (c + lv.k) % 4 == 0
               for lv, c in zip([lv for lv in levels if lv.kind == "lowrank"], starts_c)), \
        "no 2-bit level on the int8 route's word path"
    cols = w0.shape[1]
    n_rows = np.asarray([r1 - r0 for r0, r1 in rows], np.int64)
    starts = np.asarray([r0 * cols for r0, _ in rows], np.int64)
    flat = w0.reshape(-1)
    for depth in range(1, len(levels) + 1):
        depths = np.full(len(rows), depth, np.int64)
        blocks = [[built.blocks[lvl][j] for j in range(len(rows))] for lvl in range(depth)]
        size = np.asarray([[len(b) for b in row] for row in blocks], np.int64)
        off = (np.cumsum(size.reshape(-1)) - size.reshape(-1)).reshape(size.shape)
        payloads = deltadecode.Payloads(
            np.frombuffer(b"".join(b for row in blocks for b in row), np.uint8), off, size)
        want = np.concatenate([
            reconstruct(flat[s:s + rb * cols], levels[:depth],
                               [memoryview(blocks[lvl][j]) for lvl in range(depth)],
                               shared[:depth], int(rb), cols)
            for j, (s, rb) in enumerate(zip(starts, n_rows))])
        packed = deltadecode.pack(levels[:depth], shared[:depth], cols)
        got = np.full_like(flat, np.nan)
        deltadecode.decode_into(got, flat, levels, cols, starts, n_rows, depths, payloads,
                                shared, packed)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (route, depth)
        if route == "onednn":
            assert packed.int_weights, depth  # the int8 route was taken
        single = np.full_like(flat, np.nan)  # one block per call (blas: Q W in the loop)
        for j in range(len(rows)):
            one = deltadecode.Payloads(payloads.data, off[:, j:j + 1].copy(),
                                       size[:, j:j + 1].copy())
            deltadecode.decode_into(single, flat, levels, cols, starts[j:j + 1],
                                    n_rows[j:j + 1], depths[j:j + 1], one, shared)
        assert np.array_equal(single.view(np.uint32), want.view(np.uint32)), (route, depth)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 3, 4, 8, 16]), st.integers(1, 9),
                          st.floats(1e-12, 1e12)), min_size=1, max_size=4),
       st.integers(0, 12), st.sampled_from(["4", "5"]), st.integers(0, 2**32 - 1))
def test_grid_weights_are_the_rounded_scaled_products(spec, cols, version, seed) -> None:
    """``W`` is ``rint(uscale * V * 2**(G-1))`` computed the plain way (float64, the product
    formed first), bit for bit, signs of zero included; float16 levels take no part."""
    rng = np.random.default_rng(seed)
    levels, shared = [], []
    for bits, k, scale in spec:
        us = (rng.uniform(-1, 1, k) * scale).astype(np.float32)
        v = (rng.normal(0, 1, (k, cols)) * scale).astype(np.float32)
        v[rng.random(v.shape) < 0.1] = -0.0
        levels.append(Level("lowrank", bits, k, 0))
        shared.append((us, v))
    grid, w = grid_of(levels, shared, version)
    x = [sh[1].astype(np.float64) * sh[0].astype(np.float64)[:, None]
         for lv, sh in zip(levels, shared) if lv.bits != 16]
    if not x:
        assert w.shape == (0, 0)
        return
    want = np.rint(np.vstack(x) * math.ldexp(1.0, grid - 1)).astype(np.float32)
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))
