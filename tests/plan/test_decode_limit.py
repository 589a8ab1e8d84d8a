"""review6: decode-limit sweeps (limit holds after the refill, budget, determinism)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from families import make_family, write_spec

from mergefs.deltas import publish as compress
from mergefs.engine.session import Session
from mergefs.recipe.family import open_family
from mergefs.index.blocks import load_or_build
from mergefs.plan.levels import DecodeCost, choose, decode_seconds
from mergefs.spec.load import load_spec

WEIGHTS = [0.5, -0.3, 0.8]


def test_decode_limit_grid_holds_within_budget(tmp_path: Path) -> None:
    fam = make_family(tmp_path / "fam", dtype="float32", seed=11)
    sp = write_spec(tmp_path / "spec.yaml", fam, weights=WEIGHTS,
                    extra={"block_size": 512, "index_dir": str(tmp_path / "idx")})
    spec = load_spec(str(sp))
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    compress.publish(base, experts, index)
    s = Session(load_spec(str(sp)), budget_bytes=0)
    try:
        index, sc = s.index, s.engine.deltas
        total = s.plan.total_expert_bytes
        coeffs = np.asarray(WEIGHTS)
        for frac in np.linspace(0.01, 1.0, 25):
            for ratio in (0.01, 0.05, 0.2, 0.5, 1.0, 2.0, 5.0):
                budget = int(frac * total)
                cost = DecodeCost(ratio=ratio)
                a = choose(index, coeffs, budget, sc, cost)
                b = choose(index, coeffs, budget, sc, cost)
                assert np.array_equal(a.levels, b.levels)
                assert a.exact_bytes + a.sidecar_bytes <= budget, (frac, ratio)
                dec, read = decode_seconds(index, a.levels, sc, cost)
                assert dec <= ratio * read * (1 + 1e-9) + 1e-15, (frac, ratio, dec, read)
    finally:
        s.close()


def test_add_codes_bit_identical_to_per_code_lut_every_alignment() -> None:
    """add_codes (byte table path for 1/2 bits, per-code path for 3/4/8) equals the per-code
    ``a[e] += lut[bits][code] * step`` for every start offset and size."""
    from mergefs.deltas import _numba_decode as nd
    lut = np.zeros((17, 256), np.float32)
    for bits in (1, 2, 3, 4, 8):
        for c in range(1 << bits):
            lut[bits, c] = nd.value(c, bits)
    blut = nd.byte_luts(lut)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 400, dtype=np.uint8)
    for bits in (1, 2, 3, 4, 8):
        for e0 in range(17):
            for size in range(40):
                step = np.float32(rng.standard_normal())
                a0 = rng.standard_normal(size).astype(np.float32)
                ref = a0.copy()
                for e in range(size):
                    bit = (e0 + e) * bits
                    word = int(data[3 + (bit >> 3)]) | (int(data[4 + (bit >> 3)]) << 8)
                    code = (word >> (bit & 7)) & ((1 << bits) - 1)
                    ref[e] = np.float32(ref[e] + np.float32(lut[bits, code] * step))
                got = a0.copy()
                nd.add_codes(got, data, 3, e0, bits, step, lut, blut)
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (bits, e0, size)
