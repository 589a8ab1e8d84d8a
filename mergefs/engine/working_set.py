"""The memory cap: the default (half of RAM, or of a container's cgroup limit when lower), the
up-front check of every tensor's need (:mod:`mergefs.methods.needs`) against it, and
:class:`MemoryCap`, which lets units start only while the needs of the units in flight sum to
at most the cap. Any thread.
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
#: cgroup filesystem's root (tests point it elsewhere)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_limit_files(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT
                       ) -> list[Path]:
    """Where this process's memory limit may be read: its own cgroup's (from
    ``/proc/self/cgroup``, or ``proc_cgroup``: the text of one) and the root's, cgroup v2
    (``memory.max``) and v1 (``memory/memory.limit_in_bytes``)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    files = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        if parts[0] == "0" and parts[1] == "":  # v2
            files.append(root / parts[2].lstrip("/") / "memory.max")
        elif "memory" in parts[1].split(","):  # v1
            files.append(root / "memory" / parts[2].lstrip("/") / "memory.limit_in_bytes")
    files += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    return list(dict.fromkeys(files))


def default_cap_bytes(cgroup_files: Sequence[Path] | None = None) -> int:
    """``MEMORY_FRACTION`` of the machine's RAM (MemTotal of /proc/meminfo; sysconf
    elsewhere), or of the lowest cgroup memory limit among ``cgroup_files`` (default
    :func:`cgroup_limit_files`) when that is lower."""
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
    files = cgroup_limit_files() if cgroup_files is None else cgroup_files
    limit = _cgroup_limit_bytes(files)
    if limit is not None:
        total = min(total, limit)
    return int(total * MEMORY_FRACTION)


def _cgroup_limit_bytes(files: Sequence[Path]) -> int | None:
    """The lowest limit among ``files`` ("max", absent or unreadable: none; v1's "unlimited"
    is a huge number, which the caller's min with RAM discards)."""
    limits = []
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            limits.append(int(text))
    return min(limits, default=None)


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
