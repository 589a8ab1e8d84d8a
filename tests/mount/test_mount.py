"""Real FUSE mounts in subprocesses (``python -m mergefs.cli mount ...``), always unmounted.

Every mount is started through the ``mounts`` fixture, whose finalizer terminates the server
and runs ``fusermount3 -u -z`` whatever happened in the test.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from families import Family
from viewcases import CASES, tree, write_case_spec

from mergefs.engine.session import Session
from mergefs.engine.manifest import read_manifest
from mergefs.spec.load import load_spec
from mounting import Mounts, is_mounted, merge, run_cli, sha256, wait_gone

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                       reason="needs /dev/fuse and fusermount3"),
]

TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mount_index")


def header_of(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return {"size": 8 + n, **json.loads(f.read(n))}


# -- byte identity ------------------------------------------------------------------------------


@pytest.mark.parametrize("family_name", ["family_f32", "family_sharded"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_file_identical_to_merge(request: pytest.FixtureRequest, tmp_path: Path,
                                       index_dir: Path, mounts: Mounts, family_name: str,
                                       case: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec = write_case_spec(tmp_path / "spec.yaml", fam, case, index_dir)
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    want = {rel: sha256(p) for rel, p in tree(out).items()}
    got = {rel: sha256(p) for rel, p in tree(m.path).items()}
    assert got == want
    assert sorted(os.listdir(m.path / ".mergefs")) == ["manifest.jsonl", "stats.json"]


def test_safe_open_reads_every_tensor(tmp_path: Path, index_dir: Path, family_bf16: Family,
                                      family_sharded: Family, mounts: Mounts) -> None:
    import torch
    from safetensors import safe_open

    for k, (fam, case) in enumerate([(family_bf16, "dare_ties"), (family_sharded, "ties")]):
        spec = write_case_spec(tmp_path / f"spec{k}.yaml", fam, case, index_dir)
        out = merge(spec, tmp_path / f"out{k}")
        m = mounts.start(spec, name=f"mnt{k}")
        files = sorted(p for p in tree(out) if p.endswith(".safetensors"))
        n = 0
        for rel in files:
            with safe_open(m.path / rel, framework="pt") as got, \
                    safe_open(out / rel, framework="pt") as want:
                assert sorted(got.keys()) == sorted(want.keys())
                assert got.metadata() == want.metadata() == {"format": "pt"}
                for name in want.keys():  # noqa: SIM118 - safe_open is not a dict
                    a, b = got.get_tensor(name), want.get_tensor(name)
                    assert a.dtype == b.dtype and a.shape == b.shape
                    assert torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
                    n += 1
        assert n == len(fam.tensor_names)


def test_from_pretrained_logits_equal(tmp_path: Path, llama_family: Family,
                                      mounts: Mounts) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = write_case_spec(tmp_path / "spec.yaml", llama_family, "task_arithmetic",
                           tmp_path / "index", budget="50%", block_size="4KiB")
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec)
    ids = torch.tensor([[1, 5, 9, 42, 7, 100, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(m.path).eval()(ids).logits
    assert torch.equal(got, want)
    stats = m.stats()
    assert 0 < stats["expert_bytes_read"] <= stats["planned_expert_bytes"]
    assert stats["read_errors"] == 0


# -- physical reads -----------------------------------------------------------------------------


def test_one_tensor_reads_only_its_planned_blocks(tmp_path: Path, index_dir: Path,
                                                  family_f32: Family, mounts: Mounts) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    out = merge(spec_path, tmp_path / "out")
    # what the plan says a read of TENSOR needs, from an independent session (same plan)
    s = Session(load_spec(spec_path))
    try:
        lay = s.index.layout
        bb = lay.block_bytes()
        blocks = list(lay.blocks_of(lay.tensor_index()[TENSOR]))
        want_reads = set()
        for label, src, planned in [("base", s.base, blocks)] + [
                (s.engine.labels[i], e, [b for b in blocks if s.plan.selected[i, b]])
                for i, e in enumerate(s.experts)]:
            loc = src.tensors[TENSOR]
            for b in planned:
                want_reads.add((label, loc.start + int(lay.elem_start[b]) * 4,
                                loc.start + int(lay.elem_end[b]) * 4))
        want_bytes = {label: 0 for label in ["base", *s.engine.labels]}
        for label, a, b in want_reads:
            want_bytes[label] += b - a
        assert want_bytes["base"] == int(sum(bb[b] for b in blocks))
    finally:
        s.close()
    m = mounts.start(spec_path)
    hdr = header_of(out / "model.safetensors")  # reading the mount's would page in more
    a, b = (hdr["size"] + x for x in hdr[TENSOR]["data_offsets"])
    fd = os.open(m.path / "model.safetensors", os.O_RDONLY | os.O_DIRECT)  # no page readahead
    try:
        data = os.pread(fd, b - a, a)
    finally:
        os.close(fd)
    assert data == (out / "model.safetensors").read_bytes()[a:b]
    stats = m.stats()
    assert stats["physical_bytes_read"] == want_bytes
    assert stats["expert_bytes_read"] < 3 * want_bytes["base"]  # the plan skipped some
    recs = [json.loads(x) for x in (m.path / ".mergefs" / "manifest.jsonl").read_text()
            .splitlines()]
    reads = {(r["source"], r["start"], r["end"]) for r in recs if r["type"] == "read"}
    assert {r.get("tensor") for r in recs[1:]} == {TENSOR}
    assert reads == want_reads


def test_eight_threads_random_ranges(tmp_path: Path, index_dir: Path, family_sharded: Family,
                                     mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "dare_linear", index_dir)
    out = merge(spec, tmp_path / "out")
    files = {rel: p.read_bytes() for rel, p in tree(out).items()}
    m = mounts.start(spec, "--cache-size", "16KiB")  # far below the model: evictions
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        fds = {rel: os.open(m.path / rel, os.O_RDONLY) for rel in files}
        try:
            for _ in range(200):
                rel = rng.choice(sorted(files))
                blob = files[rel]
                off = rng.randrange(len(blob))
                size = rng.randrange(1, 40000)
                if os.pread(fds[rel], size, off) != blob[off:off + size]:
                    errors.append(f"{rel} [{off}, +{size})")
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert m.stats()["read_errors"] == 0


# -- read-only, lifecycle -----------------------------------------------------------------------


def test_writes_refused(tmp_path: Path, index_dir: Path, family_f32: Family,
                        mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "linear", index_dir)
    m = mounts.start(spec)
    p = m.path / "model.safetensors"
    attempts = [
        lambda: os.open(p, os.O_RDWR),
        lambda: os.open(p, os.O_WRONLY | os.O_APPEND),
        lambda: os.open(m.path / "new.txt", os.O_WRONLY | os.O_CREAT),
        lambda: os.mkdir(m.path / "d"),
        lambda: os.unlink(m.path / "config.json"),
        lambda: os.rename(m.path / "config.json", m.path / "c.json"),
        lambda: os.chmod(p, 0o666),
        lambda: os.truncate(p, 0),
        lambda: os.setxattr(p, "user.x", b"1"),
        lambda: os.symlink("config.json", m.path / "link"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EROFS
    assert sha256(p) == sha256(p)  # still readable
    st = os.stat(p)
    assert st.st_mode & 0o777 == 0o444 and os.stat(m.path).st_mode & 0o777 == 0o555


def test_sigterm_unmounts_and_finalises_manifest(tmp_path: Path, index_dir: Path,
                                                 family_sharded: Family, mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic", index_dir)
    m = mounts.start(spec)
    for p in tree(m.path).values():
        p.read_bytes()
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(30) == 0
    assert not is_mounted(m.path)
    contents = read_manifest(load_spec(spec).manifest)
    assert contents.torn_lines == 0 and contents.totals is not None
    assert contents.totals["blocks_merged"] > 0 and contents.reads
    assert run_cli("replay", load_spec(spec).manifest).returncode == 0


def test_daemon_stats_and_umount(tmp_path: Path, index_dir: Path, family_f32: Family,
                                 mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "ties", index_dir)
    out = merge(spec, tmp_path / "out")
    m = mounts.start(spec, foreground=False)  # returns once the mount answers
    assert sha256(m.path / "model.safetensors") == sha256(out / "model.safetensors")
    res = run_cli("stats", str(m.path))
    assert res.returncode == 0 and "expert bytes read" in res.stdout, res.stderr
    res = run_cli("stats", str(m.path), "--json")
    assert json.loads(res.stdout)["served_bytes"]["weights"] > 0
    again = run_cli("mount", str(spec), str(m.path))
    assert again.returncode == 1 and "already mounted" in again.stderr
    res = run_cli("umount", str(m.path))
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.path)
    assert wait_gone(m.pid)  # umount waited for the server to finalise
    contents = read_manifest(load_spec(spec).manifest)
    assert contents.totals is not None and contents.torn_lines == 0


def test_umount_clears_a_killed_mount(tmp_path: Path, index_dir: Path, family_f32: Family,
                                      mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    m = mounts.start(spec)
    (m.path / "model.safetensors").read_bytes()
    assert m.proc is not None
    m.proc.kill()
    m.proc.wait(10)
    with pytest.raises(OSError) as exc:
        os.listdir(m.path)
    assert exc.value.errno == errno.ENOTCONN
    res = run_cli("mount", str(spec), str(m.path))
    assert res.returncode == 1 and "dead mount" in res.stderr
    res = run_cli("umount", str(m.path))
    assert res.returncode == 0, res.stderr
    assert not is_mounted(m.path) and os.listdir(m.path) == []
    # the pointer names complete runs only (issue 28): the killed mount's own file is left
    # (the next run beside the pointer removes it: test_manifest_pointer.py)
    pointer = Path(load_spec(spec).manifest)
    assert not pointer.exists() and not pointer.is_symlink()
    runs = sorted(pointer.parent.glob(f"{pointer.stem}.*{pointer.suffix}"))
    assert len(runs) == 1
    contents = read_manifest(runs[0])  # whole lines only; no totals
    assert contents.torn_lines == 0 and contents.totals is None and contents.outputs


def test_mountpoint_errors(tmp_path: Path, index_dir: Path, family_f32: Family) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "linear", index_dir)
    res = run_cli("mount", str(spec), str(tmp_path / "missing"))
    assert res.returncode == 1 and "does not exist" in res.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    res = run_cli("mount", str(spec), str(busy))
    assert res.returncode == 1 and "not empty" in res.stderr
    assert "Traceback" not in res.stderr
    res = run_cli("umount", str(busy))
    assert res.returncode == 1 and "not mounted" in res.stderr


def test_persistent_cache_serves_a_remount(tmp_path: Path, index_dir: Path,
                                           family_sharded: Family, mounts: Mounts) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "ties", index_dir)
    cdir = tmp_path / "cache"
    m1 = mounts.start(spec, "--cache-dir", str(cdir), name="m1")
    first = {rel: sha256(p) for rel, p in tree(m1.path).items()}
    merged = m1.stats()["units_merged"]
    assert merged > 0
    mounts.stop(m1)  # the two servers would share the spec's manifest path
    m2 = mounts.start(spec, "--cache-dir", str(cdir), name="m2")
    assert {rel: sha256(p) for rel, p in tree(m2.path).items()} == first
    s = m2.stats()
    assert s["units_merged"] == 0 and s["cache"]["disk_hits"] == merged
