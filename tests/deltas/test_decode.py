"""Batched decoding of version-4 delta sidecars (issue 14): the compiled loop equals the numpy
decoder bit for bit, the engine's merge equals a block-by-block decode, stored residuals are the
decoded blocks' errors, and version-2 sidecars still decode with their BLAS product."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from families import write_spec
from safetensors.numpy import load_file

from mergefs.deltas import publish as compress, decode as deltadecode
from mergefs.deltas.codes import (
    DELTA_VERSION, DeltaError, dequant,
)
from mergefs.deltas.match import find
from mergefs.deltas.reconstruct import reconstruct
from mergefs.deltas import reconstruct as reconstruct_mod
from mergefs.methods import kernels
from mergefs.engine.session import Session
from mergefs.recipe.family import open_family
from mergefs.index.blocks import load_or_build
from mergefs.spec.load import load_spec
from sidecar_cases import _random_case, _setup, relabelled_lowrank_tensors
from sidecar_cases import BLOCK, _mixed_family


@pytest.mark.parametrize("seed", range(16))
def test_compiled_loop_equals_numpy_decoder_bit_for_bit(seed: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random well-formed levels of every kind (low-rank at 2/3/4/8/16 bits, quant and rows at
    1-4 bits, vq, bf16 ulp, sparse), blocks of different heights and depths: one compiled call
    writes the same bits as :func:`reconstruct` block by block, and nothing else."""
    levels, shared, cols, starts, n_rows, depths, payloads, w0 = _random_case(seed)
    assert deltadecode._compiled() is not None, "numba is a dependency of these tests"
    fast = np.full_like(w0, np.nan)
    deltadecode.decode_into(fast, w0, levels, cols, starts, n_rows, depths, payloads, shared)
    monkeypatch.setattr(deltadecode, "_decode_nb", None)
    monkeypatch.setattr(reconstruct_mod, "_quant_add_nb", None)
    monkeypatch.setattr(reconstruct_mod, "_ulp_bf16_nb", None)
    slow = np.full_like(w0, np.nan)
    deltadecode.decode_into(slow, w0, levels, cols, starts, n_rows, depths, payloads, shared)
    assert np.array_equal(fast.view(np.uint32), slow.view(np.uint32))
    touched = np.zeros(w0.size, bool)
    for s, rb in zip(starts, n_rows):
        touched[s:s + rb * cols] = True
    assert np.isnan(fast[~touched]).all()  # (a bf16 move below -0 may write a NaN pattern)
    assert not np.array_equal(fast[touched], w0[touched])  # the levels changed something


def test_compiled_loop_refuses_a_range_of_the_wrong_size() -> None:
    levels, shared, cols, starts, n_rows, depths, payloads, w0 = _random_case(3)
    j = int(np.argmax(depths))
    short = payloads.size.copy()
    short[0, j] -= 1
    bad = deltadecode.Payloads(payloads.data, payloads.off, short)
    with pytest.raises(DeltaError, match="sizes"):
        deltadecode.decode_into(np.zeros_like(w0), w0, levels, cols, starts, n_rows, depths,
                                bad, shared)


def _merge(spec, budget: int, out: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    s = Session(spec, budget_bytes=budget)
    shutil.rmtree(out, ignore_errors=True)
    s.engine.materialise(out, threads=2)
    levels = s.plan.levels
    s.finish()
    s.close()
    return load_file(str(out / "model.safetensors")), levels


def test_engine_merge_equals_block_by_block_decode(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """At budgets that reconstruct blocks at several depths, the merge with the compiled loop
    (one call per unit and expert) equals the merge that decodes block by block with numpy."""
    _, spec, base, experts, index, _ = _setup(tmp_path)
    total = int(index.expert_block_bytes().sum())
    for c in [base, *experts]:
        c.close()
    merged = 0
    for frac in (0.05, 0.2):
        fast, levels = _merge(spec, int(frac * total), tmp_path / "fast")
        assert levels is not None and len(np.unique(levels[levels > 0])) > 1
        merged += int((levels > 0).sum())
        with monkeypatch.context() as m:
            m.setattr(deltadecode, "_decode_nb", None)
            slow, levels_slow = _merge(spec, int(frac * total), tmp_path / "slow")
        assert np.array_equal(levels, levels_slow)
        for k in fast:
            assert fast[k].tobytes() == slow[k].tobytes(), (frac, k)
    assert merged > 20


def _block_errors(sc, tl, index, i: int, w0: np.ndarray, wi: np.ndarray, depth: int
                  ) -> np.ndarray:
    """``||D_b - fl(W_hat_b - W0_b)||`` of every non-zero block, decoded by one batched call."""
    lay = index.layout
    blocks = np.asarray([b for b in lay.blocks_of(tl.t) if not index.zero[i, b]], np.int64)
    js = blocks - int(lay.first_block[tl.t])
    starts = lay.elem_start[blocks] - int(lay.elem_start[lay.first_block[tl.t]])
    n_rows = (lay.elem_end[blocks] - lay.elem_start[blocks]) // tl.cols
    out = np.full_like(w0, np.nan)
    deltadecode.decode_blocks(sc, tl, js, np.full(js.size, depth), starts, n_rows, w0, out)
    d = (wi - w0).astype(np.float64)
    return np.asarray([np.linalg.norm(d[s:s + r * tl.cols] - (out[s:s + r * tl.cols]
                                                              - w0[s:s + r * tl.cols]))
                       for s, r in zip(starts, n_rows)]), js


def test_stored_residuals_are_the_errors_of_the_batched_decode(tmp_path: Path) -> None:
    fam, _, base, experts, index, paths = _setup(tmp_path, seed=32)
    found = find(base, experts, index)
    assert sorted(found) == [0, 1]
    w0s = load_file(str(fam.base / "model.safetensors"))
    checked = 0
    for i, sc in found.items():
        assert sc.meta["version"] == DELTA_VERSION == "5"
        wis = load_file(str(fam.experts[i] / "model.safetensors"))
        for tl in sc.tensors.values():
            w0 = w0s[tl.name].astype(np.float32).reshape(-1)
            wi = wis[tl.name].astype(np.float32).reshape(-1)
            for depth in range(1, len(tl.levels) + 1):
                errs, js = _block_errors(sc, tl, index, i, w0, wi, depth)
                stored = sc.range_resid[tl.levels[depth - 1].first_range + js]
                assert np.array_equal(errs, stored), (tl.name, depth)
                checked += errs.size
    assert checked > 100


def _blas_decode(w0b, levels, bufs, shared, rows_b: int, cols: int) -> np.ndarray:
    """Versions 1 and 2's low-rank and vq levels, independently: ``[U_1 ..] [V_1; ..]`` by
    BLAS, then each vq level's ``codebook[code] * row scale`` added."""
    us, vs = [], []
    for lv, buf, sh in zip(levels, bufs, shared):
        if lv.kind == "lowrank":
            u = np.frombuffer(bytes(buf), np.uint8)
            us.append(dequant(u, lv.bits, rows_b * lv.k).reshape(rows_b, lv.k)
                      * sh[0][None, :])
            vs.append(sh[1])
    acc = np.hstack(us) @ np.vstack(vs)
    for lv, buf, sh in zip(levels, bufs, shared):
        if lv.kind == "vq":
            raw = np.frombuffer(bytes(buf), dtype=np.uint8)
            scale = raw[:4 * rows_b].view("<f4")[:, None]
            acc = acc + sh[0][raw[4 * rows_b:]].reshape(rows_b, cols) * scale
    return w0b + acc.reshape(-1)


def test_version_2_sidecar_still_decodes_with_its_blas_product(tmp_path: Path) -> None:
    """A version-2 file (here: a version-3 one relabelled) opens and the engine's decoder
    reconstructs its low-rank levels with the BLAS product, as mergefs did for version 2."""
    sc, cases = relabelled_lowrank_tensors(tmp_path, 33, "2")
    checked = differ = 0
    for tl, w0, js, starts, n_rows in cases:
        depth = len([lv for lv in tl.levels if lv.kind in ("lowrank", "vq")])
        out = np.full_like(w0, np.nan)
        deltadecode.decode_blocks(sc, tl, js, np.full(js.size, depth), starts, n_rows, w0, out)
        shared = [sc.shared(lv, tl.cols) for lv in tl.levels[:depth]]
        for j, s, r in zip(js, starts, n_rows):
            bufs = [sc.read(lv.first_range + j, lv.first_range + j + 1)
                    for lv in tl.levels[:depth]]
            want = _blas_decode(w0[s:s + r * tl.cols], tl.levels[:depth], bufs, shared, int(r),
                                tl.cols)
            got = out[s:s + r * tl.cols]
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
            v3 = reconstruct(w0[s:s + r * tl.cols], tl.levels[:depth], bufs, shared,
                                    int(r), tl.cols, version="3")
            differ += not np.array_equal(v3.view(np.uint32), want.view(np.uint32))
            checked += 1
    assert checked > 5
    assert differ > 0  # the two products round differently: the version decides the route


@pytest.mark.parametrize("method", ["task_arithmetic", "linear"])
def test_reconstructed_units_merge_by_the_kernel_as_by_numpy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Units with reconstructed blocks are merged by the compiled kernel on their float32
    values (the fused path), with the same bytes as the method's numpy path on the same
    values (the kernel turned off), for every unit, at budgets that also read exact blocks."""
    fam = _mixed_family(tmp_path / "fam", 37)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, method=method, weights=[0.7, 0.4],
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    compress.publish(base, experts, index)
    total = int(index.expert_block_bytes().sum())
    for c in [base, *experts]:
        c.close()
    real = kernels.fused_merge
    exact_too = False
    for frac in (0.05, 0.3, 0.6):
        decoded = []  # kernel calls on reconstructed values (arrays; exact runs are raw bytes)

        def spy(form, ref, ref_dtype, inputs, *a, **k):
            decoded.append(any(isinstance(buf, np.ndarray) for runs in inputs if runs
                               for _, buf, _ in runs))
            return real(form, ref, ref_dtype, inputs, *a, **k)

        with monkeypatch.context() as m:
            m.setattr(kernels, "fused_merge", spy)
            s = Session(spec, budget_bytes=int(frac * total))
            shutil.rmtree(tmp_path / "k", ignore_errors=True)
            s.engine.materialise(tmp_path / "k", threads=2)
            levels = s.plan.levels
            assert levels is not None and (levels > 0).any()
            exact_too |= bool(s.plan.selected.any())
            s.finish()
            s.close()
        assert sum(decoded) > 0
        with monkeypatch.context() as m:
            m.setattr(kernels, "supports", lambda *a, **k: False)
            s = Session(spec, budget_bytes=int(frac * total))
            shutil.rmtree(tmp_path / "n", ignore_errors=True)
            s.engine.materialise(tmp_path / "n", threads=2)
            assert s.engine.units_fused == 0
            s.finish()
            s.close()
        got = load_file(str(tmp_path / "k" / "model.safetensors"))
        want = load_file(str(tmp_path / "n" / "model.safetensors"))
        assert sorted(got) == sorted(want)
        for k in got:
            assert got[k].tobytes() == want[k].tobytes(), (method, frac, k)
    assert exact_too  # some budget mixes exact blocks with reconstructed ones
