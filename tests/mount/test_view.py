"""The view and the unit cache, without a mount.

The law: any byte range of any file read through the view equals the same range of the files
``Engine.materialise`` writes, for every operator, single-file and sharded families, with a large
or a tiny cache. Plus single flight, the cache's memory bound, persistent-cache verification,
readahead staying inside a tensor, stats accounting and stable attributes.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from families import Family, make_family
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from viewcases import CARD, CASES, materialise, open_view, session_of, tree, write_case_spec

from mergefs.core.cache import UnitCache
from mergefs.core.errors import SourceChanged
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.session import Session
from mergefs.mount.view import View
from mergefs.spec.load import load_spec

TENSOR = "model.layers.0.mlp.up_proj.weight"  # 96 x 48 fp32: 36 blocks of 512 bytes


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("view_index")


class Views:
    """Opens views and closes them (and their sessions) at teardown."""

    def __init__(self) -> None:
        self.opened: list[View] = []

    def open(self, spec_path: Path, manifest: Path | None = None, cache_bytes: int = 1 << 30,
             cache_dir: Path | None = None, **kw: Any) -> View:
        spec = load_spec(spec_path)
        session = Session(spec, manifest=ManifestWriter(manifest) if manifest else None)
        view = open_view(session, UnitCache(cache_bytes, cache_dir, session.plan.plan_hash),
                         **kw)
        self.opened.append(view)
        return view

    def close(self) -> None:
        for v in self.opened:
            v.close()
            session_of(v).close()


@pytest.fixture
def views() -> Iterator[Views]:
    v = Views()
    yield v
    v.close()


@pytest.fixture(scope="module")
def module_views() -> Iterator[Views]:
    v = Views()
    yield v
    v.close()


def weight_files(view: View) -> list[str]:
    return [f.name for f in session_of(view).engine.out_files]


def all_files(view: View) -> list[str]:
    out = []

    def walk(ino: int, prefix: str) -> None:
        for name, a in view.readdir(ino):
            if a.is_dir:
                walk(a.inode, f"{prefix}{name}/")
            else:
                out.append(prefix + name)
    walk(1, "")
    return out


# -- the law: every byte range equals the materialised merge ------------------------------------


@pytest.mark.parametrize("family_name", ["family_f32", "family_sharded", "family_bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_file_equals_materialised(request: pytest.FixtureRequest, tmp_path: Path,
                                        index_dir: Path, views: Views, family_name: str,
                                        case: str) -> None:
    fam: Family = request.getfixturevalue(family_name)
    spec = write_case_spec(tmp_path / "spec.yaml", fam, case, index_dir)
    out = materialise(spec, tmp_path / "out")
    view = views.open(spec)
    assert session_of(view).engine.units_merged == 0  # building the view merges nothing
    # the card is named after its directory (CARD; test_mergekit_flags compares it)
    visible = [p for p in all_files(view) if not p.startswith(".mergefs/") and p != CARD]
    assert sorted(visible) == sorted(tree(out))
    for rel in visible:
        ino = view.inode_of(rel)
        want = (out / rel).read_bytes()
        assert view.attr(ino).size_bytes == len(want)
        assert view.read_path(rel) == want, rel


@pytest.fixture(scope="module")
def range_cases(tmp_path_factory: pytest.TempPathFactory, index_dir: Path, family_f32: Family,
                family_sharded: Family, family_bf16: Family, module_views: Views
                ) -> list[tuple[View, dict[str, bytes]]]:
    """Views (some with a cache far smaller than the model) and the materialised bytes."""
    cases = [(family_sharded, "task_arithmetic", 1 << 30), (family_f32, "ties", 1 << 30),
             (family_bf16, "dare_ties", 4096), (family_sharded, "breadcrumbs", 2048),
             (family_bf16, "linear", 1 << 30)]
    out = []
    for k, (fam, case, cache_bytes) in enumerate(cases):
        d = tmp_path_factory.mktemp(f"ranges{k}")
        extra = {"dtype": "bfloat16"} if case == "linear" else {}
        spec = write_case_spec(d / "spec.yaml", fam, case, index_dir, **extra)
        ref = materialise(spec, d / "out")
        view = module_views.open(spec, cache_bytes=cache_bytes)
        out.append((view, {rel: p.read_bytes() for rel, p in tree(ref).items()}))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_range_equals_materialised(range_cases: list[tuple[View, dict[str, bytes]]],
                                       data: st.DataObject) -> None:
    view, files = data.draw(st.sampled_from(range_cases))
    rel = data.draw(st.sampled_from(sorted(files)))
    blob = files[rel]
    offset = data.draw(st.integers(0, len(blob) + 64))
    size = data.draw(st.one_of(st.integers(0, 1024), st.integers(0, len(blob) + 64)))
    fh = view.open_path(rel)
    try:
        assert view.read(fh, offset, size) == blob[offset:offset + size]
        # a second, sequential read on the same handle (readahead may run meanwhile)
        nxt = offset + size
        assert view.read(fh, nxt, size) == blob[nxt:nxt + size]
    finally:
        view.release(fh)


def test_concurrent_random_ranges(tmp_path: Path, index_dir: Path, family_sharded: Family,
                                  views: Views) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "dare_linear", index_dir)
    files = {rel: p.read_bytes() for rel, p in tree(materialise(spec, tmp_path / "out")).items()}
    view = views.open(spec, cache_bytes=8192)  # far smaller than the model: evictions
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            rel = rng.choice(sorted(files))
            blob = files[rel]
            off = rng.randrange(len(blob))
            size = rng.randrange(1, 20000)
            got = view.read_path(rel, off, size)
            if got != blob[off:off + size]:
                errors.append(f"{rel} [{off}, {off + size})")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c = view.cache.stats()
    assert c.evictions > 0 and c.bytes_cached <= 8192


# -- single flight ------------------------------------------------------------------------------


def slow(fn: Callable[..., bytes], seconds: float, calls: list[Any]) -> Callable[..., bytes]:
    def wrapped(*args: Any) -> bytes:
        calls.append(args)
        time.sleep(seconds)
        return fn(*args)
    return wrapped


def test_single_flight_in_view(tmp_path: Path, index_dir: Path, family_f32: Family,
                               views: Views) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    ref = (materialise(spec, tmp_path / "out") / "model.safetensors").read_bytes()
    view = views.open(spec, readahead_units=0)
    calls: list[Any] = []
    session_of(view).engine.merge_unit = slow(session_of(view).engine.merge_unit, 0.3, calls)  # type: ignore[method-assign]
    t = session_of(view).engine.out_tensors[TENSOR]
    start = t.start + 100  # inside the tensor's first unit
    barrier = threading.Barrier(8)
    results: list[bytes] = []

    def reader() -> None:
        barrier.wait()
        results.append(view.read_path("model.safetensors", start, 50))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [ref[start:start + 50]] * 8
    assert len(calls) == 1
    c = view.cache.stats()
    assert (c.misses, c.merges, c.waits + c.hits) == (1, 1, 7)
    assert session_of(view).engine.units_merged == 1


def test_single_flight_cache_and_shared_error() -> None:
    cache = UnitCache(1 << 20)
    calls: list[int] = []
    barrier = threading.Barrier(10)
    got: list[bytes] = []

    def produce() -> bytes:
        calls.append(1)
        time.sleep(0.2)
        return b"x" * 100

    def reader() -> None:
        barrier.wait()
        got.append(cache.get("k", produce))

    threads = [threading.Thread(target=reader) for _ in range(10)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and got == [b"x" * 100] * 10
    assert cache.stats().merges_in_flight == 0

    failures: list[BaseException] = []
    barrier2 = threading.Barrier(5)

    def failing() -> bytes:
        calls.append(2)
        time.sleep(0.2)
        raise SourceChanged("expert changed")

    def reader2() -> None:
        barrier2.wait()
        try:
            cache.get("bad", failing)
        except SourceChanged as exc:
            failures.append(exc)

    threads = [threading.Thread(target=reader2) for _ in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(failures) == 5 and calls.count(2) == 1  # one merge, its error shared by all
    assert not cache.contains("bad")  # a failure is not cached: the next read tries again
    assert cache.get("bad", lambda: b"ok") == b"ok"


# -- the memory bound ---------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(0, 5000),
       ops=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1500)), max_size=80))
def test_cache_never_exceeds_capacity(capacity: int, ops: list[tuple[int, int]]) -> None:
    cache = UnitCache(capacity)
    model: dict[str, bytes] = {}
    for key_no, size in ops:
        key = f"k{key_no}"
        value = model.setdefault(key, bytes([key_no]) * size)
        assert cache.get(key, functools.partial(bytes, value)) == value  # hit or miss
        s = cache.stats()
        assert s.bytes_cached <= capacity
    s = cache.stats()
    assert s.hits + s.misses == len(ops)
    assert s.merges == s.misses


def test_cache_lru_order_and_oversize() -> None:
    cache = UnitCache(300)
    for k in "abc":
        cache.get(k, lambda: b"." * 100)
    cache.get("a", lambda: b"!" * 100)  # hit: "a" becomes most recent
    cache.get("d", lambda: b"." * 100)  # evicts "b", the least recently used
    assert cache.contains("a") and not cache.contains("b") and cache.contains("c")
    assert cache.stats().evictions == 1
    assert cache.get("big", lambda: b"." * 301) == b"." * 301  # served, never cached
    s = cache.stats()
    assert not cache.contains("big") and s.bytes_cached == 300 and s.entries == 3


# -- the persistent cache -----------------------------------------------------------------------


def test_persistent_cache_reused_and_corruption_detected(tmp_path: Path, index_dir: Path,
                                                         family_sharded: Family,
                                                         views: Views) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic", index_dir)
    files = {rel: p.read_bytes() for rel, p in tree(materialise(spec, tmp_path / "out")).items()}
    cdir = tmp_path / "cache"

    def read_all(view: View) -> None:
        for rel, blob in files.items():
            assert view.read_path(rel) == blob

    first = views.open(spec, cache_dir=cdir, readahead_units=0)
    read_all(first)
    first.cache.flush()
    n_units = session_of(first).engine.units_merged  # merged units; the int tensor passes through
    assert n_units > 20 and first.cache.stats().disk_writes == n_units
    plan_dir = cdir / session_of(first).plan.plan_hash
    entries = sorted(plan_dir.glob("*.bin"))
    assert len(entries) == n_units and not list(plan_dir.glob(".*.tmp"))

    second = views.open(spec, cache_dir=cdir, readahead_units=0)
    read_all(second)
    second.cache.flush()
    s = second.cache.stats()
    assert (s.disk_hits, session_of(second).engine.units_merged) == (n_units, 0)

    # corrupt one entry's payload, truncate another, give a third a wrong key
    blob = bytearray(entries[0].read_bytes())
    blob[-5] ^= 0x40
    entries[0].write_bytes(bytes(blob))
    entries[1].write_bytes(entries[1].read_bytes()[:-3])
    shutil.copyfile(entries[3], entries[2])
    third = views.open(spec, cache_dir=cdir, readahead_units=0)
    read_all(third)  # never serves the bad entries: merges those three again
    third.cache.flush()
    s = third.cache.stats()
    assert (s.disk_corrupt, session_of(third).engine.units_merged, s.disk_hits) == (3, 3, n_units - 3)
    fourth = views.open(spec, cache_dir=cdir, readahead_units=0)
    read_all(fourth)  # the re-merged entries were written back, verified
    assert session_of(fourth).engine.units_merged == 0


def test_persistent_cache_keyed_by_plan(tmp_path: Path, index_dir: Path, family_f32: Family,
                                        views: Views) -> None:
    cdir = tmp_path / "cache"
    a = write_case_spec(tmp_path / "a.yaml", family_f32, "task_arithmetic", index_dir)
    b = write_case_spec(tmp_path / "b.yaml", family_f32, "task_arithmetic", index_dir,
                        budget="10%")
    want_b = (materialise(b, tmp_path / "out_b") / "model.safetensors").read_bytes()
    va = views.open(a, cache_dir=cdir)
    va.read_path("model.safetensors")
    va.cache.flush()
    vb = views.open(b, cache_dir=cdir)
    assert session_of(va).plan.plan_hash != session_of(vb).plan.plan_hash
    assert vb.read_path("model.safetensors") == want_b
    assert vb.cache.stats().disk_hits == 0


def test_persistent_cache_write_failures_leave_no_entry(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    plan = "ab" * 16
    dropped = UnitCache(1 << 20, tmp_path, plan, write_queue_bytes=0)
    assert dropped.get("k", lambda: b"v" * 10) == b"v" * 10
    dropped.close()
    assert dropped.stats().disk_writes_dropped == 1 and not list((tmp_path / plan).iterdir())

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    cache = UnitCache(1 << 20, tmp_path, plan)
    monkeypatch.setattr(os, "fsync", full_disk)
    assert cache.get("k", lambda: b"v" * 10) == b"v" * 10  # still served
    cache.close()
    s = cache.stats()
    assert (s.disk_writes, s.disk_write_errors) == (0, 1)
    assert not list((tmp_path / plan).iterdir())  # neither a final entry nor a temporary one


# -- readahead and physical reads ---------------------------------------------------------------


def expected_reads(view: View, name: str) -> dict[str, int]:
    """Physical bytes a full read of tensor ``name`` must cost, from the plan (fp32 family)."""
    lay = session_of(view).index.layout
    t = lay.tensor_index()[name]
    blocks = list(lay.blocks_of(t))
    bb = lay.block_bytes()
    out = {"base": session_of(view).base.tensors[name].size_bytes}
    for i, label in enumerate(session_of(view).engine.labels):
        out[label] = int(sum(bb[b] for b in blocks if session_of(view).plan.selected[i, b]))
    return out


def test_reading_one_tensor_reads_only_its_planned_blocks(tmp_path: Path, index_dir: Path,
                                                          family_f32: Family,
                                                          views: Views) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    ref = (materialise(spec, tmp_path / "out") / "model.safetensors").read_bytes()
    manifest = tmp_path / "m.jsonl"
    view = views.open(spec, manifest=manifest, readahead_units=8)
    t = session_of(view).engine.out_tensors[TENSOR]
    fh = view.open_path("model.safetensors")
    for off in range(t.start, t.end, 700):  # sequential: readahead runs, inside the tensor
        assert view.read(fh, off, min(700, t.end - off)) == ref[off:min(off + 700, t.end)]
    view.close()  # waits for readahead
    stats = view.stats()
    assert stats["readahead"]["units_scheduled"] > 0
    want = expected_reads(view, TENSOR)
    assert stats["physical_bytes_read"] == want
    assert 0 < stats["expert_bytes_read"] < 3 * want["base"]  # the budget skipped some blocks
    recs = [json.loads(x) for x in manifest.read_text().splitlines()[1:]]
    assert {r["tensor"] for r in recs} == {TENSOR}
    by_source: dict[str, int] = {}
    for r in recs:
        if r["type"] == "read":
            by_source[r["source"]] = by_source.get(r["source"], 0) + r["end"] - r["start"]
    assert by_source == {k: v for k, v in want.items() if v}


def test_streaming_a_file_reads_ahead_across_tensors(tmp_path: Path, index_dir: Path,
                                                     family_f32: Family, views: Views) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    ref = (materialise(spec, tmp_path / "out") / "model.safetensors").read_bytes()
    view = views.open(spec, readahead_units=4)
    fh = view.open_path("model.safetensors")
    got = b"".join(view.read(fh, off, 4096) for off in range(0, len(ref), 4096))
    assert got == ref
    s = view.cache.stats()
    # the stream crossed tensors, so later units were merged ahead and found in the cache
    assert view.stats()["readahead"]["units_scheduled"] > 0 and s.hits + s.waits > 0


# -- stats, manifest, attributes ----------------------------------------------------------------


def strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def test_state_files(tmp_path: Path, index_dir: Path, family_sharded: Family,
                     views: Views) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", family_sharded, "task_arithmetic",
                                index_dir)
    spec = load_spec(spec_path)
    manifest = tmp_path / "m.jsonl"
    view = views.open(spec_path, manifest=manifest, cache_dir=tmp_path / "cache")
    view.read_path(weight_files(view)[0])
    stats = json.loads(view.read_path(".mergefs/stats.json"))
    assert stats["served_bytes"]["weights"] == view.attr(
        view.inode_of(weight_files(view)[0])).size_bytes
    assert stats["units_merged"] == stats["cache"]["merges"] > 0
    assert stats["physical_bytes_read"]["base"] > 0
    allowed = {spec.source, spec.base, *(e.path for e in spec.experts)}
    leaked = {s for s in strings(stats) if "/" in s} - allowed
    assert leaked == set()
    lines = view.read_path(".mergefs/manifest.jsonl").decode().splitlines()
    recs = [json.loads(x) for x in lines]
    assert recs[0]["type"] == "header" and recs[0]["plan_hash"] == stats["plan_hash"]
    assert sum(r["type"] == "output" for r in recs) == stats["units_merged"]
    assert lines == manifest.read_text().splitlines()


def test_attributes_stable_and_known_without_merging(tmp_path: Path, index_dir: Path,
                                                     family_sharded: Family, views: Views
                                                     ) -> None:
    spec = write_case_spec(tmp_path / "spec.yaml", family_sharded, "ties", index_dir)

    def snapshot(view: View) -> dict[str, Any]:
        out = {}
        for rel in all_files(view) + ["", ".mergefs"]:
            a = view.attr(view.inode_of(rel))
            out[rel] = a if not a.dynamic else (a.inode, a.mode)
        return out

    v1 = views.open(spec)
    v2 = views.open(spec)
    s1 = snapshot(v1)
    v1.read_path(weight_files(v1)[0])
    assert snapshot(v1) == s1 == snapshot(v2)
    assert session_of(v2).engine.units_merged == 0
    for a in s1.values():
        if isinstance(a, tuple):
            continue
        assert stat.S_IMODE(a.mode) == (0o555 if a.is_dir else 0o444)
    root = v1.attr(1)
    assert root.is_dir and v1.lookup(1, ".mergefs") is not None
    assert v1.lookup(1, "nope") is None and v1.lookup(v1.inode_of("config.json"), "x") is None


# -- changed sources: an error, never wrong bytes -----------------------------------------------


def test_changed_sources_are_refused(tmp_path: Path, views: Views) -> None:
    fam = make_family(tmp_path / "fam", n_experts=2, seed=7)
    spec = write_case_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", tmp_path / "idx",
                           budget="full")
    view = views.open(spec)
    cfg = fam.base / "config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace("mergefs-test", "mergefs-tesT"))  # same size, new content
    with pytest.raises(SourceChanged):
        view.read_path("config.json")

    lay = session_of(view).index.layout
    b = next(b for b in lay.blocks_of(lay.tensor_index()[TENSOR])
             if session_of(view).plan.selected[0, b])
    loc = session_of(view).experts[0].tensors[TENSOR]
    pos = loc.start + int(lay.elem_start[b]) * 4 + 3
    path = fam.experts[0] / "model.safetensors"
    with open(path, "r+b") as f:  # flip one byte of a planned block of the expert's tensor
        f.seek(pos)
        old = f.read(1)
        f.seek(pos)
        f.write(bytes([old[0] ^ 0x01]))
    t = session_of(view).engine.out_tensors[TENSOR]
    u0, _ = session_of(view).engine.unit_out_range(TENSOR, b, b + 1)
    with pytest.raises(SourceChanged):
        view.read_path("model.safetensors", t.start + u0, 16)
    assert view.stats()["read_errors"] == 2


def test_read_cached_serves_only_what_is_in_memory(tmp_path: Path, index_dir: Path,
                                                   family_f32: Family, views: Views) -> None:
    """The adapter's non-blocking path: None until the units are cached, then exactly the bytes
    of the full path; it never merges or reads a source itself."""
    spec = write_case_spec(tmp_path / "spec.yaml", family_f32, "task_arithmetic", index_dir)
    ref = (materialise(spec, tmp_path / "out") / "model.safetensors").read_bytes()
    view = views.open(spec, readahead_units=0)
    t = session_of(view).engine.out_tensors[TENSOR]
    fh = view.open_path("model.safetensors")
    try:
        header_len = len(session_of(view).engine.out_files[0].header)
        assert view.read_cached(fh, 0, header_len) == ref[:header_len]  # header: in memory
        start, size = t.start + 100, 3000  # spans several 512-byte units
        merged_before = session_of(view).engine.units_merged
        assert view.read_cached(fh, start, size) is None
        assert session_of(view).engine.units_merged == merged_before  # the fast path never merges
        assert view.read(fh, start, size) == ref[start:start + size]
        hits = view.cache.stats().hits
        assert view.read_cached(fh, start, size) == ref[start:start + size]
        assert view.cache.stats().hits > hits
        assert view.read_cached(fh, t.end - 10, 30) is None  # next tensor not merged yet
    finally:
        view.release(fh)
