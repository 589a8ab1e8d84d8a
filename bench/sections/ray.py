"""Index and merge on Ray with 1, 2, 4 worker processes, against the local run (issue 16).

Writes a synthetic bf16 family (:func:`bench.families.make_synthetic`: base + experts, several
shards, so the merge has one task per shard), then times, with the sources evicted from the page
cache before each run (cold):

- ``local``: ``load_or_build(rebuild=True)`` on two threads, and ``Session`` + ``materialise``;
- ``ray N``: a one-node Ray cluster with ``--num-cpus=N`` (N worker processes;
  :class:`bench.raycluster.LocalRayCluster`, started and stopped here, its start-up not timed),
  the same index build through :class:`mergefs.engine.ray_index.RayChunkRunner` and the same
  merge through ``ray_merge.materialise``.

Every Ray output is checked against the local one (index arrays, output bytes, plan hash).
Prints one JSON line per row and the machine's load average before and after: the machine has
2 cores shared with other users, so figures above 2 workers measure overheads.

With ``--s3`` the family is served by moto's S3 server in this process (:mod:`bench.servers`)
and each row also reports the requests and body bytes the server answered (index, merge) and
the bytes each worker process read (from the tasks' results and the manifest's ``worker``
field).

    python -m bench ray --params 40M --experts 4 --workers 1,2,4
    python -m bench ray --params 8M --experts 4 --workers 1,2,4 --s3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.common import evict, loadavg
from bench.families import make_synthetic, parse_bytes, parse_count
from bench.raycluster import LocalRayCluster
from bench.servers import MOTO_ENV, CountingMotoServer, upload_tree
from mergefs.engine import ray_index as rayindex
from mergefs.engine import ray_merge as rayexec
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.session import Session
from mergefs.index.blocks import load_or_build
from mergefs.recipe.family import open_family
from mergefs.spec.load import load_spec


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
    manifest = out.with_name(out.name + ".manifest.jsonl")
    manifest.unlink(missing_ok=True)
    session = Session(load_spec(spec_path), manifest=ManifestWriter(manifest))  # index reused
    try:
        if "://" not in session.spec.base:
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
    per_worker: dict[str, int] = {}
    for line in manifest.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "read" and "worker" in rec:
            w = f"{rec['worker']['node'][:8]}/{rec['worker']['pid']}"
            per_worker[w] = per_worker.get(w, 0) + rec["end"] - rec["start"]
    totals["bytes_per_worker"] = sorted(per_worker.values())
    return dt, session.plan.plan_hash, totals


class S3:
    """The family behind moto's S3 server in this process; counts what the server answers."""

    def __init__(self, fam: Path) -> None:
        import s3fs

        os.environ.update(MOTO_ENV)
        self.srv = CountingMotoServer().start()
        fs = s3fs.S3FileSystem(endpoint_url=self.srv.endpoint, skip_instance_cache=True)
        fs.mkdir("bench")
        upload_tree(fs, fam, "bench/fam")
        doc = yaml.safe_load((fam / "spec.yaml").read_text())
        doc["base_model"] = "s3://bench/fam/base"
        for m in doc["models"]:
            m["model"] = f"s3://bench/fam/{m['model'].removeprefix('./')}"
        doc["storage_options"] = {"s3": {"endpoint_url": self.srv.endpoint, "key": "testing",
                                         "secret": "testing"}}
        doc["index_dir"] = str(fam.parent / "s3-index")
        self.spec = fam.parent / "spec-s3.yaml"
        self.spec.write_text(yaml.safe_dump(doc, sort_keys=False))

    def served(self) -> dict[str, int]:
        got = {"requests": len(self.srv.log.requests("")), "body_bytes":
               self.srv.log.body_bytes("")}
        self.srv.log.reset()
        return got


def same_index(a: Any, b: Any) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("base_hash", "expert_hash", "norms", "zero", "gram"))


def same_dir(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.glob("*.safetensors"))
    return bool(files) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main(argv: list[str] | None = None, prog: str = "python -m bench ray") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=parse_count, default=parse_count("40M"))
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--shard-bytes", type=parse_bytes, default=parse_bytes("20MB"))
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--dir", type=Path, help="where the family goes (default: a temp dir)")
    p.add_argument("--s3", action="store_true", help="read the family from moto's S3 server")
    args = p.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="mergefs-bench-ray-"))
    fam = root / "fam"
    if not (fam / "spec.yaml").is_file():
        make_synthetic(fam, params=args.params, layers=4, n_experts=args.experts, vocab=8000,
                       shard_bytes=args.shard_bytes, seed=3, log=lambda *a: None)
    spec = fam / "spec.yaml"
    s3 = S3(fam) if args.s3 else None
    if s3 is not None:
        spec = s3.spec
    print(json.dumps({"load_before": loadavg(), "family": str(fam), "s3": args.s3,
                      "source_bytes": sum(q.stat().st_size for q in fam.rglob("*.safetensors"))}))
    rows = []
    served: dict[str, Any] = {}
    if s3 is not None:
        s3.served()
    t_index, local_index, read = index_run(spec, lambda *a: None)
    if s3 is not None:
        served["index_served"] = s3.served()
    t_merge, plan_hash, totals = merge_run(spec, root / "out-local", False)
    if s3 is not None:
        served["merge_served"] = s3.served()
    rows.append({"run": "local (2 threads)", "index_s": round(t_index, 2),
                 "index_bytes": read, "merge_s": round(t_merge, 2),
                 "merge_read_bytes": sum(totals["physical_bytes_read"].values()), **served})
    print(json.dumps(rows[-1]))
    import ray

    runners: list[Any] = []

    def make(spec: Any, base: Any, experts: Any) -> Any:
        runners.append(rayindex.RayChunkRunner(spec, base, experts))
        return runners[-1]

    for n in [int(x) for x in args.workers.split(",")]:
        cluster = LocalRayCluster(nodes=1, cpus=n, env=MOTO_ENV)  # + PYTHONPATH: this mergefs
        cluster.start()
        try:
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
            served = {}
            if s3 is not None:
                s3.served()
            t_index, index, _ = index_run(spec, make)
            if s3 is not None:
                served["index_served"] = s3.served()
            t_merge, ray_hash, ray_totals = merge_run(spec, root / f"out-ray{n}", True)
            if s3 is not None:
                served["merge_served"] = s3.served()
            index_per_worker: dict[str, int] = {}
            for part in runners[-1].parts:
                w = f"{part['worker']['node'][:8]}/{part['worker']['pid']}"
                index_per_worker[w] = index_per_worker.get(w, 0) + part["bytes_read"]
            rows.append({"run": f"ray, {n} worker process(es)", "index_s": round(t_index, 2),
                         "index_tasks": len(runners[-1].parts), "merge_s": round(t_merge, 2),
                         "merge_read_bytes": sum(ray_totals["physical_bytes_read"].values()),
                         "index_equal": same_index(index, local_index),
                         "merge_equal": same_dir(root / f"out-ray{n}", root / "out-local")
                         and ray_hash == plan_hash,
                         "index_bytes_per_worker": sorted(index_per_worker.values()),
                         "merge_bytes_per_worker": ray_totals["bytes_per_worker"], **served})
            print(json.dumps(rows[-1]))
        finally:
            ray.shutdown()
            cluster.stop()
    print(json.dumps({"load_after": loadavg()}))
    if s3 is not None:
        s3.srv.stop()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.get("index_equal", True) and r.get("merge_equal", True) for r in rows) else 1

