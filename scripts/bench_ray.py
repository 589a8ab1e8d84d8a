#!/usr/bin/env python3
"""Index and merge on Ray with 1, 2, 4 worker processes, against the local run (issue 16).

Writes a synthetic bf16 family (``scripts/make_family.py``: base + experts, several shards, so
the merge has one task per shard), then times, with the sources evicted from the page cache
before each run (cold):

- ``local``: ``load_or_build(rebuild=True)`` on two threads, and ``Session`` + ``materialise``;
- ``ray N``: a one-node Ray cluster with ``--num-cpus=N`` (N worker processes; tests/raycluster.py,
  started and stopped here, its start-up not timed), the same index build through
  :class:`mergefs.rayexec.RayChunkRunner` and the same merge through ``rayexec.materialise``.

Every Ray output is checked against the local one (index arrays, output bytes, plan hash).
Prints one JSON line per row and the machine's load (``/proc/loadavg``) before and after: the
machine has 2 cores shared with other users, so figures above 2 workers measure overheads.

    python scripts/bench_ray.py --params 40M --experts 4 --workers 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from make_family import make_synthetic, parse_bytes, parse_count
from raycluster import LocalRayCluster

from mergefs import rayexec
from mergefs.engine import Session, open_family
from mergefs.index import load_or_build
from mergefs.spec import load_spec


def evict(root: Path) -> None:
    for p in root.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def index_run(spec_path: Path, runner_for: Any) -> tuple[float, Any, int]:
    spec = load_spec(spec_path)
    base, experts = open_family(spec)
    try:
        runner = runner_for(spec, base, experts)
        evict(Path(spec.base).parent)
        t0 = time.monotonic()
        index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir, rebuild=True,
                                 runner=runner)
        dt = time.monotonic() - t0
        read = sum(c.counters.bytes_read for c in [base, *experts])
    finally:
        for c in [base, *experts]:
            c.close()
    return dt, index, read


def merge_run(spec_path: Path, out: Path, on_ray: bool) -> tuple[float, str, dict[str, Any]]:
    session = Session(load_spec(spec_path))  # the index exists: reused
    try:
        evict(Path(session.spec.base).parent)
        t0 = time.monotonic()
        if on_ray:
            rayexec.materialise(session, out, overwrite=True)
        else:
            session.engine.materialise(out, overwrite=True)
        dt = time.monotonic() - t0
        totals = session.finish()
    finally:
        session.close()
    return dt, session.plan.plan_hash, totals


def same_index(a: Any, b: Any) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("base_hash", "expert_hash", "norms", "zero", "gram"))


def same_dir(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.glob("*.safetensors"))
    return bool(files) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=parse_count, default=parse_count("40M"))
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--shard-bytes", type=parse_bytes, default=parse_bytes("20MB"))
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--dir", type=Path, help="where the family goes (default: a temp dir)")
    args = p.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="mergefs-bench-ray-"))
    fam = root / "fam"
    if not (fam / "spec.yaml").is_file():
        make_synthetic(fam, params=args.params, layers=4, n_experts=args.experts, vocab=8000,
                       shard_bytes=args.shard_bytes, seed=3, log=lambda *a: None)
    spec = fam / "spec.yaml"
    print(json.dumps({"load_before": load(), "family": str(fam),
                      "source_bytes": sum(q.stat().st_size for q in fam.rglob("*.safetensors"))}))
    rows = []
    t_index, local_index, read = index_run(spec, lambda *a: None)
    t_merge, plan_hash, totals = merge_run(spec, root / "out-local", False)
    rows.append({"run": "local (2 threads)", "index_s": round(t_index, 2),
                 "index_bytes": read, "merge_s": round(t_merge, 2),
                 "merge_read_bytes": sum(totals["physical_bytes_read"].values())})
    print(json.dumps(rows[-1]))
    import ray

    repo = str(ROOT)
    runners: list[Any] = []

    def make(spec: Any, base: Any, experts: Any) -> Any:
        runners.append(rayexec.RayChunkRunner(spec, base, experts))
        return runners[-1]

    for n in [int(x) for x in args.workers.split(",")]:
        cluster = LocalRayCluster(nodes=1, cpus=n, env={"PYTHONPATH": repo})
        cluster.start()
        try:
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
            t_index, index, _ = index_run(spec, make)
            t_merge, ray_hash, ray_totals = merge_run(spec, root / f"out-ray{n}", True)
            rows.append({"run": f"ray, {n} worker process(es)", "index_s": round(t_index, 2),
                         "index_tasks": len(runners[-1].parts), "merge_s": round(t_merge, 2),
                         "merge_read_bytes": sum(ray_totals["physical_bytes_read"].values()),
                         "index_equal": same_index(index, local_index),
                         "merge_equal": same_dir(root / f"out-ray{n}", root / "out-local")
                         and ray_hash == plan_hash})
            print(json.dumps(rows[-1]))
        finally:
            ray.shutdown()
            cluster.stop()
    print(json.dumps({"load_after": load()}))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.get("index_equal", True) and r.get("merge_equal", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
