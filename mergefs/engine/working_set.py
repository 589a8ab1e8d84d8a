"""The memory cap: the default (half of RAM, or of a container's cgroup limit when lower), the
up-front check of every tensor's need (:mod:`mergefs.methods.needs`) against it, and :class:`MemoryCap`, which lets units start only
while the needs of the units in flight sum to at most the cap. Any thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from mergefs.core.format import DTYPES
from mergefs.core.sizes import human_bytes
from mergefs.methods.needs import Need

#: the default cap: this fraction of the memory the process may use (MemTotal, or the
#: cgroup's limit when lower: a container's)
MEMORY_FRACTION = 0.5
#: where a container's memory limit is read: cgroup v2, then v1 (the first with a number)
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),
                      Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def default_cap_bytes(cgroup_files: Sequence[Path] = CGROUP_LIMIT_FILES) -> int:
    """``MEMORY_FRACTION`` of the machine's RAM (MemTotal of /proc/meminfo; sysconf
    elsewhere), or of the cgroup's memory limit (``cgroup_files``) when that is lower."""
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
    limit = _cgroup_limit_bytes(cgroup_files)
    if limit is not None:
        total = min(total, limit)
    return int(total * MEMORY_FRACTION)


def _cgroup_limit_bytes(files: Sequence[Path]) -> int | None:
    """The first limit among ``files`` ("max", absent or unreadable: none; v1's "unlimited"
    is a huge number, which the caller's min with RAM discards)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


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
