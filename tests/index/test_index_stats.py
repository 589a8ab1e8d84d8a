"""The index's summation order (mergefs.index.stats): the compiled kernel and the numpy path both
equal a plain reference of the documented order, bit for bit, over dtypes, edge values and
block sizes that are not multiples of the lane count; without numba an index has the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from families import make_family

from mergefs.index import stats as blockstats
from mergefs.methods import kernels
from mergefs.index.stats import BASE, LANES, gram_terms
from mergefs.core.dtypes import decode_f32

NP = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}


def reference_term(x: np.ndarray, y: np.ndarray) -> float:
    """The documented order, written out: float64 products of the two float32 sides, padded
    with zeros to a multiple of LANES; lane l the sequential sum of elements l, l + LANES, ...
    (np.add.accumulate is sequential by definition); lanes combined pairwise, (0+1), (2+3), ...,
    then the same on the sums; NaN as numpy's nan."""
    n = -(-x.size // LANES) * LANES
    prod = np.zeros(n, dtype=np.float64)
    with np.errstate(all="ignore"):
        prod[: x.size] = x.astype(np.float64) * y.astype(np.float64)
        lanes = list(np.add.accumulate(prod.reshape(-1, LANES), axis=0)[-1]) if n else \
            [0.0] * LANES
        while len(lanes) > 1:
            lanes = [np.float64(lanes[k]) + np.float64(lanes[k + 1])
                     for k in range(0, len(lanes), 2)]
    v = float(lanes[0])
    return float("nan") if np.isnan(v) else v


def reference(sizes: list[int], base: list[bytes | None], base_dtype: str,
              experts: list[list[bytes | None]], dtypes: list[str],
              pairs: list[tuple[int, int]]) -> np.ndarray:
    out = np.zeros((len(pairs), len(sizes)))
    for b in range(len(sizes)):
        if base[b] is None:
            continue
        w0 = decode_f32(base[b], base_dtype)  # type: ignore[arg-type]
        side = {BASE: w0}
        with np.errstate(all="ignore"):
            for r, raw in enumerate(experts):
                if raw[b] is not None:
                    side[r] = decode_f32(raw[b], dtypes[r]) - w0  # float32 difference
        for p, (r, s) in enumerate(pairs):
            if r in side and s in side:
                out[p, b] = reference_term(side[r], side[s])
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def values(rng: np.random.Generator, n: int, dtype: str, kind: str,
           near: np.ndarray | None = None) -> bytes:
    """``n`` elements of ``dtype``: any bit pattern (NaNs, infinities, subnormals, -0),
    ordinary weights, or ``near`` plus a small delta."""
    if kind == "bits":
        raw = rng.integers(0, np.iinfo(BITS[dtype]).max, n, dtype=BITS[dtype], endpoint=True)
        return raw.tobytes()
    v = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    if near is not None:
        v = near + v * np.float32(1e-2)
    edge = rng.random(n)
    v[edge < 0.02] = 0.0
    v[(edge >= 0.02) & (edge < 0.04)] = -0.0
    v[(edge >= 0.04) & (edge < 0.05)] = np.float32(1e-40)  # subnormal in float32
    return v.astype(NP[dtype]).tobytes()


SIZES = [1, 63, 64, 65, 127, 1000, 4096 + 3, 3 * 4096 + 64 * 5 + 17,
         blockstats.GRAM_COLS, 2 * blockstats.GRAM_COLS + 64 * 3 + 5]  # tiled by columns


def family_blocks(rng: np.random.Generator, base_dtype: str, dtypes: list[str], kind: str
                  ) -> tuple[list[int], list[bytes | None], list[list[bytes | None]]]:
    base, experts = [], [[] for _ in dtypes]  # type: ignore[var-annotated]
    for n in SIZES:
        b = values(rng, n, base_dtype, kind)
        base.append(b)
        w0 = decode_f32(b, base_dtype)
        for r, dt in enumerate(dtypes):
            experts[r].append(values(rng, n, dt, kind, near=np.nan_to_num(w0)))
    experts[0][2] = None  # a known-zero delta: its terms are 0
    if kind == "weights":  # an infinity met without a NaN: block 1's terms with expert 1
        x = decode_f32(experts[1][1], dtypes[1]).copy()
        x[5] = np.inf
        experts[1][1] = x.astype(NP[dtypes[1]]).tobytes()
    return SIZES, base, experts  # type: ignore[return-value]


def pairs_of(r: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(r) for j in range(i, r)] + [(BASE, BASE), (BASE, 1)]


@pytest.mark.parametrize("kind", ["weights", "bits"])
@pytest.mark.parametrize("base_dtype,dtypes", [
    ("BF16", ["BF16", "BF16", "BF16"]),
    ("F16", ["F16", "F16"]),
    ("F32", ["F32", "F32"]),
    ("BF16", ["F32", "F16", "BF16"]),  # mixed: experts in other dtypes than the base
    ("F32", ["BF16", "F32"]),
])
def test_kernel_and_numpy_equal_the_reference_order(kind: str, base_dtype: str,
                                                    dtypes: list[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.index_kernels() is not None, "numba is installed here: the kernel must run"
    rng = np.random.default_rng(len(dtypes) * 7 + len(kind) + len(base_dtype))
    sizes, base, experts = family_blocks(rng, base_dtype, dtypes, kind)
    pairs = pairs_of(len(dtypes))
    want = reference(sizes, base, base_dtype, experts, dtypes, pairs)
    got = gram_terms(sizes, base, base_dtype, experts, dtypes, pairs)
    assert np.array_equal(bits(got), bits(want))
    assert np.all(got[0, 2] == 0.0)  # the known-zero delta
    if kind == "bits":  # NaNs everywhere but in the smallest blocks
        assert np.isnan(got).any() and np.isfinite(got).any()
    else:
        assert np.isinf(got[:, 1]).any()
        assert np.isfinite(np.delete(got, 1, axis=1)).all() and (got[:-2] != 0).any()
    monkeypatch.setattr(kernels, "index_kernels", lambda: None)
    numpy_path = gram_terms(sizes, base, base_dtype, experts, dtypes, pairs)
    assert np.array_equal(bits(numpy_path), bits(want))


def test_the_order_is_not_numpys_pairwise_sum() -> None:
    """The reference is a real order: on values where summation order shows, it differs from
    the pairwise sum the index used before (so the test above can tell orders apart)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(100_003) * 10.0 ** rng.integers(-6, 6, 100_003)).astype(np.float32)
    pairwise = float(np.sum(x.astype(np.float64) ** 2))
    assert reference_term(x, x) != pairwise
    got = gram_terms([x.size], [np.zeros(x.size, np.float32).tobytes()], "F32",
                     [[x.tobytes()]], ["F32"], [(0, 0)])
    assert got[0, 0] == reference_term(x, x)


def test_a_term_does_not_depend_on_the_other_rows() -> None:
    """The same pair computed alone or among others: the same bits (pieces assemble)."""
    rng = np.random.default_rng(9)
    sizes, base, experts = family_blocks(rng, "BF16", ["BF16", "F16", "F32"], "weights")
    alone = gram_terms(sizes, base, "BF16", [experts[1], experts[2]], ["F16", "F32"], [(0, 1)])
    among = gram_terms(sizes, base, "BF16", experts, ["BF16", "F16", "F32"], pairs_of(3))
    assert np.array_equal(bits(alone[0]), bits(among[pairs_of(3).index((1, 2))]))


def test_numba_blocked_builds_the_same_index(tmp_path: Path) -> None:
    """numba's import blocked: `mergefs index` builds on numpy, says so once, and its pieces
    hold the same bits as the kernel's."""
    fam = make_family(tmp_path / "fam", n_experts=3, dtype="bfloat16", seed=11)
    code = ("import sys; sys.modules['numba'] = None\n"
            "import numpy as np\n"
            "from mergefs.methods import kernels\n"
            "from mergefs.sources import open_source\n"
            "from mergefs.index.blocks import load_or_build\n"
            "base = open_source(sys.argv[1]); ex = [open_source(p) for p in sys.argv[3:]]\n"
            "index, built = load_or_build(base, ex, 4096, sys.argv[2])\n"
            "assert built and kernels.index_kernels() is None\n")
    res = subprocess.run([sys.executable, "-c", code, str(fam.base), str(tmp_path / "np"),
                          *map(str, fam.experts)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("numba is not installed") == 1
    from mergefs.sources import open_source
    from mergefs.index.blocks import load_or_build

    base = open_source(fam.base)
    ex = [open_source(p) for p in fam.experts]
    assert kernels.index_kernels() is not None
    with_kernel, _ = load_or_build(base, ex, 4096, tmp_path / "nb")
    without, built = load_or_build(base, ex, 4096, tmp_path / "np")  # the numpy-built pieces
    assert not built
    assert np.array_equal(bits(with_kernel.gram), bits(without.gram))
    assert np.array_equal(bits(with_kernel.norms), bits(without.norms))
    assert (with_kernel.gram != 0).any()
    for c in [base, *ex]:
        c.close()


def test_lane_count_is_a_power_of_two() -> None:
    assert LANES & (LANES - 1) == 0 and blockstats.GRAM_ROWS >= 1


def test_cold_reads_bypass_the_page_cache_with_the_same_bits(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """Sources evicted from the page cache are read with O_DIRECT (aligned reads into the
    reader's buffers): the index equals one built from cached files, bytes counted alike."""
    from mergefs.index import read as indexread
    from mergefs.sources import open_source
    from mergefs.index.build import BuildReport
    from mergefs.index.blocks import load_or_build

    fam = make_family(tmp_path / "fam", n_experts=2, dtype="bfloat16", seed=12)
    files = [p for d in [fam.base, *fam.experts] for p in d.glob("*.safetensors")]

    def build(where: str) -> tuple[object, BuildReport]:
        base = open_source(fam.base)
        ex = [open_source(p) for p in fam.experts]
        report = BuildReport()
        try:
            index, _ = load_or_build(base, ex, 4096, tmp_path / where, report=report)
        finally:
            for c in [base, *ex]:
                c.close()
        return index, report

    cached, cached_report = build("warm")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted = not indexread._resident(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if not evicted:
            pytest.skip("this filesystem keeps the files in memory (no cold read to test)")
    opened: list[int | None] = []
    real = indexread.Reader._open_direct

    def spy(self: indexread.Reader, *a: object) -> int | None:
        opened.append(real(self, *a))  # type: ignore[arg-type]
        return opened[-1]

    monkeypatch.setattr(indexread.Reader, "_open_direct", spy)
    cold, cold_report = build("cold")
    assert opened and all(fd is not None for fd in opened)  # every source read O_DIRECT
    assert cold_report.bytes_read == cached_report.bytes_read
    for name in ("base_hash", "expert_hash", "norms", "zero", "gram", "base_norms"):
        a, b = getattr(cached, name), getattr(cold, name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
