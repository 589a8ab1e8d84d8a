"""Issue 10: never destroy a user's data, never load a silently wrong model.

Each numbered case of the issue, through the real CLI (subprocesses) or a real mount; every one
of these failed before the change that made it pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from families import Family, make_family, make_llama_family, write_spec
from mounting import Mounts, is_mounted, run_cli, wait_gone

needs_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256), symlinks as their target text."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("mergefs: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("safety_family"), n_experts=2, seed=81,
                       dtype="bfloat16")


def spec_for(tmp_path: Path, fam: Family, name: str = "spec.yaml", **extra: Any) -> Path:
    return write_spec(tmp_path / name, fam, "task_arithmetic", weights=[0.6, 0.4],
                      extra={"block_size": 1024, "index_dir": str(tmp_path / "idx"), **extra})


# -- 1. outputs never land in a source -------------------------------------------------------


def test_merge_into_a_source_is_refused_even_with_force(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    before = tree_digest(fam.root)
    for target in (fam.base, fam.experts[1], fam.base / "sub", fam.root):
        proc = run_cli("merge", str(spec), str(target), "--force")
        line = one_line_error(proc, str(target), "source")
        assert "--force never overrides" in line
    assert tree_digest(fam.root) == before  # the family is untouched


def test_index_cache_and_manifest_inside_a_source_are_refused(tmp_path: Path,
                                                              fam: Family) -> None:
    before = tree_digest(fam.root)
    spec = spec_for(tmp_path, fam, name="idx.yaml")
    spec.write_text(spec.read_text().replace(str(tmp_path / "idx"), str(fam.base / "idx")))
    one_line_error(run_cli("index", str(spec)), "index dir", str(fam.base))
    spec = spec_for(tmp_path, fam, name="man.yaml", manifest=str(fam.experts[0] / "m.jsonl"))
    one_line_error(run_cli("merge", str(spec), str(tmp_path / "out")), "manifest",
                   str(fam.experts[0]))
    spec = spec_for(tmp_path, fam, name="cache.yaml")
    (tmp_path / "mnt").mkdir()
    one_line_error(run_cli("mount", str(spec), str(tmp_path / "mnt"), "--cache-dir",
                           str(fam.base / "cache")), "cache dir", str(fam.base))
    assert not (tmp_path / "out").exists()
    assert tree_digest(fam.root) == before


# -- 2. budgets: a bare number is not bytes -------------------------------------------------------


def test_bare_budget_numbers_are_refused(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    for value in ("10", "100"):
        one_line_error(run_cli("merge", str(spec), str(tmp_path / "o"), "--budget", value),
                       f"{value} is ambiguous", f"{value}%", f"{value}B")
    # the option is named once ("--budget: 10 is ...", not "--budget: budget: 10 is ...")
    (tmp_path / "mnt").mkdir()
    for argv, option in (
            (["merge", str(spec), str(tmp_path / "o"), "--budget", "10"], "--budget"),
            (["plan", str(spec), "--budget", "10"], "--budget"),
            (["mount", str(spec), str(tmp_path / "mnt"), "--budget", "10"], "--budget"),
            (["sweep", str(spec), "--budgets", "5%,10"], "--budgets")):
        line = one_line_error(run_cli(*argv))
        assert line.startswith(f"mergefs: error: {option}: 10 is ambiguous"), (argv, line)
    in_spec = spec_for(tmp_path, fam, name="bare.yaml", budget=100)
    line = one_line_error(run_cli("plan", str(in_spec)))
    assert line.startswith(f"mergefs: error: {in_spec}: budget: 100 is ambiguous"), line
    # a negative budget reaches the budget parser (exit 1), not argparse (exit 2)
    one_line_error(run_cli("plan", str(spec), "--budget", "-5%"), "must not be negative")
    assert not (tmp_path / "o").exists()
    # 1 and 0.1 stay fractions; 10% and a size with a unit work
    plans = {}
    for value in ("1", "0.1", "10%", "20KiB"):
        proc = run_cli("plan", str(spec), "--budget", value, "--json")
        assert proc.returncode == 0, proc.stderr
        plans[value] = json.loads(proc.stdout)
    total = plans["1"]["total_expert_bytes"]
    assert plans["1"]["budget_bytes"] == total
    assert plans["0.1"]["budget_bytes"] == plans["10%"]["budget_bytes"] == total // 10
    assert plans["20KiB"]["budget_bytes"] == 20 * 1024


# -- 3. manifests are never truncated; replay of nothing is not OK -------------------------------


def test_refused_merge_leaves_the_manifest_and_runs_keep_their_own(tmp_path: Path,
                                                                   fam: Family) -> None:
    spec = spec_for(tmp_path, fam, budget="50%")
    pointer = tmp_path / "spec.manifest.jsonl"
    assert run_cli("merge", str(spec), str(tmp_path / "out1")).returncode == 0
    first = pointer.resolve()
    first_bytes = first.read_bytes()
    assert first != pointer and pointer.is_symlink()
    # refused (output not empty): the existing manifest and the pointer are untouched
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    one_line_error(run_cli("merge", str(spec), str(busy)), "not empty")
    assert first.read_bytes() == first_bytes and pointer.resolve() == first
    assert run_cli("replay", str(pointer)).returncode == 0
    # a second run gets its own manifest; the first is kept and still replays
    time.sleep(1.1)  # a new timestamp (a same-second run would get a -2 suffix)
    assert run_cli("merge", str(spec), str(tmp_path / "out2")).returncode == 0
    second = pointer.resolve()
    assert second != first and first.read_bytes() == first_bytes
    for m in (first, second, pointer):
        assert run_cli("replay", str(m)).returncode == 0
    # an explicit --manifest that exists is refused, never overwritten
    one_line_error(run_cli("merge", str(spec), str(tmp_path / "out3"), "--manifest", str(first)),
                   str(first), "refusing to overwrite")
    assert first.read_bytes() == first_bytes and not (tmp_path / "out3").exists()


def test_replay_refuses_manifests_without_totals_or_outputs(tmp_path: Path,
                                                            fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    m = tmp_path / "m.jsonl"
    assert run_cli("merge", str(spec), str(tmp_path / "out"), "--manifest", str(m)).returncode == 0
    lines = m.read_text().splitlines(keepends=True)
    header, totals = json.loads(lines[0]), json.loads(lines[-1])
    assert totals["type"] == "totals"
    no_totals = tmp_path / "no-totals.jsonl"
    no_totals.write_text("".join(lines[:-1]))
    one_line_error(run_cli("replay", str(no_totals)), "no totals record", "interrupted")
    header_only = tmp_path / "header-only.jsonl"
    header_only.write_text(lines[0] + json.dumps(totals) + "\n")
    one_line_error(run_cli("replay", str(header_only)), "records no merged output")
    assert header["type"] == "header"


# -- 4. a merge while the same spec is mounted -----------------------------------------------------


@pytest.mark.mount
@needs_fuse
def test_merge_while_mounted_and_one_writer_per_manifest(tmp_path: Path, fam: Family,
                                                         mounts: Mounts) -> None:
    spec = spec_for(tmp_path, fam, budget="60%")
    held = tmp_path / "held.jsonl"
    m = mounts.start(spec, "--manifest", str(held))
    (m.path / "model.safetensors").read_bytes()
    # a second writer of the same manifest is refused, naming the holder
    one_line_error(run_cli("merge", str(spec), str(tmp_path / "x"), "--manifest", str(held)),
                   str(held), f"pid {m.pid}")
    # the merge of the same spec meanwhile writes its own manifest
    assert run_cli("merge", str(spec), str(tmp_path / "out")).returncode == 0
    merged = (tmp_path / "spec.manifest.jsonl").resolve()
    (m.path / "config.json").read_bytes()
    mounts.stop(m)
    assert run_cli("replay", str(merged)).returncode == 0
    proc = run_cli("replay", str(held))
    assert proc.returncode == 0, proc.stderr
    assert merged != held.resolve()


# -- 5. dtype reaches config.json -------------------------------------------------------------------


@pytest.mark.mount
@needs_fuse
def test_output_dtype_in_config_merge_and_mount(tmp_path: Path, mounts: Mounts) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    lfam = make_llama_family(tmp_path / "llama", n_experts=2, dtype="float32", seed=3)
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        spec = write_spec(tmp_path / f"{dtype}.yaml", lfam, "task_arithmetic",
                          extra={"dtype": dtype, "index_dir": str(tmp_path / "idx")})
        out = tmp_path / f"out-{dtype}"
        proc = run_cli("merge", str(spec), str(out))
        assert proc.returncode == 0, proc.stderr
        config = json.loads((out / "config.json").read_text())
        assert config["torch_dtype"] == config["dtype"] == dtype
        base_config = json.loads((lfam.base / "config.json").read_text())
        assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == \
            {k: v for k, v in base_config.items() if k not in ("dtype", "torch_dtype")}
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.dtype == torch_dtype
        m = mounts.start(spec, name=f"mnt-{dtype}")
        for f in ("config.json", "model.safetensors"):
            assert (m.path / f).read_bytes() == (out / f).read_bytes(), f
        served = AutoModelForCausalLM.from_pretrained(m.path)
        assert served.dtype == torch_dtype
        del served
        mounts.stop(m)


# -- 6. umount of a busy mount -----------------------------------------------------------------------

HOLDER = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
f.close()
mm[:8]
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.mount
@needs_fuse
def test_umount_of_a_busy_mount_names_the_holder(tmp_path: Path, fam: Family,
                                                 mounts: Mounts) -> None:
    spec = spec_for(tmp_path, fam)
    m = mounts.start(spec, foreground=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(m.path / "model.safetensors")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        proc = run_cli("umount", str(m.path), timeout=30)
        one_line_error(proc, "busy", f"pid {holder.pid}", "python", "--lazy")
        assert is_mounted(m.path)
        assert (m.path / "config.json").read_bytes()  # still serving
        proc = run_cli("umount", "--lazy", str(m.path), timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert "lazily" in proc.stdout and "until the last user closes" in proc.stdout
        assert not is_mounted(m.path)
        os.kill(m.pid, 0)  # the server keeps serving the holder's mapping
    finally:
        holder.kill()
        holder.wait()
    assert wait_gone(m.pid), "the server did not exit after the last user closed"


# -- 7. Ctrl-C during merge ---------------------------------------------------------------------------


def test_interrupted_merge_leaves_no_partial_output(tmp_path: Path) -> None:
    big = make_family(tmp_path / "big", n_experts=2, seed=5, zero_tensors=(),
                      shapes={f"layer.{k}.weight": (1024, 2048) for k in range(6)})
    spec = write_spec(tmp_path / "spec.yaml", big, "ties", weights=[0.5, 0.5],
                      model_parameters=[{"density": 0.5}] * 2,
                      extra={"index_dir": str(tmp_path / "idx")})
    assert run_cli("index", str(spec)).returncode == 0
    out = tmp_path / "out"
    # first the interrupted *new* output, then an interrupted --force over an old one
    for attempt in ("new", "force"):
        if attempt == "force":
            assert run_cli("merge", str(spec), str(out), "--budget", "0%").returncode == 0
            old = tree_digest(out)
        argv = [sys.executable, "-m", "mergefs.cli", "merge", str(spec), str(out),
                "--manifest", str(tmp_path / f"{attempt}.jsonl")]
        proc = subprocess.Popen(argv + (["--force"] if attempt == "force" else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.mergefs-partial-*/.*.partial")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "interrupted" in err
        assert not list(tmp_path.glob(".out.mergefs-*"))  # the temporary sibling is gone
        if attempt == "new":
            assert not out.exists()
        else:
            assert tree_digest(out) == old  # the old output, whole
        # the interrupted run removed its own manifest (issue 28: a manifest that stays names a
        # complete run), so the same --manifest can be used again; a killed run's stays and
        # replay refuses it (test_reliability.py, test_manifest_pointer.py)
        assert not (tmp_path / f"{attempt}.jsonl").exists()


# -- 8. read errors are visible in `mergefs stats` ---------------------------------------------------


@pytest.mark.mount
@needs_fuse
def test_stats_shows_the_last_read_errors(tmp_path: Path, mounts: Mounts) -> None:
    fam = make_family(tmp_path / "fam", n_experts=2, seed=9)
    spec = spec_for(tmp_path, fam, cache={"memory": "64KiB"})
    m = mounts.start(spec)
    # change an expert's bytes in place (same size and header): reads of it must fail
    f = fam.experts[0] / "model.safetensors"
    data = bytearray(f.read_bytes())
    for k in range(len(data) - 4096, len(data) - 8):
        data[k] ^= 0x5A
    st = os.stat(f)
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(OSError), open(m.path / "model.safetensors", "rb") as fh:
        while fh.read(1 << 20):
            pass
    proc = run_cli("stats", str(m.path))
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(run_cli("stats", str(m.path), "--json").stdout)
    assert stats["read_errors"] >= 1
    last = stats["last_errors"][-1]
    assert last["path"] == "model.safetensors" and "changed since it was indexed" in last["error"]
    assert "changed since it was indexed" in proc.stdout.replace("\n", " ") or \
        "source changed" in proc.stdout.replace("\n", " ")
    assert "SIGBUS" in proc.stdout


# -- review findings: what --force or a layout could still destroy -------------------------------


def test_records_and_inputs_inside_the_output_are_refused(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    out = tmp_path / "out"
    assert run_cli("merge", str(spec), str(out)).returncode == 0
    # a spec kept inside the output (mergekit writes mergekit_config.yml there)
    inner = out / "mergekit_config.yml"
    inner.write_text(spec.read_text())
    before = tree_digest(out)
    one_line_error(run_cli("merge", str(inner), str(out), "--force"), "lies inside the output")
    one_line_error(run_cli("merge", str(spec), str(out), "--force", "--manifest",
                           str(out / "run2.jsonl")), "manifest", "lies inside the output")
    assert tree_digest(out) == before  # nothing deleted, nothing added
    fresh = tmp_path / "fresh"
    one_line_error(run_cli("merge", str(spec), str(fresh), "--manifest",
                           str(fresh / "m.jsonl")), "lies inside the output")
    assert not fresh.exists()  # refused before anything was written


def test_source_files_symlinked_into_the_output_are_refused(tmp_path: Path, fam: Family) -> None:
    out = tmp_path / "out"
    assert run_cli("merge", str(spec_for(tmp_path, fam)), str(out)).returncode == 0
    linked = tmp_path / "linked"  # a Hub-snapshot-like expert: its files point into `out`
    linked.mkdir()
    for f in ("model.safetensors", "config.json"):
        (linked / f).symlink_to(out / f)
    lfam = Family(fam.base, [fam.experts[0], linked], fam.root, fam.dtype, fam.tensor_names)
    spec = spec_for(tmp_path, lfam, name="linked.yaml")
    before = tree_digest(out)
    one_line_error(run_cli("merge", str(spec), str(out), "--force"), "a file of the source",
                   str(linked))
    assert tree_digest(out) == before


def test_merge_into_the_current_directory_is_refused(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    here = tmp_path / "here"
    here.mkdir()
    proc = subprocess.run([sys.executable, "-m", "mergefs.cli", "merge", str(spec), "."],
                          cwd=here, capture_output=True, text=True, timeout=120, check=False)
    one_line_error(proc, "holds the current directory")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_merge_into_a_mountpoint_is_refused_up_front(tmp_path: Path, fam: Family) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(vol)], check=True)
    try:
        spec = spec_for(tmp_path, fam)
        one_line_error(run_cli("merge", str(spec), str(vol)), "is a mountpoint", "merged")
        assert not list(tmp_path.glob(".vol.mergefs-*")) and not list(vol.iterdir())
        assert not (tmp_path / "spec.manifest.jsonl").exists()  # refused before the manifest
    finally:
        subprocess.run(["umount", str(vol)], check=False)


def test_byte_budget_manifest_replays(tmp_path: Path, fam: Family) -> None:
    spec = spec_for(tmp_path, fam)
    m = tmp_path / "m.jsonl"
    assert run_cli("merge", str(spec), str(tmp_path / "o"), "--budget", "4KiB",
                   "--manifest", str(m)).returncode == 0
    assert json.loads(m.read_text().splitlines()[0])["spec"]["budget"] == "4096B"
    proc = run_cli("replay", str(m))
    assert proc.returncode == 0, proc.stderr
