"""Coverage-guided fuzzing of the safetensors header parser with atheris, for long runs.

    pip install atheris
    python -m bench fuzz-format -max_total_time=600 [corpus_dir]

The arguments are libFuzzer's. The law: any byte string either parses or raises
mergefs.core.format.FormatError; nothing else may escape, and a parsed header must describe a
buffer that tiles exactly. The test suite checks the same law with hypothesis on a fixed example
budget (tests/test_format.py).
"""

from __future__ import annotations

import sys
from typing import Any

fmt: Any = None


def one_input(data: bytes) -> None:
    try:
        header = fmt.parse_bytes(data)
    except fmt.FormatError:
        return
    end = 0
    for t in sorted(header.tensors, key=lambda t: t.start):
        assert t.start == end, "parsed header with a hole or overlap"
        assert t.end - t.start == t.numel * t.itemsize, "parsed header with a size mismatch"
        end = t.end
    assert header.data_start + end == len(data), "parsed header not ending at file end"


def main(argv: list[str] | None = None, prog: str = "python -m bench fuzz-format") -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: {prog} [libFuzzer options] [corpus_dir]\n\n{__doc__}")
        return 0
    try:
        import atheris
    except ImportError:
        print(f"{prog}: needs atheris (pip install atheris)", file=sys.stderr)
        return 2
    global fmt
    with atheris.instrument_imports():
        from mergefs.core import format as fmt
    seed = fmt.build_header({"a": ("F32", (2, 2)), "b": ("BF16", (3,))}, {"format": "pt"})[0]
    sys.stderr.write(f"seed header: {len(seed)} bytes\n")
    atheris.Setup([prog, *args], one_input)
    atheris.Fuzz()
    return 0
