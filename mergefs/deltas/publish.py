"""Writing delta sidecars: refinement levels of every expert's delta, per row block.

``mergefs compress SPEC`` writes them into mergefs's own store under the spec's ``index_dir``
(``--publish``: beside the experts, for others to use). It reads the base and each expert once
(after the block index, which it builds or reuses), and for every mergeable 2-D (or higher: rows
x the rest) tensor whose delta is not zero builds levels on ``D = fl(W_i - W_0)`` (see :mod:`mergefs.deltas.sidecar` for the format):

- *exactly low rank* (a LoRA merged into float32 weights: singular values beyond ``r`` below
  1e-4 of the first, and the factors cost less than 2 bits per element): the rank-r factors in
  float16, then a 2-bit residual;
- *a rounding pattern* (base and expert in one 16-bit dtype, most changed elements moved by at
  most 8 ulp, as small deltas rounded to bf16 leave them): the moves (a 1-bit map and a 2, 3 or
  4-bit code per moved element), then the other changed values exactly;
- *row-sparse* (at most half of the rows changed, those mostly densely: a fine-tune's word
  embeddings change only the rows of tokens it saw): ``rows`` levels, the changed rows'
  residual at 1, 1, 2 and 2 bits (:data:`ROWS_LADDER`), the other rows exact for free;
- *sparse* (fewer than 10% of the elements changed, and the first low-rank level would hold
  less than half of the energy): the largest quarter of the changed values exactly, then the
  rest;
- *dense* (full fine-tunes): four low-rank levels, each the top singular vectors of what is
  left, quantised at 4, 3, 2, 2 bits (more bits for larger singular values, as Delta-CoMe;
  :data:`LOWRANK_GROUPS`), the left factors least-squares refitted to the quantised right ones;
  then the residual at 1 bit twice, each a ``vq`` level (8 elements per one-byte code of a
  Gaussian Lloyd codebook, a per-row scale; sign and step when the columns are not a multiple
  of 8), and that residual at 2 bits (:data:`QUANT_LADDER`).

Per (level, row block) the residual norm is computed with
:func:`mergefs.deltas.decode.decode_into`, the decoder the engine runs, so the planner's bounds use
exact errors. Blocking; worker threads only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from safetensors.numpy import save

from mergefs.deltas import decode
from mergefs.deltas.codes import (
    DELTA_VERSION, GAUSS_STEP, Level, META_KEY, TensorLevels, ULP_DTYPES, bits16, pack_bits,
    quant_levels, quantise,
)
from mergefs.deltas.reconstruct import one_blas_thread, shared_value
from mergefs.deltas.sidecar import delta_name
from mergefs.index import published as sidecar
from mergefs.sources.local import Checkpoint, write_beside
from mergefs.core.dtypes import decode_f32
from mergefs.index.blocks import BlockIndex
from mergefs.sources.lora import LoraCheckpoint

log = logging.getLogger(__name__)

#: dense ladder: (cumulative share of the rank, bits) per low-rank level, then the residual's
#: quant levels (bits). Chosen on the MiniLM full fine-tunes (docs/benchmarks.md, issue 14): at
#: 1.6 and 3.2 bits per element this keeps 0-3% more of a layer's delta than the Delta-CoMe
#: style 8/4/3/2 groups with a 1+2 bit residual, because more components at 2 bits beat fewer
#: at 8 when singular values decay slowly
LOWRANK_GROUPS = ((1 / 48, 4), (1 / 12, 3), (1 / 6, 2), (1 / 3, 2))
#: "vq": 1 bit per element as one byte per VQ_DIM elements (cols a multiple of VQ_DIM), else
#: the 1-bit scalar quant level
QUANT_LADDER: tuple[int | str, ...] = ("vq", "vq", 2)
VQ_DIM = 8
#: ``rows`` route: at most this share of the rows changed, and most elements of those changed
ROWS_SHARE = 0.5
ROWS_DENSITY = 0.5
ROWS_LADDER = (1, 1, 2, 2)
EXACT_RANK_TOL = 1e-4
SPARSE_DENSITY = 0.1


@dataclass
class _Built:
    """One tensor's levels before range ids are assigned."""

    kinds: list[tuple[str, int, int]]  # (kind, bits, k)
    shared: list[bytes | None]  # per level
    blocks: list[list[bytes]]  # per level, per block of the tensor
    resid: list[list[float]]  # per level, per block


def _spectrum(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(singular values descending, eigenvectors of the smaller Gram matrix, descending)."""
    m, n = r.shape
    vals, vecs = np.linalg.eigh(r.T @ r if n <= m else r @ r.T)
    return np.sqrt(np.maximum(vals[::-1], 0.0)), vecs[:, ::-1]


def _top_vectors(r: np.ndarray, k: int, vecs: np.ndarray | None = None) -> np.ndarray:
    """Top-k right singular vectors (k x cols) of r, from the eigenvectors of a Gram matrix."""
    m, n = r.shape
    if vecs is None:
        vecs = _spectrum(r)[1]
    if n <= m:
        return np.ascontiguousarray(vecs[:, :k].T)
    v = vecs[:, :k].T @ r
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)


def _step(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Quantiser step per row (axis=1) or column (axis=0) of x."""
    if bits >= 8:
        return 2.0 * np.abs(x).max(axis=axis) / ((1 << bits) - 1)
    rms = np.sqrt(np.mean(x * x, axis=axis))
    return GAUSS_STEP[bits] * rms


def _lowrank(r: np.ndarray, k: int, bits: int, rows: list[tuple[int, int]],
             vecs: np.ndarray | None = None) -> tuple[bytes, list[bytes], np.ndarray]:
    """(shared range, block ranges, contribution float64) of one lowrank level on residual r."""
    v = _top_vectors(r, k, vecs)
    if bits == 16:
        vscale = np.maximum(np.sqrt(np.mean(v * v, axis=1)), 1e-30).astype(np.float32)
        vq = (v / vscale[:, None]).astype(np.float16)
        v_hat = vq.astype(np.float64) * vscale[:, None]
        v_payload = vq.tobytes()
    else:
        vstep = _step(v, bits, axis=1).astype(np.float32)
        codes = quantise(v, bits, vstep[:, None].astype(np.float64))
        v_hat = quant_levels(codes, bits) * vstep[:, None].astype(np.float64)
        v_payload = pack_bits(codes, bits)
        vscale = vstep
    gram = v_hat @ v_hat.T
    try:  # argmin ||r - u v_hat||: the normal equations (gram is k x k)
        u = np.linalg.solve(gram, v_hat @ r.T).T
    except np.linalg.LinAlgError:
        u = np.linalg.lstsq(gram, v_hat @ r.T, rcond=None)[0].T
    if bits == 16:
        uscale = np.maximum(np.sqrt(np.mean(u * u, axis=0)), 1e-30).astype(np.float32)
        uq = (u / uscale[None, :]).astype(np.float16)
        u_hat = uq.astype(np.float64) * uscale[None, :]
        blocks = [uq[r0:r1].tobytes() for r0, r1 in rows]
    else:
        ustep = _step(u, bits, axis=0).astype(np.float32)
        ucodes = quantise(u, bits, ustep[None, :].astype(np.float64))
        u_hat = quant_levels(ucodes, bits) * ustep[None, :].astype(np.float64)
        blocks = [pack_bits(ucodes[r0:r1], bits) for r0, r1 in rows]
        uscale = ustep
    shared = np.concatenate([uscale, vscale]).astype("<f4").tobytes() + v_payload
    return shared, blocks, u_hat @ v_hat


def _quant(r: np.ndarray, bits: int, rows: list[tuple[int, int]]
           ) -> tuple[list[bytes], np.ndarray]:
    if bits == 1:
        step = np.mean(np.abs(r), axis=1).astype(np.float32)
    else:
        step = _step(r, bits, axis=1).astype(np.float32)
    s64 = step.astype(np.float64)[:, None]
    codes = quantise(r, bits, s64)
    contrib = quant_levels(codes, bits) * s64
    blocks = [step[r0:r1].astype("<f4").tobytes() + pack_bits(codes[r0:r1], bits)
              for r0, r1 in rows]
    return blocks, contrib


def _rows(r: np.ndarray, changed: np.ndarray, bits: int, rows: list[tuple[int, int]]
          ) -> tuple[list[bytes], np.ndarray]:
    """(block ranges, contribution) of a ``rows`` level: :func:`_quant` on the changed rows."""
    sub = r[changed]
    blocks_sub, contrib_sub = _quant(sub, bits, [(0, sub.shape[0])]) if sub.size else \
        ([b""], np.zeros_like(sub))
    contrib = np.zeros_like(r)
    contrib[changed] = contrib_sub
    step = np.frombuffer(blocks_sub[0], dtype="<f4", count=sub.shape[0])
    codes = quantise(sub, bits, step.astype(np.float64)[:, None]) if bits > 1 else \
        (sub >= 0).astype(np.uint8)
    pos = np.cumsum(changed) - changed  # index of each changed row among the changed
    blocks = []
    for r0, r1 in rows:
        mask = changed[r0:r1]
        sel = pos[r0:r1][mask]
        blocks.append(pack_bits(mask, 1) + step[sel].astype("<f4").tobytes()
                      + pack_bits(codes[sel], bits))
    return blocks, contrib


_CODEBOOK: np.ndarray | None = None


def vq_codebook() -> np.ndarray:
    """(256, VQ_DIM) float16: a Lloyd (k-means) codebook for unit Gaussian vectors, trained once
    per process on seeded samples (stored in every sidecar that uses it, so the decoder never
    retrains: reproducibility across machines does not matter). Mean squared error about
    0.326 per element at 1 bit, against 0.363 for the sign quantiser."""
    global _CODEBOOK
    if _CODEBOOK is None:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((65536, VQ_DIM))
        cb = x[rng.choice(x.shape[0], 256, replace=False)].copy()
        for _ in range(25):
            near = _nearest(x, cb)
            count = np.bincount(near, minlength=256)
            total = np.zeros_like(cb)
            np.add.at(total, near, x)
            cb = np.where(count[:, None] > 0, total / np.maximum(count, 1)[:, None], cb)
        _CODEBOOK = cb.astype(np.float16)
    return _CODEBOOK


def _nearest(x: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Index of the nearest codeword for every row of x (in slices, to bound memory)."""
    out = np.empty(x.shape[0], dtype=np.intp)
    norms = (cb * cb).sum(axis=1)
    for s0 in range(0, x.shape[0], 1 << 16):
        xs = x[s0:s0 + (1 << 16)]
        out[s0:s0 + xs.shape[0]] = (norms[None, :] - 2.0 * xs @ cb.T).argmin(axis=1)
    return out


def _vq(r: np.ndarray, rows: list[tuple[int, int]]) -> tuple[bytes, list[bytes], np.ndarray]:
    """(codebook range, block ranges, contribution) of a ``vq`` level on residual r: each row
    scaled to unit RMS, every VQ_DIM elements coded by their nearest codeword, then the row's
    scale refitted by least squares to the codewords chosen."""
    cb16 = vq_codebook()
    cb = cb16.astype(np.float64)
    m, n = r.shape
    rms = np.sqrt(np.mean(r * r, axis=1))
    rms = np.where(rms > 0, rms, 1.0)
    codes = _nearest((r / rms[:, None]).reshape(-1, VQ_DIM), cb).astype(np.uint8)
    c = cb[codes].reshape(m, n)
    scale = ((r * c).sum(axis=1) / np.maximum((c * c).sum(axis=1), 1e-300)).astype(np.float32)
    codes2 = codes.reshape(m, n // VQ_DIM)
    blocks = [scale[r0:r1].astype("<f4").tobytes() + codes2[r0:r1].tobytes() for r0, r1 in rows]
    return cb16.astype("<f2").tobytes(), blocks, c * scale.astype(np.float64)[:, None]


def _sparse(wi: np.ndarray, mask: np.ndarray, rows: list[tuple[int, int]], cols: int
            ) -> list[bytes]:
    out = []
    for r0, r1 in rows:
        idx = np.flatnonzero(mask[r0:r1]).astype("<u4")
        vals = wi[r0:r1].reshape(-1)[idx].astype("<f4")
        out.append(idx.tobytes() + vals.tobytes())
    return out


def _ulp(w0: np.ndarray, wi: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(elements an ulp level holds, their codes, code bits) for 16-bit patterns of dtype k.

    The code width (2, 3 or 4 bits: moves of up to 2, 4 or 8 ulp) minimises the level's bytes
    plus 8 bytes per changed element left to the exact sparse level after it."""
    b0, bi = bits16(w0, k), bits16(wi, k)
    moves = bi - b0
    same = (((b0 ^ bi) & 0x8000) == 0) & (moves != 0)
    mag = np.abs(moves)
    best = None
    for bits in (2, 3, 4):
        half = 1 << (bits - 1)
        ok = same & (mag <= half)
        held = int(ok.sum())
        cost = moves.size / 8 + held * bits / 8 + 8 * (int(np.count_nonzero(moves)) - held)
        if best is None or cost < best[0]:
            best = (cost, ok, bits)
    _, ok, bits = best  # type: ignore[misc]
    half = 1 << (bits - 1)
    codes = np.where(ok, moves + half - (moves > 0), 0).astype(np.uint8)  # -h..-1, 1..h
    return ok, codes, bits


def _top_share(sv: np.ndarray, p: int) -> float:
    """Share of the energy in the first low-rank level's singular directions."""
    total = float((sv**2).sum())
    k = max(1, round(LOWRANK_GROUPS[0][0] * p))
    return float((sv[:k] ** 2).sum()) / total if total else 0.0


def _row_sparse(d: np.ndarray) -> bool:
    """Few rows changed, and those mostly densely (seen tokens' embedding rows)."""
    changed = (d != 0).any(axis=1)
    n = int(changed.sum())
    return 0 < n <= ROWS_SHARE * d.shape[0] and \
        np.count_nonzero(d[changed]) >= ROWS_DENSITY * n * d.shape[1]


def build_levels(w0: np.ndarray, wi: np.ndarray, rows: list[tuple[int, int]],
                 ulp_dtype: int = 0) -> _Built:
    """Levels of one tensor (``w0``, ``wi``: float32, rows x cols) for row blocks ``rows``.

    ``ulp_dtype``: :data:`mergefs.deltas.codes.ULP_DTYPES` value when base and expert share that
    16-bit dtype (the ``ulp`` level applies), else 0.
    """
    d32 = wi - w0
    r = d32.astype(np.float64)
    m, n = r.shape
    p = min(m, n)
    built = _Built([], [], [], [])

    def add(kind: str, bits: int, k: int, shared: bytes | None, blocks: list[bytes]) -> None:
        built.kinds.append((kind, bits, k))
        built.shared.append(shared)
        built.blocks.append(blocks)

    density = np.count_nonzero(d32) / max(1, d32.size)
    sv, vecs = _spectrum(r)
    rank = int(np.count_nonzero(sv > EXACT_RANK_TOL * sv[0])) if sv.size and sv[0] > 0 else 0
    ulp_ok = None
    if ulp_dtype and density > 0.016:  # below, sparse values cost less than a bitmap
        ulp_ok, codes, ulp_bits = _ulp(w0, wi, ulp_dtype)
        if ulp_ok.sum() < 0.5 * np.count_nonzero(d32):
            ulp_ok = None  # mostly moves of more than 8 ulp: not a rounding pattern
    if ulp_ok is not None:
        flat_ok, flat_codes = ulp_ok.reshape(m, n), codes.reshape(m, n)
        add("ulp", ulp_bits, ulp_dtype, None,
            [pack_bits(flat_ok[r0:r1], 1)
             + pack_bits(flat_codes[r0:r1][flat_ok[r0:r1]], ulp_bits) for r0, r1 in rows])
        rest = (d32 != 0) & ~flat_ok
        add("sparse", 0, 0, None, _sparse(wi, rest, rows, n))
    elif 0 < rank and rank * (m + n) <= m * n // 8:  # factors cheaper than 2 bits/element
        shared, blocks, contrib = _lowrank(r, rank, 16, rows, vecs)
        add("lowrank", 16, rank, shared, blocks)
        r = r - contrib
        blocks, contrib = _quant(r, 2, rows)
        add("quant", 2, 0, None, blocks)
    elif _row_sparse(d32):
        changed = (d32 != 0).any(axis=1)
        for bits in ROWS_LADDER:
            blocks, contrib = _rows(r, changed, bits, rows)
            add("rows", bits, 0, None, blocks)
            r = r - contrib
    elif density < SPARSE_DENSITY and _top_share(sv, p) < 0.5:
        mag = np.abs(d32)
        nz = mag > 0
        cut = np.quantile(mag[nz], 0.75) if nz.any() else 0.0
        big = mag >= cut
        add("sparse", 0, 0, None, _sparse(wi, big & nz, rows, n))
        add("sparse", 0, 0, None, _sparse(wi, nz & ~big, rows, n))
    else:
        done = 0
        for share, bits in LOWRANK_GROUPS:
            k = min(p, max(done + 1, round(share * p))) - done
            if k <= 0:
                continue
            shared, blocks, contrib = _lowrank(r, k, bits, rows, vecs if done == 0 else None)
            add("lowrank", bits, k, shared, blocks)
            r = r - contrib
            done += k
        for q in QUANT_LADDER:
            if q == "vq" and n % VQ_DIM == 0:
                shared, blocks, contrib = _vq(r, rows)
                add("vq", 1, VQ_DIM, shared, blocks)
            else:
                bits = 1 if q == "vq" else int(q)
                blocks, contrib = _quant(r, bits, rows)
                add("quant", bits, 0, None, blocks)
            r = r - contrib
    built.resid = _residuals(w0, d32, built, rows, n)
    return built


def _residuals(w0: np.ndarray, d32: np.ndarray, built: _Built, rows: list[tuple[int, int]],
               cols: int) -> list[list[float]]:
    """``||D_b - fl(W_hat_b - W0_b)||`` after each level prefix, with the engine's decoder
    (:func:`mergefs.deltas.decode.decode_into`: every block of the tensor per prefix)."""
    levels = tuple(Level(kind, bits, k, 0 if s is not None else -1)
                   for (kind, bits, k), s in zip(built.kinds, built.shared))
    shared = [shared_value(lv, memoryview(s), cols) if s is not None else None
              for s, lv in zip(built.shared, levels)]
    sizes = np.asarray([[len(blob) for blob in b] for b in built.blocks], np.int64)
    sizes = sizes.reshape(len(levels), len(rows))
    off = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(sizes.shape)
    data = np.frombuffer(b"".join(blob for b in built.blocks for blob in b), dtype=np.uint8)
    payloads = decode.Payloads(data, off, sizes)
    starts = np.asarray([r0 * cols for r0, _ in rows], np.int64)
    n_rows = np.asarray([r1 - r0 for r0, r1 in rows], np.int64)
    w0f = np.ascontiguousarray(w0, dtype=np.float32).reshape(-1)
    w_hat = np.empty_like(w0f)
    packed = decode.pack(levels, shared, cols, DELTA_VERSION)
    out: list[list[float]] = [[0.0] * len(rows) for _ in levels]
    for n in range(1, len(levels) + 1):
        decode.decode_into(w_hat, w0f, levels, cols, starts, n_rows,
                           np.full(len(rows), n, np.int64), payloads, shared, packed,
                           DELTA_VERSION)
        for j, (r0, r1) in enumerate(rows):
            s0, s1 = r0 * cols, r1 * cols
            db = d32[r0:r1].reshape(-1).astype(np.float64)
            eff = (w_hat[s0:s1] - w0f[s0:s1]).astype(np.float64)  # as methods take it
            out[n - 1][j] = float(np.linalg.norm(db - eff))
    return out


def _tensor_rows(index: BlockIndex, t: int, cols: int) -> list[tuple[int, int]]:
    lay = index.layout
    return [(int(lay.elem_start[b]) // cols, int(lay.elem_end[b]) // cols)
            for b in lay.blocks_of(t)]


def encode_sidecar(base: Checkpoint, expert: Checkpoint, index: BlockIndex, i: int,
                   on_tensor: Callable[[str], None] | None = None) -> bytes:
    """The delta sidecar of expert ``i`` of ``index`` (see :mod:`mergefs.deltas.sidecar`)."""
    lay = index.layout
    payloads: list[bytes] = []
    resid: list[float] = []
    tensors = []
    codebook_id = -1  # the one shared range of every vq level
    for t, name in enumerate(lay.tensors):
        shape = base.tensors[name].shape
        blocks = lay.blocks_of(t)
        if len(shape) < 2 or math.prod(shape) == 0 or index.zero[i, blocks.start:blocks.stop].all():
            continue
        rows_n, cols = shape[0], math.prod(shape[1:])
        if rows_n < 2 or cols < 2:
            continue
        w0 = decode_f32(base.read_tensor(name), base.tensors[name].dtype).reshape(rows_n, cols)
        wi = decode_f32(expert.read_tensor(name), expert.tensors[name].dtype).reshape(rows_n, cols)
        rows = _tensor_rows(index, t, cols)
        dt0, dti = base.tensors[name].dtype, expert.tensors[name].dtype
        built = build_levels(w0, wi, rows, ULP_DTYPES.get(dt0, 0) if dt0 == dti else 0)
        zero = index.zero[i, blocks.start:blocks.stop]
        levels = []
        for lvl, (kind, bits, k) in enumerate(built.kinds):
            shared_id = -1
            if kind == "vq":
                if codebook_id < 0:
                    codebook_id = len(payloads)
                    payloads.append(built.shared[lvl])  # type: ignore[arg-type]
                    resid.append(math.nan)
                shared_id = codebook_id
            elif built.shared[lvl] is not None:
                shared_id = len(payloads)
                payloads.append(built.shared[lvl])  # type: ignore[arg-type]
                resid.append(math.nan)
            first = len(payloads)
            for j, blob in enumerate(built.blocks[lvl]):
                payloads.append(b"" if zero[j] else blob)
                resid.append(0.0 if zero[j] else built.resid[lvl][j])
            levels.append(Level(kind, bits, k, shared_id, first))
        tensors.append(TensorLevels(name, t, rows_n, cols, tuple(levels)))
        if on_tensor is not None:
            on_tensor(name)
    sizes = np.asarray([len(p) for p in payloads], dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    data = np.frombuffer(b"".join(payloads), dtype=np.uint8) if payloads else \
        np.zeros(0, np.uint8)
    meta = {"version": DELTA_VERSION, "base_key": sidecar.base_key(base),
            "block_size": lay.block_size, "layout_xxh3": sidecar.layout_hash(lay),
            "expert": sidecar.expert_identity(expert),
            "base_content": _digest(index.base_hash), "expert_content":
                _digest(index.expert_hash[i]),
            "tensors": [tl.to_json() for tl in tensors]}
    return save({"data": data.copy(), "range_start": starts.astype("<i8"),
                 "range_end": ends.astype("<i8"),
                 "range_xxh3": np.asarray([xxhash.xxh3_64_intdigest(p) for p in payloads],
                                          dtype=np.uint64).reshape(-1),
                 "range_resid": np.asarray(resid, dtype=np.float64).reshape(-1)},
                metadata={META_KEY: json.dumps(meta)})


def _digest(arr: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arr, dtype="<u8").tobytes())


def check_writable(experts: Sequence[Checkpoint]) -> None:
    """Refuse, before anything is read, experts beside which no delta sidecar can be written."""
    for e in experts:
        e.check_writable_aux("a delta sidecar", "compress a local, file:// or s3:// copy")


def write_sidecar(base: Checkpoint, expert: Checkpoint, index: BlockIndex, i: int, data: bytes,
                  store: str | Path | None = None) -> str:
    """Write the delta sidecar of ``expert`` (expert ``i`` of ``index``) into mergefs's store
    under ``store`` (a spec's ``index_dir``: :func:`mergefs.index.published.stored_path`) or,
    when ``store`` is None, beside the expert (published); returns where it went (a path or a
    URL)."""
    name = delta_name(sidecar.sidecar_name(expert, sidecar.base_key(base),
                                           index.layout.block_size))
    if store is None:
        return expert.write_aux(name, data, "delta sidecar")
    path = sidecar.stored_path(store, _digest(index.expert_hash[i]), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_beside(path, data, "delta sidecar")
    return str(path)


def publish(base: Checkpoint, experts: Sequence[Checkpoint], index: BlockIndex,
            on_tensor: Callable[[str], None] | None = None,
            store: str | Path | None = None) -> list[str]:
    """Write every expert's delta sidecar into mergefs's store under ``store`` (a spec's
    ``index_dir``), or, when ``store`` is None, beside the expert (local, ``file://`` or
    ``s3://``); returns where each went."""
    if store is None:
        check_writable(experts)  # fail before computing anything

    written = []
    for i, e in enumerate(experts):
        if isinstance(e, LoraCheckpoint):  # reads its factors already: nothing to compress
            log.info("%s is a LoRA adapter: it is read as its exact factors, no delta sidecar",
                     e.root)
            continue
        with one_blas_thread():
            data = encode_sidecar(base, e, index, i, on_tensor)
        where = write_sidecar(base, e, index, i, data, store)
        log.info("delta sidecar %s: %d bytes", where, len(data))
        written.append(where)
    return written
