"""Tests of mergefs.sources.checkpoint against model directories written by the reference safetensors."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from mergefs.core import format as fmt
from mergefs.sources.base import INDEX_NAME, GapAllowance, ReadRange, coalesce
from mergefs.sources.local import Checkpoint
from mergefs.sources import open_source
from mergefs.core.errors import SourceChanged, SourceError

TORCH_TO_NAME = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample_tensors(seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"{prefix}embed.weight": torch.randn(8, 4, generator=g),
        f"{prefix}layers.0.attn.q.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        f"{prefix}layers.0.attn.q.bias": torch.randn(4, generator=g).to(torch.float16),
        f"{prefix}layers.0.norm.weight": torch.randn(4, generator=g).to(torch.float64),
        f"{prefix}layers.0.mask": torch.randint(0, 2, (3, 5), generator=g).to(torch.bool),
        f"{prefix}layers.0.ids": torch.randint(-100, 100, (6,), generator=g),
        f"{prefix}layers.0.fp8": torch.randn(2, 3, generator=g).to(torch.float8_e4m3fn),
        f"{prefix}layers.0.u16": torch.randint(0, 60000, (3,), generator=g).to(torch.uint16),
        f"{prefix}empty": torch.zeros(0, 3),
        f"{prefix}scalar": torch.tensor(3.5),
    }


def write_extras(root: Path) -> None:
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "tokenizer.json").write_text("{}")
    (root / "sub").mkdir()
    (root / "sub" / "notes.txt").write_text("hello")
    (root / ".hidden").write_text("x")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "sub" / ".secret").write_text("x")


@pytest.fixture
def single_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path / "single"
    root.mkdir()
    tensors = sample_tensors(0)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    write_extras(root)
    # Weights that must never be listed as extra files.
    (root / "pytorch_model.bin").write_bytes(b"not really a pickle")
    (root / "stray.safetensors").write_bytes(b"ignored")
    return root, tensors


def write_sharded(root: Path, seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    root.mkdir(exist_ok=True)
    shards = {
        "model-00001-of-00002.safetensors": sample_tensors(seed, "a."),
        "model-00002-of-00002.safetensors": sample_tensors(seed + 1, "b."),
    }
    weight_map = {}
    for fname, ts in shards.items():
        save_file(ts, root / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in ts})
    (root / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return shards


@pytest.fixture
def sharded_dir(tmp_path: Path) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path / "sharded"
    shards = write_sharded(root)
    write_extras(root)
    return root, shards


def assert_matches_safe_open(ckpt: Checkpoint, path: Path, file: str) -> set[str]:
    """Every tensor of ``path`` is in the map with the reference's shape, dtype and bytes."""
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            ref = f.get_tensor(name)
            loc = ckpt.tensors[name]
            assert loc.file == file
            assert loc.shape == tuple(ref.shape)
            assert loc.dtype == TORCH_TO_NAME[ref.dtype]
            assert loc.size_bytes == ref.numel() * ref.element_size()
            assert bytes(ckpt.read_tensor(name)) == tensor_bytes(ref)
    # The recorded range is absolute in the file.
    blob = path.read_bytes()
    for name in names:
        loc = ckpt.tensors[name]
        assert bytes(ckpt.read_tensor(name)) == blob[loc.start : loc.end]
    return names


# --------------------------------------------------------------------------------------------
# Layouts


def test_single_file_dir(single_dir):
    root, tensors = single_dir
    ckpt = open_source(root)
    try:
        assert ckpt.files == ("model.safetensors",)
        assert ckpt.index_json is None
        names = assert_matches_safe_open(ckpt, root / "model.safetensors", "model.safetensors")
        assert names == set(tensors) == set(ckpt.tensor_names())
        for name, t in tensors.items():
            assert bytes(ckpt.read_tensor(name)) == tensor_bytes(t)
        assert ckpt.headers["model.safetensors"].metadata == {"format": "pt"}
    finally:
        ckpt.close()


def test_extra_files_listed_hidden_and_weights_excluded(single_dir):
    root, _ = single_dir
    ckpt = open_source(root)
    assert ckpt.extra_files == ("config.json", "sub/notes.txt", "tokenizer.json")


def test_sharded_dir(sharded_dir):
    root, shards = sharded_dir
    ckpt = open_source(root)
    try:
        assert ckpt.files == tuple(sorted(shards))
        assert ckpt.index_json is not None
        all_names: set[str] = set()
        for fname, ts in shards.items():
            names = assert_matches_safe_open(ckpt, root / fname, fname)
            assert names == set(ts)
            all_names |= names
        assert set(ckpt.tensors) == all_names
        assert ckpt.extra_files == ("config.json", "sub/notes.txt", "tokenizer.json")
        assert set(ckpt.identities) == set(shards)
    finally:
        ckpt.close()


def test_bare_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    tensors = sample_tensors(3)
    save_file(tensors, path)
    (tmp_path / "config.json").write_text("{}")  # a sibling, not part of a bare-file source
    ckpt = open_source(path)
    try:
        assert ckpt.files == ("weights.safetensors",)
        assert ckpt.extra_files == ()
        assert ckpt.path_of("weights.safetensors") == path
        assert assert_matches_safe_open(ckpt, path, "weights.safetensors") == set(tensors)
    finally:
        ckpt.close()


def test_dir_with_one_oddly_named_safetensors(tmp_path):
    save_file({"w": torch.arange(4, dtype=torch.int32)}, tmp_path / "weights.safetensors")
    ckpt = open_source(tmp_path)
    assert ckpt.files == ("weights.safetensors",)
    assert bytes(ckpt.read_tensor("w")) == tensor_bytes(torch.arange(4, dtype=torch.int32))


def test_dir_with_several_safetensors_and_no_index(tmp_path):
    save_file({"w": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"v": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(SourceError, match=INDEX_NAME):
        open_source(tmp_path)


def test_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="no model.safetensors"):
        open_source(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        open_source(tmp_path / "nope")


# --------------------------------------------------------------------------------------------
# Identity


def test_identity_fields(single_dir):
    root, _ = single_dir
    path = root / "model.safetensors"
    ckpt = open_source(root)
    ident = ckpt.identities["model.safetensors"]
    st = os.stat(path)
    assert ident.path == str(path)
    assert ident.size_bytes == st.st_size
    assert ident.mtime_ns == st.st_mtime_ns
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    assert ident.header_xxh3 == xxhash.xxh3_128_hexdigest(blob[: 8 + n])
    assert ckpt.identity_json()["files"] == [ident.to_json()]
    assert ckpt.identity_key() == open_source(root).identity_key()  # stable
    ckpt.check_unchanged()  # nothing changed yet


def test_check_unchanged_after_rewrite(single_dir):
    root, tensors = single_dir
    path = root / "model.safetensors"
    ckpt = open_source(root)
    old_ident = ckpt.identities["model.safetensors"]
    changed = dict(tensors)
    changed["extra"] = torch.ones(7)
    save_file(changed, path, metadata={"format": "pt"})
    with pytest.raises(SourceChanged) as info:
        ckpt.check_unchanged()
    assert str(path) in str(info.value)
    new_ident = open_source(root).identities["model.safetensors"]
    assert new_ident.size_bytes != old_ident.size_bytes
    assert new_ident.header_xxh3 != old_ident.header_xxh3
    assert open_source(root).identity_key() != ckpt.identity_key()


def test_check_unchanged_same_size_rewrite(single_dir):
    # Same size, different bytes: caught by the mtime even if the clock did not tick.
    root, tensors = single_dir
    path = root / "model.safetensors"
    ckpt = open_source(root)
    ident = ckpt.identities["model.safetensors"]
    changed = {k: (v + 1 if v.dtype == torch.float32 and v.numel() else v) for k, v in tensors.items()}
    save_file(changed, path, metadata={"format": "pt"})
    assert os.stat(path).st_size == ident.size_bytes
    os.utime(path, ns=(ident.mtime_ns + 1_000_000, ident.mtime_ns + 1_000_000))
    with pytest.raises(SourceChanged):
        ckpt.check_unchanged()


def test_check_unchanged_when_file_vanishes(single_dir):
    root, _ = single_dir
    ckpt = open_source(root)
    (root / "model.safetensors").unlink()
    with pytest.raises(SourceChanged, match="vanished"):
        ckpt.check_unchanged()


def test_read_of_truncated_file_is_source_changed(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, path)
    ckpt = open_source(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(SourceChanged, match="truncated"):
        ckpt.read_tensor("w")
    ckpt.close()


# --------------------------------------------------------------------------------------------
# read_ranges


@pytest.fixture
def byte_file(tmp_path: Path) -> tuple[Checkpoint, bytes]:
    path = tmp_path / "bytes.safetensors"
    save_file({"data": torch.arange(256, dtype=torch.uint8)}, path)
    ckpt = open_source(path)
    yield ckpt, path.read_bytes()
    ckpt.close()


def test_read_ranges_adjacent_coalesce(byte_file):
    ckpt, blob = byte_file
    f = ckpt.files[0]
    base = ckpt.tensors["data"].start
    assert (ckpt.counters.reads, ckpt.counters.bytes_read) == (0, 0)
    views = ckpt.read_ranges([ReadRange(f, base, base + 10), ReadRange(f, base + 10, base + 30)])
    assert ckpt.counters.reads == 1
    assert ckpt.counters.bytes_read == 30
    assert [bytes(v) for v in views] == [bytes(range(10)), bytes(range(10, 30))]


def test_read_ranges_gap_is_not_coalesced(byte_file):
    ckpt, blob = byte_file
    f = ckpt.files[0]
    base = ckpt.tensors["data"].start
    views = ckpt.read_ranges([ReadRange(f, base, base + 10), ReadRange(f, base + 11, base + 30)])
    assert ckpt.counters.reads == 2
    assert ckpt.counters.bytes_read == 29  # the gap byte is not read
    assert [bytes(v) for v in views] == [bytes(range(10)), bytes(range(11, 30))]


def test_read_ranges_overlapping_share_one_read(byte_file):
    ckpt, blob = byte_file
    f = ckpt.files[0]
    base = ckpt.tensors["data"].start
    views = ckpt.read_ranges(
        [ReadRange(f, base + 5, base + 20), ReadRange(f, base, base + 10), ReadRange(f, base + 8, base + 9)]
    )
    assert ckpt.counters.reads == 1
    assert ckpt.counters.bytes_read == 20
    assert [bytes(v) for v in views] == [bytes(range(5, 20)), bytes(range(10)), bytes([8])]


def test_read_ranges_keeps_requested_order(byte_file):
    ckpt, blob = byte_file
    f = ckpt.files[0]
    ranges = [
        ReadRange(f, 200, 210),
        ReadRange(f, 0, 8),
        ReadRange(f, 100, 150),
        ReadRange(f, 210, 220),  # adjacent to the first, requested later
        ReadRange(f, 50, 60),
    ]
    views = ckpt.read_ranges(ranges)
    assert len(views) == len(ranges)
    assert [bytes(v) for v in views] == [blob[r.start : r.end] for r in ranges]
    assert ckpt.counters.reads == 4  # [0,8) [50,60) [100,150) [200,220)
    assert ckpt.counters.bytes_read == 8 + 10 + 50 + 20


def test_read_ranges_counts_accumulate(byte_file):
    ckpt, blob = byte_file
    loc = ckpt.tensors["data"]
    ckpt.read_tensor("data")
    ckpt.read_tensor("data")
    assert ckpt.counters.reads == 2
    assert ckpt.counters.bytes_read == 2 * loc.size_bytes == 512


def test_read_ranges_across_shards(sharded_dir):
    root, shards = sharded_dir
    ckpt = open_source(root)
    f1, f2 = sorted(shards)
    a = ckpt.tensors["a.embed.weight"]
    b = ckpt.tensors["b.embed.weight"]
    assert (a.file, b.file) == (f1, f2)
    # Same offsets in two different files must never coalesce.
    views = ckpt.read_ranges([ReadRange(f2, b.start, b.end), ReadRange(f1, a.start, a.end)])
    assert ckpt.counters.reads == 2
    assert ckpt.counters.bytes_read == a.size_bytes + b.size_bytes
    assert bytes(views[0]) == tensor_bytes(shards[f2]["b.embed.weight"])
    assert bytes(views[1]) == tensor_bytes(shards[f1]["a.embed.weight"])
    ckpt.close()


def test_read_ranges_from_threads(byte_file):
    from concurrent.futures import ThreadPoolExecutor

    ckpt, blob = byte_file
    f = ckpt.files[0]
    ranges = [ReadRange(f, k, k + 16) for k in range(0, 256, 16)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: bytes(ckpt.read_ranges([r])[0]), ranges * 4))
    assert results == [blob[r.start : r.end] for r in ranges] * 4
    assert ckpt.counters.reads == 64
    assert ckpt.counters.bytes_read == 64 * 16


# --------------------------------------------------------------------------------------------
# Refusals and broken sources


def test_pickle_dir_refused(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError) as info:
        open_source(tmp_path)
    assert "safetensors" in str(info.value)
    assert "pytorch_model.bin" in str(info.value)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.ckpt"])
def test_bare_pickle_path_refused(tmp_path, name):
    path = tmp_path / name
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(SourceError) as info:
        open_source(path)
    assert "safetensors" in str(info.value)
    assert name in str(info.value)


def test_bare_non_safetensors_file_refused(tmp_path):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"PK")
    with pytest.raises(SourceError, match="not a .safetensors"):
        open_source(path)


def _rewrite_index(root: Path, edit) -> None:
    index = json.loads((root / INDEX_NAME).read_text())
    edit(index["weight_map"])
    (root / INDEX_NAME).write_text(json.dumps(index))


def test_index_names_missing_file(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    _rewrite_index(root, lambda wm: wm.update({"a.embed.weight": "model-00003-of-00002.safetensors"}))
    with pytest.raises(SourceError) as info:
        open_source(root)
    assert type(info.value) is SourceError
    assert "model-00003-of-00002.safetensors" in str(info.value)
    assert INDEX_NAME in str(info.value)


def test_index_names_missing_tensor(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    _rewrite_index(root, lambda wm: wm.update({"ghost.weight": "model-00001-of-00002.safetensors"}))
    with pytest.raises(SourceError) as info:
        open_source(root)
    msg = str(info.value)
    assert "ghost.weight" in msg and "model-00001-of-00002.safetensors" in msg
    assert INDEX_NAME in msg


def test_index_maps_tensor_to_wrong_shard(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    _rewrite_index(root, lambda wm: wm.update({"a.embed.weight": "model-00002-of-00002.safetensors"}))
    with pytest.raises(SourceError) as info:
        open_source(root)
    msg = str(info.value)
    assert "a.embed.weight" in msg and "model-00001-of-00002.safetensors" in msg


def test_tensor_not_in_weight_map(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    _rewrite_index(root, lambda wm: wm.pop("b.scalar"))
    with pytest.raises(SourceError) as info:
        open_source(root)
    msg = str(info.value)
    assert "b.scalar" in msg and INDEX_NAME in msg


def test_index_path_escaping_the_directory(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    # The target exists, so only the escape check can refuse it.
    save_file({"a.embed.weight": torch.zeros(1)}, tmp_path / "x.safetensors")
    _rewrite_index(root, lambda wm: wm.update({"a.embed.weight": "../x.safetensors"}))
    with pytest.raises(SourceError) as info:
        open_source(root)
    assert "../x.safetensors" in str(info.value)
    assert "escapes" in str(info.value)


def test_index_absolute_path_refused(tmp_path):
    root = tmp_path / "m"
    write_sharded(root)
    target = tmp_path / "x.safetensors"
    save_file({"a.embed.weight": torch.zeros(1)}, target)
    _rewrite_index(root, lambda wm: wm.update({"a.embed.weight": str(target)}))
    with pytest.raises(SourceError, match="escapes"):
        open_source(root)


@pytest.mark.parametrize("content", ["not json", json.dumps({"weight_map": {"a": 1}}), "[]"])
def test_malformed_index(tmp_path, content):
    root = tmp_path / "m"
    write_sharded(root)
    (root / INDEX_NAME).write_text(content)
    with pytest.raises(SourceError) as info:
        open_source(root)
    assert INDEX_NAME in str(info.value)


def test_tensor_in_two_shards(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    save_file({"w": torch.zeros(2)}, root / "s1.safetensors")
    save_file({"w": torch.ones(2)}, root / "s2.safetensors")
    (root / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    # s2 is not named by the index, so it is not a weight file at all.
    assert open_source(root).files == ("s1.safetensors",)
    (root / INDEX_NAME).write_text(
        json.dumps({"weight_map": {"w": "s1.safetensors", "w2": "s2.safetensors"}})
    )
    with pytest.raises(SourceError, match="also appears"):
        open_source(root)


def _truncation_points(blob: bytes) -> dict[str, tuple[int, type]]:
    (n,) = struct.unpack("<Q", blob[:8])
    return {
        "inside-length": (5, fmt.HeaderTooShort),
        "inside-header": (8 + n // 2, fmt.HeaderOutOfBounds),
        "inside-data": (len(blob) - 3, fmt.BufferSizeMismatch),
    }


@pytest.mark.parametrize("where", ["inside-length", "inside-header", "inside-data"])
@pytest.mark.parametrize("layout", ["dir", "bare"])
def test_truncated_safetensors_is_format_error_naming_the_path(tmp_path, where, layout):
    root = tmp_path / "m"
    root.mkdir()
    path = root / "model.safetensors"
    save_file(sample_tensors(5), path)
    blob = path.read_bytes()
    cut, expected = _truncation_points(blob)[where]
    path.write_bytes(blob[:cut])
    with pytest.raises(fmt.FormatError) as info:
        open_source(root if layout == "dir" else path)
    assert type(info.value) is expected
    assert str(path) in str(info.value)


def test_shard_with_bad_header_names_the_shard(tmp_path):
    root = tmp_path / "m"
    shards = write_sharded(root)
    bad = root / sorted(shards)[1]
    blob = bad.read_bytes()
    bad.write_bytes(blob + b"\x00")  # a trailing byte past the buffer
    with pytest.raises(fmt.BufferSizeMismatch) as info:
        open_source(root)
    assert str(bad) in str(info.value)


# -- the gap allowance (issue 14: coalesced gap bytes count against the budget) ----------------
def test_coalesce_takes_gaps_from_the_allowance_until_spent():
    # gaps of 5, 3 and 4 bytes, all within the 8-byte threshold; overlaps and touches are free
    ranges = [ReadRange("f", 0, 10), ReadRange("f", 15, 20), ReadRange("f", 20, 25),
              ReadRange("f", 22, 24), ReadRange("f", 28, 30), ReadRange("f", 34, 40)]
    allowance = GapAllowance(8)
    runs = coalesce(ranges, 8, allowance)
    assert [(r.start, r.end) for r in runs] == [(0, 30), (34, 40)]  # 5 + 3 taken; 4 refused
    assert allowance.spent_bytes == 8 == sum(r.end - r.start - r.covered_bytes for r in runs)
    none_left = GapAllowance(0)
    assert [(r.start, r.end) for r in coalesce(ranges, 8, none_left)] == \
        [(0, 10), (15, 25), (28, 30), (34, 40)]  # touching and overlapping still share
    assert none_left.spent_bytes == 0
    unlimited = GapAllowance(None)
    assert [(r.start, r.end) for r in coalesce(ranges, 8, unlimited)] == \
        [(r.start, r.end) for r in coalesce(ranges, 8)] == [(0, 40)]
    assert unlimited.spent_bytes == 12


def test_gap_allowance_is_never_overspent_by_concurrent_takers():
    import random
    import threading

    allowance = GapAllowance(100_003)
    taken: list[int] = []
    start = threading.Barrier(8)

    def taker(seed: int) -> None:
        rng = random.Random(seed)
        mine = 0
        start.wait()
        for _ in range(5000):
            n = rng.randint(1, 97)
            if allowance.take(n):
                mine += n
        taken.append(mine)

    threads = [threading.Thread(target=taker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(taken) == allowance.spent_bytes <= allowance.limit_bytes
    assert allowance.spent_bytes > allowance.limit_bytes - 97  # demand far above the limit
    assert not allowance.take(97) and allowance.take(0)
    with pytest.raises(ValueError, match="limit_bytes"):
        GapAllowance(-1)


# --------------------------------------------------------------------------------------------
# What callers outside sources/ ask of any source (remote sources: tests/test_remote.py)


def test_local_source_files_aux_and_advice(single_dir):
    root, _ = single_dir
    ckpt = open_source(root)
    try:
        root = Path(ckpt.root)
        assert ckpt.extra_dir() == root
        assert ckpt.local_files() == [(str(root), root / rel)
                                      for rel in (*ckpt.files, *ckpt.extra_files)]
        assert list(ckpt.file_ctimes()) == [str(root / "model.safetensors")]
        ckpt.will_need([ReadRange("model.safetensors", 0, 64)])  # advice: nothing read
        assert (ckpt.counters.bytes_read, ckpt.counters.reads) == (0, 0)
        ckpt.check_unchanged_for_reuse()
        assert ckpt.read_aux("derived.bin") is None and ckpt.aux_reader("derived.bin") is None
        ckpt.check_writable_aux("a derived file", "nothing")
        where = ckpt.write_aux("derived.bin", b"bytes", "derived file")
        assert where == str(root / "derived.bin") and ckpt.read_aux("derived.bin") == b"bytes"
        aux = ckpt.aux_reader("derived.bin")
        assert aux is not None and (aux.where, aux.path, aux.fetch) == (where, root / "derived.bin",
                                                                        None)
        assert not any(p.name.startswith(".derived.bin.tmp") for p in root.iterdir())
        (root / "model.safetensors").write_bytes(b"replaced")
        with pytest.raises(SourceChanged):
            ckpt.check_unchanged_for_reuse()
    finally:
        ckpt.close()


def test_bare_file_aux_files_live_beside_it(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file(sample_tensors(3), path)
    ckpt = open_source(path)
    try:
        assert ckpt.extra_dir() == tmp_path and ckpt.extra_files == ()
        assert ckpt.local_files() == [(str(path), path)]
        assert ckpt.write_aux("weights.x", b"1", "x") == str(tmp_path / "weights.x")
        (tmp_path / "weights.y").mkdir()  # the rename over a directory fails
        with pytest.raises(SourceError, match="weights.y: cannot write the derived file"):
            ckpt.write_aux("weights.y", b"1", "derived file")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors",
                                                               "weights.x", "weights.y"]
    finally:
        ckpt.close()
