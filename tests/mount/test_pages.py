"""The mount's fast paths without a mount: O(1) readahead decisions, copy-free slices, and the
bytes pushed into the kernel page cache (notify_store, warm-up), checked against a model of the
page cache that must equal the materialised merge wherever it holds bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from families import Family
from viewcases import materialise, session_of, write_case_spec
from viewcases import open_view as view_over

from mergefs.core.cache import UnitCache
from mergefs.engine.session import Session
from mergefs.mount.files import Stream, UnitReader
from mergefs.mount.pages import PAGE
from mergefs.mount.session import ROOT
from mergefs.mount.view import View, auto_warm_tensors
from mergefs.spec.load import load_spec

TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pages_index")


@pytest.fixture
def opened() -> Iterator[list[View]]:
    views: list[View] = []
    yield views
    for v in views:
        v.close()
        session_of(v).close()


def open_view(spec: Path, opened: list[View], cache_bytes: int = 1 << 30, **kw: Any) -> View:
    view = view_over(Session(load_spec(spec)), UnitCache(cache_bytes), **kw)
    opened.append(view)
    return view


def reader_of(view: View) -> UnitReader:
    """The unit reader of a plain spec's view (its one variant)."""
    return view.readers[ROOT]


def stop_background(view: View) -> None:
    """Stop the warm-up, pushing and readahead (waiting for running merges), as closing does."""
    view.pages.stop()
    reader_of(view).close()


class PageCacheModel:
    """What the kernel would hold after ``notify_store`` calls: bytes by (inode, offset)."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes
        self.pages: dict[int, bytearray] = {ino: bytearray(size) for ino, size in sizes.items()}
        self.filled: dict[int, set[int]] = {ino: set() for ino in sizes}
        self.calls: list[tuple[int, int, int]] = []

    def store(self, inode: int, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        size = self.sizes[inode]
        # the rules that make every pushed page complete and in bounds
        assert offset % PAGE == 0, offset
        assert offset + n <= size, (offset, n, size)
        assert (offset + n) % PAGE == 0 or offset + n == size, (offset, n, size)
        self.pages[inode][offset:offset + n] = data
        self.filled[inode].update(range(offset // PAGE, -(-(offset + n) // PAGE)))
        self.calls.append((inode, offset, n))

    def check(self, inode: int, want: bytes) -> int:
        """Every pushed page equals the materialised file's; returns how many were pushed."""
        for p in self.filled[inode]:
            a, b = p * PAGE, min(len(want), (p + 1) * PAGE)
            assert bytes(self.pages[inode][a:b]) == want[a:b], f"page {p} differs"
        return len(self.filled[inode])


def sizes_of(view: View) -> dict[int, int]:
    return {ino: wf.size_bytes for _, ino, wf in view.weight_files()}


@pytest.mark.parametrize("fam_name", ["family_f32", "family_bf16", "family_sharded"])
def test_pushed_pages_equal_the_merge_sequential_reader(request: pytest.FixtureRequest,
                                                        tmp_path: Path, index_dir: Path,
                                                        fam_name: str,
                                                        opened: list[View]) -> None:
    fam: Family = request.getfixturevalue(fam_name)
    # units of 8 KiB or more: each holds whole pages, so a unit ahead is always pushable
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "idx",
                           block_size=8192)
    out = materialise(spec, tmp_path / "out")
    view = open_view(spec, opened, readahead_units=4)
    model = PageCacheModel(sizes_of(view))
    view.enable_page_store(model.store)
    for path, ino, _ in view.weight_files():
        want = (out / path).read_bytes()
        fh = view.open_path(path)
        half = len(want) // 2
        got = b"".join(bytes(view.read(fh, off, min(1000, half - off)))
                       for off in range(0, half, 1000))
        reader_of(view)._pool.submit(lambda: None).result()  # readahead scheduled so far is done
        assert view.pages.drain()  # pushes of the units ahead of the reader, too
        got += b"".join(bytes(view.read(fh, off, 1000)) for off in range(half, len(want), 1000))
        view.release(fh)
        assert got == want
    stop_background(view)  # waits for readahead
    pushed = 0
    for path, ino, _ in view.weight_files():
        pushed += model.check(ino, (out / path).read_bytes())
    assert pushed > 0 and view.stats()["kernel_pages"]["store_calls"] == len(model.calls)


@pytest.mark.parametrize("case", ["task_arithmetic", "ties"])
def test_warm_up_pushes_the_whole_model_and_equals_the_merge(tmp_path: Path, index_dir: Path,
                                                             family_sharded: Family, case: str,
                                                             opened: list[View]) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, case, index_dir)
    out = materialise(spec, tmp_path / "out")
    view = open_view(spec, opened)
    model = PageCacheModel(sizes_of(view))
    view.enable_page_store(model.store)
    looked_up: list[str] = []
    view.start_warm(looked_up.append)
    assert view.pages.wait_warm(120) and view.pages.drain()
    assert looked_up == [p for p, _, _ in view.weight_files()]
    stats = view.stats()["kernel_pages"]
    merged = sum(s.end - s.start for _, _, wf in view.weight_files() for s in wf.segments
                 if s.merged)
    assert stats["warm"]["bytes"] == merged and stats["warm"]["errors"] == 0
    for path, ino, wf in view.weight_files():
        want = (out / path).read_bytes()
        n = model.check(ino, want)
        # every page but those that touch pass-through tensors (not merged, not pushed)
        skipped = {p for s in wf.segments if s.tensor is not None and not s.merged
                   for p in range(s.start // PAGE, -(-s.end // PAGE))}
        assert n == -(-len(want) // PAGE) - len(skipped)
    # and reads after the warm-up are memory hits (no merge)
    merges = view.cache.stats().merges
    for path, _, _ in view.weight_files():
        assert view.read_path(path) == (out / path).read_bytes()
    assert view.cache.stats().merges == merges


def test_warm_up_stops_at_the_cache_size(tmp_path: Path, index_dir: Path,
                                         family_f32: Family, opened: list[View]) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    view = open_view(spec, opened, cache_bytes=20_000)
    view.start_warm(lambda path: None)
    assert view.pages.wait_warm(60)
    warm = view.stats()["kernel_pages"]["warm"]
    assert 0 < warm["bytes"] <= 20_000 and view.cache.stats().evictions == 0


def test_no_store_before_enable_or_after_disable(tmp_path: Path, index_dir: Path,
                                                 family_f32: Family, opened: list[View]) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    view = open_view(spec, opened, readahead_units=4)
    calls: list[int] = []
    view.enable_page_store(lambda ino, off, data: calls.append(off))
    assert view.pages.disable(1.0)
    fh = view.open_path("model.safetensors")
    size = view.attr(view.inode_of("model.safetensors")).size_bytes
    for off in range(0, size, 4096):
        view.read(fh, off, 4096)
    stop_background(view)
    assert calls == [] and view.stats()["readahead"]["units_scheduled"] > 0


def test_store_errors_are_counted_not_raised(tmp_path: Path, index_dir: Path,
                                             family_f32: Family, opened: list[View]) -> None:
    import errno

    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", tmp_path / "idx",
                           block_size=8192)  # units that hold whole pages
    out = materialise(spec, tmp_path / "out")
    view = open_view(spec, opened, readahead_units=4)

    def fail(ino: int, off: int, data: bytes | memoryview) -> None:
        raise OSError(errno.ENOSYS, "not supported")

    view.enable_page_store(fail)
    size = view.attr(view.inode_of("model.safetensors")).size_bytes
    fh = view.open_path("model.safetensors")
    half = size // 2
    got = b"".join(bytes(view.read(fh, off, min(4096, half - off))) for off in range(0, half, 4096))
    reader_of(view)._pool.submit(lambda: None).result()
    assert view.pages.drain()
    got += b"".join(bytes(view.read(fh, off, 4096)) for off in range(half, size, 4096))
    stop_background(view)
    assert got == (out / "model.safetensors").read_bytes()
    kp = view.stats()["kernel_pages"]
    assert kp["store_errors"] >= 1 and not kp["enabled"]  # ENOSYS turns pushing off


# -- the per-request path ------------------------------------------------------------------------


def test_one_readahead_decision_per_unit(tmp_path: Path, index_dir: Path, family_f32: Family,
                                         opened: list[View], monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """A sequential reader in small requests decides readahead once per unit it enters, and
    each unit is considered once: the per-request cost does not grow with readahead depth."""
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    view = open_view(spec, opened, readahead_units=8)
    decisions: list[int] = []
    considered: list[int] = []
    real_readahead = reader_of(view)._readahead
    real_schedule = reader_of(view)._schedule

    def counting(wf: Any, stream: Stream, cur: int, run_start: int) -> None:
        decisions.append(cur)
        real_readahead(wf, stream, cur, run_start)

    def schedule(wf: Any, k: int, limit: int) -> bool:
        taken = real_schedule(wf, k, limit)
        if taken:  # (refused when readahead_pending are queued: a later decision retries)
            considered.append(k)
        return taken

    monkeypatch.setattr(reader_of(view), "_readahead", counting)
    monkeypatch.setattr(reader_of(view), "_schedule", schedule)
    path = "model.safetensors"
    wf = next(w for p, _, w in view.weight_files() if p == path)
    fh = view.open_path(path)
    n_reads = 0
    for off in range(0, wf.size_bytes, 64):  # units are 512 bytes here
        view.read(fh, off, 64)
        n_reads += 1
    stop_background(view)
    assert len(decisions) == len(set(decisions)) <= len(wf.segments)
    assert n_reads > 4 * len(decisions)
    assert considered and len(considered) == len(set(considered))  # each unit once per run


def test_reads_inside_one_unit_are_slices_not_copies(tmp_path: Path, index_dir: Path,
                                                     family_f32: Family,
                                                     opened: list[View]) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    out = (materialise(spec, tmp_path / "out") / "model.safetensors").read_bytes()
    view = open_view(spec, opened, readahead_units=0)
    wf = next(w for p, _, w in view.weight_files() if p == "model.safetensors")
    seg = next(s for s in wf.segments if s.merged and s.end - s.start > 64)
    fh = view.open_path("model.safetensors")
    slow = view.read(fh, seg.start + 8, 32)
    fast = view.read_cached(fh, seg.start + 8, 32)
    assert isinstance(slow, memoryview) and isinstance(fast, memoryview)
    assert slow.obj is fast.obj is view.cache.cached(seg.key)  # the cached bytes themselves
    assert bytes(fast) == bytes(slow) == out[seg.start + 8:seg.start + 40]
    across = view.read(fh, seg.end - 8, 16)  # spans two units: joined, still exact
    assert bytes(across) == out[seg.end - 8:seg.end + 8]
    view.release(fh)


def test_auto_warm_up_waits_for_a_whole_model_reader(tmp_path: Path, index_dir: Path,
                                                    family_sharded: Family,
                                                    opened: list[View]) -> None:
    """--warm auto (the default): reading one tensor, even whole, starts nothing; reading
    tensor after tensor, as a loader does, starts the warm-up of the rest, which pushes pages
    equal to the merge's."""
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic", index_dir)
    out = materialise(spec, tmp_path / "out")
    view = open_view(spec, opened, readahead_units=0)
    model = PageCacheModel(sizes_of(view))
    view.enable_page_store(model.store)
    looked_up: list[str] = []
    view.arm_auto_warm(looked_up.append)
    files = view.weight_files()
    segs = [(path, s) for path, _, wf in files for s in wf.segments if s.merged]
    tensors = list(dict.fromkeys(s.tensor for _, s in segs))
    need = auto_warm_tensors(view.merged_tensor_count(ROOT))
    assert 2 <= need < len(tensors)
    handles = {path: view.open_path(path) for path, _, _ in files}

    def read_tensor(name: str) -> None:
        for path, s in segs:
            if s.tensor == name:
                got = bytes(view.read(handles[path], s.start, s.end - s.start))
                assert got == (out / path).read_bytes()[s.start:s.end]

    for name in tensors[:need - 1]:
        read_tensor(name)
        read_tensor(name)  # again: still one tensor
    assert not view.pages._warm_threads and looked_up == []
    read_tensor(tensors[need - 1])
    assert view.pages.wait_warm(120) and view.pages.drain()
    assert looked_up == [p for p, _, _ in files]
    assert view.stats()["kernel_pages"]["warm"]["errors"] == 0
    # pages equal the merge's (units behind what a reader reached are not pushed: it read them)
    assert sum(model.check(ino, (out / path).read_bytes()) for path, ino, _ in files) > 0
    view.arm_auto_warm(looked_up.append)
    read_tensor(tensors[-1])
    assert len(view.pages._warm_threads) == 1  # once per variant


@pytest.mark.parametrize("merged, need", [(2, 2), (3, 2), (10, 5), (16, 8), (400, 8)])
def test_auto_warm_threshold(merged: int, need: int) -> None:
    assert auto_warm_tensors(merged) == need


def test_auto_warm_up_starts_when_a_loader_opens_config_json(tmp_path: Path, index_dir: Path,
                                                             family_sharded: Family,
                                                             opened: list[View]) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic", index_dir)
    view = open_view(spec, opened)
    looked_up: list[str] = []
    view.open_path("config.json")  # not armed (--warm off, or before the mount is up): nothing
    assert not view.pages._warm_threads
    view.arm_auto_warm(looked_up.append)
    view.release(view.open_path("config.json"))
    assert view.pages.wait_warm(120)
    assert looked_up == [p for p, _, _ in view.weight_files()]
    view.open_path("config.json")
    assert len(view.pages._warm_threads) == 1


def test_a_failing_unit_does_not_hold_the_warm_up(tmp_path: Path, index_dir: Path,
                                                  family_f32: Family, opened: list[View],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit whose prefetch or merge fails is counted as a warm-up error and frees its slot:
    the warm-up ends (before, a failing prefetch kept the slot, and the warm-up, then the
    unmount that waits for it, waited forever)."""
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    view = open_view(spec, opened)
    engine = session_of(view).engine

    def broken(name: str, b0: int, b1: int) -> None:
        raise KeyError(name)

    monkeypatch.setattr(engine, "prefetch", broken)
    view.start_warm(lambda path: None)
    assert view.pages.wait_warm(30)
    warm = view.stats()["kernel_pages"]["warm"]
    merged = sum(1 for _, _, wf in view.weight_files() for s in wf.segments if s.merged)
    assert warm["errors"] > 0 and warm["errors"] + warm["units"] == merged
