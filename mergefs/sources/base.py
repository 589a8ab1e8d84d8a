"""What every source shares: tensor locations, read ranges and their coalescing, file identities and read counters. Pure data and helpers; no file is opened here."""

from __future__ import annotations
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from mergefs.core import format as fmt
from mergefs.core.errors import SourceError


INDEX_NAME = "model.safetensors.index.json"


SINGLE_NAME = "model.safetensors"


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


MAX_PREFIX_READ = 8 + fmt.HEADER_SIZE_CAP


#: Published index sidecars (mergefs.index.published) live beside weights; they are never weights.
SIDECAR_RE = re.compile(r"(^|.*\.)mergefs-index\.[0-9a-f]+\.\d+\.safetensors$")


@dataclass(frozen=True)
class FileIdentity:
    """What a file was when we parsed it: a change in any field means the file changed.

    ``etag`` is the store's entity tag of a remote object (None for local files and for stores
    that send none); it is left out of the JSON when None, so local identities are unchanged.
    """

    path: str
    size_bytes: int
    mtime_ns: int
    header_xxh3: str
    etag: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "size_bytes": self.size_bytes,
            "mtime_ns": self.mtime_ns,
            "header_xxh3": self.header_xxh3,
        }
        if self.etag is not None:
            out["etag"] = self.etag
        return out


@dataclass(frozen=True)
class AuxFile:
    """A file beside a source's weights (a delta sidecar), as a reader of its byte ranges needs it.

    ``where`` is what messages and manifests name: a path or a URL. A file on this machine has
    ``path`` (read it by pread) and no ``fetch``; a remote one has ``fetch(start, end)``, its
    bytes by ranged requests pinned to the version seen when it was found (a replaced object
    fails the read), and ``coalesce_gap_bytes``: fetches at most this far apart may share one
    request.
    """

    where: str
    path: Path | None = None
    fetch: Callable[[int, int], bytes] | None = None
    coalesce_gap_bytes: int = 0


def aux_read_only(root: object, what: str, instead: str) -> SourceError:
    """The error of a source beside which nothing can be written (``check_writable_aux``)."""
    return SourceError(f"{root}: cannot publish {what} here: HTTP sources are read-only, and so "
                       f"are slices over remote models ({instead})")


@dataclass(frozen=True)
class TensorLoc:
    """Where one tensor's bytes live: ``[start, end)`` are absolute offsets in ``file``."""

    name: str
    file: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def size_bytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadRange:
    """A half-open byte range ``[start, end)`` of one file of a source."""

    file: str
    start: int
    end: int


@dataclass(frozen=True)
class Run:
    """One physical read ``[start, end)`` of ``file`` serving the requested ranges ``members``.

    ``covered_bytes`` is how many of its bytes some requested range asked for; the rest are gap
    bytes read only to save a request (remote sources with a gap threshold).
    """

    file: str
    start: int
    end: int
    members: tuple[int, ...]
    covered_bytes: int


class GapAllowance:
    """Gap bytes that coalesced remote reads may still fetch, shared by every read of a merge.

    A budgeted plan leaves ``budget - planned`` bytes of its budget unread: the bytes between
    coalesced ranges (fetched and dropped) are taken from that slack, so planned plus gap bytes
    stay within the budget (issue 14). ``limit_bytes`` None: no limit (a full budget: coalescing
    as the ``coalesce_gap`` threshold alone decides). ``spent_bytes`` counts every gap byte
    taken. Thread-safe: :meth:`take` is atomic, so concurrent readers never overspend.
    """

    def __init__(self, limit_bytes: int | None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must not be negative, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.spent_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` gap bytes if that many remain (True), else spend nothing (False)."""
        with self._lock:
            if self.limit_bytes is not None and self.spent_bytes + nbytes > self.limit_bytes:
                return False
            self.spent_bytes += nbytes
            return True

    def absorb(self, spent_bytes: int) -> None:
        """Count gap bytes spent elsewhere from a share of this allowance (a Ray task's)."""
        with self._lock:
            self.spent_bytes += spent_bytes


def coalesce(ranges: Sequence[ReadRange], gap_bytes: int = 0,
             allowance: GapAllowance | None = None) -> list[Run]:
    """Group ranges of one file that overlap, touch, or lie at most ``gap_bytes`` apart.

    Runs come in (file, start) order; ``members`` index into ``ranges``. With an
    ``allowance``, a gap joins two ranges only if it can be taken from the allowance; once it
    is spent, ranges further apart than touching start runs of their own.
    """
    order = sorted(range(len(ranges)), key=lambda k: (ranges[k].file, ranges[k].start))
    runs: list[Run] = []
    members: list[int] = []
    start = end = covered = 0
    for k in order:
        r = ranges[k]
        if members and (r.file != ranges[members[0]].file or r.start > end + gap_bytes
                        or (r.start > end and allowance is not None
                            and not allowance.take(r.start - end))):
            runs.append(Run(ranges[members[0]].file, start, end, tuple(members), covered))
            members = []
        if not members:
            start, end, covered = r.start, r.start, 0
        covered += max(0, r.end - max(r.start, end))  # new bytes beyond the run's end so far
        end = max(end, r.end)
        members.append(k)
    if members:
        runs.append(Run(ranges[members[0]].file, start, end, tuple(members), covered))
    return runs


def slice_runs(ranges: Sequence[ReadRange], runs: Sequence[Run],
               bufs: Sequence[memoryview]) -> list[memoryview]:
    """One zero-copy view per requested range, in request order, cut from its run's buffer."""
    out: list[memoryview | None] = [None] * len(ranges)
    for run, buf in zip(runs, bufs):
        for k in run.members:
            r = ranges[k]
            out[k] = buf[r.start - run.start : r.end - run.start]
    return [m for m in out if m is not None]


class Counters:
    """Physical read counters of one source; ``bytes_read`` counts bytes returned by pread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = 0
            self.reads = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    #: every counter, by attribute name (what :meth:`snapshot` and :meth:`absorb` carry)
    FIELDS: tuple[str, ...] = ("bytes_read", "reads")

    def snapshot(self) -> dict[str, int]:
        """Every counter's value now (e.g. to send a worker's counts to the driver)."""
        with self._lock:
            return {k: getattr(self, k) for k in self.FIELDS}

    def absorb(self, counts: dict[str, int]) -> None:
        """Add another copy's :meth:`snapshot` (reads the same source made elsewhere)."""
        with self._lock:
            for k in self.FIELDS:
                setattr(self, k, getattr(self, k) + int(counts.get(k, 0)))


CONFIG_NAME = "config.json"
