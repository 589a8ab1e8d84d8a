"""Delta sidecars are untrusted files (issue 14 review): damaged level parameters, range tables
and block ranges give a DeltaError (or the sidecar is ignored), never an unchecked read, on the
compiled route and on the numpy one; vq levels of different dimensions decode as numpy does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from sidecar_cases import _random_case, _setup

from mergefs.deltas import decode as deltadecode
from mergefs.deltas.codes import (
    DeltaError, Level, META_KEY, pack_bits, packed_size, quant_block_size, rows_block_size,
)
from mergefs.deltas.match import find
from mergefs.deltas.reconstruct import reconstruct, shared_value
from mergefs.deltas.sidecar import open_sidecar
def _vq_case(rng: np.random.Generator, cols: int, rb: int):
    """Two vq levels of dimensions 8 and 4 (bits 1 and 2), codes 255 (the last codeword)."""
    levels = (Level("vq", 1, 8, 0), Level("vq", 2, 4, 1))
    shared = [shared_value(lv, rng.normal(0, 1, 256 * lv.k).astype("<f2").tobytes(),
                                  cols) for lv in levels]
    blobs = [rng.uniform(1e-3, 1e-2, rb).astype("<f4").tobytes() + bytes([255]) * (rb * cols
                                                                                  // lv.k)
             for lv in levels]
    size = np.asarray([[len(b)] for b in blobs], np.int64)
    off = np.asarray([[0], [len(blobs[0])]], np.int64)
    data = np.frombuffer(b"".join(blobs), np.uint8)
    return levels, shared, deltadecode.Payloads(data, off, size)


def test_vq_levels_of_different_dimensions_decode_as_numpy() -> None:
    """Each codebook keeps one row per codeword in the packed book (a (256, 4) book reshaped
    to dimension 8 had 128 rows: codeword 255 read past the book)."""
    rng = np.random.default_rng(5)
    cols, rb = 16, 4
    levels, shared, payloads = _vq_case(rng, cols, rb)
    w0 = rng.normal(0, 0.05, rb * cols).astype(np.float32)
    fast = np.full_like(w0, np.nan)
    deltadecode.decode_into(fast, w0, levels, cols, np.array([0]), np.array([rb]),
                            np.array([2]), payloads, shared)
    slow = reconstruct(w0, levels, [payloads.block(0, 0), payloads.block(1, 0)], shared,
                              rb, cols)
    assert np.array_equal(fast.view(np.uint32), slow.view(np.uint32))


def test_compiled_loop_refuses_ranges_outside_the_bytes_read() -> None:
    levels, shared, cols, starts, n_rows, depths, payloads, w0 = _random_case(3)
    j = int(np.argmax(depths))
    off = payloads.off.copy()
    off[0, j] = payloads.data.size + 4096  # the size still matches the level
    bad = deltadecode.Payloads(payloads.data, off, payloads.size)
    with pytest.raises(DeltaError, match="outside"):
        deltadecode.decode_into(np.zeros_like(w0), w0, levels, cols, starts, n_rows, depths,
                                bad, shared)


@pytest.mark.parametrize("kind", ["quant", "ulp", "rows", "sparse"])
def test_numpy_route_refuses_a_short_or_long_range(kind: str) -> None:
    """The route of version-1/2 sidecars and float16 ulp levels (and of no numba) checks sizes
    as the compiled loop does: its own numba helpers read codes unchecked."""
    rng = np.random.default_rng(9)
    cols, rb = 12, 3
    lv = Level(kind, 2, 1 if kind == "ulp" else 0)
    n = rb * cols
    if kind == "quant":
        good = rng.bytes(quant_block_size(rb, cols, 2))
    elif kind == "ulp":
        good = pack_bits(np.ones(n, np.uint8), 1) + rng.bytes(packed_size(n, 2))
    elif kind == "rows":
        good = pack_bits(np.ones(rb, np.uint8), 1) + rng.bytes(
            rows_block_size(rb, rb, cols, 2) - packed_size(rb, 1))
    else:
        good = np.asarray([1, 5], "<u4").tobytes() + np.asarray([1, 2], "<f4").tobytes()
    w0 = rng.normal(0, 0.05, n).astype(np.float32)
    reconstruct(w0, (lv,), [memoryview(good)], [None], rb, cols)  # well-formed: decodes
    bad = [good[:-4], good + bytes(8)]
    if kind == "sparse":
        bad.append(np.asarray([1, n], "<u4").tobytes() + good[8:])  # a position past the block
    for raw in bad:
        with pytest.raises(DeltaError, match="size"):
            reconstruct(w0, (lv,), [memoryview(raw)], [None], rb, cols)


def _rewrite(path: str, edit) -> None:
    tensors = load_file(path)
    with safe_open(path, "np") as f:
        meta = json.loads(f.metadata()[META_KEY])
    edit(tensors, meta)
    save_file(tensors, path, metadata={META_KEY: json.dumps(meta)})


def test_a_range_table_outside_the_data_is_refused(tmp_path: Path) -> None:
    _, _, base, experts, index, paths = _setup(tmp_path, seed=34)

    def far(tensors, meta):
        tensors["range_start"][1] += 1 << 20
        tensors["range_end"][1] += 1 << 20

    _rewrite(paths[0], far)
    with pytest.raises(DeltaError, match="range table"):
        open_sidecar(Path(paths[0]))
    assert sorted(find(base, experts, index)) == [1]  # ignored, with a log line


def test_a_tensor_whose_cols_differ_from_the_base_is_ignored(tmp_path: Path) -> None:
    """The engine sizes blocks by the sidecar's ``cols``: with a wrong one it decoded part of
    each block and left the rest at the base's values, silently."""
    _, _, base, experts, index, paths = _setup(tmp_path, seed=35)

    def halve(tensors, meta):
        tl = meta["tensors"][0]
        tl["rows"], tl["cols"] = tl["rows"] * 2, tl["cols"] // 2

    _rewrite(paths[0], halve)
    assert sorted(find(base, experts, index)) == [1]


@pytest.mark.parametrize("where,key,value", [("tensor", "t", 1.0), ("level", "k", 1.5),
                                             ("level", "bits", "2")])
def test_a_field_of_the_wrong_type_is_refused(tmp_path: Path, where: str, key: str,
                                              value) -> None:
    """JSON numbers of the wrong type (``t`` 1.0 indexed the layout with a float; ``k`` 1.5
    passed ``k >= 1``) make the sidecar unreadable, so :func:`find` ignores it."""
    _, _, base, experts, index, paths = _setup(tmp_path, seed=36)

    def edit(tensors, meta):
        tl = meta["tensors"][0]
        (tl if where == "tensor" else tl["levels"][0])[key] = value

    _rewrite(paths[0], edit)
    with pytest.raises(DeltaError):
        open_sidecar(Path(paths[0]))
    assert sorted(find(base, experts, index)) == [1]
