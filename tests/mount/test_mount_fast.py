"""The mount's fast paths on real mounts: the widened readahead window, units pushed into the
kernel page cache ahead of readers (notify_store) and ``--warm``. Every byte read back, with
``read`` and with ``mmap``, equals ``mergefs merge``'s output."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest
from families import Family
from mounting import MOUNT_MARKS, Mounts, merge, sha256
pytestmark = MOUNT_MARKS
from viewcases import tree, write_case_spec

from mergefs.mount.lifecycle import READ_AHEAD_KB, mount_device


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mount_fast_index")


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mmap_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return bytes(m[:])


def seq_bytes(path: Path, block: int) -> bytes:
    parts = []
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while chunk := os.pread(fd, block, off):
            parts.append(chunk)
            off += len(chunk)
    finally:
        os.close(fd)
    return b"".join(parts)


def test_readahead_window_is_widened(tmp_path: Path, index_dir: Path, family_f32: Family,
                                     mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    m = mounts.start(spec)
    dev = mount_device(m.path)
    assert dev is not None and dev == (os.major(os.stat(m.path).st_dev),
                                       os.minor(os.stat(m.path).st_dev))
    knob = Path(f"/sys/class/bdi/{dev[0]}:{dev[1]}/read_ahead_kb")
    if os.geteuid() != 0:
        pytest.skip("only root may set the readahead window")
    import time

    # set by the server once the kernel routes requests to it (after the first stat): poll
    deadline = time.monotonic() + 10
    while int(knob.read_text()) != READ_AHEAD_KB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(knob.read_text()) == READ_AHEAD_KB
    assert "readahead window" in m.log.read_text()


@pytest.mark.parametrize("case", ["task_arithmetic", "ties"])
def test_reads_with_pushed_pages_equal_merge(tmp_path: Path, index_dir: Path,
                                             family_sharded: Family, mounts: Mounts,
                                             case: str) -> None:
    """Sequential readers in small and large requests, and mmap readers, while units merged
    ahead are pushed into the page cache; the kernel's copy is dropped between passes."""
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, case, index_dir,
                           budget="full")
    out = merge(spec, tmp_path / "out")
    want = {rel: p.read_bytes() for rel, p in tree(out).items() if rel.endswith(".safetensors")}
    m = mounts.start(spec)
    for rel, blob in sorted(want.items()):
        assert seq_bytes(m.path / rel, 4096) == blob, rel
        evict(m.path / rel)
        assert mmap_bytes(m.path / rel) == blob, rel
        evict(m.path / rel)
        assert seq_bytes(m.path / rel, 1 << 20) == blob, rel
    stats = m.stats()
    assert stats["kernel_pages"]["enabled"] and stats["kernel_pages"]["store_errors"] == 0
    assert stats["read_errors"] == 0
    # (these files are ~100 KiB: the 4 MiB readahead window asks for a whole file in a few
    # requests, so whether units are merged ahead and pushed depends on timing; the pushes
    # themselves are checked by the warm-up tests below and, page by page, in test_pages.py)


def wait_warm(m: object, seconds: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + seconds
    while True:
        warm = m.stats()["kernel_pages"]["warm"]  # type: ignore[attr-defined]
        if warm["seconds"] is not None and not warm["running"]:
            return warm  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, warm
        time.sleep(0.05)


@pytest.mark.parametrize("family_name", ["family_bf16", "family_sharded"])
def test_warm_mount_serves_the_merge(request: pytest.FixtureRequest, tmp_path: Path,
                                     index_dir: Path, mounts: Mounts, family_name: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", index_dir)
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec, "--warm")
    warm = wait_warm(m)
    assert warm["errors"] == 0 and warm["units"] > 0  # type: ignore[operator]
    stats = m.stats()
    assert stats["kernel_pages"]["stored_bytes"] > 0
    merges = stats["cache"]["merges"]
    # the pushed pages are what mmap and read see first: the bytes of the merge
    files = {rel: p for rel, p in tree(out).items()}
    for rel, p in sorted(files.items()):
        if rel.endswith(".safetensors"):
            assert mmap_bytes(m.path / rel) == p.read_bytes(), rel
    assert {rel: sha256(m.path / rel) for rel in files} == {rel: sha256(p)
                                                             for rel, p in files.items()}
    after = m.stats()
    assert after["cache"]["merges"] == merges  # everything was merged by the warm-up
    assert after["read_errors"] == 0


def test_warm_mount_with_a_small_cache_stops_and_still_serves(tmp_path: Path, index_dir: Path,
                                                              family_f32: Family,
                                                              mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec, "--warm", "--cache-size", "16KiB", foreground=False)
    warm = wait_warm(m)
    assert 0 < warm["bytes"] <= 16 * 1024  # type: ignore[operator]
    got = seq_bytes(m.path / "model.safetensors", 1 << 20)
    assert got == (out / "model.safetensors").read_bytes()
