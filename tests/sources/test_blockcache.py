"""The sweep mount's shared source-block cache, without a mount: pieces, bound, single flight."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mergefs.sources.base import ReadRange
from mergefs.sources.blockcache import SourceBlockCache

BLOB = bytes(range(256)) * 4  # 1024 bytes


class FakeSource:
    """Stands in for a Checkpoint: counts physical reads, optionally slow or failing."""

    name = "src"

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.reads: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def read_physical(self, ranges: list[ReadRange]) -> list[memoryview]:
        time.sleep(self.delay)
        if self.fail:
            raise OSError("disk on fire")
        with self.lock:
            self.reads += [(r.start, r.end) for r in ranges]
        return [memoryview(BLOB)[r.start:r.end] for r in ranges]


def cache(capacity: int = 1 << 20) -> SourceBlockCache:
    c = SourceBlockCache(capacity)
    c.add_boundaries("src", "f", np.arange(0, 1025, 128))
    return c


def test_a_run_read_once_serves_other_runs_and_blocks() -> None:
    c, src = cache(), FakeSource()
    (got,) = c.read(src, [ReadRange("f", 128, 640)])
    assert bytes(got) == BLOB[128:640] and src.reads == [(128, 640)]
    parts = c.read(src, [ReadRange("f", 256, 384), ReadRange("f", 384, 640),
                         ReadRange("f", 0, 256)])
    assert [bytes(p) for p in parts] == [BLOB[256:384], BLOB[384:640], BLOB[0:256]]
    assert src.reads == [(128, 640), (0, 128)]  # only the block not cached yet
    s = c.stats()
    assert s["miss_bytes"] == 640 and s["requested_bytes"] == 512 + (128 + 256 + 256)
    assert s["hit_bytes"] == s["requested_bytes"] - s["miss_bytes"]


def test_memory_bound_and_unaligned_ranges() -> None:
    c, src = cache(capacity=300), FakeSource()
    for start in range(0, 1024, 100):
        (got,) = c.read(src, [ReadRange("f", start, min(1024, start + 150))])
        assert bytes(got) == BLOB[start:start + 150]
        assert c.stats()["bytes_cached"] <= 300
    assert c.stats()["evictions"] > 0


def test_concurrent_misses_read_once() -> None:
    c, src = cache(), FakeSource(delay=0.2)
    results: list[bytes] = []

    def reader() -> None:
        results.append(bytes(c.read(src, [ReadRange("f", 0, 512)])[0]))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [BLOB[:512]] * 4
    assert sum(b - a for a, b in src.reads) == 512  # one read for four readers


def test_a_failed_read_reaches_its_waiters_and_is_not_cached() -> None:
    c, src = cache(), FakeSource(delay=0.2, fail=True)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            c.read(src, [ReadRange("f", 0, 256)])
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3
    src.fail = False
    assert bytes(c.read(src, [ReadRange("f", 0, 256)])[0]) == BLOB[:256]
    with pytest.raises(ValueError):
        SourceBlockCache(-1)
