"""A 9-variant sweep through one mount vs nine separate mounts vs nine ``mergekit-yaml`` runs
(issue 15), on one synthetic family (bf16, a few hundred MB).

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

    python -m bench sweepmount --out /tmp/bench-sweep        # alone
    python -m bench table --sections sweepmount              # as a section of the table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from bench import families
from bench.common import (
    MERGEFS,
    Results,
    Row,
    device_of,
    device_read_bytes,
    evict,
    find_mergekit,
    fmt_bytes,
    mergekit_cmd,
    mergekit_doc,
    not_run,
    q,
    run,
    tree_sha256,
    weight_files,
)

GRID = {"weight": [0.3, 0.5, 0.7], "budget": ["10%", "50%", "full"]}


def make(root: Path, params: int, layers: int, n_experts: int, log: Any) -> Path:
    """The synthetic family (vocabulary 8192) under ``root``, reused when its size matches."""
    info = root / "family.json"
    if info.is_file() and json.loads(info.read_text()).get("params_per_model") == \
            families.solve_shape(params, layers, 8192).params():
        log(f"reusing {root}")
    else:
        families.make_synthetic(root, params=params, layers=layers, n_experts=n_experts,
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
        m = fam / f"variant-{v.name}.mergekit.yaml"
        m.write_text(yaml.safe_dump(mergekit_doc(v.doc, fam), sort_keys=False))
        mk[v.name] = m
    return sweep, plain, mk


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def mounted_run(spec: Path, mnt: Path, fam: Path, dev: str | None) -> dict[str, Any]:
    """Cold: evict, mount (daemon), read everything, read stats, unmount."""
    mnt.mkdir(parents=True, exist_ok=True)
    evict(fam)
    d0 = device_read_bytes(dev)
    t0 = time.perf_counter()
    cmd = [*MERGEFS, "mount", spec, mnt]
    run(cmd)
    try:
        sums = tree_sha256(mnt)
        stats = json.loads((mnt / ".mergefs" / "stats.json").read_text())
    finally:
        run([*MERGEFS, "umount", mnt], check=False)
    wall = time.perf_counter() - t0
    d1 = device_read_bytes(dev)
    return {"wall": wall, "sums": sums, "stats": stats, "command": q(cmd),
            "device_bytes": (d1 - d0) if d0 is not None and d1 is not None else None}


def manifest_bytes(spec: Path) -> int:
    pointer = spec.with_name(spec.stem + ".manifest.jsonl")
    return os.path.getsize(os.path.realpath(pointer)) if pointer.exists() else 0


def section(res: Results, fam: Path, label: str) -> None:
    """Add the three rows (and raw data) to ``res``."""
    sweep, plain, mk = write_specs(fam)
    run([*MERGEFS, "index", sweep])
    dev = device_of(fam)
    work = res.work / "sweepmount"
    work.mkdir(parents=True, exist_ok=True)
    names = list(plain)

    r = mounted_run(sweep, work / "mnt-sweep", fam, dev)
    shared = r["stats"]["shared"]
    sweep_read = sum(shared["physical_bytes_read"].values())
    sweep_written = manifest_bytes(sweep)
    res.add(Row(
        "sweepmount", "9-variant sweep through one mount", label, "cold",
        f"{r['wall']:.1f} s, read {fmt_bytes(sweep_read)}, wrote {fmt_bytes(sweep_written)}",
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
    res.add(Row(
        "sweepmount", "nine separate mounts, one per variant", label, "cold",
        f"{sum(walls):.1f} s, read {fmt_bytes(reads)}, wrote {fmt_bytes(written)}",
        {"wall": sum(walls), "walls": walls, "source_bytes_read": reads, "disk_written": written,
         "device_bytes_read": dev_total, "same_bytes_as_sweep_mount": same},
        versus=f"sweep mount: {sweep_read / reads:.0%} of the bytes read, "
               f"{r['wall'] / sum(walls):.0%} of the time; files "
               + ("identical" if same else "DIFFER"),
        target="same files as the sweep mount", met=same,
        command=q([*MERGEFS, "mount", plain[names[0]], "MNT"]) + "  # x9, read, umount"))

    exe = find_mergekit()
    if exe is None:
        res.add(not_run("sweepmount", "nine mergekit-yaml runs", label, "mergekit-yaml not found"))
        return
    base, experts = families.family_dirs(fam)
    inputs = sum(f.stat().st_size for f in weight_files(base, *experts))
    walls, mk_written, mk_dev = [], 0, 0
    cmd: list[str] = []
    for name in names:
        out = work / f"mk-{name}"
        shutil.rmtree(out, ignore_errors=True)
        evict(fam)
        d0 = device_read_bytes(dev)
        cmd = mergekit_cmd(exe, mk[name], out)
        p = run(cmd)
        d1 = device_read_bytes(dev)
        walls.append(p.wall)
        mk_dev += (d1 - d0) if d0 is not None and d1 is not None else 0
        mk_written += dir_bytes(out)
        shutil.rmtree(out, ignore_errors=True)
    res.add(Row(
        "sweepmount", "nine mergekit-yaml runs (no budget: every byte read)", label, "cold",
        f"{sum(walls):.1f} s, read {fmt_bytes(9 * inputs)}, wrote {fmt_bytes(mk_written)}",
        {"wall": sum(walls), "walls": walls, "source_bytes_read": 9 * inputs,
         "device_bytes_read_all_processes": mk_dev, "disk_written": mk_written},
        versus=f"sweep mount: {r['wall'] / sum(walls):.0%} of the time, "
               f"{sweep_read / (9 * inputs):.0%} of the bytes read",
        note="mergekit reads every tensor of every input: bytes read = 9 x the inputs' weight "
             "files; the block device's count (all processes, a shared machine) is in metrics",
        command=q(cmd).replace(names[-1], "<variant>") + "  # x9"))


def main(argv: list[str] | None = None, prog: str = "python -m bench sweepmount") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/bench-sweepmount")
    p.add_argument("--params", type=families.parse_count, default=60_000_000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=3)
    args = p.parse_args(argv)
    res = Results(args.out, vars(args))
    fam = make(Path(args.out).resolve() / "family", args.params, args.layers, args.experts,
               res.log)
    label = f"synthetic-{args.params / 1e6:.0f}M-x{args.experts}"
    try:
        section(res, fam, label)
    finally:
        res.write("mergefs benchmarks: sweep mount")
    for row in res.rows:
        print(f"| {row.case} | {row.result} | {row.versus} |")
        print(f"|   `{row.command}` |")
    return 0
