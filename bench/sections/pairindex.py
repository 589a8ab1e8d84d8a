"""Adding an expert to an indexed family vs building the whole index again (cold reads).

    python -m bench pairindex [--dir /tmp] [--mib 96]

Two small fp32 families (:func:`bench.families.make_small_family`) of a base and 4 experts:
"dense" (every tensor trained, 30% of each tensor's rows left equal to the base) and "sparse"
(LoRA-like: 10 of 12 tensors bit-identical to the base). For each: a fresh 4-expert build; a
3-expert build, then the 4th expert added; the 4 experts reordered; one removed. Every source
file is evicted from the page cache before each step. Prints a Markdown table per family.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import evict, markdown
from bench.families import SmallFamily, make_small_family
from mergefs.index.blocks import load_or_build
from mergefs.index.build import BuildReport
from mergefs.sources import open_source

BLOCK = 1 << 20


def step(fam: SmallFamily, which: list[int], idx: Path) -> tuple[float, BuildReport]:
    """One cold ``load_or_build`` of the base and experts ``which`` into index ``idx``."""
    evict(fam.base, *fam.experts)
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


def row(label: str, seconds: float, report: BuildReport, fam: SmallFamily) -> list[str]:
    names = {str(fam.base): "base", **{str(e): e.name for e in fam.experts}}
    per = ", ".join(f"{names[k]} {v / 2**20:.0f}" for k, v in sorted(report.bytes_read.items()))
    return [label, f"{seconds:.2f} s", f"{sum(report.bytes_read.values()) / 2**20:.0f} MiB",
            per or "-", f"{len(report.experts_built)} / {report.pairs_built}"]


def main(argv: list[str] | None = None, prog: str = "python -m bench pairindex") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where to make a fresh folder")
    ap.add_argument("--mib", type=int, default=96, help="size of each model, MiB")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-pairindex-", dir=args.dir))  # fresh every run
    n_tensors = 12
    rows = max(1, args.mib * 2**20 // (n_tensors * 2048 * 4))
    shapes = {f"model.layers.{k}.w.weight": (rows, 2048) for k in range(n_tensors)}
    for kind, zero in (("dense", ()), ("sparse", tuple(list(shapes)[:10]))):
        fam = make_small_family(root / kind, n_experts=4, shapes=shapes, zero_tensors=zero,
                                seed=3)
        print(f"\n{kind}: base + 4 experts of {args.mib} MiB fp32, block 1 MiB, cold\n")
        body = [row("fresh 4-expert build", *step(fam, [0, 1, 2, 3], root / f"{kind}-full"),
                    fam)]
        idx = root / f"{kind}-grow"
        for label, which in (("3-expert build", [0, 1, 2]), ("add the 4th expert", [0, 1, 2, 3]),
                             ("reorder the 4", [3, 1, 0, 2]), ("remove one", [3, 0, 2])):
            body.append(row(label, *step(fam, which, idx), fam))
        print(markdown(["step", "wall", "read", "read per source (MiB)",
                        "pieces built (experts / pairs)"], body), end="")
    return 0
