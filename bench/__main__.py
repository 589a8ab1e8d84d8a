"""``python -m bench SECTION [options]``; ``python -m bench --help`` lists the sections,
``python -m bench SECTION --help`` a section's options."""

from __future__ import annotations

import sys
import textwrap

from bench.common import children_run_this_mergefs
from bench.sections import SECTIONS, entry

USAGE = """usage: python -m bench SECTION [options]    (from the repository root)

mergefs benchmarks. Cold rows evict the sources from the page cache first (os.sync, then
posix_fadvise DONTNEED on every file); every row carries the command that reproduces it.
Current figures: docs/benchmarks.md. `python -m bench SECTION --help` for a section's options.

sections:
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        width = max(map(len, SECTIONS)) + 4
        print(USAGE + "\n".join(textwrap.fill(s, 96, initial_indent=f"  {n}".ljust(width),
                                              subsequent_indent=" " * width)
                                for n, s in SECTIONS.items()))
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SECTIONS:
        print(f"python -m bench: unknown section {name!r}; one of: {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    children_run_this_mergefs()
    return entry(name)(rest, prog=f"python -m bench {name}")


if __name__ == "__main__":
    sys.exit(main())
