"""The merge's working set: the bytes merging one tensor holds, per method and path, and the
memory cap that bounds the sum over the units in flight.

A unit is merged on one of three paths (mergefs.engine.merger):

- ``blocks``: elementwise methods merge runs of about ``UNIT_ELEMS`` elements;
- ``staged``: a method with a two-phase form (:class:`mergefs.methods.base.Staged`: the GTA
  rows) holds, in phase 1, the base's float32 values and one input's whole tensor (raw, float32,
  its delta, the method's workspace) at a time; in phase 2 blocks of ``STAGED_BLOCK_ELEMS``
  elements of every input; throughout, one bit per element per input (the masks) and at the end
  the output's bytes (twice: the blocks and their join). The need adds both phases: glibc's
  heap does not always reuse phase 1's freed buffers for phase 2's (measured);
- ``whole``: every input's whole tensor (raw and float32) plus the method's own temporaries
  (:attr:`mergefs.methods.base.Method.workspace`) and the output.

The formulas count the buffers the engine and the method allocate, as bytes per element
(tests/engine/test_staged.py measures the staged path's peak against them); they do not count
the interpreter, numpy and torch themselves (~0.1 GB, ~0.4 GB with torch), the mount's caches, or
the kernel's page cache. :class:`MemoryCap` lets units start only while the sum of the needs of
the units in flight stays under the cap. Pure arithmetic plus a condition variable; any thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergefs.core.format import DTYPES
from mergefs.core.sizes import human_bytes
from mergefs.methods.base import Method

#: the default cap: this fraction of the machine's RAM (MemTotal)
MEMORY_FRACTION = 0.5
#: elements per block of the staged path's phase 2 (a multiple of 32: torch's sum groups)
STAGED_BLOCK_ELEMS = 1 << 19
#: elementwise methods' units: about this many elements (mergefs.engine.merger.UNIT_ELEMS)
UNIT_ELEMS = 1 << 20
MERGED_DTYPES = ("F32", "BF16", "F16")


def default_cap_bytes() -> int:
    """``MEMORY_FRACTION`` of the machine's RAM (MemTotal of /proc/meminfo; sysconf elsewhere)."""
    total = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 << 30
    return int(total * MEMORY_FRACTION)


@dataclass(frozen=True)
class Need:
    """What merging one tensor holds at its peak: ``bytes`` on ``path``."""

    tensor: str
    size_bytes: int
    path: str  # "blocks" | "staged" | "whole"


def staged_path(method: Method, n_inputs: int, params: Mapping[str, Any], fused: bool,
                elementwise: bool) -> bool:
    """Whether a whole-tensor unit of ``method`` is merged in two phases."""
    return method.staged is not None and not elementwise and not fused and n_inputs > 0


def tensor_need(method: Method, tensor: str, n_elems: int, n_inputs: int, src_item: int,
                out_item: int, path: str, block_elems: int = STAGED_BLOCK_ELEMS) -> Need:
    """The peak bytes of merging a tensor of ``n_elems`` elements with ``n_inputs`` inputs
    besides the base (source items of ``src_item`` bytes, output items of ``out_item``) on
    ``path``."""
    n, k, s = n_elems, n_inputs, src_item
    a, b = method.workspace
    read = (k + 1) * (s + 4)  # every input's raw bytes and float32 values, the base's too
    if path == "blocks":
        unit = min(n, UNIT_ELEMS)
        return Need(tensor, unit * (read + a + b * k + 4 + 2 * out_item), path)
    if path == "staged":
        st = method.staged
        assert st is not None
        masks = k * ((n + 7) // 8)
        phase1 = n * (4 + s + 4 + 4 + st.phase1_bytes)  # base, one input raw + f32, its delta
        blk = min(n, block_elems + 63)  # (a last block takes the tail and up to 63 more)
        phase2 = blk * (read + k * st.block_bytes_per_input + st.block_bytes)
        # both phases counted: the heap does not always hand phase 1's freed buffers to phase 2
        return Need(tensor, phase1 + phase2 + masks + 2 * n * out_item, path)
    return Need(tensor, n * (read + a + b * k + 4 + 2 * out_item), path)


def item_bytes(dtype: str) -> int:
    return int(DTYPES[dtype][0])


class CapExceeded(Exception):
    """A tensor needs more than the cap (raised by :func:`check`; the caller words it)."""

    def __init__(self, need: Need, cap_bytes: int) -> None:
        super().__init__(
            f"tensor {need.tensor!r} needs {human_bytes(need.size_bytes)} to merge "
            f"({need.path} path), more than the memory cap of {human_bytes(cap_bytes)}")
        self.need = need
        self.cap_bytes = cap_bytes


def check(needs: list[Need], cap_bytes: int) -> None:
    """Raise :class:`CapExceeded` for the largest need above ``cap_bytes``."""
    over = [x for x in needs if x.size_bytes > cap_bytes]
    if over:
        raise CapExceeded(max(over, key=lambda x: x.size_bytes), cap_bytes)


class MemoryCap:
    """Units in flight hold at most ``cap_bytes`` of working set between them: ``hold(n)``
    waits until ``n`` bytes are free (a unit needing more than the whole cap, which
    :func:`check` refuses up front, waits for the others and then runs alone). ``peak_bytes``:
    the most held at once (the engine's own accounting)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.held_bytes = 0
        self.peak_bytes = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.cap_bytes)
        with self._cond:
            while self.held_bytes and self.held_bytes + n > self.cap_bytes:
                self._cond.wait()
            self.held_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return n

    def release(self, n: int) -> None:
        with self._cond:
            self.held_bytes -= n
            self._cond.notify_all()
