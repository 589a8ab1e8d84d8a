"""Where an index build's time goes: imports, numba load, and per stage thread CPU and wall.

    python -m bench profile-index SPEC [--cold]     # --cold: evict the sources first

Wraps the stage functions of mergefs.index.build (reads, hashes, zero flags, Gram terms, the
reader queue) with timers, then runs ``load_or_build(..., rebuild=True)`` as ``mergefs index
--rebuild`` does (without the progress bar). "wall in stage" is summed over the threads that
ran the stage (the reader runs READ_STREAMS reads at a time). The imports are timed from this
module's own import (``python -m bench`` imports no mergefs module before it).
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import threading
import time
from typing import Any

from bench.common import evict

t_start = time.perf_counter()  # the imports below are timed
from mergefs.index import build as indexbuild
from mergefs.index.blocks import load_or_build
from mergefs.methods import kernels
from mergefs.recipe.family import open_family
from mergefs.spec.load import load_spec

t_imports = time.perf_counter()
cpu: collections.Counter[str] = collections.Counter()
wall: collections.Counter[str] = collections.Counter()
lock = threading.Lock()


def wrap(owner: Any, name: str, label: str) -> None:
    f = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return f(*a, **k)
        finally:
            with lock:
                cpu[label] += time.thread_time() - c0
                wall[label] += time.perf_counter() - t0

    setattr(owner, name, timed)


def main(argv: list[str] | None = None, prog: str = "python -m bench profile-index") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--cold", action="store_true", help="evict the sources first")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    base, experts = open_family(spec)
    if args.cold:
        evict(*[c.path_of(f) for c in [base, *experts] for f in c.files])
    for name in ("hash_blocks", "zero_blocks", "gram_terms"):
        wrap(indexbuild, name, name)
    wrap(indexbuild.Reader, "read", "read (reader threads)")
    wrap(indexbuild.Pass, "chunk", "chunk (computing thread)")
    wrap(queue.Queue, "get", "waiting for a chunk read")
    wrap(queue.Queue, "put", "reader waiting for the computing thread")
    t0 = time.perf_counter()
    kernels.index_kernels()
    t_numba = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    load_or_build(base, experts, spec.block_size, spec.index_dir, rebuild=True, sidecars=False)
    t_build = time.perf_counter() - t0
    size = sum(c.tensors[t].size_bytes for c in [base, *experts] for t in c.tensors)
    print(f"{'cold' if args.cold else 'as cached'}, load {os.getloadavg()[0]:.1f}: imports "
          f"{t_imports - t_start:.2f} s, numba load {t_numba:.2f} s, build {t_build:.2f} s "
          f"({size / t_build / 1e9:.2f} GB/s; process CPU {time.process_time() - c0:.2f} s)")
    for name in sorted(wall, key=lambda n: -wall[n]):
        print(f"  {name:40s} thread CPU {cpu[name]:6.2f} s   wall in stage {wall[name]:6.2f} s")
    return 0
