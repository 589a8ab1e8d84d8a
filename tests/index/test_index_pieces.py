"""The block index stored as pieces (base, (base, expert), pairs of experts), with exact pairs
(``exact=True``, ``mergefs index --exact``): adding an expert builds only its pieces, removing or reordering builds nothing, specs share pieces, a changed
expert rebuilds only itself, and the assembled index equals a fresh build bit for bit."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from families import Family, make_family, write_spec

from mergefs.sources.local import Checkpoint
from mergefs.sources import open_source
from mergefs.engine.session import Session
from mergefs.core.format import FLOAT_DTYPES
from mergefs.index.blocks import BlockIndex, build_index, load_or_build
from mergefs.index.layout import build_layout
from mergefs.index.build import BuildReport
from mergefs.spec.load import load_spec

BLOCK = 1024


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("pairs") / "fam", n_experts=4, dtype="bfloat16",
                       seed=21)


def opened(fam: Family, which: list[int]) -> tuple[Checkpoint, list[Checkpoint]]:
    return open_source(fam.base), [open_source(fam.experts[i]) for i in which]


def index_of(fam: Family, which: list[int], idx: Path, **kw: object
             ) -> tuple[BlockIndex, bool, BuildReport]:
    """The exact path (``mergefs index --exact``): pairs built as before sketches; the
    default (estimated cross terms) is tested in test_index_sketches.py."""
    kw.setdefault("exact", True)
    base, experts = opened(fam, which)
    report = BuildReport()
    try:
        index, built = load_or_build(base, experts, BLOCK, idx, report=report, **kw)  # type: ignore[arg-type]
    finally:
        for c in [base, *experts]:
            c.close()
    return index, built, report


def float_bytes(model: Path) -> int:
    return sum(t.size_bytes for t in open_source(model).tensors.values()
               if t.dtype in FLOAT_DTYPES)


def assert_same(a: BlockIndex, b: BlockIndex) -> None:
    assert a.key == b.key and a.has_gram == b.has_gram
    for name in ("base_hash", "expert_hash", "norms", "zero", "gram", "expert_itemsize",
                 "base_norms"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def fresh(fam: Family, which: list[int]) -> BlockIndex:
    base, experts = opened(fam, which)
    try:
        return build_index(base, experts, build_layout(base, BLOCK))
    finally:
        for c in [base, *experts]:
            c.close()


def test_adding_an_expert_builds_only_its_pieces(fam: Family, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    idx = tmp_path / "idx"
    _, built, first = index_of(fam, [0, 1, 2], idx)
    assert built and first.base_built and first.pairs_built == 3
    assert sorted(first.experts_built) == sorted(str(fam.experts[i]) for i in range(3))

    caplog.set_level(logging.INFO, logger="mergefs")
    index, built, add = index_of(fam, [0, 1, 2, 3], idx)
    assert built and not add.base_built
    assert add.experts_built == [str(fam.experts[3])]  # the old experts' pieces are reused
    assert add.pairs_built == 3  # (3, 0), (3, 1), (3, 2)
    assert f"no index yet for {fam.experts[3]}" in caplog.text
    # The new expert is read in full; of the old ones only the blocks where both deltas are
    # non-zero (their Gram term with the new one): less than a full rebuild reads.
    assert add.bytes_read[str(fam.experts[3])] == float_bytes(fam.experts[3])
    _, _, full = index_of(fam, [0, 1, 2, 3], tmp_path / "again", rebuild=True)
    for i in range(3):
        old = str(fam.experts[i])
        assert 0 < add.bytes_read[old] < full.bytes_read[old] == float_bytes(fam.experts[i])
    assert sum(add.bytes_read.values()) < sum(full.bytes_read.values())
    assert index.has_gram
    assert_same(index, fresh(fam, [0, 1, 2, 3]))


def test_reorder_remove_and_sharing_build_nothing_new(fam: Family, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    idx = tmp_path / "idx"
    index_of(fam, [0, 1], idx)
    _, _, b = index_of(fam, [1, 2], idx)  # shares expert 1 with the first spec
    assert b.experts_built == [str(fam.experts[2])] and b.pairs_built == 1
    assert len(list((idx / "pieces").glob("expert-*.safetensors"))) == 3
    caplog.set_level(logging.INFO, logger="mergefs")
    _, built, c = index_of(fam, [2, 0], idx)  # both indexed before, never together
    assert built and c.experts_built == [] and c.pairs_built == 1
    assert "merged together for the first time" in caplog.text
    for which in ([2, 1, 0], [1, 0], [0], [0, 2, 1, 2]):  # reordered, removed, repeated
        index, built, r = index_of(fam, which, idx)
        assert not built and r.bytes_read == {} and r.experts_built == [], which
        assert_same(index, fresh(fam, which))


def test_changed_expert_rebuilds_only_it(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    fam = make_family(tmp_path / "fam", n_experts=3, dtype="float32", seed=4)
    idx = tmp_path / "idx"
    index_of(fam, [0, 1, 2], idx)
    path = fam.experts[1] / "model.safetensors"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # touched: same bytes
    caplog.set_level(logging.INFO, logger="mergefs")
    _, built, touched = index_of(fam, [0, 1, 2], idx)
    assert not built and touched.experts_built == [] and touched.pairs_built == 0
    assert touched.verified == [str(fam.experts[1])]  # hashed once, found equal: reused
    assert touched.bytes_read == touched.verify_bytes == {
        str(fam.experts[1]): float_bytes(fam.experts[1])}
    assert "building block index" not in caplog.text

    data = bytearray(path.read_bytes())  # now new bytes, same size
    loc = open_source(fam.experts[1]).tensors["lm_head.weight"]
    data[(loc.start + loc.end) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    caplog.clear()
    index, built, changed = index_of(fam, [0, 1, 2], idx)
    assert changed.experts_built == [str(fam.experts[1])] and changed.pairs_built == 2
    text = "\n".join(line for line in caplog.text.splitlines() if "block index" in line)
    assert str(fam.experts[1]) in text
    assert str(fam.experts[0]) not in text and str(fam.experts[2]) not in text
    assert_same(index, fresh(fam, [0, 1, 2]))


def test_plan_and_merge_unchanged_versus_a_full_build(fam: Family, tmp_path: Path) -> None:
    three = dataclasses.replace(fam, experts=fam.experts[:3])
    extra = {"block_size": BLOCK, "budget": "40%", "index_dir": str(tmp_path / "idx")}
    Session(load_spec(write_spec(tmp_path / "three.yaml", three, "task_arithmetic",
                                 extra=extra))).close()
    grown = write_spec(tmp_path / "four.yaml", fam, "task_arithmetic", extra=extra)
    full = write_spec(tmp_path / "full.yaml", fam, "task_arithmetic",
                      extra={**extra, "index_dir": str(tmp_path / "fresh")})
    outs = []
    for spec in (grown, full):
        s = Session(load_spec(spec))
        try:
            assert s.index_built
            s.engine.materialise(tmp_path / spec.stem)
            outs.append((s.plan.plan_hash, s.plan.error_exact,
                         (tmp_path / spec.stem / "model.safetensors").read_bytes()))
        finally:
            s.close()
    assert outs[0] == outs[1]


def test_index_of_the_earlier_format_is_rebuilt_saying_why(fam: Family, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "family-0123456789abcdef.json").write_text("{}")  # what format 1 left here
    caplog.set_level(logging.INFO, logger="mergefs")
    _, built, _ = index_of(fam, [0], idx)
    assert built and "holds an index of an earlier format (one file per family)" in caplog.text


def test_base_rewritten_in_place_makes_every_expert_piece_stale(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    """Same size, header and mtime: the base's pieces go stale by its ctime, and an expert
    indexed by another spec against the old bytes is rebuilt too (its base digest differs)."""
    fam = make_family(tmp_path / "fam", n_experts=2, dtype="float32", seed=8)
    idx = tmp_path / "idx"
    index_of(fam, [0], idx)
    index_of(fam, [1], idx)
    path = fam.base / "model.safetensors"
    st = path.stat()
    loc = open_source(fam.base).tensors["lm_head.weight"]
    data = bytearray(path.read_bytes())
    data[(loc.start + loc.end) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    caplog.set_level(logging.INFO, logger="mergefs")
    _, _, first = index_of(fam, [0], idx)
    assert first.base_built and first.experts_built == [str(fam.experts[0])]
    assert f"{path} was modified since the last index" in caplog.text
    index, _, second = index_of(fam, [1], idx)
    assert not second.base_built and second.experts_built == [str(fam.experts[1])]
    assert f"{fam.base} changed since {fam.experts[1]} was indexed" in caplog.text
    assert_same(index, fresh(fam, [1]))


def test_range_statistics_of_one_expert_equal_the_builder(fam: Family) -> None:
    """The pure per-(expert, block range) function a distributed build would run per task."""
    from mergefs.index.stats import expert_range_stats
    from mergefs.index.build import chunks, source_ranges

    index = fresh(fam, [0, 1])
    base, experts = opened(fam, [0, 1])
    lay = index.layout
    try:
        for b0, b1 in chunks(lay):
            name = lay.tensors[int(lay.tensor_of[b0])]
            o = int(lay.elem_start[b0])
            spans = [(int(lay.elem_start[b]) - o, int(lay.elem_end[b]) - o) for b in range(b0, b1)]
            [bbuf], [ebuf] = (src.read_ranges([source_ranges(src, lay, b0, b1)])
                              for src in (base, experts[1]))
            got = expert_range_stats(spans, bbuf, base.tensors[name].dtype, ebuf,
                                     experts[1].tensors[name].dtype)
            assert np.array_equal(got.base_hash, index.base_hash[b0:b1])
            assert np.array_equal(got.expert_hash, index.expert_hash[1, b0:b1])
            assert np.array_equal(got.zero, index.zero[1, b0:b1])
            assert np.array_equal(np.sqrt(got.sq_norms), index.norms[1, b0:b1])
    finally:
        for c in [base, *experts]:
            c.close()


def test_pieces_from_sidecars_then_read_in_full(fam: Family, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Remote experts with published sidecars are not read and have no Gram pairs; asking for
    the full index later reads them and computes the pairs, equal to the index published."""
    import shutil

    from mergefs.index.published import publish

    copies = [tmp_path / f"e{i}" for i in range(2)]
    for i, c in enumerate(copies):
        shutil.copytree(fam.experts[i], c)
    base = open_source(fam.base)
    experts = [open_source(f"file://{c}") for c in copies]
    try:
        full, _ = load_or_build(base, experts, BLOCK, tmp_path / "pub", sidecars=False,
                                exact=True)
        publish(base, experts, full)
        caplog.set_level(logging.INFO, logger="mergefs")
        first = BuildReport()
        index, built = load_or_build(base, experts, BLOCK, tmp_path / "use", report=first)
        assert built and not index.has_gram and set(first.bytes_read) == {str(base.root)}
        assert "2 of 2 experts from published sidecars" in caplog.text
        again = BuildReport()
        index, built = load_or_build(base, experts, BLOCK, tmp_path / "use", sidecars=False,
                                     report=again, exact=True)
        assert built and index.has_gram and again.pairs_built == 1
        for e, src in zip(experts, fam.experts):  # each read once: pairs in the same pass
            assert again.bytes_read[str(e.root)] == float_bytes(src)
        assert "was indexed from its published sidecar only" in caplog.text
        assert_same(index, full)
    finally:
        for c in [base, *experts]:
            c.close()


def test_an_index_dir_that_cannot_be_written_is_a_clear_error(fam: Family, tmp_path: Path
                                                              ) -> None:
    from mergefs.core.errors import SourceError

    blocker = tmp_path / "idx"
    blocker.write_text("a file where the index folder should be")
    with pytest.raises(SourceError, match="cannot write the index"):
        index_of(fam, [0], blocker)


def test_an_expert_relabelled_to_another_dtype_gets_new_pairs(fam: Family,
                                                              tmp_path: Path) -> None:
    """The same bytes read as fp16 instead of bf16 are other deltas: stored Gram terms keyed by
    bytes alone were reused, giving a wrong cross term (review finding)."""
    import json
    import shutil

    relabelled = tmp_path / "as-f16"
    shutil.copytree(fam.experts[0], relabelled)
    f = relabelled / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    hdr = json.loads(data[8:8 + n])
    for k, v in hdr.items():
        if k != "__metadata__" and v["dtype"] == "BF16":
            v["dtype"] = "F16"
    h = json.dumps(hdr, separators=(",", ":")).encode()
    f.write_bytes(data[:8] + h + b" " * (n - len(h)) + data[8 + n:])
    idx = tmp_path / "idx"
    index_of(fam, [0, 1], idx)  # the bf16 expert and its pair with expert 1, stored
    base = open_source(fam.base)
    experts = [open_source(relabelled), open_source(fam.experts[1])]
    try:
        got, _ = load_or_build(base, experts, BLOCK, idx, exact=True)
        want = build_index(base, experts, build_layout(base, BLOCK))
    finally:
        for c in [base, *experts]:
            c.close()
    assert np.array_equal(got.expert_hash, want.expert_hash)
    assert not np.array_equal(got.gram[:, 0, 1], fresh(fam, [0, 1]).gram[:, 0, 1])
    assert_same(got, want)
    assert_same(index_of(fam, [0, 1], idx)[0], fresh(fam, [0, 1]))  # the first pair intact
