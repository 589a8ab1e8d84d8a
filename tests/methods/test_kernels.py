"""The compiled merge kernels (mergefs.methods.kernels) against the method registry, bit for bit.

Three levels: the dtype conversions against numpy/ml_dtypes on random and special bit patterns;
``fused_merge`` against the registry's own arithmetic (``Method.merge`` on the decoded unit, then
``encode``: exactly the engine's numpy path) on units full of edge values (+-0.0, NaNs of many
payloads and both signs, +-inf, subnormals, the largest finite values, values that round across
dtype boundaries, bf16 rounding ties), with partial runs, every source, mixed and output dtype,
1..4 models for task arithmetic and 1..7 for linear, normalize on and off, lambda 1 and not; and
whole merges through the engine with the kernels on and off, with a count that the kernel ran.
Where two different NaNs meet in one operation the payload is not defined (see mergefs.methods.kernels):
there both results must be NaN.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from families import make_family, write_spec

from mergefs.methods import exact, kernels
from mergefs.core.dtypes import NUMPY_DTYPES, decode_f32, encode
from mergefs.engine.session import Session
from mergefs.methods.base import Fused
from mergefs.methods import get
from mergefs.methods.base import Unit
from mergefs.spec.load import load_spec

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.UNAVAILABLE_REASON)

SPECIAL_F32 = np.array([
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC12345, 0xFFE00001,  # NaNs
    0x00000001, 0x807FFFFF, 0x00400000, 0x00010000,  # subnormals
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F000000, 0x7E800000,  # largest finite, large exponents
    0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF,  # bf16 ties (to even down, up) and around
    0x477FE000, 0x477FF000, 0x477FEFFF,  # around the f16 overflow threshold
    0x38800000, 0x33000000, 0x33000001, 0x387FC000, 0x337FFFFF,  # f16 subnormal/zero edges
], dtype=np.uint32)
_RAW = {"F32": np.uint32, "BF16": np.uint16, "F16": np.uint16}


def special_values(dtype: str) -> np.ndarray:
    """Edge bit patterns in the source dtype, as raw little-endian unsigned ints."""
    if dtype == "F32":
        return SPECIAL_F32
    with np.errstate(all="ignore"):
        raw = SPECIAL_F32.view(np.float32).astype(NUMPY_DTYPES[dtype]).view(np.uint16)
    extra = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFE01, 0x7F80, 0xFF80,
                      0x7F81, 0xFFC1, 0x0001, 0x83FF, 0x7BFF, 0x7F7F, 0xFF7F, 0x0080],
                     dtype=np.uint16)
    return np.concatenate([raw, extra])


def edge_raw(rng: np.random.Generator, dtype: str, w0: np.ndarray, share: float) -> np.ndarray:
    """Raw values of ``dtype``: ``w0`` plus a small delta (many exact zero deltas and -0.0),
    a share of elements replaced by edge bit patterns."""
    with np.errstate(all="ignore"):
        vals = w0 + rng.normal(0, 2e-4, w0.size).astype(np.float32)
        raw = vals.astype(NUMPY_DTYPES[dtype]).view(_RAW[dtype]).copy()
        same = rng.random(w0.size) < 0.2
        raw[same] = w0.astype(NUMPY_DTYPES[dtype]).view(_RAW[dtype])[same]  # zero deltas
    special = special_values(dtype)
    pos = rng.random(w0.size) < share
    raw[pos] = special[rng.integers(0, special.size, int(pos.sum()))]
    return raw


def oracle(method: str, g: dict[str, Any], per: list[dict[str, Any]], ref: bytes, ref_dtype: str,
           inputs: Sequence[Sequence[tuple[int, bytes, str]] | None], out: str
           ) -> tuple[bytes, np.ndarray]:
    """The engine's numpy path: decode, the reference's values outside runs, ``Method.merge``,
    ``encode``; and where two different non-finite values met (the NaN-payload exemption)."""
    m = get(method)
    assert m is not None
    w0 = decode_f32(ref, ref_dtype)
    values = []
    for runs in inputs:
        full = w0.copy()
        for lo, buf, dtype in runs or ():
            x = decode_f32(buf, dtype)
            full[lo:lo + x.size] = x
        values.append(full)
    base = w0 if m.caps.base.value == "required" else None
    unit = Unit(tensor="t", shape=(w0.size,), elem_offset=0, base=base, inputs=tuple(values),
                params=g, input_params=tuple(per), expert_ids=tuple(range(len(values))))
    with np.errstate(all="ignore"):
        merged = np.ascontiguousarray(m.merge(unit), dtype=np.float32)
        data = encode(merged, out)
    bits = np.stack([a.view(np.uint32) for a in (w0, *values)])
    finite = np.isfinite(np.stack([w0, *values]))
    distinct = np.zeros(w0.size, np.int64)
    for j in np.flatnonzero(~finite.all(axis=0)):
        distinct[j] = len(set(bits[~finite[:, j], j].tolist()))
    return data, distinct >= 2


def assert_same(got: bytes, want: bytes, exempt: np.ndarray, out: str) -> None:
    """Bit for bit, except that where two different non-finite values met both must be NaN."""
    g, w = np.frombuffer(got, _RAW[out]), np.frombuffer(want, _RAW[out])
    assert g.size == w.size
    differ = g != w
    bad = np.flatnonzero(differ & ~exempt)
    assert bad.size == 0, [(int(j), hex(g[j]), hex(w[j])) for j in bad[:5]]
    as_f32 = {"F32": lambda a: a.view(np.float32), "BF16": lambda a: decode_f32(a, "BF16"),
              "F16": lambda a: decode_f32(a, "F16")}[out]
    assert np.all(np.isnan(as_f32(g[differ]))) and np.all(np.isnan(as_f32(w[differ])))


# -- conversions -----------------------------------------------------------------------------------


def test_encoders_match_numpy_and_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    bits = np.concatenate([SPECIAL_F32, rng.integers(0, 2**32, 1 << 20, dtype=np.uint64)
                           .astype(np.uint32)])
    near = (np.arange(-4096, 4096, dtype=np.int64)[None, :]
            + SPECIAL_F32.astype(np.int64)[:, None]).ravel() % (1 << 32)
    f = np.concatenate([bits, near.astype(np.uint32)]).view(np.float32)
    for name, enc in (("F16", kernels.encode_f16), ("BF16", kernels.encode_bf16)):
        got = np.empty(f.size, np.uint16)
        enc(f, got)
        with np.errstate(all="ignore"):
            want = np.frombuffer(encode(f, name), np.uint16)
        assert np.array_equal(got, want), name


def test_f16_table_is_numpys_decode() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(kernels.F16_TABLE.view(np.uint32),
                          decode_f32(every.tobytes(), "F16").view(np.uint32))


# -- one unit against the registry -----------------------------------------------------------------

def _case(rng: np.random.Generator, method: str, n: int, ref_dtype: str, src: Sequence[str],
          size: int, share: float, partial: bool
          ) -> tuple[bytes, list[list[tuple[int, bytes, str]] | None]]:
    w0 = rng.normal(0, 0.02, size).astype(np.float32)
    w0[rng.random(size) < 0.05] = np.float32(-0.0)
    with np.errstate(all="ignore"):
        ref_raw = w0.astype(NUMPY_DTYPES[ref_dtype]).view(_RAW[ref_dtype]).copy()
    special = special_values(ref_dtype)
    pos = rng.random(size) < share
    ref_raw[pos] = special[rng.integers(0, special.size, int(pos.sum()))]
    w0 = decode_f32(ref_raw.tobytes(), ref_dtype)
    inputs: list[list[tuple[int, bytes, str]] | None] = []
    for k in range(n):
        if partial and k == n - 1 and n > 1:
            inputs.append(None)  # the reference's values (an input the plan never reads)
            continue
        raw = edge_raw(rng, src[k], w0, share)
        if not partial:
            inputs.append([(0, raw.tobytes(), src[k])])
            continue
        cuts = np.sort(rng.choice(np.arange(1, size), size=4, replace=False))
        inputs.append([(int(a), raw[a:b].tobytes(), src[k])  # two runs, gaps around them
                       for a, b in ((cuts[0], cuts[1]), (cuts[2], cuts[3]))])
    return ref_raw.tobytes(), inputs


def _params(rng: np.random.Generator, method: str, n: int, normalize: bool, lam: float,
            big: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    w = rng.uniform(-1.0, 1.5, n) * (3e4 if big else 1.0)
    per = [{"weight": float(x)} for x in w]
    if method == "linear":
        return {"normalize": normalize}, per
    return {"normalize": normalize, "lambda": lam, "rescale": False, "int8_mask": False}, per


@pytest.mark.parametrize("method, n", [("task_arithmetic", n) for n in (1, 2, 3, 4)]
                         + [("linear", n) for n in (1, 2, 3, 5, 7, 8, 17, 32)])
def test_fused_merge_equals_registry(method: str, n: int) -> None:
    rng = np.random.default_rng(100 * n + len(method))
    dtypes = list(kernels.DTYPES)
    checked = exempted = 0
    for ref_dtype in dtypes:
        for out in dtypes:
            for variant in range(4):
                normalize, lam = variant & 1 == 1, (1.0, 0.7)[variant >> 1]
                # experts in the reference's dtype, or mixed (each a random dtype)
                src = [ref_dtype] * n if variant < 2 else list(rng.choice(dtypes, n))
                g, per = _params(rng, method, n, normalize, lam, big=variant == 3)
                if method == "linear" and normalize and sum(p["weight"] for p in per) == 0:
                    continue
                form = get(method).fused(g, per)  # type: ignore[union-attr]
                assert form is not None
                for share, partial, size in ((0.0, False, 4099), (0.25, True, 3001),
                                             (0.6, False, 257)):
                    ref, inputs = _case(rng, method, n, ref_dtype, src, size, share, partial)
                    want, exempt = oracle(method, g, per, ref, ref_dtype, inputs, out)
                    got = kernels.fused_merge(form, ref, ref_dtype, inputs, out)
                    assert_same(got, want, exempt, out)
                    checked += size
                    exempted += int(exempt.sum())
    # the exemption covers only NaN meetings (more inputs: more elements where two meet)
    assert exempted < checked // (10 if n <= 7 else 4)


def _torch_case(rng: np.random.Generator, n: int, numel: int, ref_dtype: str, out: str,
                lam: float, normalize: bool = False) -> None:
    """The kernel's torch-order form against the registry's torch path (``_merge_torch``)."""
    from mergefs.methods import gta

    per = [{"weight": float(w)} for w in rng.uniform(-1.0, 1.5, n)]
    g = {"normalize": normalize, "lambda": lam, "rescale": False, "int8_mask": False}
    form = get("task_arithmetic").fused(g, per)  # type: ignore[union-attr]
    assert form is not None and form.order == "torch"
    src = list(rng.choice(list(kernels.DTYPES), n))
    ref, inputs = _case(rng, "task_arithmetic", n, ref_dtype, src, numel, 0.02, numel > 8)
    w0 = decode_f32(ref, ref_dtype)
    values = []
    for runs in inputs:
        full = w0.copy()
        for lo, buf, dtype in runs or ():
            x = decode_f32(buf, dtype)
            full[lo:lo + x.size] = x
        values.append(full)
    unit = Unit(tensor="t", shape=(numel,), elem_offset=0, base=w0, inputs=tuple(values),
                params=g, input_params=tuple(per), expert_ids=tuple(range(n)))
    with np.errstate(all="ignore"):
        want = encode(np.ascontiguousarray(gta._merge_torch(unit, None, False).numpy()), out)
    _, exempt = oracle("task_arithmetic", {**g, "lambda": 1.0}, per, ref, ref_dtype, inputs, out)
    assert kernels.supports(form, [ref_dtype, *src], out, numel)
    assert_same(kernels.fused_merge(form, ref, ref_dtype, inputs, out), want, exempt, out)


@pytest.mark.parametrize("n", [5, 6, 8, 15, 16, 17, 24, 31, 32, 33, 48, 64, 65])
def test_torch_order_slices_equal_torch_on_whole_tensors(n: int) -> None:
    """5-65 models in block units: the registry's numpy path and the kernel, slice by slice
    (``elem_offset``, ``tensor_size``), equal torch's merge of the whole tensor."""
    pytest.importorskip("torch")
    from mergefs.methods import gta

    rng = np.random.default_rng(50 + n)
    m = get("task_arithmetic")
    assert m is not None and m.elementwise(n, {"normalize": False, "lambda": 1.0})
    for numel in (7, 40, 4099 + 32 * 7):
        per = [{"weight": float(w)} for w in rng.uniform(-1.0, 1.5, n)]
        g = {"normalize": numel == 40, "lambda": 0.9, "rescale": False, "int8_mask": False}
        ref, inputs = _case(rng, "task_arithmetic", n, "BF16", ["BF16"] * n, numel, 0.0, False)
        w0 = decode_f32(ref, "BF16")
        xs = [decode_f32(r[0][1], "BF16") if r else w0 for r in inputs]
        whole = Unit(tensor="t", shape=(numel,), elem_offset=0, base=w0, inputs=tuple(xs),
                     params=g, input_params=tuple(per), expert_ids=tuple(range(n)))
        want = gta._merge_torch(whole, None, False).numpy().view(np.uint32)
        cuts = sorted({0, numel, *rng.integers(1, numel, 3).tolist(), numel - 5, numel - 33})
        form = m.fused(g, per)
        assert form is not None
        for a, b in itertools.pairwise(cuts):
            if not 0 <= a < b:
                continue
            part = Unit(tensor="t", shape=(b - a,), elem_offset=a, base=w0[a:b],
                        inputs=tuple(x[a:b] for x in xs), params=g, input_params=tuple(per),
                        expert_ids=tuple(range(n)), tensor_size=numel)
            got = np.asarray(m.merge(part), dtype=np.float32).view(np.uint32)
            assert np.array_equal(got, want[a:b]), (numel, a, b)
            fused = kernels.fused_merge(form, ref[2 * a:2 * b], "BF16",
                                        [[(0, r[0][1][2 * a:2 * b], "BF16")] if r else None
                                         for r in inputs], "F32", a, numel)
            assert np.frombuffer(fused, np.uint32).tolist() == want[a:b].tolist(), (a, b)


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 15, 16, 17, 24, 32, 33])
def test_torch_order_form_equals_registry_torch_path(n: int) -> None:
    """5..33 models: whole tensors through torch; sizes around every group, vector and thread
    split boundary of torch's sum (multi-threaded from 32768 * n elements)."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(n)
    sizes = [2, 3, 5, 7, 8, 9, 31, 32, 33, 63, 95, 4099, 16417, 65536 + 40]
    for k, numel in enumerate(sizes):
        _torch_case(rng, n, numel, kernels.DTYPES[k % 3], kernels.DTYPES[(k // 3) % 3],
                    (1.0, 0.7)[k % 2], normalize=k % 3 == 1)


def test_torch_sum_model_equals_torch() -> None:
    """exact.torch_sum_tail and row_sum against torch's own stack(...).sum(dim=0), on values
    where input order and row_sum order give different sums, at every position."""
    torch = pytest.importorskip("torch")
    from mergefs.methods import exact

    rng = np.random.default_rng(1)
    for n in (*range(5, 70), 100, 255, exact.TORCH_SUM_MAX):
        for numel in (2, 4, 6, 7, 8, 12, 31, 33, 40, 100, 1000) + ((40000 + 24,) * (n < 34)):
            xs = rng.normal(size=(n, numel)).astype(np.float32) * \
                np.exp2(rng.integers(-20, 20, size=(n, numel))).astype(np.float32)
            want = torch.from_numpy(xs).sum(dim=0).numpy()
            tail = exact.torch_sum_tail(numel, n)
            assert tail is not None
            got = np.concatenate([exact.multi_row_sum(list(xs[:, :tail])),
                                  exact.row_sum(list(xs[:, tail:]))])
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, numel)
    assert exact.torch_sum_tail(1, 8) is None
    assert exact.torch_sum_tail(100, exact.TORCH_SUM_MAX + 1) is None


def test_fused_forms_are_declared_only_where_exact() -> None:
    """The registry declares a kernel form only where its numpy kernel is the arithmetic."""
    ta, lin = get("task_arithmetic"), get("linear")
    assert ta is not None and lin is not None
    g = {"normalize": False, "lambda": 1.0, "rescale": False, "int8_mask": False}
    assert ta.fused(g, [{"weight": 0.5}] * 4) == Fused("delta", (0.5,) * 4)
    assert ta.fused(g, [{"weight": 0.5}] * 5) == Fused("delta", (0.5,) * 5, order="torch")
    assert ta.fused({**g, "normalize": True}, [{"weight": 0.5}] * 5) == \
        Fused("delta", (0.5,) * 5, 2.5, order="torch")
    for n in (16, 17, 32, exact.TORCH_SUM_MAX):  # torch's cascade levels, modelled
        assert ta.fused(g, [{"weight": 0.5}] * n) == Fused("delta", (0.5,) * n, order="torch")
    assert ta.fused(g, [{"weight": 0.5}] * (exact.TORCH_SUM_MAX + 1)) is None
    assert lin.fused({"normalize": True}, [{"weight": 0.5}] * 7) == \
        Fused("fma", (0.5,) * 7, 3.5)
    assert lin.fused({"normalize": True}, [{"weight": 0.5}] * 33) == \
        Fused("fma", (0.5,) * 33, 16.5)
    for name in ("ties", "dare_linear", "dare_ties", "breadcrumbs", "della", "slerp", "karcher"):
        m = get(name)
        assert m is not None
        params = {p.name: p.default for p in m.global_params if not p.required}
        assert m.fused({**params, "normalize": False, "lambda": 1.0},
                       [{"weight": 0.5, "density": 0.5}] * 2) is None, name


# -- whole merges through the engine ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_engine_uses_the_kernel_and_equals_numpy(dtype: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fam = make_family(tmp_path / "fam", n_experts=3, dtype=dtype, seed=7)  # type: ignore[arg-type]
    cases = [("task_arithmetic", {"lambda": 0.9}, {}),
             ("linear", {}, {}),
             ("task_arithmetic", {"normalize": True}, {"dtype": "float16"}),
             ("linear", {"normalize": False}, {"dtype": "bfloat16", "budget": "40%"})]
    for k, (method, params, extra) in enumerate(cases):
        spec = write_spec(tmp_path / f"s{k}.yaml", fam, method, [0.6, -0.3, 0.45], params,
                          {"block_size": "4KiB", "index_dir": str(tmp_path / "idx"), **extra})
        before = kernels.counters.units
        fast = Session(load_spec(spec))
        try:
            got = fast.engine.materialise(tmp_path / f"fast{k}")
            used, merged = fast.engine.units_fused, fast.engine.units_merged
            # the kernel merged every unit but the base's own bytes (none fell back silently)
            assert used > 0 and kernels.counters.units - before == used
            assert used == merged - _base_only_units(fast), (method, used, merged)
        finally:
            fast.close()
        with monkeypatch.context() as mp:
            mp.setattr(kernels, "UNAVAILABLE_REASON", "disabled by the test")
            slow = Session(load_spec(spec))
            try:
                want = slow.engine.materialise(tmp_path / f"slow{k}")
                assert slow.engine.units_fused == 0
            finally:
                slow.close()
        assert got == want, method
        for f in (tmp_path / f"slow{k}").glob("*.safetensors"):
            assert f.read_bytes() == (tmp_path / f"fast{k}" / f.name).read_bytes()


def test_engine_six_models_in_torch_order(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """6 models (block units, torch's sum order): kernel on and off give the same bytes."""
    pytest.importorskip("torch")
    fam = make_family(tmp_path / "fam", n_experts=6, dtype="bfloat16", seed=11)
    spec = write_spec(tmp_path / "s.yaml", fam, "task_arithmetic",
                      [0.3, 0.61, -0.42, 0.73, 0.54, 0.34], {"lambda": 0.8},
                      {"block_size": "4KiB", "index_dir": str(tmp_path / "idx"),
                       "budget": "60%"})
    outs = {}
    for mode in ("kernel", "numpy"):
        with monkeypatch.context() as mp:
            if mode == "numpy":
                mp.setattr(kernels, "UNAVAILABLE_REASON", "disabled by the test")
            s = Session(load_spec(spec))
            try:
                outs[mode] = s.engine.materialise(tmp_path / mode)
                fused = s.engine.units_fused
                assert (fused > 0) == (mode == "kernel")
                if mode == "kernel":
                    assert fused == s.engine.units_merged - _base_only_units(s)
            finally:
                s.close()
    assert outs["kernel"] == outs["numpy"]


def _base_only_units(s: Session) -> int:
    """Units of the materialised merge that are the base's bytes (no expert read, and
    ``W0 + 0`` is ``W0``): the only ones the engine merges without any kernel."""
    e = s.engine
    count = 0
    for f in e.out_files:
        for t in f.tensors:
            if t.layout_index is None:
                continue
            for b0, b1 in e.units(t.name, 1 << 20):
                if any(row[b0:b1].any() for row in e.plan.selected):
                    continue
                rng = e._range(e.base, t.name, int(e.layout.elem_start[b0]),
                               int(e.layout.elem_end[b1 - 1]))
                buf = e.base.read_ranges([rng])[0]
                count += e._unread_is_base(e.base.tensors[t.name].dtype, t.dtype, buf)
    return count


def test_merges_without_numba(tmp_path: Path) -> None:
    """numba is optional: with its import blocked, the numpy path gives the same bytes."""
    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=3)
    spec = write_spec(tmp_path / "s.yaml", fam, "task_arithmetic", [0.7, 0.4], None,
                      {"block_size": "4KiB", "index_dir": str(tmp_path / "idx")})
    code = ("import sys; sys.modules['numba'] = None\n"
            "from mergefs import cli; from mergefs.methods import kernels\n"
            "assert not kernels.available()\n"
            "rc = cli.main(['merge', sys.argv[1], sys.argv[2]])\n"
            "assert 'numba' not in sys.modules or sys.modules['numba'] is None\n"
            "assert kernels.counters.units == 0\n"
            "sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, str(spec), str(tmp_path / "np")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "numba is not installed" in res.stderr
    session = Session(load_spec(spec))
    try:
        session.engine.materialise(tmp_path / "nb")
        assert session.engine.units_fused > 0
    finally:
        session.close()
    for f in (tmp_path / "np").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "nb" / f.name).read_bytes()


def test_a_numba_that_fails_to_import_falls_back_to_numpy(tmp_path: Path) -> None:
    """numba installed but broken (built for another numpy: its import raises): the merge runs
    on numpy with the same bytes, saying why once (review finding: merge crashed, mount EIO)."""
    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=4)
    spec = write_spec(tmp_path / "s.yaml", fam, "task_arithmetic", [0.7, 0.4], None,
                      {"block_size": "4KiB", "index_dir": str(tmp_path / "idx")})
    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def fake(name, *a, **k):\n"
            "    if name == 'numba' or name.startswith('numba.'):\n"
            "        raise ImportError('Numba needs NumPy 2.2 or less (simulated)')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = fake\n"
            "from mergefs import cli; from mergefs.methods import kernels\n"
            "rc = cli.main(['merge', sys.argv[1], sys.argv[2]])\n"
            "assert kernels.counters.units == 0\n"
            "sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, str(spec), str(tmp_path / "np")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("numba is installed but unusable (ImportError") == 1
    from mergefs import cli

    assert cli.main(["merge", str(spec), str(tmp_path / "nb")]) == 0
    assert kernels.counters.units > 0  # here, the kernel ran
    for f in (tmp_path / "np").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "nb" / f.name).read_bytes()
