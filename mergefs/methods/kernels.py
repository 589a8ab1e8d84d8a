"""Compiled merge kernels (numba): decode, subtract, scale, accumulate and encode in one pass.

:func:`fused_merge` computes one unit of a method whose registry entry declares its arithmetic
as a :class:`~mergefs.methods.Fused` form (task arithmetic up to 256 models on x86, linear with
any number), operation for operation as the method's numpy kernel (:mod:`mergefs.methods.gta`,
:mod:`mergefs.methods.linear`), so the bytes are the registry's, hence mergekit's:

- ``"delta"``: per input in mergekit's order, ``S = S + (X_k - W0) * w_k`` from ``S = +0.0``
  (numpy's ``outer_sum``: sequential, which is torch's order for up to 4 inputs), then
  ``S / divisor``, ``S * lambda`` and ``W0 + S``, each rounded to float32;
- ``"fma"``: ``S = fma(X_k, w_k, S)`` from ``+0.0`` with one rounding per step (LLVM's
  ``llvm.fma.f32``: the same correctly rounded result as torch's ``addcmul_`` and the numpy
  kernel's float64 round-to-odd emulation), then ``S / divisor`` (any number of inputs:
  mergekit's linear is a loop of ``addcmul_``; the divisor is torch's sum of the weights,
  :func:`mergefs.methods.exact.vector_sum`).

An input the plan omits in a range holds the reference's values there, as in the numpy path
(``(W0 - W0) * w`` is not always 0: it is NaN where ``W0`` is inf or NaN, so the kernel computes
it rather than skipping it). With 5 to 256 models (the registry's torch order,
``order="torch"``) the sum over inputs is torch's ``stack(...).sum(dim=0)``, whose order depends
on the element's position (ATen's ``SumKernel.cpp``): in groups of 32 columns ``multi_row_sum``
(input order into a first level from +0.0; after each block of 16 inputs that level is added
into the next, ``level_1 = level_1 + level_0``, and restarts at +0.0; at the end the levels are
added in order: ``S_rest + ((B_1 + B_2) + ...)``, input order for up to 16 inputs;
:func:`mergefs.methods.exact.multi_row_sum`); 4-way interleaved partial sums in the last
``numel % 32`` (``row_sum``; with 64 or more inputs each partial has its own cascade). A
multi-threaded reduction splits at multiples of 32 columns, so this holds for any thread count
below 47 — with 47 or more torch threads, a last chunk of fewer than 8 columns is summed by
another routine, which differs for small tensors with ``numel % 32`` in 4..7: a mergekit run
with that many threads can differ there in the last elements. The kernel accumulates each
input into level 0 and carries the levels at block ends (:class:`_Cascade`, the compiled
``add_into``), then recomputes the tail elements in torch's order with numpy
(:func:`mergefs.methods.exact.torch_sum_tail`; tested against torch up to 256 inputs). Not
fused, the registry's path runs: more than 256 models, one-element tensors with 8 or more
(torch sums them along the contiguous input axis), sparsified and sign-consensus methods
(masks, whole-tensor ranks), units with delta sidecar levels, and non-x86 machines (other SIMD
widths) with more than 4 models.

NaN payloads: IEEE 754 leaves open which payload ``a + b`` carries when both are NaN, and numpy
is not consistent about it (its vector loops return ``a``'s, its scalar tail loop, a
length-dependent set of elements, ``b``'s). The kernels always return ``a``'s, quietened. So
the output equals the registry's bit for bit except where two *different* NaNs meet in one
operation (both results are then NaN); with a bf16 output, where every NaN is ``0x7fc0`` with its
sign, that is only a difference of signs. Everything else (+-0.0, +-inf, subnormals, every
finite value, NaNs met alone) is bit-identical. Decoding and encoding reproduce numpy's and
ml_dtypes' conversions: bf16 -> f32 is a shift, f16 -> f32 numpy's own table of all 65536 values,
f32 -> bf16 rounds to nearest even (NaN -> ``0x7fc0`` with its sign), f32 -> f16 is numpy's
``npy_floatbits_to_halfbits``.

numba is optional: the kernels are compiled on first use and cached on disk (``cache=True``);
:func:`warm_up` loads them (the mount and the merge start loading on a thread while they
open: :func:`start_warm_up`). When numba cannot be imported,
:func:`available` is False with the reason in :data:`UNAVAILABLE_REASON`, and the engine merges
with the registry's numpy kernels (the same bytes, slower). :data:`counters` counts the units
merged here, so tests can tell that the kernel ran.

Pure functions; numba releases the GIL inside the kernels (``nogil``), so worker threads merge
in parallel. Never call them on the trio thread.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from mergefs.core.dtypes import decode_f32
from mergefs.methods.base import Fused
from mergefs.methods import exact

log = logging.getLogger(__name__)

UNAVAILABLE_REASON = "" if importlib.util.find_spec("numba") is not None else (
    "numba is not installed; `pip install numba` for the fused kernels (mergefs merges with "
    "numpy meanwhile: same bytes, slower)")
_nb: Any = None  # mergefs.methods._numba_kernels, imported on first use
_load_lock = threading.Lock()

#: source and output dtypes the kernels handle
DTYPES = ("F32", "BF16", "F16")
_RAW: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"),
                                  "F16": np.dtype("<u2")}
# numpy's own f16 -> f32 conversion of every half bit pattern (exact, payloads as numpy has them)
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)
F16_TABLE.flags.writeable = False


class Counters:
    """Units merged by the kernels in this process (a test's proof that they ran)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.units = 0

    def add(self) -> None:
        with self._lock:
            self.units += 1


counters = Counters()

#: one input's planned runs: (offset in elements from the unit's start, raw bytes, dtype)
Runs = Sequence[tuple[int, Any, str]]


def _kernels() -> Any:
    global _nb
    if _nb is None:
        if UNAVAILABLE_REASON:
            raise RuntimeError(UNAVAILABLE_REASON)
        with _load_lock:
            if _nb is None:
                import numba

                if getattr(numba.config, "DISABLE_JIT", False):  # fma has no pure-Python form
                    raise RuntimeError("NUMBA_DISABLE_JIT is set")
                from mergefs.methods import _numba_kernels

                _nb = _numba_kernels
    return _nb


def _usable() -> bool:
    """The kernels load (numba imports, JIT on); else, once, the reason is recorded and logged
    and the numpy path is used (a numba built for another numpy fails at import)."""
    global UNAVAILABLE_REASON
    if UNAVAILABLE_REASON:
        return False
    if _nb is not None:
        return True
    try:
        _kernels()
    except Exception as exc:  # noqa: BLE001 - any failure to load means: use numpy
        UNAVAILABLE_REASON = (f"numba is installed but unusable ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); mergefs "
                              "merges with numpy: same bytes, slower")
        note_unavailable()
        return False
    return True


_noted = False


def note_unavailable() -> None:
    """Log once per process that the numpy path is used, and why."""
    global _noted
    if UNAVAILABLE_REASON and not _noted:
        _noted = True
        log.warning("%s", UNAVAILABLE_REASON)


def available() -> bool:
    """Whether numba is installed (without importing it)."""
    return not UNAVAILABLE_REASON


def supports(form: Fused | None, src_dtypes: Sequence[str], out_dtype: str,
             numel: int) -> bool:
    """Whether :func:`fused_merge` handles this form, these source dtypes and the output for a
    unit of ``numel`` elements (waits for a warm-up in progress: :func:`start_warm_up`)."""
    if not (form is not None and out_dtype in DTYPES
            and all(d in DTYPES for d in src_dtypes)
            and (form.order == "sequential"
                 or exact.torch_sum_tail(numel, len(form.weights)) is not None)):
        return False
    _wait_for_warm_up()
    return _usable()


def _ro(buf: Any, dtype: str) -> np.ndarray:
    a = np.frombuffer(buf, dtype=_RAW[dtype])
    a.flags.writeable = False  # one array type for every buffer: fewer signatures to compile
    return a


def _decode_ref(k: Any, buf: Any, dtype: str) -> np.ndarray:
    raw = _ro(buf, dtype)
    if dtype == "F32":
        return raw
    w0 = np.empty(raw.size, np.float32)
    if dtype == "BF16":
        k.dec_bf16(raw, w0)
    else:
        k.dec_f16(raw, w0, F16_TABLE)
    w0.flags.writeable = False
    return w0


def _accumulate(k: Any, form: str, acc: np.ndarray, w0: np.ndarray, raw: np.ndarray | None,
                dtype: str, c: np.float32) -> None:
    """One input over ``acc``'s elements; ``raw`` None: the reference's values ``w0``."""
    if form == "delta":
        if raw is None or dtype == "F32":
            k.delta_f32(acc, w0, w0 if raw is None else raw, c)
        elif dtype == "BF16":
            k.delta_bf16(acc, w0, raw, c)
        else:
            k.delta_f16(acc, w0, raw, c, F16_TABLE)
    elif raw is None or dtype == "F32":
        k.fma_f32(acc, w0 if raw is None else raw, c)
    elif dtype == "BF16":
        k.fma_bf16(acc, raw, c)
    else:
        k.fma_f16(acc, raw, c, F16_TABLE)


def fused_merge(form: Fused, ref_buf: Any, ref_dtype: str, inputs: Sequence[Runs | None],
                out_dtype: str, elem_offset: int = 0, tensor_size: int = 0) -> bytes:
    """The merged bytes (``out_dtype``) of one unit.

    ``ref_buf``: the reference's (base's) bytes of the unit; ``inputs``: per input in mergekit's
    order, its planned runs (``Runs``; elements outside them hold the reference's values), or
    None for the reference's values everywhere; ``elem_offset``: where the unit starts in its
    tensor of ``tensor_size`` elements (0: the unit is the tensor; only the torch order needs
    it). Requires :func:`supports`.
    """
    data = _merge(form, ref_buf, ref_dtype, inputs, out_dtype, elem_offset, tensor_size)
    counters.add()
    return data


def _merge(form: Fused, ref_buf: Any, ref_dtype: str, inputs: Sequence[Runs | None],
           out_dtype: str, elem_offset: int = 0, tensor_size: int = 0) -> bytes:
    k = _kernels()
    w0 = _decode_ref(k, ref_buf, ref_dtype)
    n = w0.size
    acc = np.zeros(n, np.float32)  # +0.0, as the numpy kernels start
    cascade = _Cascade(k, len(form.weights)) if form.order == "torch" else None
    for i, (runs, w) in enumerate(zip(inputs, form.weights, strict=True)):
        c = np.float32(w)
        pos = 0
        for lo, buf, dtype in runs or ():
            raw = _ro(buf, dtype)
            hi = lo + raw.size
            if lo > pos:  # omitted: the reference's values
                _accumulate(k, form.form, acc[pos:lo], w0[pos:lo], None, ref_dtype, c)
            _accumulate(k, form.form, acc[lo:hi], w0[lo:hi], raw, dtype, c)
            pos = hi
        if pos < n:
            _accumulate(k, form.form, acc[pos:], w0[pos:], None, ref_dtype, c)
        if cascade is not None:
            acc = cascade.row_done(i + 1, acc)
    if cascade is not None:
        acc = cascade.total(acc, len(form.weights))
        whole = exact.torch_sum_tail(tensor_size or n, len(form.weights))
        assert whole is not None
        tail = max(whole - elem_offset, 0)  # in this unit
        if tail < n:
            acc[tail:] = _torch_tail(w0, tail, inputs, form.weights)
    div = np.float32(1 if form.divisor is None else form.divisor)
    lam = np.float32(1 if form.scale is None else form.scale)
    args = (w0, acc, div, form.divisor is not None, lam, form.scale is not None,
            form.form == "delta")
    if out_dtype == "F32":
        k.fin_f32(*args, acc)  # in place: element j is read before it is written
        out: np.ndarray = acc
    else:
        out = np.empty(n, np.uint16)
        (k.fin_bf16 if out_dtype == "BF16" else k.fin_f16)(*args, out)
    return out.tobytes()


class _Cascade:
    """The levels of torch's ``multi_row_sum`` (:func:`mergefs.methods.exact.multi_row_sum`)
    over the inputs, with the kernel's arrays: level 0 is the accumulator the inputs are added
    to. A level at +0.0 everywhere is None and ``0 + x`` is ``x`` itself: ``x`` is a sum from
    +0.0 (never -0.0, its NaNs quiet), so the copy has the bits of the addition."""

    def __init__(self, k: Any, rows: int) -> None:
        self.k = k
        self.power = exact.cascade_power(rows)
        self.levels: list[np.ndarray | None] = [None] * exact.CASCADE_LEVELS

    def row_done(self, done: int, acc: np.ndarray) -> np.ndarray:
        """After input ``done - 1`` was added to ``acc`` (level 0): the carry at the end of a
        block; returns level 0 (a fresh accumulator after a carry)."""
        if done % (1 << self.power):
            return acc
        lv = self.levels
        lv[0] = acc
        for j in range(1, exact.carry_levels(done, self.power) + 1):
            lower = lv[j - 1]
            assert lower is not None
            if lv[j] is None:
                lv[j] = lower
            else:
                self.k.add_into(lv[j], lower)
            lv[j - 1] = None
        return np.zeros(acc.size, np.float32)

    def total(self, acc: np.ndarray, rows: int) -> np.ndarray:
        """Level 0 (``acc``; +0.0 when ``rows`` ends a block) plus levels 1, 2, 3 in order."""
        total = acc if rows % (1 << self.power) else None
        for lv in self.levels[1:]:
            if lv is not None:
                if total is None:
                    total = lv
                else:
                    self.k.add_into(total, lv)
        return acc if total is None else total


def _torch_tail(w0: np.ndarray, tail: int, inputs: Sequence[Runs | None],
                weights: Sequence[float]) -> np.ndarray:
    """The input-axis sum of positions ``[tail, n)`` in torch's ``row_sum`` order (numpy: at
    most 31 elements): ``sum_k (X_k - W0) * w_k``, each operation in float32."""
    ref = w0[tail:]
    xs = []
    with np.errstate(all="ignore"):
        for runs, w in zip(inputs, weights):
            x = ref.copy()
            for lo, buf, dtype in runs or ():
                item = _RAW[dtype].itemsize
                hi = lo + len(buf) // item
                a = max(lo, tail)
                if a < hi:
                    x[a - tail:hi - tail] = decode_f32(memoryview(buf)[(a - lo) * item:], dtype)
            xs.append((x - ref) * np.float32(w))
        return exact.row_sum(xs)


_warming: threading.Thread | None = None  # start_warm_up's thread
_warming_lock = threading.Lock()


def start_warm_up(full: bool = True) -> threading.Thread:
    """Load the kernels on a background (daemon) thread, once per process, while the caller
    opens the family: :func:`warm_up` (``full``: every signature, the mount) or only numba and
    the kernel module (a merge, which compiles the few signatures it uses on first call).
    :func:`supports` waits for that thread, so a unit never starts on a kernel the warm-up is
    about to find broken: numba broken -> numpy, the same bytes, as without the thread."""
    global _warming
    with _warming_lock:
        if _warming is None:
            _warming = threading.Thread(target=warm_up if full else _usable,
                                        name="mergefs-kernels", daemon=True)
            _warming.start()
        return _warming


def _wait_for_warm_up() -> None:
    t = _warming
    if t is not None and t is not threading.current_thread():
        t.join()


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel signature now, so that the first
    unit merged does not wait for the compiler. A kernel that fails to compile turns the
    kernels off (the numpy path merges; logged once) instead of failing reads later."""
    global UNAVAILABLE_REASON
    if not _usable():
        return
    try:
        for src in DTYPES:
            b = np.zeros(4, _RAW[src]).tobytes()
            for out in DTYPES:
                for form in (Fused("delta", (0.5, 0.25), 1.5, 0.5),
                             Fused("fma", (0.5, 0.25), 0.75), Fused("delta", (0.5, 0.25)),
                             Fused("delta", (0.5, 0.25), order="torch")):
                    _merge(form, b, src, [[(0, b, src)], [(1, b[:-_RAW[src].itemsize], src)]],
                           out)
        _kernels().add_into(np.zeros(4, np.float32), np.zeros(4, np.float32))  # 17+ inputs
    except Exception as exc:  # noqa: BLE001 - a compiler failure of this numba/LLVM
        UNAVAILABLE_REASON = (f"the numba kernels failed to compile ({type(exc).__name__}); "
                              "mergefs merges with numpy: same bytes, slower")
        note_unavailable()


def index_kernels() -> Any:
    """The compiled index kernels (``idx_delta_*``, ``gram_lanes``, ``sketch_tile``, ``dec_*``
    of :mod:`mergefs.methods._numba_kernels`; what they compute: :mod:`mergefs.index.stats`), or
    None when numba cannot be used (then :mod:`mergefs.index.stats` computes the same bits with numpy,
    logged once)."""
    if _usable():
        return _kernels()
    note_unavailable()
    return None


def encode_f16(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> float16 bits into ``out`` (uint16), exactly as numpy casts."""
    _kernels().encode_f16(values, out)


def encode_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bits into ``out`` (uint16), exactly as ml_dtypes casts."""
    _kernels().encode_bf16(values, out)
