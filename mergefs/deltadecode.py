"""Decoding many row blocks of one tensor's delta sidecar levels at once (issue 14).

The engine reconstructs ``W_hat`` of every planned block of a unit, and the publisher measures
every level prefix of every block, with :func:`decode_into`: one call per tensor (or run of
blocks), each block with its own level depth, written straight into the caller's float32
buffer. With numba, one compiled loop per call (defined, or loaded from numba's disk cache, at
the first call: importing numba costs ~0.15 s, which a merge without sidecars need not pay);
without it, or for ``ulp`` levels of float16 experts, :func:`mergefs.deltas.reconstruct` block by
block. Both compute exactly the version-3 arithmetic of :mod:`mergefs.deltas` (the fixed-order
low-rank product, no fused multiply-add: numba without ``fastmath`` does not contract), so the
bits do not depend on which ran; sidecars of versions 1 and 2 (a BLAS low-rank product) are
decoded block by block as before.

:func:`read_payloads` reads the block ranges of a tensor's levels, one pread per adjacent run
per level, into one buffer. Blocking; worker threads only, never the trio thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import deltas as dl

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
    first: np.ndarray  # (L,) int64: lowrank, first row of ``v``/``uscale``; vq, of ``book``
    uscale: np.ndarray  # (K,) float32: every lowrank level's U column scales, in order
    v: np.ndarray  # (K, cols) float32: every lowrank level's V rows, in order
    book: np.ndarray  # (W, dim) float32: every vq level's codebook, in order
    compiled_ok: bool  # False: a level the compiled loop does not decode (float16 ulp)


def pack(levels: tuple[dl.Level, ...], shared: list[tuple[np.ndarray, np.ndarray] | None],
         cols: int) -> Packed:
    n = len(levels)
    first = np.zeros(n, np.int64)
    us, vs, books = [], [], []
    rows_v = rows_b = 0
    for lvl, (lv, sh) in enumerate(zip(levels, shared)):
        if lv.kind == "lowrank":
            assert sh is not None
            first[lvl] = rows_v
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
        np.asarray([lv.k for lv in levels], np.int64), first,
        np.ascontiguousarray(np.concatenate(us) if us else np.zeros(1), dtype=np.float32),
        np.ascontiguousarray(np.vstack(vs) if vs else np.zeros((1, cols)), dtype=np.float32),
        np.ascontiguousarray(np.vstack([b.reshape(-1, dim) for b in books]) if books
                             else np.zeros((1, 1)), dtype=np.float32),
        not any(lv.kind == "ulp" and lv.k != 1 for lv in levels))


def decode_into(out: np.ndarray, w0: np.ndarray, levels: tuple[dl.Level, ...], cols: int,
                starts: np.ndarray, rows: np.ndarray, depths: np.ndarray, payloads: Payloads,
                shared: list[tuple[np.ndarray, np.ndarray] | None],
                packed: Packed | None = None) -> None:
    """``out[s:s + rows[j] * cols] = W_hat`` of block ``j`` (``s = starts[j]``: element offsets
    into ``out`` and ``w0``, both flat float32) from its first ``depths[j]`` levels, version 3.

    ``shared`` and ``packed`` cover ``levels[:max(depths)]`` (``packed``: :func:`pack` of them,
    computed here when None). Raises :class:`mergefs.deltas.DeltaError` when a block's ranges
    do not have the sizes its levels imply.
    """
    if len(starts) == 0:
        return
    depth = int(depths.max())
    if packed is None:
        packed = pack(levels[:depth], shared[:depth], cols)
    kernel = _compiled() if packed.compiled_ok else None
    if kernel is None:
        for j in range(len(starts)):
            s, n, k = int(starts[j]), int(rows[j]) * cols, int(depths[j])
            out[s:s + n] = dl.reconstruct(w0[s:s + n], levels[:k],
                                          [payloads.block(lvl, j) for lvl in range(k)],
                                          shared[:k], int(rows[j]), cols)
        return
    bad = kernel(out.view(np.uint32), np.ascontiguousarray(w0).view(np.uint32),
                 np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(rows, np.int64),
                 np.ascontiguousarray(depths, np.int64), cols, packed.kind, packed.bits,
                 packed.k, packed.first, packed.uscale, packed.v, packed.book, payloads.data,
                 payloads.off, payloads.size)
    if bad >= 0:
        raise dl.DeltaError(f"block {bad} of the call: its level ranges do not have the sizes "
                            "its levels imply (a damaged level table)")


def read_payloads(sc: dl.DeltaSidecar, tl: dl.TensorLevels, js: np.ndarray, depths: np.ndarray,
                  tensor: str = "") -> Payloads:
    """Level ``l`` of the tensor's blocks ``js`` (ascending, relative to its first block) whose
    depth exceeds ``l``: one pread per run of adjacent blocks per level, as ``read_runs``."""
    depth = int(depths.max()) if len(js) else 0
    off = np.zeros((depth, len(js)), np.int64)
    size = np.zeros((depth, len(js)), np.int64)
    pieces: list[memoryview] = []
    pos = 0
    for lvl, lv in enumerate(tl.levels[:depth]):
        sel = np.flatnonzero(depths > lvl)
        ranges = lv.first_range + np.asarray(js, np.int64)[sel]
        cuts = np.flatnonzero(np.diff(ranges) != 1) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ranges)]):
            r0, r1 = int(ranges[a]), int(ranges[b - 1]) + 1
            buf = sc.read(r0, r1, tensor)
            run = ranges[a:b]
            off[lvl, sel[a:b]] = pos + sc.range_start[run] - sc.range_start[r0]
            size[lvl, sel[a:b]] = sc.range_end[run] - sc.range_start[run]
            pieces.append(buf)
            pos += len(buf)
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8) if pieces else np.zeros(0, np.uint8)
    return Payloads(data, off, size)


def decode_blocks(sc: dl.DeltaSidecar, tl: dl.TensorLevels, js: np.ndarray, depths: np.ndarray,
                  starts: np.ndarray, n_rows: np.ndarray, w0: np.ndarray, out: np.ndarray,
                  tensor: str = "") -> None:
    """Read blocks ``js`` of tensor ``tl`` (relative to its first block; ascending) and decode
    them at ``depths`` into ``out`` (see :func:`decode_into`: ``starts`` index ``w0`` and
    ``out``, block ``j`` has ``n_rows[j]`` rows)."""
    if len(js) == 0:
        return
    payloads = read_payloads(sc, tl, js, depths, tensor)
    depth = int(depths.max())
    shared = [sc.shared(lv, tl.cols, tensor) for lv in tl.levels[:depth]]
    if sc.meta["version"] in dl.BLAS_VERSIONS:
        with dl.one_blas_thread():
            for j in range(len(js)):
                s, n, k = int(starts[j]), int(n_rows[j]) * tl.cols, int(depths[j])
                out[s:s + n] = dl.reconstruct(w0[s:s + n], tl.levels[:k],
                                              [payloads.block(lvl, j) for lvl in range(k)],
                                              shared[:k], int(n_rows[j]), tl.cols,
                                              version=sc.meta["version"])
        return
    with sc._shared_lock:
        packed = sc._packed.get((tl.name, depth))
        if packed is None:
            packed = sc._packed[(tl.name, depth)] = pack(tl.levels[:depth], shared, tl.cols)
    decode_into(out, w0, tl.levels, tl.cols, starts, n_rows, depths, payloads, shared, packed)


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
    except ImportError:
        return None
    jit = numba.njit(cache=True, nogil=True)

    @jit
    def code_at(data, o, bit, bits):  # type: ignore[no-untyped-def]
        """The ``bits``-bit code at bit ``bit`` of the bytes from ``data[o]``."""
        byte = o + (bit >> 3)
        sh = bit & 7
        v = np.int64(data[byte]) >> sh
        if sh + bits > 8:
            v |= np.int64(data[byte + 1]) << (8 - sh)
        return v & ((1 << bits) - 1)

    @jit
    def value(code, bits):  # type: ignore[no-untyped-def]
        """A code's value in steps (midrise; 1 bit: +-1), exact in float32."""
        if bits == 1:
            return np.float32(2 * code - 1)
        return np.float32(code) - np.float32(((1 << bits) - 1) / 2.0)

    @jit
    def u32(data, o):  # type: ignore[no-untyped-def]
        return np.uint32(np.uint32(data[o]) | (np.uint32(data[o + 1]) << 8)
                         | (np.uint32(data[o + 2]) << 16) | (np.uint32(data[o + 3]) << 24))

    @jit
    def f32(data, o):  # type: ignore[no-untyped-def]
        return np.uint32(u32(data, o)).view(np.float32)

    @jit
    def f16(data, o):  # type: ignore[no-untyped-def]
        """The little-endian float16 at ``data[o]``, as float32 (exact)."""
        h = np.uint32(data[o]) | (np.uint32(data[o + 1]) << 8)
        sign = (h >> 15) << 31
        exp = (h >> 10) & 0x1F
        mant = h & 0x3FF
        if exp == 0x1F:
            bits = sign | np.uint32(0x7F800000) | (mant << 13)
        elif exp != 0:
            bits = sign | ((exp + 112) << 23) | (mant << 13)
        elif mant == 0:
            bits = sign
        else:  # subnormal: normalise
            e = np.uint32(113)
            while (mant & 0x400) == 0:
                mant <<= 1
                e -= 1
            bits = sign | (e << 23) | ((mant & 0x3FF) << 13)
        return np.uint32(bits).view(np.float32)

    @jit
    def popcount(data, o, n):  # type: ignore[no-untyped-def]
        """Set bits among the first ``n`` bits of the bytes from ``data[o]``."""
        c = 0
        for e in range(n):
            c += (data[o + (e >> 3)] >> (e & 7)) & 1
        return c

    @jit
    def sizes_ok(j, depth, rb, cols, kind, bits, ks, data, off, size):  # type: ignore[no-untyped-def]
        n = rb * cols
        for lvl in range(depth):
            o, got, kd, b = off[lvl, j], size[lvl, j], kind[lvl], bits[lvl]
            if kd == 0:
                need = 2 * rb * ks[lvl] if b == 16 else (rb * ks[lvl] * b + 7) // 8
            elif kd == 1:
                need = 4 * rb + (n * b + 7) // 8
            elif kd == 2:
                if got == 0:
                    continue  # no changed row
                nm = (rb + 7) // 8
                if got < nm:
                    return False
                ch = popcount(data, o, rb)
                need = nm + 4 * ch + (ch * cols * b + 7) // 8
            elif kd == 3:
                if cols % ks[lvl] != 0:
                    return False
                need = 4 * rb + n // ks[lvl]
            elif kd == 4:
                nm = (n + 7) // 8
                if got < nm:
                    return False
                need = nm + (popcount(data, o, n) * b + 7) // 8
            else:
                if got % 8 != 0:
                    return False
                for q in range(got // 8):
                    if u32(data, o + 4 * q) >= n:
                        return False
                need = got
            if got != need:
                return False
        return True

    @jit
    def add_codes(a, data, o, e0, bits, step, lut):  # type: ignore[no-untyped-def]
        """``a[e] += fl(value of code e0 + e * step)``: the codes packed from ``data[o]``."""
        lut_b = lut[bits]
        if bits == 3:  # codes straddle bytes
            for e in range(a.size):
                a[e] += lut_b[code_at(data, o, (e0 + e) * 3, 3)] * step
            return
        mask = (1 << bits) - 1
        for e in range(a.size):
            bit = (e0 + e) * bits
            a[e] += lut_b[(data[o + (bit >> 3)] >> (bit & 7)) & mask] * step

    @jit
    def add_products(acc, cols, u, v, nk):  # type: ignore[no-untyped-def]
        """``acc[r, e] += fl(u[r, c] * v[c, e])`` for ``c`` in ``0 .. nk-1`` in order, each
        rounded: two rows and four components per pass (per element the same operations, in
        the same order; fewer loads of ``v`` and ``acc``)."""
        rb = u.shape[0]
        r = 0
        while r < rb:
            two = r + 1 < rb
            a = acc[r * cols:(r + 1) * cols]
            b = acc[(r + 1) * cols:(r + 2) * cols] if two else a
            c = 0
            while c + 4 <= nk:
                v0, v1, v2, v3 = v[c], v[c + 1], v[c + 2], v[c + 3]
                a0, a1, a2, a3 = u[r, c], u[r, c + 1], u[r, c + 2], u[r, c + 3]
                if two:
                    b0, b1, b2, b3 = u[r + 1, c], u[r + 1, c + 1], u[r + 1, c + 2], u[r + 1, c + 3]
                    for e in range(cols):
                        x0, x1, x2, x3 = v0[e], v1[e], v2[e], v3[e]
                        a[e] = (((a[e] + a0 * x0) + a1 * x1) + a2 * x2) + a3 * x3
                        b[e] = (((b[e] + b0 * x0) + b1 * x1) + b2 * x2) + b3 * x3
                else:
                    for e in range(cols):
                        a[e] = (((a[e] + a0 * v0[e]) + a1 * v1[e]) + a2 * v2[e]) + a3 * v3[e]
                c += 4
            while c < nk:
                v0 = v[c]
                a0 = u[r, c]
                for e in range(cols):
                    a[e] += a0 * v0[e]
                if two:
                    b0 = u[r + 1, c]
                    for e in range(cols):
                        b[e] += b0 * v0[e]
                c += 1
            r += 2

    @jit
    def decode(out, w0, starts, rows, depths, cols, kind, bits, ks, first, uscale, v, book,
               data, off, size):  # type: ignore[no-untyped-def]
        """See :func:`decode_into` (``out`` and ``w0`` as uint32); returns the first block whose
        ranges have the wrong sizes (nothing written from it on), or -1."""
        acc = np.zeros(rows.max() * cols, np.float32)
        u = np.zeros((rows.max(), v.shape[0]), np.float32)
        lut = np.zeros((17, 256), np.float32)  # lut[bits][code]: the code's value in steps
        for b in (1, 2, 3, 4, 8):
            for c in range(1 << b):
                lut[b, c] = value(c, b)
        for j in range(starts.size):
            s, rb, depth = starts[j], rows[j], depths[j]
            n = rb * cols
            if not sizes_ok(j, depth, rb, cols, kind, bits, ks, data, off, size):
                return j
            additive = False
            for lvl in range(depth):
                additive |= kind[lvl] <= 3
            if additive:
                acc[:n] = 0
            nk = 0  # low-rank: every component's U value of a row, then V row by V row
            for lvl in range(depth):
                if kind[lvl] == 0:
                    nk += ks[lvl]
            if nk > 0:
                c = 0
                for lvl in range(depth):
                    if kind[lvl] != 0:
                        continue
                    k, b, o = ks[lvl], bits[lvl], off[lvl, j]
                    for q in range(k):  # the V rows are in this order
                        for r in range(rb):
                            if b == 16:
                                uv = f16(data, o + 2 * (r * k + q))
                            else:
                                uv = lut[b, code_at(data, o, (r * k + q) * b, b)]
                            u[r, c] = uv * uscale[first[lvl] + q]
                        c += 1
                add_products(acc, cols, u[:rb], v, nk)
            for lvl in range(depth):
                kd, b, o = kind[lvl], bits[lvl], off[lvl, j]
                if kd == 1:  # quant: a step per row, then the codes
                    for r in range(rb):
                        add_codes(acc[r * cols:(r + 1) * cols], data, o + 4 * rb, r * cols, b,
                                  f32(data, o + 4 * r), lut)
                elif kd == 2 and size[lvl, j] > 0:  # rows: bitmap, steps, changed rows' codes
                    nm = (rb + 7) // 8
                    ch = popcount(data, o, rb)
                    codes = o + nm + 4 * ch
                    c = 0
                    for r in range(rb):
                        if (data[o + (r >> 3)] >> (r & 7)) & 1:
                            add_codes(acc[r * cols:(r + 1) * cols], data, codes, c * cols, b,
                                      f32(data, o + nm + 4 * c), lut)
                            c += 1
                elif kd == 3:  # vq: a scale per row, then one byte per dim elements
                    dim = ks[lvl]
                    per = cols // dim
                    for r in range(rb):
                        scale = f32(data, o + 4 * r)
                        for q in range(per):
                            word = first[lvl] + np.int64(data[o + 4 * rb + r * per + q])
                            for d in range(dim):
                                acc[r * cols + q * dim + d] += book[word, d] * scale
            if additive:
                for e in range(n):
                    out[s + e] = np.float32(np.uint32(w0[s + e]).view(np.float32) + acc[e]).view(np.uint32)
            else:
                for e in range(n):
                    out[s + e] = w0[s + e]
            for lvl in range(depth):
                if kind[lvl] != 4:
                    continue  # ulp (bfloat16): the base's pattern moved, where the bitmap says
                b, o = bits[lvl], off[lvl, j]
                half = 1 << (b - 1)
                pos = ((n + 7) >> 3) * 8
                for e in range(n):
                    if (data[o + (e >> 3)] >> (e & 7)) & 1:
                        code = code_at(data, o, pos, b)
                        move = code - half + (1 if code >= half else 0)
                        b16 = np.int64(w0[s + e] >> 16) + move
                        out[s + e] = np.uint32(b16 & 0xFFFF) << 16
                        pos += b
            for lvl in range(depth):
                if kind[lvl] != 5:
                    continue  # sparse: positions, then the exact values
                o, cnt = off[lvl, j], size[lvl, j] // 8
                for q in range(cnt):
                    out[s + u32(data, o + 4 * q)] = u32(data, o + 4 * (cnt + q))
        return -1

    return decode
