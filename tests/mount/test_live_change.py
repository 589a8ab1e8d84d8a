"""Sources that change under a live mount, and after it: an error or the old merge's bytes, never
a mixture; ``mergefs index`` notices and rebuilds; a remount serves the new merge only.

Every change here keeps the file's size and header and puts its mtime back, so the file identity
(size, mtime, header hash) cannot see it: only the per-block hashes (reads) and the status-change
time (``mergefs index``) can.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from families import INT_TENSOR_NAME, Family, make_family
from mounting import Mounts, merge, run_cli
from viewcases import write_case_spec

from mergefs.engine.session import Session
from mergefs.spec.load import load_spec

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                       reason="needs /dev/fuse and fusermount3"),
]

READ_FIRST = "model.layers.0.mlp.up_proj.weight"  # merged and cached before the change
CHANGED = "lm_head.weight"  # one byte of expert-1 flipped in a planned block
UNTOUCHED = "model.embed_tokens.weight"  # first read after the change
PAGE = 4096


@pytest.fixture
def fam(tmp_path: Path) -> Family:
    return make_family(tmp_path / "fam", n_experts=2, seed=41)  # own copy: the tests modify it


def tensor_range(merged: Path, name: str) -> tuple[int, int]:
    with open(merged, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        a, b = json.loads(f.read(n))[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def flip_planned_byte(spec: Path, expert: int, tensor: str, which: float = 0.5
                      ) -> tuple[Path, tuple[int, int]]:
    """Flip one byte of a block of ``tensor`` that the plan reads from ``expert``; keep size and
    mtime. Returns the file and the block's output byte range within the tensor."""
    s = Session(load_spec(spec))
    try:
        lay = s.index.layout
        planned = [b for b in lay.blocks_of(lay.tensor_index()[tensor])
                   if s.plan.selected[expert, b]]
        b = planned[int(which * (len(planned) - 1))]
        loc = s.experts[expert].tensors[tensor]
        pos = loc.start + int(lay.elem_start[b]) * 4 + 5
        path = s.experts[expert].path_of(loc.file)
        unit = s.engine.unit_out_range(tensor, b, b + 1)
    finally:
        s.close()
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(1)
        f.seek(pos)
        f.write(bytes([old[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size
    return path, unit


def direct_pread(path: Path, size: int, offset: int) -> bytes:
    """A read the kernel passes to the mount as is (no page cache, no readahead)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def test_source_changed_under_live_mount(tmp_path: Path, fam: Family, mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "idx",
                           budget="full")
    old = merge(spec, tmp_path / "old") / "model.safetensors"
    old_bytes = old.read_bytes()
    m = mounts.start(spec)
    served = m.path / "model.safetensors"

    a0, a1 = tensor_range(old, READ_FIRST)
    with open(served, "rb") as f:  # merged, verified and cached before the change
        f.seek(a0)
        assert f.read(a1 - a0) == old_bytes[a0:a1]

    changed_file, (u0, u1) = flip_planned_byte(spec, 1, CHANGED)
    c0, _ = tensor_range(old, CHANGED)
    bad0, bad1 = c0 + u0, c0 + u1  # the changed unit's bytes in the served file

    # the changed tensor, not cached yet: EIO (through the page cache, as a reader sees it)
    with open(served, "rb") as f:
        f.seek(bad0)
        with pytest.raises(OSError) as exc:
            f.read(bad1 - bad0)
        assert exc.value.errno == errno.EIO
    # a tensor never read before, untouched by the change: the right bytes
    t0, t1 = tensor_range(old, UNTOUCHED)
    with open(served, "rb") as f:
        f.seek(t0)
        assert f.read(t1 - t0) == old_bytes[t0:t1]
    # the tensor cached before the change: still the old merge's bytes
    assert direct_pread(served, a1 - a0, a0) == old_bytes[a0:a1]

    # every page of the file: an error exactly where the changed unit is, else the old merge
    failed = []
    for off in range(0, len(old_bytes), PAGE):
        try:
            got = direct_pread(served, PAGE, off)
        except OSError as e:
            assert e.errno == errno.EIO
            failed.append(off)
            continue
        assert got == old_bytes[off:off + PAGE], f"page at {off} differs from the old merge"
    assert failed == list(range(bad0 // PAGE * PAGE, bad1, PAGE)), (failed, bad0, bad1)

    stats = m.stats()
    assert stats["read_errors"] >= 1 + len(failed)
    log = m.log.read_text()
    assert f"{changed_file}: bytes of {CHANGED!r} differ from the index" in log, log

    # `mergefs index` sees the change (its identity did not) and says why it rebuilds
    res = run_cli("index", str(spec))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("built index"), res.stdout
    assert "building block index:" in res.stderr and str(changed_file) in res.stderr, res.stderr
    again = run_cli("index", str(spec))
    assert again.stdout.startswith("reused index"), again.stdout + again.stderr

    # a new mount serves the new merge, everywhere
    mounts.stop(m)
    new = merge(spec, tmp_path / "new") / "model.safetensors"
    assert new.read_bytes() != old_bytes
    m2 = mounts.start(spec, name="mnt2")
    assert (m2.path / "model.safetensors").read_bytes() == new.read_bytes()
    assert m2.stats()["read_errors"] == 0


def test_remount_after_change_never_serves_stale_persistent_cache(
        tmp_path: Path, fam: Family, mounts: Mounts) -> None:
    """Units cached on disk before a change must not be mixed with units merged after it."""
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "idx",
                           budget="full")
    cache = tmp_path / "cache"
    old = merge(spec, tmp_path / "old") / "model.safetensors"
    m1 = mounts.start(spec, "--cache-dir", str(cache), name="m1")
    a0, a1 = tensor_range(old, READ_FIRST)
    assert direct_pread(m1.path / "model.safetensors", a1 - a0, a0) == old.read_bytes()[a0:a1]
    assert m1.stats()["units_merged"] > 0
    mounts.stop(m1)  # finishes the disk writes

    flip_planned_byte(spec, 0, READ_FIRST)  # a unit now on disk, merged from the old bytes
    flip_planned_byte(spec, 1, CHANGED)  # a unit never cached
    res = run_cli("index", str(spec))  # what the EIO message tells the user to run
    assert res.returncode == 0 and res.stdout.startswith("built index"), res.stdout + res.stderr
    new = merge(spec, tmp_path / "new") / "model.safetensors"

    m2 = mounts.start(spec, "--cache-dir", str(cache), name="m2")
    got = (m2.path / "model.safetensors").read_bytes()
    assert got[a0:a1] == new.read_bytes()[a0:a1], "a stale cached unit was served"
    assert got == new.read_bytes()
    assert m2.stats()["cache"]["disk_hits"] == 0


def test_changed_base_under_live_mount_is_eio(tmp_path: Path, fam: Family,
                                              mounts: Mounts) -> None:
    """The base is read for every unit: a changed base block fails its unit, for any budget.
    Tensors passed through from the base (integers: no index hashes) are checked too."""
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "linear", tmp_path / "idx",
                           budget="0%")
    old = merge(spec, tmp_path / "old") / "model.safetensors"
    m = mounts.start(spec)
    s = Session(load_spec(spec))
    try:
        lay = s.index.layout
        b = list(lay.blocks_of(lay.tensor_index()[CHANGED]))[3]
        loc = s.base.tensors[CHANGED]
        pos = loc.start + int(lay.elem_start[b]) * 4 + 2
        u0, u1 = s.engine.unit_out_range(CHANGED, b, b + 1)
        path = s.base.path_of(loc.file)
    finally:
        s.close()
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    c0, _ = tensor_range(old, CHANGED)
    with pytest.raises(OSError) as exc:
        direct_pread(m.path / "model.safetensors", u1 - u0, c0 + u0)
    assert exc.value.errno == errno.EIO
    ok = direct_pread(m.path / "model.safetensors", u0, c0)  # the blocks before it
    assert ok == old.read_bytes()[c0:c0 + u0]
    assert f"{path}: bytes of {CHANGED!r} differ from the index" in m.log.read_text()

    # an integer tensor, passed through from the base, changed after the mount started
    s = Session(load_spec(spec))
    try:
        loc = s.base.tensors[INT_TENSOR_NAME]
    finally:
        s.close()
    with open(path, "r+b") as f:
        f.seek(loc.start + 9)
        byte = f.read(1)
        f.seek(loc.start + 9)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    i0, i1 = tensor_range(old, INT_TENSOR_NAME)
    with pytest.raises(OSError) as exc:
        direct_pread(m.path / "model.safetensors", i1 - i0, i0)
    assert exc.value.errno == errno.EIO
    assert f"{path}: bytes of {INT_TENSOR_NAME!r} changed since the mount started" in \
        m.log.read_text()
