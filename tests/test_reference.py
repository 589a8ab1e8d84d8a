"""Sanity checks of the test scaffolding itself: the numpy reference and the synthetic families."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from families import DEFAULT_ZERO_TENSORS, INT_TENSOR_NAME, Family, write_spec
from reference import (
    cast_to,
    dare_uniform,
    omit_mask,
    read_tensor,
    reference_merge,
    reference_merge_dir,
    tensor_dtype,
)

MASK64 = 2**64 - 1
TENSOR = "model.layers.0.mlp.up_proj.weight"


def scalar_uniform(seed: int, tensor: str, i: int, j: int) -> float:
    """The doc's ``u`` written with Python integers, one element at a time."""
    x = xxhash.xxh3_64_intdigest(f"{seed}\x00{tensor}\x00{i}".encode()) + j * 0x9E3779B97F4A7C15
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# --- the counter-based uniform -----------------------------------------------------------------


def test_dare_uniform_matches_scalar_definition() -> None:
    indices = [0, 1, 2, 12345, 2**32 + 5, 2**40 + 7, 2**64 - 1]
    got = dare_uniform(7, TENSOR, 2, np.array(indices, dtype=np.uint64))
    want = [scalar_uniform(7, TENSOR, 2, j) for j in indices]
    assert got.tolist() == want


def test_dare_uniform_independent_of_slicing() -> None:
    whole = dare_uniform(0, TENSOR, 1, np.arange(10_000))
    pieces = [
        dare_uniform(0, TENSOR, 1, np.arange(a, b)) for a, b in [(0, 3), (3, 4097), (4097, 10_000)]
    ]
    shuffled = np.random.default_rng(0).permutation(10_000)
    assert np.array_equal(whole, np.concatenate(pieces))
    assert np.array_equal(whole[shuffled], dare_uniform(0, TENSOR, 1, shuffled))


def test_dare_keep_fraction_close_to_density() -> None:
    u = dare_uniform(0, TENSOR, 0, np.arange(100_000))
    assert np.all((u >= 0) & (u < 1))
    for density in (0.1, 0.3, 0.9):
        assert abs(np.mean(u < density) - density) < 0.01


def test_dare_streams_differ_by_seed_tensor_and_expert() -> None:
    j = np.arange(1000)
    ref = dare_uniform(0, TENSOR, 0, j)
    for other in (
        dare_uniform(1, TENSOR, 0, j),
        dare_uniform(0, "x", 0, j),
        dare_uniform(0, TENSOR, 1, j),
    ):
        assert not np.array_equal(ref, other)


# --- operators on hand-made and family tensors -------------------------------------------------


def test_task_arithmetic_weight_one_returns_expert(family_f32: Family) -> None:
    base = read_tensor(family_f32.base, TENSOR)
    expert = read_tensor(family_f32.experts[0], TENSOR)
    merged = reference_merge("task_arithmetic", base, [expert], TENSOR, {}, [{"weight": 1.0}])
    assert merged.dtype == np.float32 and merged.shape == base.shape
    np.testing.assert_array_max_ulp(merged, expert, maxulp=1)


def test_fully_omitted_experts_give_the_base(family_f32: Family) -> None:
    base = read_tensor(family_f32.base, TENSOR)
    experts = [read_tensor(e, TENSOR) for e in family_f32.experts]
    masks = [omit_mask(base.size, [(0, base.size)])] * len(experts)
    for method in ("task_arithmetic", "ties", "dare_ties", "breadcrumbs"):
        params = {"density": 0.5} if method != "task_arithmetic" else {}
        merged = reference_merge(
            method,
            base,
            experts,
            TENSOR,
            params,
            [{"weight": 0.4}] * len(experts),
            omit_masks=masks,
        )
        assert np.array_equal(merged, base), method


def test_linear_with_listed_base_is_weighted_average() -> None:
    merged = reference_merge(
        "linear", arr(0, 0), [arr(2, 4)], "t", {}, [{"weight": 1.0}], base_weight=1.0
    )
    assert merged.tolist() == [1.0, 2.0]
    unnormalised = reference_merge(
        "linear",
        arr(1, 1),
        [arr(2, 4)],
        "t",
        {"normalize": False},
        [{"weight": 1.0}],
        base_weight=1.0,
    )
    assert unnormalised.tolist() == [3.0, 5.0]  # a = 2: 2 * W0 + (W1 - W0)


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_ties_full_density_single_expert_returns_expert(family_f32: Family, weight: float) -> None:
    base = read_tensor(family_f32.base, TENSOR)
    expert = read_tensor(family_f32.experts[1], TENSOR)
    merged = reference_merge("ties", base, [expert], TENSOR, {}, [{"weight": weight}])
    np.testing.assert_array_max_ulp(merged, expert, maxulp=1)


def test_ties_keeps_largest_magnitudes_ties_by_lower_index() -> None:
    base = np.zeros(5, np.float32)
    merged = reference_merge(
        "ties", base, [arr(3, -3, 1, 0, 3)], "t", {"density": 0.4}, [{"weight": 1.0}]
    )
    assert merged.tolist() == [3.0, -3.0, 0.0, 0.0, 0.0]


def test_ties_sign_consensus() -> None:
    base = np.zeros(3, np.float32)
    merged = reference_merge(
        "ties", base, [arr(1, -1, 2), arr(-2, -1, 0)], "t", {}, [{"weight": 1.0}, {"weight": 1.0}]
    )
    # sgn = [-1, -2, 2]; agreeing: [e1], [e0, e1], [e0]; divisor [1, 2, 1]
    assert merged.tolist() == [-2.0, -1.0, 2.0]


def test_breadcrumbs_drops_both_tails() -> None:
    delta = arr(10, 1, 9, 2, 8, 3, 7, 4, 6, 5)
    base = np.zeros(10, np.float32)
    merged = reference_merge(
        "breadcrumbs", base, [delta], "t", {"density": 0.5, "gamma": 0.1}, [{"weight": 1.0}]
    )
    assert merged.tolist() == [0, 0, 9, 0, 8, 0, 7, 0, 6, 5]
    # kept 9, n_top 2, n_bot max(0, 10 - 9 - 2) = 0: ascending ranks [0, 9), the largest goes.
    merged = reference_merge(
        "breadcrumbs", base, [delta], "t", {"density": 0.95, "gamma": 0.2}, [{"weight": 1.0}]
    )
    assert merged.tolist() == [0, 1, 9, 2, 8, 3, 7, 4, 6, 5]


def test_dare_linear_rescales_kept_elements(family_f32: Family) -> None:
    base = read_tensor(family_f32.base, TENSOR)
    expert = read_tensor(family_f32.experts[0], TENSOR)
    merged = reference_merge(
        "dare_linear", base, [expert], TENSOR, {"seed": 3}, [{"weight": 1.0, "density": 0.5}]
    )
    delta = (expert - base).ravel()
    keep = dare_uniform(3, TENSOR, 0, np.arange(base.size)) < 0.5
    got = merged.ravel()
    assert np.array_equal(got[~keep], base.ravel()[~keep])
    # mergekit's rescale: the L1 norm ratio of the delta and its kept part, not 1 / density
    ratio = np.abs(delta).astype(np.float64).sum() / np.abs(delta[keep]).astype(np.float64).sum()
    want = base.ravel() + np.where(keep, delta.astype(np.float64) * ratio, 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)
    assert abs(ratio - 2.0) > 1e-4


def test_slerp_endpoints(family_f32: Family) -> None:
    base = read_tensor(family_f32.base, TENSOR)
    expert = read_tensor(family_f32.experts[0], TENSOR)  # nearly parallel: the lerp branch
    assert np.array_equal(reference_merge("slerp", base, [expert], TENSOR, {"t": 0.0}, []), base)
    np.testing.assert_array_max_ulp(
        reference_merge("slerp", base, [expert], TENSOR, {"t": 1.0}, []), expert, maxulp=1
    )
    rng = np.random.default_rng(0)
    v0, v1 = rng.normal(size=(2, 64, 8)).astype(np.float32)  # nearly orthogonal: the arc branch
    assert np.array_equal(reference_merge("slerp", v0, [v1], "t", {"t": 0.0}, []), v0)
    assert np.array_equal(reference_merge("slerp", v0, [v1], "t", {"t": 1.0}, []), v1)
    mid = reference_merge("slerp", v0, [v1], "t", {"t": 0.5}, [])
    assert np.linalg.norm(mid) > np.linalg.norm((v0 + v1) / 2)  # on the arc, not the chord


def test_cast_to_rounds_to_nearest_even() -> None:
    halfway = arr(1 + 2**-11, 1 + 3 * 2**-11)
    assert cast_to(halfway, "F16").tolist() == [1.0, 1 + 2**-9]
    halfway = arr(1 + 2**-8, 1 + 3 * 2**-8)
    out = cast_to(halfway, "bfloat16")
    assert out.dtype == ml_dtypes.bfloat16
    assert out.astype(np.float32).tolist() == [1.0, 1 + 2**-6]


# --- the synthetic families ----------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["family_f32", "family_f16", "family_bf16", "family_sharded"])
def test_family_zero_deltas(request: pytest.FixtureRequest, fixture: str) -> None:
    family: Family = request.getfixturevalue(fixture)
    for expert in family.experts:
        for name in family.tensor_names:
            b, e = read_tensor(family.base, name), read_tensor(expert, name)
            assert b.dtype == e.dtype and b.shape == e.shape
            same_rows = np.all(
                b.view(np.uint8).reshape(b.shape[0], -1)
                == e.view(np.uint8).reshape(e.shape[0], -1),
                axis=1,
            )
            if name in DEFAULT_ZERO_TENSORS or name == INT_TENSOR_NAME:
                assert same_rows.all(), name
            else:
                assert int(0.3 * b.shape[0]) <= same_rows.sum() < b.shape[0], name


def test_sharded_family_matches_single_file_family_by_name(
    family_f32: Family, family_sharded: Family
) -> None:
    assert family_sharded.tensor_names == family_f32.tensor_names
    for single, sharded in zip(
        [family_f32.base, *family_f32.experts],
        [family_sharded.base, *family_sharded.experts],
        strict=True,
    ):
        for name in family_f32.tensor_names:
            assert np.array_equal(read_tensor(single, name), read_tensor(sharded, name))
    base_index = (family_sharded.base / "model.safetensors.index.json").read_text()
    expert_index = (family_sharded.experts[0] / "model.safetensors.index.json").read_text()
    assert base_index != expert_index


def test_reference_merge_dir_from_spec(family_bf16: Family, tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "spec.yaml",
        family_bf16,
        method="ties",
        parameters={"density": 0.5},
        extra={"dtype": "float32"},
    )
    merged = reference_merge_dir(spec)
    assert sorted(merged) == family_bf16.tensor_names
    assert np.array_equal(merged[INT_TENSOR_NAME], read_tensor(family_bf16.base, INT_TENSOR_NAME))
    for name in DEFAULT_ZERO_TENSORS:
        base = read_tensor(family_bf16.base, name).astype(np.float32)
        assert merged[name].dtype == np.float32 and np.array_equal(merged[name], base)
    own_dtype = reference_merge_dir(write_spec(tmp_path / "own.yaml", family_bf16))
    assert own_dtype[TENSOR].dtype == ml_dtypes.bfloat16


def test_llama_family(llama_family: Family) -> None:
    assert tensor_dtype(llama_family.base, "model.norm.weight") == "F32"
    for name in ("model.norm.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert np.array_equal(
            read_tensor(llama_family.base, name), read_tensor(llama_family.experts[0], name)
        )
    name = "model.layers.0.mlp.up_proj.weight"
    b, e = read_tensor(llama_family.base, name), read_tensor(llama_family.experts[0], name)
    relative = np.linalg.norm(e - b) / np.linalg.norm(b)
    assert 1e-3 < relative < 1e-1
