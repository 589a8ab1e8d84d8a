"""Session-wide fixtures: small synthetic checkpoint families written once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from families import Family, make_family, make_llama_family


@pytest.fixture(scope="session")
def family_f32(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Base + 3 float32 experts, single-file models."""
    return make_family(tmp_path_factory.mktemp("family_f32"), dtype="float32", seed=0)


@pytest.fixture(scope="session")
def family_f16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Base + 3 float16 experts, single-file models."""
    return make_family(tmp_path_factory.mktemp("family_f16"), dtype="float16", seed=1)


@pytest.fixture(scope="session")
def family_bf16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Base + 3 bfloat16 experts, single-file models."""
    return make_family(tmp_path_factory.mktemp("family_bf16"), dtype="bfloat16", seed=2)


@pytest.fixture(scope="session")
def family_sharded(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """float32; base in 3 shards, experts in 3 shards holding the tensors in reverse order.

    Same seed as ``family_f32``, so its tensors equal that family's, name by name.
    """
    return make_family(
        tmp_path_factory.mktemp("family_sharded"),
        dtype="float32",
        seed=0,
        sharded=True,
        expert_layout="reversed",
    )


@pytest.fixture(scope="session")
def llama_family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """A tiny float32 Llama base and 2 experts written by transformers' ``save_pretrained``."""
    return make_llama_family(tmp_path_factory.mktemp("llama_family"), n_experts=2, seed=0)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Any]:
    """Real mounts in subprocesses (tests/test_mount.py::Mounts), always unmounted after."""
    from mounting import Mounts

    m = Mounts(tmp_path)
    try:
        yield m
    finally:
        m.cleanup()
