"""Helpers of the delta sidecar tests: families with sidecars, random decode cases, relabelled low-rank tensors."""

from __future__ import annotations
from mergefs.deltas.codes import Level, lowrank_block_size, pack_bits, packed_size
from families import Family, row_sparse
import json
from pathlib import Path
import numpy as np
from families import make_family, write_spec
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from mergefs.deltas import publish as compress, decode as deltadecode
from mergefs.deltas.codes import (
    META_KEY,
)
from mergefs.deltas.match import find
from mergefs.deltas.reconstruct import shared_value
from mergefs.recipe.family import open_family
from mergefs.index.blocks import load_or_build
from mergefs.spec.load import load_spec


def _random_case(seed: int) -> tuple:
    """Levels of every kind in a random order (low-rank first), blocks of random heights and
    depths, a base with signed zeros, and the blocks' ranges."""
    rng = np.random.default_rng(seed)
    cols = 8 * int(rng.integers(1, 6)) if seed % 2 else int(rng.integers(3, 41))
    kinds = ["lowrank"] * int(rng.integers(0, 3))
    kinds += [str(k) for k in rng.permutation(["quant", "rows", "vq", "ulp", "sparse", "quant"])
              if k != "vq" or cols % 8 == 0]  # vq: cols a multiple of its dimension
    levels, shared_raw = zip(*[_random_level(rng, k, cols) for k in kinds])
    levels = tuple(levels)
    shared = [shared_value(lv, s, cols) if s is not None else None
              for lv, s in zip(levels, shared_raw)]
    n_rows = rng.integers(1, 9, 7)
    depths = rng.integers(1, len(levels) + 1, n_rows.size)
    starts = np.concatenate([[0], np.cumsum(n_rows * cols)[:-1]]) + 3  # not at 0
    blobs = [[_random_block(rng, lv, int(rb), cols) if d > lvl else b""
              for rb, d in zip(n_rows, depths)] for lvl, lv in enumerate(levels)]
    size = np.asarray([[len(b) for b in row] for row in blobs], np.int64)
    off = (np.cumsum(size.reshape(-1)) - size.reshape(-1)).reshape(size.shape)
    data = np.frombuffer(b"".join(b for row in blobs for b in row), dtype=np.uint8)
    payloads = deltadecode.Payloads(data, off, size)
    w0 = rng.normal(0, 0.05, int(starts[-1] + n_rows[-1] * cols) + 5).astype(np.float32)
    w0[rng.random(w0.size) < 0.1] = -0.0
    return levels, shared, cols, starts, n_rows, depths, payloads, w0


def _setup(tmp_path: Path, seed: int = 31):
    fam = _mixed_family(tmp_path / "fam", seed)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, weights=[0.7, -0.4],
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    paths = compress.publish(base, experts, index)
    return fam, spec, base, experts, index, paths


def relabelled_lowrank_tensors(tmp_path: Path, seed: int, version: str):
    """Expert 0's sidecar of a :func:`_setup` family relabelled as ``version`` and opened, and
    per tensor whose first level is a quantised low-rank one ``(tl, w0, js, starts, n_rows)``:
    its non-zero blocks as :func:`mergefs.deltas.decode.decode_blocks` takes them."""
    fam, _, base, experts, index, paths = _setup(tmp_path, seed=seed)
    loaded = load_file(paths[0])
    with safe_open(paths[0], "np") as f:
        meta = json.loads(f.metadata()[META_KEY])
    meta["version"] = version
    save_file(loaded, paths[0], metadata={META_KEY: json.dumps(meta)})
    sc = find(base, experts, index)[0]
    assert sc.meta["version"] == version
    w0s = load_file(str(fam.base / "model.safetensors"))
    lay = index.layout
    cases = []
    for tl in sc.tensors.values():
        if tl.levels[0].kind != "lowrank" or tl.levels[0].bits == 16:
            continue
        blocks = np.asarray([b for b in lay.blocks_of(tl.t) if not index.zero[0, b]])
        cases.append((tl, w0s[tl.name].astype(np.float32).reshape(-1),
                      blocks - int(lay.first_block[tl.t]),
                      lay.elem_start[blocks] - int(lay.elem_start[lay.first_block[tl.t]]),
                      (lay.elem_end[blocks] - lay.elem_start[blocks]) // tl.cols))
    return sc, cases


def _row_sparse_family(root: Path) -> Family:
    """Experts that change only scattered rows (about 15%) of every 2-D tensor, densely there
    (as a fine-tune changes only the seen tokens' embedding rows)."""
    fam = make_family(root, seed=9, n_experts=2)
    rng = np.random.default_rng(1)
    base = load_file(str(fam.base / "model.safetensors"))
    for e in fam.experts:
        tensors = dict(base)
        for name, w0 in base.items():
            if w0.ndim != 2 or w0.dtype != np.float32:
                continue
            tensors[name] = row_sparse(w0, rng, 0.15)
        save_file(tensors, str(e / "model.safetensors"), metadata={"format": "pt"})
    return fam


BLOCK = 512


def _random_level(rng: np.random.Generator, kind: str, cols: int
                  ) -> tuple[Level, bytes | None]:
    """A level of ``kind`` with random parameters, and its shared range (or None)."""
    if kind == "lowrank":
        bits, k = int(rng.choice([2, 3, 4, 8, 16])), int(rng.integers(1, 7))
        scales = rng.uniform(0.01, 1, 2 * k).astype("<f4").tobytes()
        body = (rng.normal(0, 1, k * cols).astype("<f2").tobytes() if bits == 16
                else rng.bytes(packed_size(k * cols, bits)))
        return Level("lowrank", bits, k), scales + body
    if kind == "vq":
        return Level("vq", 1, 8), rng.normal(0, 1, 256 * 8).astype("<f2").tobytes()
    bits = int(rng.integers(1, 5))
    return Level(kind, bits, 1 if kind == "ulp" else 0), None


def _random_block(rng: np.random.Generator, lv: Level, rows_b: int, cols: int) -> bytes:
    """A well-formed random block range of level ``lv`` for a block of ``rows_b`` rows."""
    n = rows_b * cols
    steps = rng.uniform(1e-4, 1e-2, rows_b).astype("<f4").tobytes()
    if lv.kind == "lowrank":
        if lv.bits == 16:
            return rng.normal(0, 1, rows_b * lv.k).astype("<f2").tobytes()
        return rng.bytes(lowrank_block_size(rows_b, lv.k, lv.bits))
    if lv.kind == "quant":
        return steps + rng.bytes(packed_size(n, lv.bits))
    if lv.kind == "vq":
        return steps + rng.bytes(n // lv.k)
    if lv.kind == "rows":
        if rng.random() < 0.2:
            return b""  # no changed row
        mask = rng.random(rows_b) < 0.5
        ch = int(mask.sum())
        return (pack_bits(mask, 1) + steps[:4 * ch]
                + rng.bytes(packed_size(ch * cols, lv.bits)))
    if lv.kind == "ulp":
        mask = rng.random(n) < 0.3
        codes = rng.integers(0, 1 << lv.bits, int(mask.sum()))
        return pack_bits(mask, 1) + pack_bits(codes, lv.bits)
    idx = rng.choice(n, int(rng.integers(0, 12)), replace=False).astype("<u4")
    return idx.tobytes() + rng.normal(0, 1, idx.size).astype("<f4").tobytes()


def _mixed_family(root: Path, seed: int):
    """Dense deltas (low-rank, vq, quant levels) and row-sparse ones (rows levels)."""
    fam = make_family(root, seed=seed, n_experts=2)
    rng = np.random.default_rng(seed)
    base = load_file(str(fam.base / "model.safetensors"))
    for e in fam.experts:
        tensors = load_file(str(e / "model.safetensors"))
        w0 = base["model.embed_tokens.weight"]
        rows = rng.random(w0.shape[0]) < 0.2
        d = np.zeros_like(w0)
        d[rows] = rng.normal(0, 2e-3, (int(rows.sum()), w0.shape[1]))
        tensors["model.embed_tokens.weight"] = w0 + d
        save_file(tensors, str(e / "model.safetensors"), metadata={"format": "pt"})
    return fam
