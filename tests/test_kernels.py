"""The compiled kernels (mergefs.kernels) against the numpy path, bit for bit.

Three levels: the dtype conversions against numpy/ml_dtypes on random and special bit patterns;
``fused_additive`` against the numpy arithmetic of ``Engine.merge_unit`` on units full of edge
values (+-0.0, NaNs of many payloads and both signs, +-inf, subnormals, the largest finite
values, values that round across dtype boundaries) with overlapping partial expert runs; and
whole merges (every unit, linear and task arithmetic, every source and output dtype, partial
and full budget) with the kernels on and off, plus the numpy reference of tests/reference.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from families import Family, write_spec
from reference import reference_merge_dir
from safetensors.numpy import save_file

from mergefs import kernels
from mergefs.dtypes import NUMPY_DTYPES, decode_f32, encode
from mergefs.engine import Engine, Session
from mergefs.spec import load_spec

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.UNAVAILABLE_REASON)

SPECIAL_F32 = np.array([
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC12345, 0xFFE00001,  # NaNs
    0x00000001, 0x807FFFFF, 0x00400000,  # subnormals
    0x7F7FFFFF, 0xFF7FFFFF,  # largest finite
    0x3F808000, 0x3F818000, 0x3F80C000,  # bf16 ties (to even down, to even up) and above
    0x477FE000, 0x477FF000, 0x477FEFFF,  # around the f16 overflow threshold
    0x38800000, 0x33000000, 0x33000001, 0x387FC000, 0x337FFFFF,  # f16 subnormal/zero edges
], dtype=np.uint32)


def special_values(dtype: str) -> np.ndarray:
    """Edge bit patterns in the source dtype, as raw little-endian unsigned ints."""
    if dtype == "F32":
        return SPECIAL_F32
    f = SPECIAL_F32.view(np.float32)
    with np.errstate(all="ignore"):
        raw = f.astype(NUMPY_DTYPES[dtype]).view(np.uint16)
    extra = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFE01, 0x7F80, 0xFF80,
                      0x7F81, 0xFFC1, 0x0001, 0x83FF, 0x7BFF, 0x7F7F], dtype=np.uint16)
    return np.concatenate([raw, extra])


def random_unit(rng: np.random.Generator, dtype: str, n: int, edge_share: float) -> bytes:
    """n values of ``dtype``: mostly N(0, 0.02), a share of them edge bit patterns."""
    vals = rng.normal(0, 0.02, n).astype(np.float32)
    with np.errstate(all="ignore"):
        raw = vals.astype(NUMPY_DTYPES[dtype]).view(np.uint32 if dtype == "F32" else np.uint16)
    raw = raw.copy()
    special = special_values(dtype)
    k = int(n * edge_share)
    pos = rng.choice(n, size=k, replace=False)
    raw[pos] = special[rng.integers(0, special.size, k)]
    raw[: special.size] = special[: min(n, special.size)]  # every pattern at least once
    return raw.tobytes()


def numpy_additive(base_buf: bytes, expert_runs: list[list[tuple[int, bytes]]],
                   coeffs: list[float], base_scale: float, src: str, out: str
                   ) -> tuple[bytes, np.ndarray]:
    """The numpy arithmetic of ``Engine.merge_unit`` for additive methods, as written there;
    and where two NaNs met in an addition (numpy's payload there depends on the element's
    position: see mergefs.kernels)."""
    w0 = decode_f32(base_buf, src)
    acc = np.zeros_like(w0)
    both_nan = np.zeros(w0.size, bool)
    for i, runs in enumerate(expert_runs):
        for lo, buf in runs:
            wi = decode_f32(buf, src)
            wi -= w0[lo:lo + wi.size]
            wi *= np.float32(coeffs[i])
            both_nan[lo:lo + wi.size] |= np.isnan(acc[lo:lo + wi.size]) & np.isnan(wi)
            acc[lo:lo + wi.size] += wi
    scaled = w0 if np.float32(base_scale) == 1 else np.float32(base_scale) * w0
    both_nan |= np.isnan(scaled) & np.isnan(acc)
    if np.float32(base_scale) == 1:
        merged = np.add(w0, acc, out=acc)
    else:
        merged = np.float32(base_scale) * w0 + acc
    return encode(merged, out), both_nan


def assert_same(got: bytes, want: bytes, both_nan: np.ndarray, out: str) -> None:
    """Bit for bit, except that where two NaNs met both must be NaN."""
    dt = NUMPY_DTYPES[out]
    g, w = np.frombuffer(got, dt), np.frombuffer(want, dt)
    raw = np.uint32 if out == "F32" else np.uint16
    differ = g.view(raw) != w.view(raw)
    assert not np.any(differ & ~both_nan), np.flatnonzero(differ & ~both_nan)[:5]
    assert np.all(np.isnan(g[differ].astype(np.float32)))
    assert np.all(np.isnan(w[differ].astype(np.float32)))


# -- conversions -----------------------------------------------------------------------------------


def test_encoders_match_numpy_and_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    bits = np.concatenate([SPECIAL_F32, rng.integers(0, 2**32, 1 << 20, dtype=np.uint64)
                           .astype(np.uint32)])
    # every float32 within 2**12 ulps of each f16/bf16 rounding boundary region, too
    near = (np.arange(-4096, 4096, dtype=np.int64)[None, :]
            + SPECIAL_F32.astype(np.int64)[:, None]).ravel() % (1 << 32)
    f = np.concatenate([bits, near.astype(np.uint32)]).view(np.float32)
    for name, enc in (("F16", kernels.encode_f16), ("BF16", kernels.encode_bf16)):
        got = np.empty(f.size, np.uint16)
        enc(f, got)
        with np.errstate(all="ignore"):
            want = np.frombuffer(encode(f, name), np.uint16)
        assert np.array_equal(got, want), name


def test_f16_decode_table_is_numpy() -> None:
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(kernels.F16_TABLE.view(np.uint32),
                          h.view(np.float16).astype(np.float32).view(np.uint32))


# -- one unit ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("out", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("base_scale", [1.0, 0.7])
def test_fused_additive_equals_numpy_on_edge_values(src: str, out: str,
                                                    base_scale: float) -> None:
    rng = np.random.default_rng([ord(src[1]), ord(out[1]), int(base_scale * 10)])
    for trial in range(6):
        n = int(rng.integers(1, 5000))
        base = random_unit(rng, src, n, edge_share=0.2)
        coeffs = [float(c) for c in rng.choice([0.3, -0.61, 0.0, 1.0, 2.5e-3, -1e30], 4)]
        runs: list[list[tuple[int, bytes]]] = []
        for _ in coeffs:
            pieces = []
            edges = np.sort(rng.choice(n + 1, size=min(n + 1, 6), replace=False))
            for a, b in zip(edges[::2], edges[1::2]):
                if b > a and rng.random() < 0.8:
                    pieces.append((int(a), random_unit(rng, src, int(b - a), 0.2)))
            runs.append(pieces)
        if trial == 0:
            runs[0] = [(0, random_unit(rng, src, n, 0.5))]  # one expert covering the unit
        with np.errstate(all="ignore"):
            want, both_nan = numpy_additive(base, runs, coeffs, base_scale, src, out)
            got = kernels.fused_additive(memoryview(base),
                                         [[(lo, memoryview(b)) for lo, b in r] for r in runs],
                                         coeffs, base_scale, src, out)
        assert len(got) == len(want) == n * (4 if out == "F32" else 2)
        assert_same(got, want, both_nan, out)
        if not both_nan.any():
            assert got == want


def test_nan_payloads_and_signed_zeros_survive_like_numpy() -> None:
    """Operand order: a NaN in the base copied by the experts keeps its payload; -0.0 + -0.0
    is -0.0 and -0.0 + +0.0 is +0.0; inf - inf is the default NaN; where two different NaNs
    meet, the first operand's (numpy's vector loop) is kept."""
    b = np.array([0x7FC00001, 0x80000000, 0x80000000, 0xFFC00002, 0x7F800000, 0x7FC00007],
                 np.uint32)
    e1 = np.array([0x7FC00001, 0x80000000, 0x00000000, 0xFFC00002, 0xFF800000, 0x3F800000],
                  np.uint32)
    e2 = np.array([0x7FC00001, 0x80000000, 0x80000000, 0xFFC00002, 0x7F800000, 0x3F800000],
                  np.uint32)
    runs = [[(0, e1.tobytes())], [(0, e2.tobytes())]]
    for coeffs in ([0.5, -0.25], [-1.0, 0.0]):
        for scale in (1.0, -0.5):
            with np.errstate(all="ignore"):
                want, _ = numpy_additive(b.tobytes(), runs, coeffs, scale, "F32", "F32")
                got = kernels.fused_additive(b.tobytes(), runs, coeffs, scale, "F32", "F32")
            assert got == want
    # two different NaN payloads meeting: the first operand's, quietened, every time
    e3 = np.full(40, 0x7F800001, np.uint32)  # signalling
    e4 = np.full(40, 0xFFC00004, np.uint32)
    base = np.zeros(40, np.uint32)
    with np.errstate(all="ignore"):
        got = kernels.fused_additive(base.tobytes(), [[(0, e3.tobytes())], [(0, e4.tobytes())]],
                                     [1.0, 1.0], 1.0, "F32", "F32")
    assert set(np.frombuffer(got, np.uint32).tolist()) == {0x7FC00001}


# -- whole merges ----------------------------------------------------------------------------------


def edge_family(root: Path, dtype: str, n_experts: int = 3) -> Family:
    """A one-file family full of edge values. The base has them at elements ``k`` with
    ``k % (n + 1) == 0`` (experts keep most of those, NaNs included, or overwrite them), expert
    ``i`` its own at ``k % (n + 1) == i + 1``: so two different NaN payloads never meet in one
    addition (see mergefs.kernels), and every output must be bit-identical."""
    rng = np.random.default_rng(7)
    np_dtype = NUMPY_DTYPES[dtype]
    raw_t = np.uint32 if dtype == "F32" else np.uint16
    special = special_values(dtype)
    shapes = {"a.weight": (64, 96), "b.weight": (300,), "c.bias": (17,)}
    models: list[dict[str, np.ndarray]] = [{} for _ in range(n_experts + 1)]
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        slot = np.arange(n) % (n_experts + 1)
        base = np.frombuffer(random_unit(rng, dtype, n, 0.0), raw_t).copy()
        base[slot == 0] = special[rng.integers(0, special.size, int((slot == 0).sum()))]
        models[0][name] = base
        for i in range(1, n_experts + 1):
            e = base.copy()
            change = (rng.random(n) < 0.7) & (slot != 0)
            e[change] = np.frombuffer(random_unit(rng, dtype, int(change.sum()), 0.0), raw_t)
            mine = slot == i
            e[mine] = special[rng.integers(0, special.size, int(mine.sum()))]
            over = (slot == 0) & (rng.random(n) < 0.2)  # some base edge values overwritten
            e[over] = np.frombuffer(random_unit(rng, dtype, int(over.sum()), 0.0), raw_t)
            models[i][name] = e
    dirs = []
    for k, tensors in enumerate(models):
        d = root / ("base" if k == 0 else f"expert-{k - 1}")
        d.mkdir(parents=True, exist_ok=True)
        save_file({name: arr.view(np_dtype).reshape(shapes[name])
                   for name, arr in tensors.items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({"model_type": "edge"}))
        dirs.append(d)
    return Family(base=dirs[0], experts=dirs[1:], root=root,
                  dtype={"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
                  tensor_names=sorted(shapes))


def all_units(session: Session, use_kernels: bool) -> dict[tuple[str, int, int], bytes]:
    eng = session.engine
    eng.use_kernels = use_kernels
    out = {}
    for t in eng.out_tensors.values():
        if t.layout_index is None:
            continue
        for b0, b1 in eng.units(t.name, 1 << 12):
            with np.errstate(all="ignore"):
                out[(t.name, b0, b1)] = eng.merge_unit(t.name, b0, b1)
    return out


@pytest.mark.parametrize("fam_name", ["family_f32", "family_f16", "family_bf16",
                                      "family_sharded", "edge_f32", "edge_f16", "edge_bf16"])
@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_engine_kernels_equal_numpy_every_unit(request: pytest.FixtureRequest, tmp_path: Path,
                                               tmp_path_factory: pytest.TempPathFactory,
                                               fam_name: str, method: str) -> None:
    if fam_name.startswith("edge_"):
        fam = edge_family(tmp_path_factory.mktemp(fam_name), fam_name[5:].upper())
    else:
        fam = request.getfixturevalue(fam_name)
    n = len(fam.experts)
    weights = [0.5, -0.3, 0.8][:n]
    params = {"lambda": 0.7} if method == "task_arithmetic" else {"normalize": False}
    for out_dtype in (None, "float32", "float16", "bfloat16"):
        for budget in ("40%", "full"):
            extra = {"block_size": 512, "index_dir": str(tmp_path / "idx"), "budget": budget}
            if out_dtype:
                extra["dtype"] = out_dtype
            spec = write_spec(tmp_path / f"spec-{out_dtype}-{budget}.yaml", fam, method,
                              weights=weights, parameters=params, extra=extra)
            session = Session(load_spec(spec))
            try:
                fast = all_units(session, True)
                slow = all_units(session, False)
            finally:
                session.close()
            assert fast.keys() == slow.keys() and fast
            bad = [k for k in fast if fast[k] != slow[k]]
            assert not bad, (out_dtype, budget, bad[:3])


def test_full_merge_with_kernels_equals_reference(tmp_path: Path, family_bf16: Family) -> None:
    """The materialised merge (kernels on) against tests/reference.py, the independent oracle."""
    spec = write_spec(tmp_path / "spec.yaml", family_bf16, "task_arithmetic",
                      weights=[0.5, -0.3, 0.8], parameters={"lambda": 0.7},
                      extra={"block_size": 512, "index_dir": str(tmp_path / "idx"),
                             "dtype": "bfloat16"})
    assert Engine.use_kernels
    session = Session(load_spec(spec))
    try:
        session.engine.materialise(tmp_path / "out")
    finally:
        session.close()
    ref = reference_merge_dir(spec)
    from safetensors.numpy import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, arr in ref.items():
        assert got[name].tobytes() == np.asarray(arr).tobytes(), name


def test_bf16_kernel_matches_ml_dtypes_rounding_exhaustively_near_ties() -> None:
    """Every float32 whose low 16 bits are 0x7fff, 0x8000 or 0x8001 (the ties and their
    neighbours), for a spread of high halves."""
    hi = np.arange(0, 1 << 16, 7, dtype=np.uint32) << np.uint32(16)
    f = (hi[:, None] + np.array([0x7FFF, 0x8000, 0x8001], np.uint32)[None, :]).ravel() \
        .view(np.float32)
    got = np.empty(f.size, np.uint16)
    kernels.encode_bf16(f, got)
    with np.errstate(all="ignore"):
        want = f.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(got, want)
