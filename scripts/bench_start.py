#!/usr/bin/env python3
"""Fixed costs: ``mergefs mount`` from exec to ready, and ``mergefs merge``, for several
mergefs source trees side by side (interleaved rounds, order reversed every other round; cold
sources unless ``--warm``), medians. Prints ``uptime`` at the start and the end.

    python scripts/bench_start.py mount SPEC TREE [TREE ...] --repeats 5
    python scripts/bench_start.py merge SPEC TREE [TREE ...] --budget 10% --repeats 5

A TREE is a directory holding a ``mergefs`` package (PYTHONPATH), e.g. this checkout and a
``git archive`` of the code before. "Ready": the mount command has returned (it does once the
mountpoint answers) and ``MNT/config.json`` has been read. This script is not imported by
mergefs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import PY, evict


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["mount", "merge"])
    ap.add_argument("spec", type=Path)
    ap.add_argument("trees", nargs="+", help="mergefs source trees (PYTHONPATH) to compare")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", default="10%", help="merge: the budget")
    ap.add_argument("--warm", action="store_true", help="do not evict the sources first")
    args = ap.parse_args(argv)
    spec = args.spec.resolve()
    doc = __import__("yaml").safe_load(spec.read_text())
    sources = [spec.parent / doc["base_model"], *(spec.parent / m["model"]
                                                  for m in doc["models"])]
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    mnt, out = work / "mnt", work / "out"
    mnt.mkdir()
    print("uptime at the start:", uptime())
    times: dict[str, list[float]] = {t: [] for t in args.trees}
    cli = [PY, "-P", "-m", "mergefs.cli.main"]
    try:
        for rnd in range(args.repeats):
            for tree in args.trees if rnd % 2 == 0 else args.trees[::-1]:
                env = {**os.environ, "PYTHONPATH": tree}
                if not args.warm:
                    evict(*sources)
                quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
                if args.kind == "mount":
                    t0 = time.perf_counter()
                    subprocess.run([*cli, "mount", str(spec), str(mnt)], env=env, check=True,
                                   **quiet)
                    json.loads((mnt / "config.json").read_text())
                    times[tree].append(time.perf_counter() - t0)
                    subprocess.run([*cli, "umount", str(mnt)], env=env, check=True, **quiet)
                else:
                    t0 = time.perf_counter()
                    subprocess.run([*cli, "merge", str(spec), str(out), "--budget", args.budget,
                                    "--force"], env=env, check=True, **quiet)
                    times[tree].append(time.perf_counter() - t0)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    for tree, xs in times.items():
        print(f"{args.kind} {tree}: median {statistics.median(xs):.3f} s (runs "
              f"{', '.join(f'{x:.2f}' for x in xs)})")
    print("uptime at the end:", uptime())
    return 0


if __name__ == "__main__":
    sys.exit(main())
