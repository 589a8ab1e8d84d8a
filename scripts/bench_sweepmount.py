#!/usr/bin/env python3
"""Benchmark (issue 15): a 9-variant sweep through one mount vs nine separate mounts vs nine
``mergekit-yaml`` runs, on one synthetic family (bf16, a few hundred MB).

The sweep is ``weight: [0.3, 0.5, 0.7] x budget: [10%, 50%, full]`` over ``task_arithmetic``.
Each configuration makes every byte of all nine merged models available once:

- ``sweep mount``: ``mergefs mount sweep.yaml MNT``, every file of every variant read through
  the mount (1 MiB reads), ``mergefs umount``;
- ``separate mounts``: for each variant, ``mergefs mount variant.yaml MNT``, every file read,
  ``mergefs umount``;
- ``mergekit-yaml``: each variant's spec (mergefs keys stripped; mergekit has no budget, so the
  three budgets of a weight are three identical full merges) written to an output directory.

Cold: sources are evicted from the page cache before the sweep mount, before each separate mount
and before each mergekit run (``os.sync`` + ``POSIX_FADV_DONTNEED``). Reported: wall time (mount
start to unmount, or mergekit start to exit), source bytes read (mergefs' own pread counters:
the sweep's shared totals, the sum of the nine mounts' totals; mergekit reads every tensor of
every input, so nine times the inputs' weight files; the block device's counts, all processes,
are kept in the metrics but mean little on a shared machine), and bytes written to disk (the
manifests; mergekit's output directories). The index is built once before (not timed).

    python scripts/bench_sweepmount.py --out /tmp/bench-sweep        # standalone
    python scripts/bench.py --sections sweepmount                     # as a bench section

Not imported by mergefs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import bench as B  # scripts/bench.py (rows, runs, eviction, device counters); bench.py, when
import make_family  # it calls this section, registers itself as "bench" first
import yaml

GRID = {"weight": [0.3, 0.5, 0.7], "budget": ["10%", "50%", "full"]}
READ_CHUNK = 1 << 20


def mergekit_exe() -> Path | None:
    """mergekit-yaml beside this interpreter, or in the bench's own mergekit venv."""
    for cand in (Path(sys.executable).parent / "mergekit-yaml",
                 B.MERGEKIT_VENV / "bin" / "mergekit-yaml"):
        if cand.exists():
            return cand
    return None


def make(root: Path, params: int, layers: int, n_experts: int, log: Any) -> Path:
    info = root / "family.json"
    if info.is_file() and json.loads(info.read_text()).get("params_per_model") == \
            make_family.solve_shape(params, layers, 8192).params():
        log(f"reusing {root}")
    else:
        make_family.make_synthetic(root, params=params, layers=layers, n_experts=n_experts,
                                   vocab=8192, seed=0, log=log)
    return root


def write_specs(fam: Path) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """sweep.yaml, one plain spec per variant, one mergekit spec per variant."""
    from mergefs.spec.variants import expand

    doc = yaml.safe_load((fam / "spec.yaml").read_text())
    doc["sweep"] = GRID
    sweep = fam / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(doc, sort_keys=False))
    plain, mk = {}, {}
    for v in expand(doc, str(sweep)):
        p = fam / f"variant-{v.name}.yaml"
        p.write_text(yaml.safe_dump(v.doc, sort_keys=False))
        plain[v.name] = p
        d = {k: val for k, val in v.doc.items() if k not in B.MERGEFS_ONLY_KEYS}
        d["base_model"] = str((fam / d["base_model"]).resolve())
        for m in d["models"]:
            m["model"] = str((fam / m["model"]).resolve())
        q = fam / f"variant-{v.name}.mergekit.yaml"
        q.write_text(yaml.safe_dump(d, sort_keys=False))
        mk[v.name] = q
    return sweep, plain, mk


def read_tree(root: Path) -> dict[str, str]:
    """Read every (non-hidden) file under ``root`` in 1 MiB reads; sha256 by relative path."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith(".") or (Path(dirpath) == root and f == "variants.json"):
                continue
            h = hashlib.sha256()
            with open(Path(dirpath) / f, "rb", buffering=0) as fh:
                while chunk := fh.read(READ_CHUNK):
                    h.update(chunk)
            out[str((Path(dirpath) / f).relative_to(root))] = h.hexdigest()
    return out


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def mounted_run(spec: Path, mnt: Path, fam: Path, dev: str | None) -> dict[str, Any]:
    """Cold: evict, mount (daemon), read everything, read stats, unmount."""
    mnt.mkdir(parents=True, exist_ok=True)
    B.evict(fam)
    d0 = B.device_read_bytes(dev)
    t0 = time.perf_counter()
    cmd = [*B.MERGEFS, "mount", spec, mnt]
    B.run(cmd)
    try:
        sums = read_tree(mnt)
        stats = json.loads((mnt / ".mergefs" / "stats.json").read_text())
    finally:
        B.run([*B.MERGEFS, "umount", mnt], check=False)
    wall = time.perf_counter() - t0
    d1 = B.device_read_bytes(dev)
    return {"wall": wall, "sums": sums, "stats": stats, "command": B.q(cmd),
            "device_bytes": (d1 - d0) if d0 is not None and d1 is not None else None}


def manifest_bytes(spec: Path) -> int:
    pointer = spec.with_name(spec.stem + ".manifest.jsonl")
    return os.path.getsize(os.path.realpath(pointer)) if pointer.exists() else 0


def section(bench: Any, fam: Path, label: str) -> None:
    """Add the three rows (and raw data) to a running :class:`bench.Bench`."""
    sweep, plain, mk = write_specs(fam)
    B.run([*B.MERGEFS, "index", sweep])
    dev = B.device_of(fam)
    work = bench.work / "sweepmount"
    work.mkdir(parents=True, exist_ok=True)
    names = list(plain)

    r = mounted_run(sweep, work / "mnt-sweep", fam, dev)
    shared = r["stats"]["shared"]
    sweep_read = sum(shared["physical_bytes_read"].values())
    sweep_written = manifest_bytes(sweep)
    bench.add(B.Row(
        "sweepmount", "9-variant sweep through one mount", label, "cold",
        f"{r['wall']:.1f} s, read {B.fmt_bytes(sweep_read)}, wrote "
        f"{B.fmt_bytes(sweep_written)}",
        {"wall": r["wall"], "source_bytes_read": sweep_read, "disk_written": sweep_written,
         "device_bytes_read": r["device_bytes"], "shared": shared,
         "units_shared": shared["units_shared"]},
        versus=f"{shared['units_merged']} units merged, {shared['units_shared']} served from "
               "another variant's merge", command=r["command"] + "  # then read every file"))

    walls, reads, written, dev_total = [], 0, 0, 0
    same = True
    for name in names:
        s = mounted_run(plain[name], work / f"mnt-{name}", fam, dev)
        walls.append(s["wall"])
        reads += sum(s["stats"]["physical_bytes_read"].values())
        written += manifest_bytes(plain[name])
        dev_total += s["device_bytes"] or 0
        same &= s["sums"] == {k.split("/", 1)[1]: v for k, v in r["sums"].items()
                              if k.startswith(name + "/")}
    bench.add(B.Row(
        "sweepmount", "nine separate mounts, one per variant", label, "cold",
        f"{sum(walls):.1f} s, read {B.fmt_bytes(reads)}, wrote {B.fmt_bytes(written)}",
        {"wall": sum(walls), "walls": walls, "source_bytes_read": reads, "disk_written": written,
         "device_bytes_read": dev_total, "same_bytes_as_sweep_mount": same},
        versus=f"sweep mount: {sweep_read / reads:.0%} of the bytes read, "
               f"{r['wall'] / sum(walls):.0%} of the time; files "
               + ("identical" if same else "DIFFER"),
        target="same files as the sweep mount", met=same,
        command=B.q([*B.MERGEFS, "mount", plain[names[0]], "MNT"]) + "  # x9, read, umount"))

    exe = mergekit_exe()
    if exe is None:
        bench.add(B.not_run("sweepmount", "nine mergekit-yaml runs", label,
                            "mergekit-yaml not found"))
        return
    base, experts = B.Bench.family_dirs(fam)
    inputs = sum(f.stat().st_size for f in B.weight_files(base, *experts))
    walls, mk_written, mk_dev = [], 0, 0
    cmd: list[Any] = []
    for name in names:
        out = work / f"mk-{name}"
        shutil.rmtree(out, ignore_errors=True)
        B.evict(fam)
        d0 = B.device_read_bytes(dev)
        cmd = [exe, mk[name], out, "--lazy-unpickle", "--no-copy-tokenizer", "--quiet"]
        p = B.run(cmd)
        d1 = B.device_read_bytes(dev)
        walls.append(p.wall)
        mk_dev += (d1 - d0) if d0 is not None and d1 is not None else 0
        mk_written += dir_bytes(out)
        shutil.rmtree(out, ignore_errors=True)
    bench.add(B.Row(
        "sweepmount", "nine mergekit-yaml runs (no budget: every byte read)", label, "cold",
        f"{sum(walls):.1f} s, read {B.fmt_bytes(9 * inputs)}, wrote "
        f"{B.fmt_bytes(mk_written)}",
        {"wall": sum(walls), "walls": walls, "source_bytes_read": 9 * inputs,
         "device_bytes_read_all_processes": mk_dev, "disk_written": mk_written},
        versus=f"sweep mount: {r['wall'] / sum(walls):.0%} of the time, "
               f"{sweep_read / (9 * inputs):.0%} of the bytes read",
        note="mergekit reads every tensor of every input: bytes read = 9 x the inputs' weight "
             "files; the block device's count (all processes, a shared machine) is in metrics",
        command=B.q(cmd).replace(name, "<variant>") + "  # x9"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench-sweepmount")
    p.add_argument("--params", type=make_family.parse_count, default=60_000_000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=3)
    args = p.parse_args(argv)
    bench_args = argparse.Namespace(quick=True, out=args.out, repeats=1)
    bench = B.Bench(bench_args)
    fam = make(Path(args.out).resolve() / "family", args.params, args.layers, args.experts,
               bench.log)
    label = f"synthetic-{args.params / 1e6:.0f}M-x{args.experts}"
    try:
        section(bench, fam, label)
    finally:
        bench.write()
    for row in bench.rows:
        print(f"| {row.case} | {row.result} | {row.versus} |")
        print(f"|   `{row.command}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
