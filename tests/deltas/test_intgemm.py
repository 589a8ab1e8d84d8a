"""The exact low-rank product on oneDNN's int8 matmul (:mod:`mergefs.deltas.intgemm`, issue 14): the
same integers as the float32 product, exactly, for codes of every width (8-bit ones by their
bias), weights needing one to three base-256 digits, and any number of rows; and the route
stays off where it would not be exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergefs.deltas import intgemm

needs_route = pytest.mark.skipif(not intgemm.available(),
                                 reason="this CPU has neither AMX nor VNNI: no oneDNN route")


def _case(seed: int, rows: int, widths: list[int], cols: int, shape: str):
    """Codes at ``widths`` and integer weights at the largest scale the exact grid allows
    (``sum_c (2**bits_c - 1) max|W_c| < 2**23``), the leading rows largest (``shape``
    ``decay``), all equal (``flat``), or a few huge (``spiky``)."""
    rng = np.random.default_rng(seed)
    bits = np.asarray(widths)
    top = (1 << bits) - 1
    codes = rng.integers(0, top + 1, size=(rows, len(bits)))
    if rows > 2:
        codes[0], codes[1] = top, 0  # the extremes of every column
    budget = ((1 << 23) - 1) // int(top.sum())
    if shape == "decay":
        peak = budget * 2.0 ** -np.arange(len(bits))
    elif shape == "flat":
        peak = np.full(len(bits), float(budget))
    else:
        peak = np.where(rng.random(len(bits)) < 0.2, budget, 3.0)
    w = np.rint(rng.uniform(-1, 1, (len(bits), cols)) * peak[:, None])
    w[:, 0] = np.floor(peak)  # the peak itself
    return codes, bits, w.astype(np.float32)


@needs_route
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 300),
       st.lists(st.sampled_from([2, 3, 4, 8]), min_size=1, max_size=40), st.integers(1, 70),
       st.sampled_from(["decay", "flat", "spiky"]))
def test_product_equals_the_integer_product(seed, rows, widths, cols, shape) -> None:
    codes, bits, w = _case(seed, rows, widths, cols, shape)
    q = 2 * codes.astype(np.int64) - ((1 << bits) - 1)
    want = q @ w.astype(np.int64)
    assert np.abs(want).max() < 1 << 24
    iw = intgemm.prepare(w, bits == 8)
    got = intgemm.product(intgemm.to_x(codes, bits), iw)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.astype(np.int64), want)
    # the float32 BLAS product the other route computes: the same bits
    assert np.array_equal(got.view(np.uint32), (q.astype(np.float32) @ w).view(np.uint32))


@needs_route
def test_digits_hold_only_the_rows_that_need_them() -> None:
    """Weights of three digits in the leading row only: the higher digits' products have one
    column of x, not all of them."""
    _, bits, w = _case(7, 50, [2] * 30, 20, "decay")
    iw = intgemm.prepare(w, bits == 8)
    assert iw.ndig == 3
    sizes = [len(d.rows) if d.rows is not None else len(bits) for d in iw.digits]
    assert sizes[0] < sizes[1] <= sizes[2] == len(bits), sizes
    assert iw.digits[0].rows is not None and 0 in iw.digits[0].rows


def test_route_off_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERGEFS_EXACT_GEMM", "blas")
    assert intgemm._decide() is False


def test_a_failing_self_check_turns_the_route_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN build whose products are not exact (here: off by one) is never used."""
    monkeypatch.setenv("MERGEFS_EXACT_GEMM", "onednn")
    real = intgemm.product
    monkeypatch.setattr(intgemm, "product", lambda x, iw: real(x, iw) + np.float32(1))
    assert intgemm._decide() is False


def test_product_refuses_a_mismatched_x() -> None:
    if not intgemm.available():
        pytest.skip("no oneDNN route")
    iw = intgemm.prepare(np.ones((4, 3), np.float32), np.zeros(4, bool))
    with pytest.raises(ValueError, match="columns"):
        intgemm.product(np.zeros((2, 5), np.uint8), iw)


def test_the_route_waits_for_torch_or_enough_blas_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch imported, the decoder keeps the BLAS until it has done SWITCH_MACS
    multiply-adds (importing torch costs about a second); with torch imported, at once."""
    import sys

    from mergefs.deltas import decode as deltadecode

    if not intgemm.available():
        pytest.skip("no oneDNN route on this CPU")
    monkeypatch.setattr(deltadecode, "_blas_macs", [0])
    assert deltadecode._int_route() is intgemm  # torch is imported in this process
    monkeypatch.delitem(sys.modules, "torch")
    assert deltadecode._int_route() is None
    monkeypatch.setattr(deltadecode, "_blas_macs", [deltadecode.SWITCH_MACS])
    assert deltadecode._int_route() is intgemm


def test_products_leave_other_threads_thread_counts_alone() -> None:
    """A product runs oneDNN on one thread of the calling thread only: threads started while
    (or after) worker threads multiply keep torch's default count."""
    import threading

    import torch

    if not intgemm.available():
        pytest.skip("no oneDNN route on this CPU")
    default = torch.get_num_threads()
    if default == 1:
        pytest.skip("torch runs one thread here anyway")
    codes, bits, w = _case(3, 200, [2] * 64, 96, "flat")
    iw = intgemm.prepare(w, bits == 8)
    x = intgemm.to_x(codes, bits)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            intgemm.product(x, iw)

    workers = [threading.Thread(target=work) for _ in range(2)]
    for t in workers:
        t.start()
    seen: list[int] = []
    try:
        for _ in range(50):
            probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            probe.start()
            probe.join()
    finally:
        stop.set()
        for t in workers:
            t.join()
    assert seen == [default] * 50
    assert torch.get_num_threads() == default
