"""Delta sidecars (issue 14): format, exact residual norms, checksums, matching.

Expected deltas come from safetensors' own loader here, never from mergefs' index.
"""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from families import Family, make_family, write_spec
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from mergefs.deltas import publish as compress
from mergefs.deltas.codes import (
    DeltaError, META_KEY, pack_bits, packed_size, rows_block_size, unpack_bits, vq_block_size,
)
from mergefs.deltas.match import find
from mergefs.deltas.reconstruct import reconstruct
from mergefs.deltas.sidecar import DeltaSidecar, open_remote_sidecar, open_sidecar
from mergefs.deltas import reconstruct as reconstruct_mod
from mergefs.recipe.family import open_family
from mergefs.core.errors import SourceChanged
from mergefs.index.blocks import load_or_build
from mergefs.spec.load import load_spec
from sidecar_cases import _row_sparse_family

BLOCK = 512


@given(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.integers(0, 255), max_size=300))
@settings(max_examples=60, deadline=None)
def test_pack_round_trip(bits: int, values: list[int]) -> None:
    codes = np.asarray(values, dtype=np.uint8) & np.uint8((1 << bits) - 1)
    buf = pack_bits(codes, bits)
    assert len(buf) == packed_size(codes.size, bits)
    assert np.array_equal(unpack_bits(buf, bits, codes.size), codes)


def _open(fam: Family, tmp: Path, weights: list[float] | None = None) -> tuple:
    spec_path = write_spec(tmp / "spec.yaml", fam, weights=weights,
                           extra={"block_size": BLOCK, "index_dir": str(tmp / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    return spec, base, experts, index


def _load_f32(path: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) for k, v in load_file(str(path)).items()
            if v.dtype.kind == "f" or v.dtype == ml_dtypes.bfloat16}


def _check_residuals(fam: Family, base, experts, index, found) -> int:
    """Every (level, block) residual norm equals the one recomputed from the file's bytes."""
    w0s = _load_f32(fam.base / "model.safetensors")
    checked = 0
    for i, sc in found.items():
        wis = _load_f32(fam.experts[i] / "model.safetensors")
        lay = index.layout
        for name, tl in sc.tensors.items():
            w0 = w0s[name].reshape(tl.rows, tl.cols)
            d = (wis[name].reshape(tl.rows, tl.cols) - w0).astype(np.float64)
            for j, b in enumerate(lay.blocks_of(tl.t)):
                r0, r1 = int(lay.elem_start[b]) // tl.cols, int(lay.elem_end[b]) // tl.cols
                if index.zero[i, b]:  # nothing stored: the block is never read
                    assert all(sc.range_resid[lv.first_range + j] == 0 for lv in tl.levels)
                    assert all(sc.range_bytes()[lv.first_range + j] == 0 for lv in tl.levels)
                    continue
                for n_lv in range(1, len(tl.levels) + 1):
                    levels = tl.levels[:n_lv]
                    w_hat = reconstruct(
                        np.ascontiguousarray(w0[r0:r1]).reshape(-1), levels,
                        [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in levels],
                        [sc.shared(lv, tl.cols) for lv in levels], r1 - r0, tl.cols)
                    eff = (w_hat - w0[r0:r1].reshape(-1)).astype(np.float64)
                    want = np.linalg.norm(d[r0:r1].reshape(-1) - eff)
                    got = sc.range_resid[levels[-1].first_range + j]
                    assert got == want
                    checked += 1
                # refinement: the last level leaves less than the plain delta norm
                last = tl.levels[-1].first_range + j
                assert sc.range_resid[last] <= index.norms[i, b] + 1e-12
    return checked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_residual_norms_are_exact(tmp_path: Path, dtype: str) -> None:
    fam = make_family(tmp_path / "fam", dtype=dtype, seed=3)
    _, base, experts, index = _open(fam, tmp_path)
    paths = compress.publish(base, experts, index)
    assert len(paths) == 3 and all(Path(p).is_file() for p in paths)
    found = find(base, experts, index)
    assert sorted(found) == [0, 1, 2]
    assert _check_residuals(fam, base, experts, index, found) > 100


def test_block_ranges_are_contiguous_and_adjacent(tmp_path: Path) -> None:
    fam = make_family(tmp_path / "fam", seed=4)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    sc = find(base, experts, index)[0]
    assert np.all(sc.range_end[:-1] == sc.range_start[1:])  # one byte stream, no holes
    for tl in sc.tensors.values():
        n_blocks = len(index.layout.blocks_of(tl.t))
        for lv in tl.levels:
            r = slice(lv.first_range, lv.first_range + n_blocks)
            assert np.all(sc.range_resid[r] >= 0)
            if lv.shared >= 0:
                assert np.isnan(sc.range_resid[lv.shared])


def test_corrupt_range_is_refused(tmp_path: Path) -> None:
    fam = make_family(tmp_path / "fam", seed=5)
    _, base, experts, index = _open(fam, tmp_path)
    path = Path(compress.publish(base, experts, index)[0])
    sc = open_sidecar(path)
    r = int(np.flatnonzero(sc.range_bytes() > 0)[3])
    start, _ = sc.abs_range(r, r + 1)
    raw = bytearray(path.read_bytes())
    raw[start] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(SourceChanged, match="checksum"):
        open_sidecar(path).read(r, r + 1)


def test_sidecar_of_another_expert_is_ignored(tmp_path: Path, caplog) -> None:
    fam = make_family(tmp_path / "fam", seed=6)
    _, base, experts, index = _open(fam, tmp_path)
    paths = [Path(p) for p in compress.publish(base, experts, index)]
    shutil.copy(paths[1], paths[0])
    found = find(base, experts, index)
    assert sorted(found) == [1, 2]
    assert "ignoring delta sidecar" in caplog.text


def _lora_family(root: Path, dtype: str) -> Family:
    """Experts whose delta is a rank-2 product on two tensors (LoRA merged), rest untouched."""
    fam = make_family(root, dtype=dtype, seed=7, n_experts=2)
    rng = np.random.default_rng(0)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    base = load_file(str(fam.base / "model.safetensors"))
    for k, e in enumerate(fam.experts):
        tensors = dict(base)
        for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            w0 = base[name].astype(np.float32)
            b = rng.normal(0, 1, (w0.shape[0], 2)).astype(np.float32)
            a = rng.normal(0, 1, (2, w0.shape[1])).astype(np.float32)
            scale = 2e-3 if dtype == "float32" else 2e-5  # bf16: a sparse +-1 ulp pattern
            tensors[name] = (w0 + scale * (b @ a)).astype(np_dtype)
        save_file(tensors, str(e / "model.safetensors"), metadata={"format": "pt"})
    return fam


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_merged_deltas_are_nearly_exact_in_few_bytes(tmp_path: Path, dtype: str) -> None:
    fam = _lora_family(tmp_path / "fam", dtype)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    found = find(base, experts, index)
    for i, sc in found.items():
        assert set(sc.tensors) == {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"}
        for tl in sc.tensors.values():
            blocks = index.layout.blocks_of(tl.t)
            lv = tl.levels[0]
            assert lv.kind == ("lowrank" if dtype == "float32" else "ulp")
            first = tl.levels[0 if dtype == "float32" else -1]
            r = sc.range_resid[first.first_range:first.first_range + len(blocks)]
            energy = 1 - (r**2).sum() / (index.norms[i, blocks.start:blocks.stop] ** 2).sum()
            assert energy >= 0.999
    _check_residuals(fam, base, experts, index, found)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "rows"])
def test_compiled_decode_equals_numpy(tmp_path: Path, dtype: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if dtype == "rows":  # float32, row-sparse deltas: the rows levels
        fam = _row_sparse_family(tmp_path / "fam")
    else:
        fam = _lora_family(tmp_path / "fam", dtype) if dtype == "bfloat16" else \
            make_family(tmp_path / "fam", dtype=dtype, seed=8)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    sc = find(base, experts, index)[0]
    w0s = _load_f32(fam.base / "model.safetensors")
    lay = index.layout

    def decode_all() -> list[np.ndarray]:
        out = []
        for tl in sc.tensors.values():
            w0 = w0s[tl.name].reshape(tl.rows, tl.cols)
            for j, r0, r1, w0b in _stored_blocks(lay, index, 0, tl, w0):
                out.append(reconstruct(
                    w0b, tl.levels,
                    [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in tl.levels],
                    [sc.shared(lv, tl.cols) for lv in tl.levels], r1 - r0, tl.cols))
        return out

    fast = decode_all()
    monkeypatch.setattr(reconstruct_mod, "_quant_add_nb", None)
    monkeypatch.setattr(reconstruct_mod, "_ulp_bf16_nb", None)
    slow = decode_all()
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _stored_blocks(lay, index, i: int, tl, w0: np.ndarray):
    """(j, r0, r1, base block float32 flat) of every block of tensor ``tl`` that expert ``i``
    stores (zero-delta blocks have nothing to decode); ``w0``: the base tensor (rows, cols)."""
    for j, b in enumerate(lay.blocks_of(tl.t)):
        if index.zero[i, b]:
            continue
        r0, r1 = int(lay.elem_start[b]) // tl.cols, int(lay.elem_end[b]) // tl.cols
        yield j, r0, r1, np.ascontiguousarray(w0[r0:r1]).reshape(-1)


def _numpy_rows_decode(w0: np.ndarray, levels, blocks, rows_b: int, cols: int) -> np.ndarray:
    """An independent decoder of ``rows`` levels: bitmap, float32 steps, packed codes."""
    acc = np.zeros((rows_b, cols), np.float32)
    for lv, buf in zip(levels, blocks):
        raw = np.frombuffer(bytes(buf), dtype=np.uint8)
        nmask = (rows_b + 7) // 8
        mask = np.unpackbits(raw[:nmask], bitorder="little")[:rows_b].astype(bool)
        changed = int(mask.sum())
        step = raw[nmask:nmask + 4 * changed].view("<f4")
        bits = np.unpackbits(raw[nmask + 4 * changed:], bitorder="little")
        bits = bits[:changed * cols * lv.bits].reshape(-1, lv.bits)
        codes = (bits * (1 << np.arange(lv.bits))).sum(axis=1)
        vals = 2.0 * codes - 1 if lv.bits == 1 else codes - ((1 << lv.bits) - 1) / 2
        acc[mask] += vals.reshape(changed, cols).astype(np.float32) * step[:, None]
    return w0 + acc.reshape(-1)


def test_rows_levels_decode_like_an_independent_numpy_decoder(tmp_path: Path) -> None:
    fam = _row_sparse_family(tmp_path / "fam")
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    found = find(base, experts, index)
    assert sorted(found) == [0, 1]
    w0s = _load_f32(fam.base / "model.safetensors")
    lay = index.layout
    decoded = 0
    for i, sc in found.items():
        wis = _load_f32(fam.experts[i] / "model.safetensors")
        for tl in sc.tensors.values():
            assert [lv.kind for lv in tl.levels] == ["rows"] * len(compress.ROWS_LADDER)
            w0 = w0s[tl.name].reshape(tl.rows, tl.cols)
            changed = (wis[tl.name].reshape(tl.rows, tl.cols) != w0).any(axis=1)
            for j, r0, r1, w0b in _stored_blocks(lay, index, i, tl, w0):
                for n_lv in range(1, len(tl.levels) + 1):
                    levels = tl.levels[:n_lv]
                    bufs = [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in levels]
                    assert len(bufs[-1]) == rows_block_size(
                        int(changed[r0:r1].sum()), r1 - r0, tl.cols, levels[-1].bits)
                    got = reconstruct(w0b, levels, bufs, [None] * n_lv, r1 - r0, tl.cols)
                    want = _numpy_rows_decode(w0b, levels, bufs, r1 - r0, tl.cols)
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
                    # unchanged rows are reconstructed exactly (zero residual there)
                    same = np.repeat(~changed[r0:r1], tl.cols)
                    assert np.array_equal(got[same], w0b[same])
                    decoded += 1
    assert decoded > 20
    assert _check_residuals(fam, base, experts, index, found) == decoded


def test_rows_levels_keep_most_energy_in_few_bytes(tmp_path: Path) -> None:
    """Row-sparse deltas: the first two levels (about 2 bits per changed element) keep more
    than 80% of each tensor's delta energy, in less than a sixth of its bf16 bytes."""
    fam = _row_sparse_family(tmp_path / "fam")
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    for i, sc in find(base, experts, index).items():
        for tl in sc.tensors.values():
            blocks = index.layout.blocks_of(tl.t)
            lv = tl.levels[1]
            r = sc.range_resid[lv.first_range:lv.first_range + len(blocks)]
            energy = 1 - (r**2).sum() / (index.norms[i, blocks.start:blocks.stop] ** 2).sum()
            assert energy > 0.8
            nbytes = sum(int(sc.range_bytes()[v.first_range:v.first_range + len(blocks)].sum())
                         for v in tl.levels[:2])
            assert nbytes < 2 * tl.rows * tl.cols / 6


def test_sidecar_version_is_checked(tmp_path: Path) -> None:
    """Version 1 (same layout, without ``rows`` and ``vq``) is still read, but a version-1 file
    holding a level kind that version does not have is refused (it cannot come from mergefs);
    an unknown version is refused with one line that says to re-run ``mergefs compress``."""
    import json

    fam = make_family(tmp_path / "fam", seed=10, n_experts=1)
    _, base, experts, index = _open(fam, tmp_path)
    path = Path(compress.publish(base, experts, index)[0])
    loaded = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()[META_KEY])
    kinds = {lv["kind"] for t in meta["tensors"] for lv in t["levels"]}
    assert kinds & {"rows", "vq"}, "the family should use a version-2 level kind"
    v1_only = json.loads(json.dumps(meta))
    for t in v1_only["tensors"]:
        t["levels"] = [lv for lv in t["levels"] if lv["kind"] not in ("rows", "vq")]
    for version, doc, ok in (("1", v1_only, True), ("1", meta, False), ("99", meta, False)):
        doc["version"] = version
        save_file(loaded, str(path), metadata={META_KEY: json.dumps(doc)})
        if ok:
            assert open_sidecar(path).meta["version"] == "1"
        elif version == "1":
            with pytest.raises(DeltaError, match=r"is not one of a version-1 sidecar"):
                open_sidecar(path)
        else:
            with pytest.raises(DeltaError, match=r"version 99.*re-run `mergefs compress`"):
                open_sidecar(path)


def _np_codes(raw: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Values (float32, in steps) of n little-endian packed codes: midrise, 1 bit is +-1."""
    b = np.unpackbits(raw, bitorder="little")[:n * bits].reshape(n, bits)
    codes = (b.astype(np.int64) * (1 << np.arange(bits))).sum(axis=1)
    return (2.0 * codes - 1 if bits == 1 else codes - ((1 << bits) - 1) / 2).astype(np.float32)


def _numpy_dense_decode(w0: np.ndarray, levels, blocks, shared_raw, rows_b: int,
                        cols: int) -> np.ndarray:
    """An independent decoder of the dense ladder (lowrank, vq, quant levels) from raw bytes;
    version 5's low-rank product in int64 (no BLAS, no float sums)."""
    qs, xs, tops = [], [], []
    for lv, buf, sh in zip(levels, blocks, shared_raw):
        if lv.kind != "lowrank":
            continue
        raw = np.frombuffer(bytes(sh), dtype=np.uint8)
        scales = raw[:8 * lv.k].view("<f4")
        v = _np_codes(raw[8 * lv.k:], lv.bits, lv.k * cols).reshape(lv.k, cols)
        xs.append((v * scales[lv.k:, None]).astype(np.float64)
                  * scales[:lv.k].astype(np.float64)[:, None])
        u = _np_codes(np.frombuffer(bytes(buf), dtype=np.uint8), lv.bits, rows_b * lv.k)
        qs.append((2 * u.astype(np.float64)).astype(np.int64).reshape(rows_b, lv.k))
        tops += [(1 << lv.bits) - 1] * lv.k
    acc = None
    if qs:  # version 5: the exact integer product on the grid of the module docstring
        x = np.vstack(xs)
        total = math.fsum(t * float(np.abs(row).max()) for t, row in zip(tops, x)) / 2
        grid = 23 - math.frexp(total)[1]
        lim = np.asarray([63 if t == 255 else 127 for t in tops])[:, None]
        while (np.abs(np.rint(x * 2.0 ** (grid - 1))) > lim).any():  # and W (2 W) in int8
            grid -= 1
        w = np.rint(x * 2.0 ** (grid - 1)).astype(np.int64)
        assert sum(t * int(np.abs(row).max()) for t, row in zip(tops, w)) < 1 << 24
        exact = np.hstack(qs) @ w  # int64: no rounding anywhere
        acc = exact.astype(np.float32) * np.float32(2.0 ** -grid) + np.float32(0)
    for lv, buf, sh in zip(levels, blocks, shared_raw):
        raw = np.frombuffer(bytes(buf), dtype=np.uint8)
        if lv.kind == "vq":
            book = np.frombuffer(bytes(sh), dtype="<f2").astype(np.float32).reshape(-1, lv.k)
            q = book[raw[4 * rows_b:]].reshape(rows_b, cols) * raw[:4 * rows_b].view("<f4")[:, None]
        elif lv.kind == "quant":
            q = _np_codes(raw[4 * rows_b:], lv.bits, rows_b * cols).reshape(rows_b, cols) \
                * raw[:4 * rows_b].view("<f4")[:, None]
        else:
            continue
        acc = q if acc is None else acc + q
    return w0.copy() if acc is None else w0 + acc.reshape(-1)


def test_dense_ladder_decodes_like_an_independent_numpy_decoder(tmp_path: Path) -> None:
    """Low-rank, vq and quant levels (every prefix of every block) decode bit for bit as an
    independent reading of the bytes; the vq codebook is one range shared by all tensors."""
    fam = make_family(tmp_path / "fam", seed=12, n_experts=1)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    sc = find(base, experts, index)[0]
    w0s = _load_f32(fam.base / "model.safetensors")
    lay = index.layout
    kinds: set[str] = set()
    books = set()
    for tl in sc.tensors.values():
        w0 = w0s[tl.name].reshape(tl.rows, tl.cols)
        shared_raw = [sc.read(lv.shared, lv.shared + 1) if lv.shared >= 0 else None
                      for lv in tl.levels]
        books.update(lv.shared for lv in tl.levels if lv.kind == "vq")
        for j, r0, r1, w0b in _stored_blocks(lay, index, 0, tl, w0):
            for n_lv in range(1, len(tl.levels) + 1):
                levels = tl.levels[:n_lv]
                bufs = [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in levels]
                if levels[-1].kind == "vq":
                    assert len(bufs[-1]) == vq_block_size(r1 - r0, tl.cols, levels[-1])
                got = reconstruct(w0b, levels, bufs,
                                         [sc.shared(lv, tl.cols) for lv in levels],
                                         r1 - r0, tl.cols)
                want = _numpy_dense_decode(w0b, levels, bufs, shared_raw[:n_lv], r1 - r0,
                                           tl.cols)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
                kinds.add(levels[-1].kind)
    assert {"lowrank", "vq", "quant"} <= kinds
    assert len(books) == 1  # one codebook range for the whole sidecar


def test_remote_sidecar_spans_take_gaps_from_the_allowance(tmp_path: Path) -> None:
    """A remote sidecar's spans within ``coalesce_gap`` share one fetch while each gap can be
    taken from its allowance (the merge's, shared with the exact reads): no limit joins them
    all, an empty allowance fetches each span alone, a partial one joins until it is spent;
    the bytes are the same in every case."""
    from mergefs.sources.base import GapAllowance

    fam = make_family(tmp_path / "fam", seed=4)
    _, base, experts, index = _open(fam, tmp_path)
    path = Path(compress.publish(base, experts, index)[0])
    blob = path.read_bytes()
    local = open_sidecar(path)
    every_other = np.flatnonzero(local.range_bytes() > 0)[::2][:6]
    spans = [(int(r), int(r) + 1) for r in every_other]
    want = [bytes(v) for v in local.read_spans(spans)]
    gaps = [int(local.range_start[b[0]] - local.range_end[a[0]])
            for a, b in itertools.pairwise(spans)]
    assert len(spans) == 6 and min(gaps) > 0

    def read(allowance: GapAllowance | None) -> DeltaSidecar:
        sc = open_remote_sidecar(str(path), lambda a, b: blob[a:b], 1 << 20)
        sc.gap_allowance = allowance
        assert [bytes(v) for v in sc.read_spans(spans)] == want
        return sc

    sc = read(None)
    assert (sc.reads, sc.gap_bytes) == (1, sum(gaps))
    sc = read(GapAllowance(0))
    assert (sc.reads, sc.gap_bytes) == (6, 0)
    part = GapAllowance(gaps[0] + gaps[1])
    sc = read(part)
    assert (sc.reads, sc.gap_bytes) == (4, gaps[0] + gaps[1]) == (4, part.spent_bytes)
    assert sc.bytes_read == sum(len(w) for w in want) + part.spent_bytes
