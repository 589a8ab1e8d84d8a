"""One reader process of the load test (tests/test_stress.py); not a test module.

    python stressreader.py MOUNTED_FILE EXPECTED_FILE SECONDS SEED

Runs three threads until SECONDS have passed: random ranges with O_DIRECT (every read reaches
the mount), a sequential stream through the page cache, and an mmap reader; after each pass the
streaming readers drop the file's pages (POSIX_FADV_DONTNEED), so the next pass reaches the mount
again. Every byte is compared with EXPECTED_FILE. Prints one JSON line: reads and bytes per kind,
and the first few mismatches or errors.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import threading
import time


def main() -> int:
    mounted, expected_path, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), \
        int(sys.argv[4])
    with open(expected_path, "rb") as f:
        expected = f.read()
    size = len(expected)
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    reads: dict[str, int] = {}
    nbytes_by_kind: dict[str, int] = {}
    problems: list[str] = []

    def note(kind: str, nbytes: int) -> None:
        with lock:
            reads[kind] = reads.get(kind, 0) + 1
            nbytes_by_kind[kind] = nbytes_by_kind.get(kind, 0) + nbytes

    def problem(text: str) -> None:
        with lock:
            if len(problems) < 10:
                problems.append(text)

    def random_ranges(rng: random.Random) -> None:
        fd = os.open(mounted, os.O_RDONLY | os.O_DIRECT)
        try:
            while time.monotonic() < deadline:
                off = rng.randrange(size)
                n = rng.choice([1, 7, 4096, rng.randrange(1, 300_000)])
                try:
                    got = os.pread(fd, n, off)
                except OSError as exc:
                    problem(f"random [{off}, +{n}): {exc}")
                    continue
                if got != expected[off:off + n]:
                    problem(f"random [{off}, +{n}): bytes differ")
                note("random", len(got))
        finally:
            os.close(fd)

    def stream(rng: random.Random) -> None:
        chunk = 1 << 20
        while time.monotonic() < deadline:
            start = rng.randrange(0, size, 4096)  # begin anywhere; run to the end
            with open(mounted, "rb", buffering=0) as f:
                f.seek(start)
                pos = start
                while pos < size and time.monotonic() < deadline:
                    try:
                        got = f.read(chunk)
                    except OSError as exc:
                        problem(f"stream at {pos}: {exc}")
                        break
                    if got != expected[pos:pos + len(got)]:
                        problem(f"stream [{pos}, +{len(got)}): bytes differ")
                    note("stream", len(got))
                    pos += len(got)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def mapped(rng: random.Random) -> None:
        while time.monotonic() < deadline:
            with open(mounted, "rb") as f:
                try:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                        for _ in range(64):
                            off = rng.randrange(size)
                            n = rng.randrange(1, 200_000)
                            if mm[off:off + n] != expected[off:off + n]:
                                problem(f"mmap [{off}, +{n}): bytes differ")
                            note("mmap", min(n, size - off))
                except (OSError, ValueError) as exc:
                    problem(f"mmap: {exc}")
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    threads = [threading.Thread(target=fn, args=(random.Random(seed * 10 + k),))
               for k, fn in enumerate((random_ranges, stream, mapped))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"reads": reads, "bytes": nbytes_by_kind, "problems": problems}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
