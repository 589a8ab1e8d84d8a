"""Security: a read-only mount that others cannot read by default, parser caps before allocation,
no writes outside the output, index and cache folders, no paths leaked beyond the spec's own."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
from families import Family, make_family, write_spec
from mounting import Mounts, run_cli

from mergefs.core import format as fmt
from mergefs.sources import open_source
from mergefs.cli import main as cli_main

needs_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("security_family"), n_experts=2, seed=51)


def spec_for(tmp_path: Path, fam: Family, **extra: object) -> Path:
    return write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.6, 0.3],
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx"),
                             "budget": "50%", **extra})


def mount_options(path: Path) -> tuple[set[str], set[str]]:
    """(mount options, superblock options) of the mount at ``path``, from mountinfo."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                sep = fields.index("-")
                return set(fields[5].split(",")), set(fields[sep + 3].split(","))
    raise AssertionError(f"{path} is not mounted")


# -- the mount: read-only, private --------------------------------------------------------------


@pytest.mark.mount
@needs_fuse
def test_mount_is_read_only_and_private(tmp_path: Path, fam: Family, mounts: Mounts) -> None:
    spec = spec_for(tmp_path, fam)
    m = mounts.start(spec)
    opts, super_opts = mount_options(m.path)
    assert "ro" in opts  # the kernel refuses writes before they reach the handlers
    assert "allow_other" not in opts | super_opts
    p = m.path / "model.safetensors"
    # test_mount.test_writes_refused covers open for writing, create, mkdir, unlink, rename,
    # chmod, truncate, setxattr and symlink; these are the other calls that would modify
    attempts = {
        "utime": lambda: os.utime(p, (0, 0)),
        "chown": lambda: os.chown(p, 1, 1),
        "link": lambda: os.link(p, m.path / "hard"),
        "rmdir": lambda: os.rmdir(m.path / ".mergefs"),
        "mknod": lambda: os.mkfifo(m.path / "fifo"),
        "removexattr": lambda: os.removexattr(p, "user.x"),
        "write to state": lambda: os.open(m.path / ".mergefs" / "stats.json", os.O_WRONLY),
        "rename state": lambda: os.rename(m.path / ".mergefs", m.path / "state"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EROFS, what
    assert not (m.path / "hard").exists() and not (m.path / "fifo").exists()

    other = mounts.start(spec_for(tmp_path, fam, manifest=str(tmp_path / "m2.jsonl")),
                         "--allow-other", name="shared")
    opts, super_opts = mount_options(other.path)
    assert "allow_other" in opts | super_opts  # the option is real: only given when asked


# -- the parser: caps before allocation ---------------------------------------------------------


@pytest.mark.parametrize("declared, file_bytes", [
    (100 * 10**9, 64),  # a small file declaring a 100 GB header
    (fmt.HEADER_SIZE_CAP + 1, 8 + fmt.HEADER_SIZE_CAP + 1),  # a sparse file big enough to hold it
])
def test_header_length_capped_before_allocation(tmp_path: Path, declared: int,
                                                file_bytes: int) -> None:
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", declared) + b"{")
        f.truncate(file_bytes)  # sparse: no disk blocks
    tracemalloc.start()
    try:
        with pytest.raises(fmt.HeaderTooLarge) as exc:
            open_source(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(path) in str(exc.value)
    assert peak < 1 << 20, f"{peak} bytes allocated before refusing the header"


def test_tensor_count_capped_before_entries_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """More entries than the cap: refused before any entry is validated or built (test_format
    checks the real cap; here a small one shows no entry object is made)."""
    built = []
    monkeypatch.setattr(fmt, "MAX_TENSORS", 10)
    monkeypatch.setattr(fmt, "_parse_entry", lambda *a: built.append(a))
    body = json.dumps({f"t{k}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * k, 4 * k + 4]}
                       for k in range(11)}).encode()
    with pytest.raises(fmt.TooManyTensors):
        fmt.parse_header(body)
    assert built == []


# -- writes stay inside the output, index and cache folders -------------------------------------


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` (not following symlinks) -> (mode, size, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.mount
@needs_fuse
def test_writes_only_where_the_spec_says(tmp_path: Path, mounts: Mounts) -> None:
    """index, merge, mount (with a persistent cache) and umount: every new or changed file lies
    in the index dir, the output dir, the cache dir, or is the manifest (+ its lock and log).
    The family, including an extra file that is a symlink to a file outside it, is untouched;
    the symlink's target is copied as content, never written through."""
    work = tmp_path / "work"
    fam = make_family(work / "fam", n_experts=2, seed=52)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "notes.txt"
    secret.write_text("outside the model directory\n")
    (fam.base / "notes.txt").symlink_to(secret)
    spec = write_spec(work / "spec.yaml", fam, "task_arithmetic", weights=[0.5, 0.5],
                      extra={"block_size": 1024, "index_dir": "idx", "budget": "60%",
                             "manifest": "logs/run.manifest.jsonl"})
    before_work, before_outside = snapshot(work), snapshot(outside)

    assert run_cli("index", str(spec)).returncode == 0
    assert cli_main(["merge", str(spec), str(work / "out")]) == 0
    # --force into an output dir holding a symlink named like an output file: replaced, the
    # target is not written
    forced = work / "forced"
    assert cli_main(["merge", str(spec), str(forced), "--manifest",
                     str(work / "logs" / "first.manifest.jsonl")]) == 0
    (forced / "config.json").unlink()
    (forced / "config.json").symlink_to(secret)
    assert cli_main(["merge", str(spec), str(forced), "--force", "--manifest",
                     str(work / "logs" / "forced.manifest.jsonl")]) == 0
    assert not (forced / "config.json").is_symlink()
    m = mounts.start(spec, "--cache-dir", str(work / "cache"))
    assert (m.path / "notes.txt").read_text() == secret.read_text()
    for p in m.path.iterdir():
        if p.is_file():
            p.read_bytes()
    mounts.stop(m)

    assert snapshot(outside) == before_outside
    assert secret.read_text() == "outside the model directory\n"
    after = snapshot(work)
    changed = {p for p, v in after.items() if before_work.get(p) != v}
    allowed = re.compile(r"(idx|out|forced|cache|logs)(/.*)?$")
    assert {p for p in changed if not allowed.fullmatch(p)} == set()
    assert {p for p in before_work if p not in after} == set()  # nothing removed
    # the merged copy of the symlinked extra file is a regular file holding its content
    copied = work / "out" / "notes.txt"
    assert not copied.is_symlink() and copied.read_text() == secret.read_text()
    # the index dir holds only hash-named pieces; logs holds the manifest, its lock and its log
    assert [p.name for p in (work / "idx").iterdir()] == ["pieces"]
    names = sorted(p.name for p in (work / "idx" / "pieces").iterdir())
    assert names and all(re.fullmatch(r"(base|expert|pair)-[0-9a-f]{32}\.safetensors"
                                      r"|source-[0-9a-f]{16}-[0-9a-f]{16}\.json|usage-[0-9a-f]{32}\.json", n)
                                  for n in names), names
    logs = {p.name for p in (work / "logs").iterdir()}
    assert {n for n in logs if not re.fullmatch(r"run\.manifest\.\d{8}T\d{6}Z(-\d+)?\.jsonl", n)
            } <= {"run.manifest.jsonl", "run.manifest.log", "first.manifest.jsonl",
                  "forced.manifest.jsonl"}
    assert (work / "logs" / "run.manifest.jsonl").is_symlink()  # -> the latest run's manifest
    # the cache holds one folder per plan hash, of hash-named entries
    for entry in (work / "cache").rglob("*"):
        rel = entry.relative_to(work / "cache").as_posix()
        assert re.fullmatch(r"[0-9a-f]{32}(/[0-9a-f]{32}\.bin)?", rel), rel


def test_partial_file_planted_as_symlink_is_not_written_through(tmp_path: Path,
                                                               fam: Family) -> None:
    """``merge --force`` into a folder where someone left ``.model.safetensors.partial`` (the
    temporary name) as a symlink to another file: the merge must not write through it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    spec = spec_for(tmp_path, fam)
    assert cli_main(["merge", str(spec), str(out)]) == 0  # an earlier merge output
    for name in (".model.safetensors.partial", ".config.json.partial"):
        (out / name).symlink_to(victim)
    assert cli_main(["merge", str(spec), str(out), "--force"]) == 0
    assert victim.read_text() == "precious\n"
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors").is_symlink()


# -- the state directory leaks no paths ---------------------------------------------------------


ABS_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+@-]+/)*[\w.+@-]+")


@pytest.mark.mount
@needs_fuse
def test_state_files_name_only_the_spec_paths(tmp_path: Path, fam: Family,
                                              mounts: Mounts) -> None:
    spec = spec_for(tmp_path, fam, cache={"memory": "1MiB"})
    m = mounts.start(spec, "--cache-dir", str(tmp_path / "private-cache"))
    (m.path / "model.safetensors").read_bytes()
    allowed_roots = [fam.base.resolve(), *(e.resolve() for e in fam.experts)]
    texts = {name: (m.path / ".mergefs" / name).read_text()
             for name in ("stats.json", "manifest.jsonl")}
    found = 0
    for name, text in texts.items():
        for path in ABS_PATH.findall(text):
            found += 1
            p = Path(path)
            assert p == spec.resolve() or any(p == r or r in p.parents
                                              for r in allowed_roots), (name, path)
    assert found > 0  # the scan saw the spec's own paths
    for name, text in texts.items():
        assert str(tmp_path / "private-cache") not in text, name
        assert str(tmp_path / "idx") not in text, name
