"""Delta sidecars through the view (the mount's reads, without FUSE): the bytes equal the
materialised merge at the same budget, and units smaller than their tensor read the tensor's
planned sidecar ranges once (``Engine._unit_payloads``) instead of once per unit."""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecar_cases import _setup

from mergefs.engine import merger as engine_mod
from mergefs.core.cache import UnitCache
from mergefs.engine.session import Session
from mergefs.mount.session import MountSession
from mergefs.mount.view import View


def _through_view(spec, budget: int, cache_bytes: int, chunk: int) -> tuple[bytes, Session]:
    s = Session(spec, budget_bytes=budget)
    view = View(MountSession.of(s), UnitCache(cache_bytes))
    try:
        size = view.attr(view.inode_of("model.safetensors")).size_bytes
        data = b"".join(view.read_path("model.safetensors", off, chunk)
                        for off in range(0, size, chunk))
    finally:
        view.close()
    return data, s


@pytest.mark.parametrize("frac", [0.05, 0.2])
def test_view_serves_the_merge_and_reads_each_tensors_levels_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, frac: float) -> None:
    _, spec, base, experts, index, _ = _setup(tmp_path)
    total = int(index.expert_block_bytes().sum())
    for c in [base, *experts]:
        c.close()
    budget = int(frac * total)
    s = Session(spec, budget_bytes=budget)
    s.engine.materialise(tmp_path / "out", threads=2)
    want = (tmp_path / "out" / "model.safetensors").read_bytes()
    s.finish()
    s.close()

    reads = {}
    for held in (True, False):  # held: the tensor's ranges read once for all its units
        with monkeypatch.context() as m:
            if not held:
                m.setattr(engine_mod, "TENSOR_LEVELS_MAX_BYTES", 0)
            got, s = _through_view(spec, budget, 64 << 20, 4093)
            assert got == want, held
            sc_reads = sum(sc.reads for sc in s.deltas.values())
            sc_bytes = sum(sc.bytes_read for sc in s.deltas.values())
            assert s.plan.levels is not None and (s.plan.levels > 0).sum() > 10
            # every planned range once (shared ranges included in the plan's sidecar bytes)
            assert sc_bytes <= s.plan.sidecar_bytes
            assert not s.engine._tensor_levels  # every held tensor was decoded to the end
            reads[held] = sc_reads
            s.finish()
            s.close()
    assert reads[True] < reads[False]


def test_a_tiny_cache_re_merges_units_and_still_serves_the_merge(tmp_path: Path) -> None:
    """Units evicted and merged again (the tensor's held ranges were already dropped, or are
    read again): the same bytes, read twice in full."""
    _, spec, base, experts, index, _ = _setup(tmp_path, seed=32)
    total = int(index.expert_block_bytes().sum())
    for c in [base, *experts]:
        c.close()
    budget = int(0.1 * total)
    s = Session(spec, budget_bytes=budget)
    s.engine.materialise(tmp_path / "out", threads=1)
    want = (tmp_path / "out" / "model.safetensors").read_bytes()
    s.finish()
    s.close()
    s = Session(spec, budget_bytes=budget)
    view = View(MountSession.of(s), UnitCache(2048))
    try:
        for _ in range(2):
            assert view.read_path("model.safetensors") == want
        # random order, small reads
        for off in range(len(want) - 1000, 0, -7919):
            assert view.read_path("model.safetensors", off, 1000) == want[off:off + 1000]
    finally:
        view.close()
        s.finish()
        s.close()
