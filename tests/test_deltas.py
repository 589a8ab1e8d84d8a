"""Delta sidecars (issue 14): format, exact residual norms, checksums, matching.

Expected deltas come from safetensors' own loader here, never from mergefs' index.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from families import Family, make_family, write_spec
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from mergefs import compress, deltas
from mergefs.engine import open_family
from mergefs.errors import SourceChanged
from mergefs.index import load_or_build
from mergefs.spec import load_spec

BLOCK = 512


@given(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.integers(0, 255), max_size=300))
@settings(max_examples=60, deadline=None)
def test_pack_round_trip(bits: int, values: list[int]) -> None:
    codes = np.asarray(values, dtype=np.uint8) & np.uint8((1 << bits) - 1)
    buf = deltas.pack_bits(codes, bits)
    assert len(buf) == deltas.packed_size(codes.size, bits)
    assert np.array_equal(deltas.unpack_bits(buf, bits, codes.size), codes)


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
                    w_hat = deltas.reconstruct(
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
    found = deltas.find(base, experts, index)
    assert sorted(found) == [0, 1, 2]
    assert _check_residuals(fam, base, experts, index, found) > 100


def test_block_ranges_are_contiguous_and_adjacent(tmp_path: Path) -> None:
    fam = make_family(tmp_path / "fam", seed=4)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    sc = deltas.find(base, experts, index)[0]
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
    sc = deltas.open_sidecar(path)
    r = int(np.flatnonzero(sc.range_bytes() > 0)[3])
    start, _ = sc.abs_range(r, r + 1)
    raw = bytearray(path.read_bytes())
    raw[start] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(SourceChanged, match="checksum"):
        deltas.open_sidecar(path).read(r, r + 1)


def test_sidecar_of_another_expert_is_ignored(tmp_path: Path, caplog) -> None:
    fam = make_family(tmp_path / "fam", seed=6)
    _, base, experts, index = _open(fam, tmp_path)
    paths = [Path(p) for p in compress.publish(base, experts, index)]
    shutil.copy(paths[1], paths[0])
    found = deltas.find(base, experts, index)
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
    found = deltas.find(base, experts, index)
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_equals_numpy(tmp_path: Path, dtype: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fam = _lora_family(tmp_path / "fam", dtype) if dtype == "bfloat16" else \
        make_family(tmp_path / "fam", dtype=dtype, seed=8)
    _, base, experts, index = _open(fam, tmp_path)
    compress.publish(base, experts, index)
    sc = deltas.find(base, experts, index)[0]
    w0s = _load_f32(fam.base / "model.safetensors")
    lay = index.layout

    def decode_all() -> list[np.ndarray]:
        out = []
        for tl in sc.tensors.values():
            w0 = w0s[tl.name].reshape(tl.rows, tl.cols)
            for j, b in enumerate(lay.blocks_of(tl.t)):
                if index.zero[0, b]:
                    continue
                r0, r1 = int(lay.elem_start[b]) // tl.cols, int(lay.elem_end[b]) // tl.cols
                out.append(deltas.reconstruct(
                    np.ascontiguousarray(w0[r0:r1]).reshape(-1), tl.levels,
                    [sc.read(lv.first_range + j, lv.first_range + j + 1) for lv in tl.levels],
                    [sc.shared(lv, tl.cols) for lv in tl.levels], r1 - r0, tl.cols))
        return out

    fast = decode_all()
    monkeypatch.setattr(deltas, "_quant_add_nb", None)
    monkeypatch.setattr(deltas, "_ulp_bf16_nb", None)
    slow = decode_all()
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
