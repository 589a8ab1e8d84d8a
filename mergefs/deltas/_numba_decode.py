"""The numba loops behind :mod:`mergefs.deltas.decode` and :func:`mergefs.deltas.reconstruct.reconstruct`
(imported on first use: importing numba
costs ~0.15 s, which a merge without sidecars should not pay). See that module for what it
computes and why it equals :func:`mergefs.deltas.reconstruct.reconstruct` (version 3) bit for bit.

Module-level functions, so that numba's disk cache finds them (functions defined in a closure
were compiled again in every process, ~2.5 s). No ``fastmath``: it would allow reassociation
and FMA contraction, which change bits. Pure; ``nogil``. Longer than ~500 lines on purpose: every
compiled loop of the decoder lives in this one module, so that importing it pays numba's import
once and its intrinsics (``axpy8``, ``axpy4``) are defined once for all the loops that use them.
"""

# mypy: ignore-errors
from __future__ import annotations

import sys

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)
_LITTLE = sys.byteorder == "little"


def _axpy_codegen(width):
    """LLVM for ``dst[d:d + width] += src[s:s + width] * scale``: one vector load of each, a
    vector multiply, a vector add (no fused multiply-add: IR without fast-math flags is not
    contracted), one store; per lane the float32 operations of the scalar loop, in its order."""
    from llvmlite import ir
    from numba.core import types

    def codegen(context, builder, sig, args):
        dst, doff, src, soff, scale = args
        f32 = ir.FloatType()
        vt = ir.VectorType(f32, width)
        d_arr = context.make_array(sig.args[0])(context, builder, dst)
        s_arr = context.make_array(sig.args[2])(context, builder, src)
        doff = context.cast(builder, doff, sig.args[1], types.intp)
        soff = context.cast(builder, soff, sig.args[3], types.intp)
        scale = context.cast(builder, scale, sig.args[4], types.float32)
        dptr = builder.bitcast(builder.gep(d_arr.data, [doff]), vt.as_pointer())
        sptr = builder.bitcast(builder.gep(s_arr.data, [soff]), vt.as_pointer())
        i32 = ir.IntType(32)
        one = builder.insert_element(ir.Constant(vt, ir.Undefined), scale, ir.Constant(i32, 0))
        splat = builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                       ir.Constant(ir.VectorType(i32, width), [0] * width))
        prod = builder.fmul(builder.load(sptr, align=4), splat)
        builder.store(builder.fadd(builder.load(dptr, align=4), prod), dptr, align=4)
        return context.get_dummy_value()

    return codegen


def _axpy_intrinsic(width):
    from numba.core import types
    from numba.extending import intrinsic

    def typer(typingctx, dst, doff, src, soff, scale):
        ok = all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C"
                 for a in (dst, src))
        ok &= all(isinstance(o, types.Integer) for o in (doff, soff))
        if not ok or scale != types.float32:  # contiguous float32 arrays, whose memory the
            return None  # offsets index; a float32 scale (a wider one would round otherwise)
        return types.void(dst, doff, src, soff, scale), _axpy_codegen(width)

    typer.__name__ = f"axpy{width}"
    return intrinsic(typer)


#: ``axpyN(dst, d, src, s, scale)``: ``dst.flat[d:d + N] += src.flat[s:s + N] * scale`` in one
#: vector operation (float32 C-contiguous arrays; no bounds check, as the loops here). The
#: vq codewords and the per-byte code values are 8 or 4 values at once, which this numba does
#: not vectorise by itself (its SLP vectoriser is off): 3x faster, the same bits.
axpy8 = _axpy_intrinsic(8)
axpy4 = _axpy_intrinsic(4)


@_jit
def code_at(data, o, bit, bits):
    """The ``bits``-bit code at bit ``bit`` of the bytes from ``data[o]``."""
    byte = o + (bit >> 3)
    sh = bit & 7
    v = np.int64(data[byte]) >> sh
    if sh + bits > 8:
        v |= np.int64(data[byte + 1]) << (8 - sh)
    return v & ((1 << bits) - 1)


@_jit
def value(code, bits):
    """A code's value in steps (midrise; 1 bit: +-1), exact in float32."""
    if bits == 1:
        return np.float32(2 * code - 1)
    return np.float32(code) - np.float32(((1 << bits) - 1) / 2.0)


@_jit
def u32(data, o):
    return np.uint32(np.uint32(data[o]) | (np.uint32(data[o + 1]) << 8)
                     | (np.uint32(data[o + 2]) << 16) | (np.uint32(data[o + 3]) << 24))


@_jit
def f32(data, o):
    return np.uint32(u32(data, o)).view(np.float32)


@_jit
def f16(data, o):
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


@_jit
def popcount(data, o, n):
    """Set bits among the first ``n`` bits of the bytes from ``data[o]``."""
    c = 0
    for e in range(n):
        c += (data[o + (e >> 3)] >> (e & 7)) & 1
    return c


@_jit
def sizes_ok(j, depth, rb, cols, kind, bits, ks, data, off, size):
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


@_jit
def add_codes(a, data, o, e0, bits, step, lut, blut):
    """``a[e] += fl(value of code e0 + e * step)``: the codes packed from ``data[o]``
    (``blut[bits, x, t]``: the value of the ``t``-th code of byte ``x``, :func:`byte_luts`)."""
    lut_b = lut[bits]
    if bits == 3:  # codes straddle bytes
        for e in range(a.size):
            a[e] += lut_b[code_at(data, o, (e0 + e) * 3, 3)] * step
        return
    mask = (1 << bits) - 1
    per = 8 // bits
    if (e0 * bits) % 8 == 0 and a.size % per == 0:  # whole bytes: per byte, its codes
        byte0 = o + (e0 * bits >> 3)
        if per == 4:  # a byte's four values at once
            for q in range(a.size // 4):
                axpy4(a, q * 4, blut, (bits * 256 + np.int64(data[byte0 + q])) * 8, step)
        elif per == 8:
            for q in range(a.size // 8):
                axpy8(a, q * 8, blut, (bits * 256 + np.int64(data[byte0 + q])) * 8, step)
        else:
            for q in range(a.size // per):
                x = data[byte0 + q]
                for c in range(per):
                    a[q * per + c] += lut_b[(x >> (c * bits)) & mask] * step
        return
    for e in range(a.size):
        bit = (e0 + e) * bits
        a[e] += lut_b[(data[o + (bit >> 3)] >> (bit & 7)) & mask] * step


@_jit
def byte_luts(lut):
    """``blut[b, x, t] = lut[b, t-th b-bit code of byte x]`` for b = 1, 2, 4 (float32)."""
    blut = np.zeros((5, 256, 8), np.float32)
    for b in (1, 2, 4):
        for x in range(256):
            for t in range(8 // b):
                blut[b, x, t] = lut[b, (x >> (t * b)) & ((1 << b) - 1)]
    return blut


@_jit
def add_products(acc, cols, u, v, nk):
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


@_jit
def decode(out, w0, out_f, w0_f, starts, rows, depths, cols, kind, bits, ks, first, loop,
           uscale, v, book, data, off, size, p, prow, pscale, wgrid, qmode):
    """See :func:`decode_into` (``out`` and ``w0`` as uint32, ``out_f`` and ``w0_f`` the same
    memory as float32); returns the first block whose ranges have the wrong sizes (nothing
    written from it on), or -1.

    Low-rank levels with ``loop[lvl]`` are summed here component by component (version 3, and
    float16 levels of versions 4 and 5); block ``j``'s other low-rank levels (versions 4, 5)
    are already multiplied out, exactly, in rows ``prow[j] ..`` of ``p`` (-1: none), to be scaled by
    ``pscale[j]`` (a power of two); ``qmode`` 1: those rows of ``p`` hold the block's ``Q``
    instead, multiplied here by ``wgrid`` (one block: a compiled loop instead of a BLAS call;
    the same integers, exact in any order)."""
    acc = np.zeros(rows.max() * cols, np.float32)
    u = np.zeros((rows.max(), v.shape[0]), np.float32)
    lut = np.zeros((17, 256), np.float32)  # lut[bits][code]: the code's value in steps
    for b in (1, 2, 3, 4, 8):
        for c in range(1 << b):
            lut[b, c] = value(c, b)
    blut = byte_luts(lut)
    rcount = np.zeros(kind.size, np.int64)  # add_rows: per rows level, changed rows so far
    rch = np.zeros(kind.size, np.int64)  # and its changed rows in all
    for j in range(starts.size):
        s, rb, depth = starts[j], rows[j], depths[j]
        n = rb * cols
        if not sizes_ok(j, depth, rb, cols, kind, bits, ks, data, off, size):
            return j
        additive = False
        for lvl in range(depth):
            additive |= kind[lvl] <= 3
        nk = 0  # low-rank components summed here, one by one
        for lvl in range(depth):
            if kind[lvl] == 0 and loop[lvl]:
                nk += ks[lvl]
        if additive and nk == 0 and (qmode == 0 or p.shape[1] <= ROW_PRODUCT_K):
            # row by row: each row's product and levels while it is in L1, then W_hat's row
            # (per element the same operations in the same order as the block-wise path)
            add_rows(out_f, w0_f, s, rb, cols, depth, j, kind, bits, ks, first, book, data,
                     off, size, p, prow[j], pscale[j], wgrid, qmode, lut, blut, acc, rcount,
                     rch)
        else:
            block_levels(out, w0, out_f, w0_f, s, rb, cols, depth, j, additive, nk, kind,
                         bits, ks, first, loop, uscale, v, book, data, off, size, p, prow[j],
                         pscale[j], wgrid, qmode, lut, blut, acc, u)
        overwrite(out, w0, s, n, depth, j, kind, bits, data, off, size)
    return -1


@_jit
def add_rows(out_f, w0_f, s, rb, cols, depth, j, kind, bits, ks, first, book, data, off, size,
             p, pr0, ps, wgrid, qmode, lut, blut, acc, rcount, rch):
    """``W_hat`` of a block without looped low-rank levels, row by row: the exact product's
    row (``pr0 >= 0``; ``qmode``: computed here from ``Q``'s row and ``wgrid``) or +0, the
    quant, rows and vq levels' parts of it in level order, then ``w0 + acc``."""
    for lvl in range(depth):
        rcount[lvl] = 0
        if kind[lvl] == 2 and size[lvl, j] > 0:
            rch[lvl] = popcount(data, off[lvl, j], rb)
    nm = (rb + 7) // 8
    a = acc[:cols]
    for r in range(rb):
        if pr0 >= 0 and qmode:
            row_product(a, p, pr0 + r, wgrid, cols)
            for e in range(cols):
                a[e] = a[e] * ps + np.float32(0.0)
        elif pr0 >= 0:
            for e in range(cols):
                a[e] = p[pr0 + r, e] * ps + np.float32(0.0)
        else:
            a[:] = 0
        for lvl in range(depth):
            kd, b, o = kind[lvl], bits[lvl], off[lvl, j]
            if kd == 1:
                add_codes(a, data, o + 4 * rb, r * cols, b, f32(data, o + 4 * r), lut, blut)
            elif kd == 2 and size[lvl, j] > 0:
                if (data[o + (r >> 3)] >> (r & 7)) & 1:
                    c = rcount[lvl]
                    add_codes(a, data, o + nm + 4 * rch[lvl], c * cols, b,
                              f32(data, o + nm + 4 * c), lut, blut)
                    rcount[lvl] = c + 1
            elif kd == 3:
                vq_row(a, data, o, r, rb, cols, ks[lvl], first[lvl], book)
        o_f = out_f[s + r * cols:s + (r + 1) * cols]
        w_f = w0_f[s + r * cols:s + (r + 1) * cols]
        for e in range(cols):
            o_f[e] = w_f[e] + a[e]


#: ``qmode`` products of at most this many components are made row by row (``add_rows``: 7-10%
#: faster for a 42 x 384 block of 1-4 components), more block by block (``block_levels``: two
#: rows per pass over ``wgrid``)
ROW_PRODUCT_K = 8


@_jit
def row_product(a, q, qr, w, cols):
    """``a[e] = sum_c q[qr, c] * w[c, e]``, four components per pass from +0 (integers whose
    partial sums stay below ``2**24``: exact in any order). :func:`add_products` on a one-row
    slice computes the same, slower here (39-41 against 35 us per 42 x 384 block of 8
    components)."""
    k = q.shape[1]
    for e in range(cols):
        a[e] = np.float32(0.0)
    c = 0
    while c + 4 <= k:
        a0, a1, a2, a3 = q[qr, c], q[qr, c + 1], q[qr, c + 2], q[qr, c + 3]
        v0, v1, v2, v3 = w[c], w[c + 1], w[c + 2], w[c + 3]
        for e in range(cols):
            a[e] = (((a[e] + a0 * v0[e]) + a1 * v1[e]) + a2 * v2[e]) + a3 * v3[e]
        c += 4
    while c < k:
        a0 = q[qr, c]
        v0 = w[c]
        for e in range(cols):
            a[e] += a0 * v0[e]
        c += 1


@_jit
def vq_row(ar, data, o, r, rb, cols, dim, f0, book):
    """``ar += scale * codeword`` per ``dim`` elements of row ``r`` of a vq level at ``o``."""
    per = cols // dim
    scale = f32(data, o + 4 * r)
    c0 = o + 4 * rb + r * per
    if dim == 8:  # the one dimension mergefs writes: a codeword at once
        wide = book.shape[1]
        for q in range(per):  # (no array view per code: it costs refcounts)
            axpy8(ar, q * 8, book, (f0 + np.int64(data[c0 + q])) * wide, scale)
    else:
        for q in range(per):
            w = f0 + np.int64(data[c0 + q])
            for d in range(dim):
                ar[q * dim + d] += book[w, d] * scale


@_jit
def block_levels(out, w0, out_f, w0_f, s, rb, cols, depth, j, additive, nk, kind, bits, ks,
                 first, loop, uscale, v, book, data, off, size, p, pr0, ps, wgrid, qmode, lut,
                 blut, acc, u):
    """``W_hat`` of a block level by level over the whole block (looped low-rank levels, or
    a ``qmode`` product of many components)."""
    n = rb * cols
    if additive:
        acc[:n] = 0
    if pr0 >= 0 and qmode:
        add_products(acc, cols, p[pr0:pr0 + rb], wgrid, p.shape[1])  # from +0: exact integers
        for e in range(n):
            acc[e] = acc[e] * ps + np.float32(0.0)
    elif pr0 >= 0:  # the exact product, scaled (exact), then +0 (never -0)
        for r in range(rb):
            pr = pr0 + r
            for e in range(cols):
                acc[r * cols + e] = p[pr, e] * ps + np.float32(0.0)
    if nk > 0:  # low-rank: every component's U value of a row, then V row by V row
        c = 0
        for lvl in range(depth):
            if kind[lvl] != 0 or not loop[lvl]:
                continue
            k, b, o = ks[lvl], bits[lvl], off[lvl, j]
            sc = uscale[first[lvl]:first[lvl] + k]
            mask = (1 << b) - 1
            for r in range(rb):  # the V rows are in this order
                ur = u[r, c:c + k]
                for q in range(k):
                    e = r * k + q
                    if b == 16:
                        uv = f16(data, o + 2 * e)
                    elif b == 3:  # codes straddle bytes
                        uv = lut[3, code_at(data, o, e * 3, 3)]
                    else:
                        uv = lut[b, (data[o + ((e * b) >> 3)] >> ((e * b) & 7)) & mask]
                    ur[q] = uv * sc[q]
            c += k
        add_products(acc, cols, u[:rb], v, nk)
    for lvl in range(depth):
        kd, b, o = kind[lvl], bits[lvl], off[lvl, j]
        if kd == 1:  # quant: a step per row, then the codes
            for r in range(rb):
                add_codes(acc[r * cols:(r + 1) * cols], data, o + 4 * rb, r * cols, b,
                          f32(data, o + 4 * r), lut, blut)
        elif kd == 2 and size[lvl, j] > 0:  # rows: bitmap, steps, changed rows' codes
            nm = (rb + 7) // 8
            ch = popcount(data, o, rb)
            codes = o + nm + 4 * ch
            c = 0
            for r in range(rb):
                if (data[o + (r >> 3)] >> (r & 7)) & 1:
                    add_codes(acc[r * cols:(r + 1) * cols], data, codes, c * cols, b,
                              f32(data, o + nm + 4 * c), lut, blut)
                    c += 1
        elif kd == 3:  # vq: a scale per row, then one byte per dim elements
            for r in range(rb):
                vq_row(acc[r * cols:(r + 1) * cols], data, o, r, rb, cols, ks[lvl], first[lvl],
                       book)
    if additive:
        o_f = out_f[s:s + n]
        w_f = w0_f[s:s + n]
        for e in range(n):
            o_f[e] = w_f[e] + acc[e]
    else:
        for e in range(n):
            out[s + e] = w0[s + e]


@_jit
def overwrite(out, w0, s, n, depth, j, kind, bits, data, off, size):
    """The ulp and sparse levels of a block: values of ``W_hat`` replaced."""
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



def q_luts(u8=False):
    """``luts[b][x, t] = 2 * (value of the t-th b-bit code of byte x)`` for b = 1, 2, 4, 8
    (index 0, 3, 5-7: unused), float32; ``u8``: the uint8 ``x`` of
    :func:`mergefs.deltas.intgemm.to_x` instead (that plus 128; an 8-bit code itself), int16."""
    luts = np.zeros((9, 256, 8), np.int16 if u8 else np.float32)
    for b in (1, 2, 4, 8):
        for x in range(256):
            for t in range(8 // b):
                code = (x >> (t * b)) & ((1 << b) - 1)
                if u8:
                    luts[b, x, t] = code if b == 8 else 2 * code - ((1 << b) - 1) + 128
                else:
                    luts[b, x, t] = 2 * code - ((1 << b) - 1)
    return luts


@_jit
def unpack_exact(uq, urow, rows, depths, cols, kind, bits, ks, loop, data, off, size, luts,
                 shift):
    """``uq[urow[j] + r, c] = 2 * (value of U code (r, c))`` of block ``j``'s low-rank levels
    without ``loop`` within its depth, their components side by side in level order (odd
    integers, exact in float32); blocks with ``urow[j] < 0`` are skipped. Returns the first
    block whose ranges have the wrong sizes, or -1. ``luts[b][x, t]``: that value of the
    ``t``-th ``b``-bit code of byte ``x`` (:func:`q_luts`). ``shift`` 128 (``uq`` uint8 and
    ``luts`` of ``q_luts(True)``): :func:`mergefs.deltas.intgemm.to_x` of the codes instead (the
    widths that do not go through ``luts``, 3 bits, are never 8)."""
    # 2-bit codes: a byte's four x at once, as one little-endian word
    words = _LITTLE and shift == 128 and uq.shape[1] % 4 == 0
    w32 = np.zeros(256, np.uint32)
    if words:
        uq32 = uq.view(np.uint32)
        for x in range(256):
            for t in range(4):
                w32[x] |= np.uint32(luts[2, x, t]) << (8 * t)
    else:
        uq32 = np.zeros((1, 1), np.uint32)
    for j in range(rows.size):
        if urow[j] < 0:
            continue
        rb, depth = rows[j], depths[j]
        if not sizes_ok(j, depth, rb, cols, kind, bits, ks, data, off, size):
            return j
        c = 0
        for lvl in range(depth):
            if kind[lvl] != 0 or loop[lvl]:
                continue
            k, b, o = ks[lvl], bits[lvl], off[lvl, j]
            topi = (1 << b) - 1
            per = 8 // b
            if words and b == 2 and k % 4 == 0 and c % 4 == 0:  # a word per byte
                c4 = c // 4
                for r in range(rb):
                    row = urow[j] + r
                    o_r = o + r * (k // 4)
                    for q in range(k // 4):
                        uq32[row, c4 + q] = w32[data[o_r + q]]
            elif b != 3 and k % per == 0:  # each row's codes start a byte: per byte, its codes
                for r in range(rb):  # (2-d indexing, no array view per row: refcounts)
                    row = urow[j] + r
                    o_r = o + r * (k // per)
                    if per == 4:  # constant trip counts: the compiler unrolls them
                        for q in range(k // 4):
                            x = data[o_r + q]
                            for t in range(4):
                                uq[row, c + q * 4 + t] = luts[2, x, t]
                    elif per == 2:
                        for q in range(k // 2):
                            x = data[o_r + q]
                            for t in range(2):
                                uq[row, c + q * 2 + t] = luts[4, x, t]
                    else:
                        for q in range(k // per):
                            x = data[o_r + q]
                            for t in range(per):
                                uq[row, c + q * per + t] = luts[b, x, t]
            elif b == 3 and k % 8 == 0:  # eight codes per three bytes
                for r in range(rb):
                    row = urow[j] + r
                    o_r = o + r * (3 * k // 8)
                    for q in range(k // 8):
                        x = (np.int64(data[o_r + 3 * q]) | (np.int64(data[o_r + 3 * q + 1]) << 8)
                             | (np.int64(data[o_r + 3 * q + 2]) << 16))
                        for t in range(8):
                            uq[row, c + q * 8 + t] = 2 * ((x >> (3 * t)) & 7) - 7 + shift
            else:
                for r in range(rb):
                    row = urow[j] + r
                    for q in range(k):
                        code = code_at(data, o, (r * k + q) * b, b)
                        uq[row, c + q] = 2 * code - topi + shift
            c += k
    return -1


# -- the per-block helpers of mergefs.deltas.reconstruct.reconstruct -----------------------------------


@_jit
def quant_add(acc, raw, bits, step, cols):
    """``acc[e] += value(code e) * step[e // cols]`` (the ``quant`` level, versions 1-2 and the
    numpy route of :func:`mergefs.deltas.reconstruct.reconstruct`)."""
    for e in range(acc.size):
        acc[e] += value(code_at(raw, 0, e * bits, bits), bits) * step[e // cols]


@_jit
def ulp_bf16(out, w0, raw, bits):
    """bfloat16 ``ulp`` level: the moved elements' patterns (the numpy route of
    :func:`mergefs.deltas.reconstruct.reconstruct`)."""
    n = w0.size
    half = 1 << (bits - 1)
    pos = ((n + 7) >> 3) * 8  # bit position of the first code
    for e in range(n):
        if (raw[e >> 3] >> (e & 7)) & 1:
            code = code_at(raw, 0, pos, bits)
            move = code - half + (1 if code >= half else 0)
            b16 = np.int64(w0[e] >> 16) + move
            out[e] = np.uint32(b16 & 0xFFFF) << 16
            pos += bits
