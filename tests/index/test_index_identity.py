"""Index pieces are found by content, not by paths or times (issue 31): a touched source is
hashed once and its pieces reused, a renamed family reads nothing, a copied family is hashed
once per source and reuses every piece, and an expert rewritten in place is read once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from families import Family, make_family

from mergefs.core.format import FLOAT_DTYPES
from mergefs.index.blocks import BlockIndex, build_index, load_or_build
from mergefs.index.build import BuildReport
from mergefs.index.layout import build_layout
from mergefs.sources import open_source

BLOCK = 1024


def index_of(fam: Family, idx: Path, **kw: object) -> tuple[BlockIndex, bool, BuildReport]:
    """The family's index, with its exact pairs (what identity must keep reusing)."""
    kw.setdefault("exact", True)
    base, experts = open_source(fam.base), [open_source(e) for e in fam.experts]
    report = BuildReport()
    try:
        index, built = load_or_build(base, experts, BLOCK, idx, report=report, **kw)  # type: ignore[arg-type]
    finally:
        for c in [base, *experts]:
            c.close()
    return index, built, report


def fresh(fam: Family) -> BlockIndex:
    base, experts = open_source(fam.base), [open_source(e) for e in fam.experts]
    try:
        return build_index(base, experts, build_layout(base, BLOCK))
    finally:
        for c in [base, *experts]:
            c.close()


def same(a: BlockIndex, b: BlockIndex) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n))
               for n in ("base_hash", "expert_hash", "norms", "zero", "gram", "base_norms"))


def float_bytes(model: Path) -> int:
    return sum(t.size_bytes for t in open_source(model).tensors.values()
               if t.dtype in FLOAT_DTYPES)


def pieces(idx: Path) -> dict[str, int]:
    """Every piece file by name, with its inode (a rewritten piece gets a new one)."""
    return {p.name: p.stat().st_ino for p in (idx / "pieces").glob("*.safetensors")}


def nothing_built(r: BuildReport) -> bool:
    return not r.base_built and r.experts_built == [] and r.pairs_built == 0


@pytest.fixture
def fam(tmp_path: Path) -> Family:
    return make_family(tmp_path / "fam", n_experts=3, dtype="bfloat16", seed=31)


def test_touched_sources_are_hashed_once_and_reused(fam: Family, tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    index_of(fam, idx)
    before = pieces(idx)
    touched = [fam.base, fam.experts[1]]
    for model in touched:
        f = model / "model.safetensors"
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    index, built, r = index_of(fam, idx)
    # touching the base rebuilds no expert piece and no pair: only the touched files are
    # read, once each, to compare their block hashes with the stored ones
    assert not built and nothing_built(r) and sorted(r.verified) == sorted(map(str, touched))
    assert r.bytes_read == r.verify_bytes == {str(m): float_bytes(m) for m in touched}
    assert pieces(idx) == before and same(index, fresh(fam))
    _, _, again = index_of(fam, idx)  # their new times are recorded: nothing read now
    assert again.bytes_read == {} and again.verified == []


def test_a_renamed_family_reads_nothing(fam: Family, tmp_path: Path) -> None:
    """A renamed directory keeps its files (inode, size, mtime, status-change time): the rule
    is that such a source is known without reading."""
    idx = tmp_path / "idx"
    index_of(fam, idx)
    before = pieces(idx)
    moved = tmp_path / "renamed"
    os.rename(fam.root, moved)
    fam2 = Family(moved / fam.base.name, [moved / e.name for e in fam.experts], moved,
                  fam.dtype, fam.tensor_names)
    index, built, r = index_of(fam2, idx)
    assert not built and nothing_built(r) and r.bytes_read == {} and r.verified == []
    assert pieces(idx) == before and same(index, fresh(fam2))


@pytest.mark.parametrize("keep_times", [True, False])
def test_a_copied_family_is_hashed_once_and_reuses_every_piece(fam: Family, tmp_path: Path,
                                                               keep_times: bool) -> None:
    """A copy has new inodes (and, without -p, new mtimes): sizes and headers alone cannot
    tell two fine-tunes of one base apart, so each copied source is hashed once (never its
    statistics computed) and matched to the stored pieces by content."""
    idx = tmp_path / "idx"
    index_of(fam, idx)
    before = pieces(idx)
    copy = tmp_path / "copy"
    shutil.copytree(fam.root, copy, copy_function=shutil.copy2 if keep_times
                    else shutil.copyfile)
    fam2 = Family(copy / fam.base.name, [copy / e.name for e in fam.experts], copy,
                  fam.dtype, fam.tensor_names)
    index, built, r = index_of(fam2, idx)
    models = [fam2.base, *fam2.experts]
    assert not built and nothing_built(r) and sorted(r.verified) == sorted(map(str, models))
    assert r.bytes_read == r.verify_bytes == {str(m): float_bytes(m) for m in models}
    assert pieces(idx) == before and same(index, fresh(fam2))
    # the original family is still known by its own stamps: nothing read
    assert index_of(fam, idx)[2].bytes_read == {}


def _rewrite_every_tensor(model: Path) -> Path:
    """New bytes in every float tensor, same size, header and mtime (a fine-tune saved again
    over the old one)."""
    f = model / "model.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    for loc in open_source(model).tensors.values():
        if loc.dtype in FLOAT_DTYPES:
            data[loc.start + 1] ^= 0x01  # a low mantissa bit of the first element
    with open(f, "r+b") as out:
        out.write(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return f


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_an_expert_rewritten_in_place_is_read_once(fam: Family, tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    index_of(fam, idx)
    _rewrite_every_tensor(fam.experts[2])
    index_size = sum(p.stat().st_size for p in (idx / "pieces").iterdir())
    slack = 2 * index_size + 8192  # the index's own small files, read while loading
    e, size = str(fam.experts[2]), float_bytes(fam.experts[2])
    assert size > slack  # so that a second read of the expert would show in rchar
    base, experts = open_source(fam.base), [open_source(m) for m in fam.experts]
    r = BuildReport()
    try:
        r0 = _rchar()
        index, built = load_or_build(base, experts, BLOCK, idx, report=r, exact=True)
        rchar = _rchar() - r0
    finally:
        for c in [base, *experts]:
            c.close()
    assert built and r.experts_built == [e] and not r.base_built and r.pairs_built == 2
    # the verifying read stopped in its first chunk and handed it to the rebuild: every
    # byte of the changed expert read once
    assert 0 < r.verify_bytes[e] < size and r.bytes_read[e] == size
    assert r.verified == [] and set(r.verify_bytes) == {e}
    # and the process read nothing the build did not count but the index's own small files
    assert rchar <= sum(r.bytes_read.values()) + slack
    assert same(index, fresh(fam))


def test_a_changed_base_rebuilds_and_an_unchanged_copy_matches_old_pieces(
        fam: Family, tmp_path: Path) -> None:
    """Stale statistics are never used: a base rewritten in place (mtime kept) is rebuilt,
    and so are the expert pieces against it; the index equals a fresh build."""
    idx = tmp_path / "idx"
    index_of(fam, idx)
    _rewrite_every_tensor(fam.base)
    index, built, r = index_of(fam, idx)
    assert built and r.base_built and sorted(r.experts_built) == sorted(map(str, fam.experts))
    assert r.bytes_read[str(fam.base)] == float_bytes(fam.base)  # read once, as the expert
    assert same(index, fresh(fam))


def test_a_verified_source_is_served_from_an_index_directory_that_cannot_be_written(
        fam: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied family verified against a shared index it cannot write to (read-only, another
    machine's) is served: recording its new stamp is best effort, as the usage record is."""
    from mergefs.core.errors import SourceError
    from mergefs.index import store

    idx = tmp_path / "idx"
    index_of(fam, idx)
    copy = tmp_path / "copy"
    shutil.copytree(fam.root, copy)
    fam2 = Family(copy / fam.base.name, [copy / e.name for e in fam.experts], copy,
                  fam.dtype, fam.tensor_names)

    def refuse(path: Path, data: bytes, what: str) -> None:
        raise SourceError(f"{path}: cannot write the {what}: Read-only file system")

    monkeypatch.setattr(store, "write_beside", refuse)
    index, built, r = index_of(fam2, idx)
    assert not built and len(r.verified) == 4 and same(index, fresh(fam2))
