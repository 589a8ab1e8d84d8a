"""Growing an index one expert at a time, 2 -> N experts: bytes read per addition, with the
exact Gram pairs built on every addition (before issue 31) against sketches (now).

    python -m bench growindex [--dir /tmp] [--mib 8] [--experts 16]

One dense bf16 family (:func:`bench.families.make_small_family`: every tensor trained, no row
left equal to the base, as in full fine-tunes) of a base and N experts, block 1 MiB. Each mode
starts from an index of experts 0 and 1, then adds experts 2, 3, ... one at a time
(``load_or_build`` of experts 0..n-1): "exact pairs" with ``exact=True`` (every new pair read
where both deltas are non-zero, as every build did before sketches), "sketches" with the
default. For each addition: the bytes the build read by its own counters and by
``/proc/self/io`` (``rchar``: every read call of this process, stored pieces included), as
multiples of one expert's bytes, and the cumulative bytes. The sources stay in the page cache
(what is counted is bytes read, not time). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import markdown
from bench.families import make_small_family
from mergefs.index.blocks import load_or_build
from mergefs.index.build import BuildReport
from mergefs.sources import open_source

BLOCK = 1 << 20


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def add(fam: object, n: int, idx: Path, exact: bool) -> tuple[int, int]:
    """(bytes by the build's counters, rchar) of indexing experts 0..n-1 into ``idx``."""
    base = open_source(fam.base)  # type: ignore[attr-defined]
    experts = [open_source(e) for e in fam.experts[:n]]  # type: ignore[attr-defined]
    report = BuildReport()
    try:
        before = rchar()
        load_or_build(base, experts, BLOCK, idx, report=report, exact=exact)
        return sum(report.bytes_read.values()), rchar() - before
    finally:
        for c in [base, *experts]:
            c.close()


def main(argv: list[str] | None = None, prog: str = "python -m bench growindex") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="where to make a fresh folder")
    ap.add_argument("--mib", type=int, default=8, help="size of each model, MiB (bf16)")
    ap.add_argument("--experts", type=int, default=16, help="experts at the end")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-growindex-", dir=args.dir))  # fresh every run
    n_tensors = 8
    rows = max(1, args.mib * 2**20 // (n_tensors * 2048 * 2))
    shapes = {f"model.layers.{k}.w.weight": (rows, 2048) for k in range(n_tensors)}
    fam = make_small_family(root / "fam", n_experts=args.experts, dtype="bfloat16",
                            shapes=shapes, zero_tensors=(), zero_row_fraction=0.0, seed=7)
    one = sum(t.size_bytes for t in open_source(fam.experts[0]).tensors.values()
              if t.dtype != "I64")
    got: dict[bool, list[tuple[int, int]]] = {}
    for exact in (True, False):
        idx = root / f"idx-{'exact' if exact else 'sketch'}"
        add(fam, 2, idx, exact)
        got[exact] = [add(fam, n, idx, exact) for n in range(3, args.experts + 1)]
    print(f"\ndense bf16 family: base + {args.experts} experts of {one / 2**20:.1f} MiB, block "
          "1 MiB; bytes read per addition, in experts' bytes (counters / rchar), page cache "
          "warm\n")
    body = []
    cum = {True: 0, False: 0}
    for k, n in enumerate(range(3, args.experts + 1)):
        cells = []
        for exact in (True, False):
            counted, rc = got[exact][k]
            cum[exact] += counted
            cells += [f"{counted / one:.2f} / {rc / one:.2f}", f"{cum[exact] / one:.1f}"]
        body.append([f"{n - 1} -> {n}", *cells])
    print(markdown(["experts", "exact pairs on add: this addition", "cumulative",
                    "sketches: this addition", "cumulative"], body), end="")
    return 0
