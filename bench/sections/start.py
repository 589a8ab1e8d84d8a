"""Fixed costs: ``mergefs mount`` from exec to ready, and ``mergefs merge``, for several
mergefs source trees side by side (interleaved rounds, order reversed every other round; cold
sources unless ``--warm``), medians. Prints the load average at the start and the end.

    python -m bench start mount SPEC TREE [TREE ...] --repeats 5
    python -m bench start merge SPEC TREE [TREE ...] --budget 10% --repeats 5

A TREE is a directory holding a ``mergefs`` package (PYTHONPATH), e.g. this checkout and a
``git archive`` of the code before. "Ready": the mount command has returned (it does once the
mountpoint answers) and ``MNT/config.json`` has been read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import MERGEFS, evict, loadavg, run


def main(argv: list[str] | None = None, prog: str = "python -m bench start") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["mount", "merge"])
    ap.add_argument("spec", type=Path)
    ap.add_argument("trees", nargs="+", help="mergefs source trees (PYTHONPATH) to compare")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", default="10%", help="merge: the budget")
    ap.add_argument("--warm", action="store_true", help="do not evict the sources first")
    args = ap.parse_args(argv)
    spec = args.spec.resolve()
    doc = yaml.safe_load(spec.read_text())
    sources = [spec.parent / doc["base_model"], *(spec.parent / m["model"]
                                                  for m in doc["models"])]
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    mnt, out = work / "mnt", work / "out"
    mnt.mkdir()
    print("load average at the start:", loadavg())
    times: dict[str, list[float]] = {t: [] for t in args.trees}
    try:
        for rnd in range(args.repeats):
            for tree in args.trees if rnd % 2 == 0 else args.trees[::-1]:
                env = {"PYTHONPATH": tree}
                if not args.warm:
                    evict(*sources)
                if args.kind == "mount":
                    t0 = time.perf_counter()
                    run([*MERGEFS, "mount", spec, mnt], env=env)
                    json.loads((mnt / "config.json").read_text())
                    times[tree].append(time.perf_counter() - t0)
                    run([*MERGEFS, "umount", mnt], env=env)
                else:
                    t0 = time.perf_counter()
                    run([*MERGEFS, "merge", spec, out, "--budget", args.budget, "--force"],
                        env=env)
                    times[tree].append(time.perf_counter() - t0)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    for tree, xs in times.items():
        print(f"{args.kind} {tree}: median {statistics.median(xs):.3f} s (runs "
              f"{', '.join(f'{x:.2f}' for x in xs)})")
    print("load average at the end:", loadavg())
    return 0
