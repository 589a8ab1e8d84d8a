"""Delta sidecar decode alone (issue 14): every block a budget's plan reconstructs, decoded from
sidecar bytes already in memory, by several routes on the same blocks:

- ``batched``: :func:`mergefs.deltas.decode.decode_into`, one call per (expert, tensor), by the
  sidecars' own arithmetic (versions 4 and 5: the exact low-rank product on oneDNN's int8
  matmul where the CPU has AMX or VNNI, :mod:`mergefs.deltas.intgemm`, else by BLAS; what the engine
  runs), one thread;
- ``batched_blas``: the same with every exact product a float32 BLAS product (the same bits);
- ``batched_v3``: the same call with version 3's fixed-order compiled product (different bits,
  same work: what the engine ran before version 4);
- ``numpy_blocks``: the sidecars' arithmetic block by block in numpy (the fallback);
- ``blas_blocks``: the version-2 route, block by block with a rounding BLAS product;
- ``batched_2threads``: ``batched`` with the (expert, tensor) calls shared by two threads, as
  the engine's two workers run them: wall time,

best of ``--repeat`` runs each, against the cold pread of the exact expert bytes those blocks
replace (:func:`bench.sections.sidecar.replaced_read_seconds`), by one thread and by two. Needs
published sidecars (``mergefs compress``).

    python -m bench decode --family /tmp/minilm --spec spec-full.yaml --budgets 10,20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch  # noqa: F401 (imported, as by any merge that uses torch: the int8 route is on at once)

from bench.sections.sidecar import replaced_read_seconds
from mergefs.core.dtypes import decode_f32
from mergefs.deltas import decode as deltadecode
from mergefs.deltas.reconstruct import one_blas_thread, reconstruct
from mergefs.engine.session import Session
from mergefs.spec.load import load_spec


def _jobs(s: Session) -> list[tuple[Any, ...]]:
    """Per (expert, tensor) with planned blocks: what decode_into takes, bytes read already,
    and the output buffer (touched already, as the exact read's buffers are)."""
    lay = s.index.layout
    jobs = []
    for i, sc in sorted(s.engine.deltas.items()):
        for tl in sc.tensors.values():
            blocks = np.asarray([b for b in lay.blocks_of(tl.t) if s.plan.levels[i, b] > 0])
            if blocks.size == 0:
                continue
            depths = s.plan.levels[i, blocks].astype(np.int64)
            first = int(lay.first_block[tl.t])
            e0 = int(lay.elem_start[first])
            payloads = deltadecode.read_payloads(sc, tl, blocks - first, depths, tl.name)
            depth = int(depths.max())
            shared = [sc.shared(lv, tl.cols, tl.name) for lv in tl.levels[:depth]]
            base = s.engine.base
            w0 = decode_f32(base.read_tensor(tl.name), base.tensors[tl.name].dtype)
            jobs.append((tl, w0, lay.elem_start[blocks] - e0,
                         (lay.elem_end[blocks] - lay.elem_start[blocks]) // tl.cols, depths,
                         payloads, shared,
                         {v: deltadecode.pack(tl.levels[:depth], shared, tl.cols, v)
                          for v in {sc.meta["version"], "3"}}, sc.meta["version"],
                         np.zeros_like(w0)))  # written before: no page faults in the timing
    return jobs


def _run(jobs: list[tuple[Any, ...]], route: str) -> float:
    if route == "batched_2threads":
        order = sorted(jobs, key=lambda j: -int(j[3].sum()) * j[0].cols)  # largest first
        shares: list[list[tuple[Any, ...]]] = [[], []]
        load = [0, 0]
        for job in order:  # greedy: each call to the less loaded thread
            k = int(np.argmin(load))
            shares[k].append(job)
            load[k] += int(job[3].sum()) * job[0].cols
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda share: _run(share, "batched"), shares))
        return time.perf_counter() - t0
    if route == "batched_blas":
        route_was = deltadecode._int_route
        deltadecode._int_route = lambda: None
        try:
            return _run(jobs, "batched")
        finally:
            deltadecode._int_route = route_was
    t0 = time.perf_counter()
    for tl, w0, starts, n_rows, depths, payloads, shared, packed, version, out in jobs:
        if route in ("batched", "batched_v3"):
            v = "3" if route == "batched_v3" else version
            deltadecode.decode_into(out, w0, tl.levels, tl.cols, starts, n_rows, depths,
                                    payloads, shared, packed[v], v)
            continue
        v = "2" if route == "blas_blocks" else version
        with one_blas_thread():
            for j in range(len(starts)):
                s, k = int(starts[j]), int(depths[j])
                n = int(n_rows[j]) * tl.cols
                out[s:s + n] = reconstruct(
                    w0[s:s + n], tl.levels[:k], [payloads.block(lvl, j) for lvl in range(k)],
                    shared[:k], int(n_rows[j]), tl.cols, version=v)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None, prog: str = "python -m bench decode") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, required=True)
    p.add_argument("--spec", default="spec.yaml")
    p.add_argument("--budgets", default="10,20", help="%% of the experts' bf16 bytes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="only the batched routes")
    p.add_argument("--decode-limit", default=None,
                   help="plan with this decode_limit (a number, or none) instead of the spec's")
    args = p.parse_args(argv)
    spec = load_spec(str(args.family / args.spec))
    if args.decode_limit is not None:
        spec = dataclasses.replace(spec, decode_limit=None if args.decode_limit == "none"
                                   else float(args.decode_limit))
    sources = [Path(spec.base), *[Path(e.path) for e in spec.experts]]
    for b in args.budgets.split(","):
        probe = Session(spec, budget_bytes=0)
        lay = probe.index.layout
        bf16 = 2 * int((lay.elem_end - lay.elem_start).sum()) * len(spec.experts)
        probe.close()
        s = Session(spec, budget_bytes=int(float(b) / 100 * bf16))
        jobs = _jobs(s)
        row: dict[str, Any] = {"budget": b, "decode_limit": spec.decode_limit,
                               "decode_model_s": s.plan.decode_seconds,
                               "replaced_read_model_s": s.plan.replaced_read_seconds,
                               "blocks": int(sum(len(j[2]) for j in jobs)),
                               "load_avg_1m": round(os.getloadavg()[0], 2)}
        _run(jobs, "batched")  # numba: compiled or loaded from its cache
        _run(jobs, "batched_blas")
        _run(jobs, "batched_v3")
        routes = ["batched", "batched_blas", "batched_2threads", "batched_v3", "numpy_blocks",
                  "blas_blocks"]
        if args.quick:
            routes = routes[:3]
        with one_blas_thread():  # held once, as the engine's workers hold it
            for route in routes:
                row[f"{route}_s"] = round(min(_run(jobs, route) for _ in range(args.repeat)), 4)
        for threads in (1, 2):
            secs, nbytes = min(replaced_read_seconds(s, sources, threads)
                               for _ in range(args.repeat))
            row[f"replaced_exact_read_cold_{threads}threads_s"] = round(secs, 4)
        row["replaced_exact_bytes"] = nbytes
        s.close()
        print(json.dumps(row))
    return 0

