"""Adding an expert to an indexed family vs building the whole index again (cold reads).

    PYTHONPATH=. python scripts/bench_pairindex.py [--dir /tmp] [--mib 96]

Two synthetic fp32 families of a base and 4 experts: "dense" (every tensor trained, 30% of each
tensor's rows left equal to the base) and "sparse" (LoRA-like: 10 of 12 tensors bit-identical
to the base). For each: a fresh 4-expert build; a 3-expert build, then the 4th expert added; the
4 experts reordered. Every source file is evicted from the page cache before each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from families import Family, make_family

from mergefs.sources import open_source
from mergefs.index.build import BuildReport
from mergefs.index.blocks import load_or_build

BLOCK = 1 << 20


def evict(fam: Family) -> None:
    for model in [fam.base, *fam.experts]:
        for f in model.glob("*.safetensors"):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages (a family just written) cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def step(fam: Family, which: list[int], idx: Path) -> tuple[float, BuildReport]:
    evict(fam)
    base = open_source(fam.base)
    experts = [open_source(fam.experts[i]) for i in which]
    report = BuildReport()
    t0 = time.perf_counter()
    try:
        load_or_build(base, experts, BLOCK, idx, report=report)
    finally:
        for c in [base, *experts]:
            c.close()
    return time.perf_counter() - t0, report


def row(label: str, seconds: float, report: BuildReport, fam: Family) -> None:
    names = {str(fam.base): "base", **{str(e): e.name for e in fam.experts}}
    per = ", ".join(f"{names[k]} {v / 2**20:.0f}" for k, v in sorted(report.bytes_read.items()))
    print(f"| {label} | {seconds:.2f} s | {sum(report.bytes_read.values()) / 2**20:.0f} MiB "
          f"| {per or '-'} | {len(report.experts_built)} / {report.pairs_built} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None, help="where to make a fresh folder")
    ap.add_argument("--mib", type=int, default=96, help="size of each model, MiB")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-pairindex-", dir=args.dir))  # fresh every run
    n_tensors = 12
    rows = max(1, args.mib * 2**20 // (n_tensors * 2048 * 4))
    shapes = {f"model.layers.{k}.w.weight": (rows, 2048) for k in range(n_tensors)}
    for kind, zero in (("dense", ()), ("sparse", tuple(list(shapes)[:10]))):
        fam = make_family(root / kind, n_experts=4, shapes=shapes, zero_tensors=zero, seed=3)
        print(f"\n{kind}: base + 4 experts of {args.mib} MiB fp32, block 1 MiB, cold\n")
        print("| step | wall | read | read per source (MiB) | pieces built (experts / pairs) |")
        print("|---|---|---|---|---|")
        row("fresh 4-expert build", *step(fam, [0, 1, 2, 3], root / f"{kind}-full"), fam)
        idx = root / f"{kind}-grow"
        row("3-expert build", *step(fam, [0, 1, 2], idx), fam)
        row("add the 4th expert", *step(fam, [0, 1, 2, 3], idx), fam)
        row("reorder the 4", *step(fam, [3, 1, 0, 2], idx), fam)
        row("remove one", *step(fam, [3, 0, 2], idx), fam)


if __name__ == "__main__":
    main()
