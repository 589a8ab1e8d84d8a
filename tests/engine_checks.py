"""Helpers of the engine tests: merged outputs against the numpy reference under a plan's omissions."""

from __future__ import annotations
from pathlib import Path
import numpy as np
from reference import (
    omit_mask,
    read_tensor,
    tensor_names,
)
from mergefs.engine.session import Session


def plan_omit_masks(session: Session, base: Path) -> dict[str, list[np.ndarray]]:
    """Omit masks from the plan: ``selected[i, b]`` False => expert i's elements of b omitted."""
    lay = session.index.layout
    sel = session.plan.selected
    masks = {}
    for t, name in enumerate(lay.tensors):
        blocks = lay.blocks_of(t)
        numel = numel_of(base, name)  # from safetensors, not from the layout
        masks[name] = [
            omit_mask(numel, [(int(lay.elem_start[b]), int(lay.elem_end[b]))
                              for b in blocks if not sel[i, b]])
            for i in range(sel.shape[0])
        ]
    return masks


def assert_matches(out: Path, expected: dict[str, np.ndarray]) -> None:
    assert sorted(expected) == tensor_names(out)
    bad = []
    for name, want in expected.items():
        got = read_tensor(out, name)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        if got.tobytes() != want.tobytes():
            diff = int(np.count_nonzero(got.view(np.uint8) != want.view(np.uint8)))
            bad.append(f"{name}: {diff} differing bytes")
    assert not bad, bad


def numel_of(base: Path, name: str) -> int:
    return int(np.prod(read_tensor(base, name).shape))
