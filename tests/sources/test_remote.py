"""Remote sources against real servers on 127.0.0.1: moto's S3 server and a Range HTTP server.

Byte and request counts are taken at the servers (tests/servers.py), never from mergefs alone.
Every remote merge is compared bit for bit with the same merge of the same family read locally.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_family
from bench.servers import CountingMotoServer, RangeHTTPServer, upload_tree

pytest.importorskip("fsspec")
pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")
pytest.importorskip("moto")

from mergefs import cli
from mergefs.engine.output import MARKER
from mergefs.engine.session import Session
from mergefs.core.errors import MergefsError, SourceChanged, SourceError, SpecError
from mergefs.sources.remote import HEADER_PROBE_BYTES
from mergefs.spec.load import load_spec

pytestmark = pytest.mark.remote

BLOCK = 512
BUCKET = "models"
SECRET = "s3cr3t-never-to-be-written-9f1c"
KEY_ID = "AKIDNEVERWRITTEN77"


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("remote_fam"), n_experts=3, seed=11)


@pytest.fixture(scope="module")
def fam_sharded(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("remote_sharded"), n_experts=2, seed=12,
                       sharded=True, expert_layout="reversed")


@pytest.fixture(scope="module")
def aws_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        yield


@pytest.fixture(scope="module")
def s3(aws_env: None, fam: Family, fam_sharded: Family) -> Iterator[CountingMotoServer]:
    import s3fs

    srv = CountingMotoServer().start()
    fs = s3fs.S3FileSystem(endpoint_url=srv.endpoint, skip_instance_cache=True)
    fs.mkdir(BUCKET)
    upload_tree(fs, fam.root, f"{BUCKET}/fam")
    upload_tree(fs, fam_sharded.root, f"{BUCKET}/sharded")
    srv.fs = fs  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http_root(tmp_path_factory: pytest.TempPathFactory, fam: Family) -> Path:
    root = tmp_path_factory.mktemp("http_root")
    shutil.copytree(fam.root, root / "fam")
    return root


@pytest.fixture(scope="module")
def http_server(http_root: Path) -> Iterator[RangeHTTPServer]:
    srv = RangeHTTPServer(http_root).start()
    yield srv
    srv.stop()


@pytest.fixture
def http(http_server: RangeHTTPServer) -> RangeHTTPServer:
    http_server.log.reset()
    http_server.log.faults.clear()
    http_server.log.deny.clear()
    return http_server


# -- helpers ------------------------------------------------------------------------------------
def write_spec(path: Path, base: str, experts: list[str], **extra: Any) -> Path:
    weights = [0.5, -0.3, 0.8][: len(experts)]
    doc: dict[str, Any] = {
        "merge_method": "task_arithmetic",
        "base_model": base,
        "models": [{"model": e, "parameters": {"weight": w}} for e, w in zip(experts, weights)],
        "parameters": {"lambda": 0.9},
        "block_size": BLOCK,
        "index_dir": str(path.parent / f"{path.stem}-index"),
    }
    doc.update(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def merge(spec_path: Path, out: Path, manifest: Any = None) -> tuple[Session, dict[str, Any]]:
    session = Session(load_spec(spec_path), manifest=manifest)
    try:
        session.engine.materialise(out)
        return session, session.finish()
    finally:
        session.close()


def local_merge(tmp: Path, family: Family, name: str = "local", **extra: Any
                ) -> tuple[Session, Path]:
    spec = write_spec(tmp / f"{name}.yaml", str(family.base),
                      [str(e) for e in family.experts], **extra)
    out = tmp / f"{name}-out"
    session, _ = merge(spec, out)
    return session, out


#: the model card's files: they name the models as the spec gives them (here a URL or an id,
#: there a path) and the output directory, so two merges of the same weights differ there
CARD_FILES = ("README.md", "mergekit_config.yml")


def assert_same_dir(a: Path, b: Path) -> None:
    # .mergefs/merge.json records which run wrote the directory (spec, plan hash, time)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file()
                     and p.relative_to(a).as_posix() not in (MARKER, *CARD_FILES))
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()
                     and p.relative_to(b).as_posix() not in (MARKER, *CARD_FILES))
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def planned_runs(session: Session, i: int) -> set[tuple[str, int, int]]:
    """Byte ranges of expert i's planned blocks, runs of adjacent blocks of a tensor merged."""
    lay, src = session.index.layout, session.experts[i]
    out: set[tuple[str, int, int]] = set()
    for t, name in enumerate(lay.tensors):
        loc, item = src.tensors[name], lay.itemsize[t]
        run: list[int] | None = None
        for b in list(lay.blocks_of(t)) + [None]:
            if b is not None and session.plan.selected[i, b]:
                s0 = loc.start + int(lay.elem_start[b]) * item
                e0 = loc.start + int(lay.elem_end[b]) * item
                run = [run[0], e0] if run else [s0, e0]
            elif run:
                out.add((loc.file, run[0], run[1]))
                run = None
    return out


def served_ranges(log: Any, prefix: str) -> set[tuple[str, int, int]]:
    got = set()
    for s in log.requests(prefix, "GET"):
        if s.path.endswith(".safetensors") and "mergefs-index" not in s.path:
            got.add((s.path.rsplit("/", 1)[1], s.start, s.end))
    return got


# -- HTTP ---------------------------------------------------------------------------------------
def test_http_budgeted_merge_reads_only_planned_ranges(tmp_path: Path, fam: Family,
                                                       http: RangeHTTPServer) -> None:
    local, local_out = local_merge(tmp_path, fam, budget="40%")
    urls = [f"{http.url}/fam/expert-{i}" for i in range(3)]
    spec = write_spec(tmp_path / "http.yaml", str(fam.base), urls, budget="40%",
                      remote={"coalesce_gap": 0})
    session = Session(load_spec(spec))  # opens and indexes (reads the experts once)
    http.log.reset()
    try:
        session.engine.materialise(tmp_path / "out")
        totals = session.finish()
    finally:
        session.close()
    assert np.array_equal(session.plan.selected, local.plan.selected)
    assert 0 < session.plan.planned_bytes < session.plan.total_expert_bytes
    for i in range(3):
        want = planned_runs(session, i)
        got = served_ranges(http.log, f"/fam/expert-{i}/")
        assert got == want, i  # exactly the planned runs, each once
        assert len(http.log.requests(f"/fam/expert-{i}/", "GET")) == len(want)
    served = http.log.body_bytes("/fam/expert-")
    assert served == session.plan.planned_bytes == totals["expert_bytes_read"]
    assert sum(totals["physical_requests"][lab] for lab in session.engine.labels) == \
        len(http.log.requests("/fam/expert-", "GET"))
    assert http.log.requests("/fam/expert-", "HEAD") == []  # nothing re-probed while merging
    assert_same_dir(tmp_path / "out", local_out)


def tensor_runs(session: Session, i: int, gap_bytes: int) -> set[tuple[str, int, int]]:
    """Expert i's planned runs coalesced per tensor (a unit of ``materialise`` here) by the
    ``coalesce_gap`` threshold alone: the GETs of a merge whose gap allowance has no limit."""
    by_tensor: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for t, name in enumerate(session.index.layout.tensors):
        loc = session.experts[i].tensors[name]
        by_tensor[(loc.file, loc.start, loc.end)] = []
    for f, a, b in planned_runs(session, i):
        key = next(k for k in by_tensor if k[0] == f and k[1] <= a and b <= k[2])
        by_tensor[key].append((a, b))
    out: set[tuple[str, int, int]] = set()
    for (f, _, _), runs in by_tensor.items():
        cur: list[int] | None = None
        for a, b in sorted(runs):
            if cur is not None and a - cur[1] <= gap_bytes:
                cur[1] = b
            else:
                if cur is not None:
                    out.add((f, cur[0], cur[1]))
                cur = [a, b]
        if cur is not None:
            out.add((f, cur[0], cur[1]))
    return out


def http_merge(tmp_path: Path, fam: Family, http: RangeHTTPServer, name: str, budget: str,
               gap: str | int) -> tuple[Session, dict[str, Any]]:
    """A merge of the HTTP experts; the server's log holds its merge GETs only."""
    urls = [f"{http.url}/fam/expert-{i}" for i in range(3)]
    spec = write_spec(tmp_path / f"{name}.yaml", str(fam.base), urls, budget=budget,
                      remote={"coalesce_gap": gap})
    session = Session(load_spec(spec))
    http.log.reset()
    try:
        session.engine.materialise(tmp_path / f"{name}-out")
        return session, session.finish()
    finally:
        session.close()


def test_http_full_budget_gap_threshold_trades_bytes_for_requests(
        tmp_path: Path, fam: Family, http: RangeHTTPServer) -> None:
    """A full budget leaves the gaps unlimited: runs of planned ranges at most
    ``coalesce_gap`` apart share one GET, as the threshold alone says."""
    session, totals = http_merge(tmp_path, fam, http, "full", "full", "64KiB")
    gets = http.log.requests("/fam/expert-", "GET")
    want = [tensor_runs(session, i, 64 << 10) for i in range(3)]
    for i in range(3):
        assert served_ranges(http.log, f"/fam/expert-{i}/") == want[i], i
    assert len(gets) == sum(map(len, want)) < sum(len(planned_runs(session, i))
                                                  for i in range(3))
    gap = sum(e.counters.gap_bytes for e in session.experts)
    assert totals["expert_gap_bytes_allowed"] is None
    assert totals["expert_gap_bytes_read"] == gap > 0
    assert http.log.body_bytes("/fam/expert-") == session.plan.planned_bytes + gap == \
        totals["expert_bytes_read"]
    _, local_out = local_merge(tmp_path, fam, budget="full")
    assert_same_dir(tmp_path / "full-out", local_out)


def test_http_gap_bytes_fit_the_budget(tmp_path: Path, fam: Family,
                                       http: RangeHTTPServer) -> None:
    """Below a full budget, the gaps coalesced GETs fetch come out of the budget's slack
    (``budget - planned``): planned plus gap bytes stay within the budget, and once the
    slack is spent the remaining ranges are fetched separately (more GETs, no extra bytes);
    the merged bytes equal the local merge's."""
    full, full_totals = http_merge(tmp_path, fam, http, "full", "full", "64KiB")
    full_gets = len(http.log.requests("/fam/expert-", "GET"))
    # every non-zero block is planned, and half the gaps the full budget read fit the slack
    budget = full.plan.nonzero_expert_bytes + full_totals["expert_gap_bytes_read"] // 2
    session, totals = http_merge(tmp_path, fam, http, "part", f"{budget}B", "64KiB")
    planned = session.plan.planned_bytes
    assert planned == full.plan.planned_bytes and budget < session.plan.total_expert_bytes
    spent = totals["expert_gap_bytes_read"]
    assert totals["expert_gap_bytes_allowed"] == budget - planned
    assert 0 < spent <= budget - planned
    assert sum(e.counters.gap_bytes for e in session.experts) == spent
    assert http.log.body_bytes("/fam/expert-") == planned + spent == \
        totals["expert_bytes_read"] <= budget
    gets = len(http.log.requests("/fam/expert-", "GET"))
    runs = sum(len(planned_runs(session, i)) for i in range(3))
    assert full_gets < gets < runs  # some runs still share a GET, the rest go alone
    for i in range(3):  # each GET is a run of planned ranges, each range read once
        got = sorted(served_ranges(http.log, f"/fam/expert-{i}/"))
        mine = sorted(planned_runs(session, i))
        assert all(any(f == g and a <= p and q <= b for g, a, b in got)
                   for f, p, q in mine), i
        starts, ends = {(f, p) for f, p, _ in mine}, {(f, q) for f, _, q in mine}
        assert all((g, a) in starts and (g, b) in ends for g, a, b in got), i
    _, local_out = local_merge(tmp_path, fam, "local-part", budget=f"{budget}B")
    assert_same_dir(tmp_path / "part-out", local_out)


def test_http_small_budget_reads_no_gap_bytes(tmp_path: Path, fam: Family,
                                              http: RangeHTTPServer) -> None:
    """Issue 14's measurement: a 10% budget over HTTP with the default ``coalesce_gap``
    (1 MiB) read more than the budget in gaps. Now the plan fills the budget, nothing is left
    for gaps, and the GETs are exactly the planned runs."""
    session, totals = http_merge(tmp_path, fam, http, "ten", "10%", "1MiB")
    assert totals["expert_gap_bytes_allowed"] == \
        session.plan.budget_bytes - session.plan.planned_bytes == 0
    assert totals["expert_gap_bytes_read"] == 0
    for i in range(3):
        assert served_ranges(http.log, f"/fam/expert-{i}/") == planned_runs(session, i), i
    assert http.log.body_bytes("/fam/expert-") == totals["expert_bytes_read"] == \
        session.plan.planned_bytes <= session.plan.budget_bytes
    _, local_out = local_merge(tmp_path, fam, "local-ten", budget="10%")
    assert_same_dir(tmp_path / "ten-out", local_out)


def test_http_transient_errors_are_retried(tmp_path: Path, fam: Family,
                                           http: RangeHTTPServer,
                                           caplog: pytest.LogCaptureFixture) -> None:
    urls = [f"{http.url}/fam/expert-{i}" for i in range(3)]
    spec = write_spec(tmp_path / "retry.yaml", str(fam.base), urls, budget="full",
                      remote={"coalesce_gap": 0})
    session = Session(load_spec(spec))
    http.log.reset()
    http.log.faults["/fam/expert-1/model.safetensors"] = ["503", "reset", "502"]
    caplog.set_level(logging.WARNING, logger="mergefs")
    try:
        session.engine.materialise(tmp_path / "out")
    finally:
        session.close()
    assert session.experts[1].counters.retries == 3
    assert len(http.log.requests("/fam/expert-1/", "GET")) == \
        session.experts[1].counters.reads + 3
    assert sum("retrying" in r.getMessage() and "/fam/expert-1/" in r.getMessage()
               for r in caplog.records) == 3
    _, local_out = local_merge(tmp_path, fam, budget="full")
    assert_same_dir(tmp_path / "out", local_out)


def test_http_gives_up_naming_the_url(tmp_path: Path, fam: Family,
                                      http: RangeHTTPServer) -> None:
    urls = [f"{http.url}/fam/expert-{i}" for i in range(3)]
    spec = write_spec(tmp_path / "giveup.yaml", str(fam.base), urls,
                      remote={"retries": 1, "coalesce_gap": 0})
    session = Session(load_spec(spec))
    http.log.faults["/fam/expert-2/model.safetensors"] = ["503"] * 50
    try:
        with pytest.raises(SourceError) as err:
            session.engine.materialise(tmp_path / "out")
    finally:
        session.close()
    msg = str(err.value)
    assert f"{http.url}/fam/expert-2/model.safetensors" in msg
    assert "503" in msg and "gave up after 2 attempts" in msg


def test_http_403_and_404_are_clear(tmp_path: Path, fam: Family, http: RangeHTTPServer,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    http.log.deny.add("/fam/expert-1/")
    urls = [f"{http.url}/fam/expert-0", f"{http.url}/fam/expert-1"]
    spec = write_spec(tmp_path / "denied.yaml", str(fam.base), urls)
    assert cli.main(["plan", str(spec)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert f"{http.url}/fam/expert-1" in err and "access denied (403)" in err

    missing = write_spec(tmp_path / "missing.yaml", str(fam.base),
                         [f"{http.url}/fam/expert-0", f"{http.url}/fam/nope"])
    with pytest.raises(SourceError, match=r"/fam/nope: no model.safetensors"):
        Session(load_spec(missing))
    bare = write_spec(tmp_path / "bare.yaml", str(fam.base),
                      [f"{http.url}/fam/nope/model.safetensors"])
    with pytest.raises(SourceError, match=r"/fam/nope/model.safetensors: not found \(404\)"):
        Session(load_spec(bare))


def test_http_replaced_object_is_detected(tmp_path: Path, http_root: Path,
                                          http: RangeHTTPServer) -> None:
    fam2 = make_family(http_root / "replace", n_experts=2, seed=21)
    urls = [f"{http.url}/replace/expert-{i}" for i in range(2)]
    spec = write_spec(tmp_path / "replace.yaml", str(fam2.base), urls)
    session = Session(load_spec(spec))
    try:
        target = fam2.experts[0] / "model.safetensors"
        data = (fam2.experts[1] / "model.safetensors").read_bytes()
        assert len(data) == target.stat().st_size  # same size, same header: only the ETag moves
        target.write_bytes(data)
        os.utime(target, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
        with pytest.raises(SourceChanged, match=r"replace/expert-0/model.safetensors: object "
                                                 r"replaced"):
            session.engine.materialise(tmp_path / "out")
        with pytest.raises(SourceChanged):
            session.experts[0].check_unchanged()
    finally:
        session.close()


def test_http_without_etag_replaced_object_fails_the_hash_check(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("noetag")
    fam2 = make_family(root / "f", n_experts=2, seed=22)
    srv = RangeHTTPServer(root, etags=False).start()
    try:
        urls = [f"{srv.url}/f/expert-{i}" for i in range(2)]
        spec = write_spec(tmp_path / "noetag.yaml", str(fam2.base), urls)
        session = Session(load_spec(spec))
        try:
            (fam2.experts[0] / "model.safetensors").write_bytes(
                (fam2.experts[1] / "model.safetensors").read_bytes())
            with pytest.raises(SourceChanged, match="differ from the index"):
                session.engine.materialise(tmp_path / "out")
        finally:
            session.close()
    finally:
        srv.stop()


# -- S3 -----------------------------------------------------------------------------------------
def s3_options(srv: CountingMotoServer, secret: bool = False) -> dict[str, Any]:
    opts: dict[str, Any] = {"s3": {"endpoint_url": srv.endpoint}}
    if secret:
        opts["s3"].update(key=KEY_ID, secret=SECRET)
    return opts


def test_s3_all_remote_merge_equals_local_and_reads_only_the_plan(
        tmp_path: Path, fam: Family, s3: CountingMotoServer) -> None:
    local, local_out = local_merge(tmp_path, fam, budget="35%")
    spec = write_spec(tmp_path / "s3.yaml", f"s3://{BUCKET}/fam/base",
                      [f"s3://{BUCKET}/fam/expert-{i}" for i in range(3)], budget="35%",
                      storage_options=s3_options(s3), remote={"coalesce_gap": 0})
    session = Session(load_spec(spec))
    s3.log.reset()
    try:
        session.engine.materialise(tmp_path / "out")
        totals = session.finish()
    finally:
        session.close()
    assert np.array_equal(session.plan.selected, local.plan.selected)
    for i in range(3):
        assert served_ranges(s3.log, f"/fam/expert-{i}/") == planned_runs(session, i)
    assert s3.log.body_bytes("/fam/expert-") == session.plan.planned_bytes == \
        totals["expert_bytes_read"]
    assert_same_dir(tmp_path / "out", local_out)  # weights, config.json, tokenizer.json


def test_s3_sharded_full_budget_is_bit_identical(tmp_path: Path, fam_sharded: Family,
                                                 s3: CountingMotoServer) -> None:
    _, local_out = local_merge(tmp_path, fam_sharded)
    spec = write_spec(tmp_path / "s3sh.yaml", f"s3://{BUCKET}/sharded/base",
                      [f"s3://{BUCKET}/sharded/expert-{i}" for i in range(2)],
                      storage_options=s3_options(s3))
    merge(spec, tmp_path / "out")
    assert_same_dir(tmp_path / "out", local_out)


def test_s3_403_404_and_replaced_object(tmp_path: Path, fam: Family,
                                        s3: CountingMotoServer) -> None:
    opts = s3_options(s3)
    spec = write_spec(tmp_path / "nf.yaml", str(fam.base),
                      [f"s3://{BUCKET}/fam/expert-0", f"s3://{BUCKET}/nothing-here"],
                      storage_options=opts)
    with pytest.raises(SourceError, match=rf"s3://{BUCKET}/nothing-here: no such directory"):
        Session(load_spec(spec))
    spec = write_spec(tmp_path / "nb.yaml", str(fam.base), ["s3://no-such-bucket/m"],
                      storage_options=opts)
    with pytest.raises(SourceError, match=r"s3://no-such-bucket/m: not found \(404\)"):
        Session(load_spec(spec))
    s3.log.deny.add(f"/{BUCKET}/fam/expert-2/model.safetensors")
    try:
        spec = write_spec(tmp_path / "deny.yaml", str(fam.base),
                          [f"s3://{BUCKET}/fam/expert-2/model.safetensors"],
                          storage_options=opts)
        with pytest.raises(SourceError, match=r"fam/expert-2/model.safetensors: access denied"):
            Session(load_spec(spec))
    finally:
        s3.log.deny.clear()

    # A replaced object: S3 answers 412 to the If-Match of the ETag recorded at open.
    s3.fs.copy(f"{BUCKET}/fam/expert-0/model.safetensors", f"{BUCKET}/victim/model.safetensors")
    spec = write_spec(tmp_path / "victim.yaml", str(fam.base), [f"s3://{BUCKET}/victim"],
                      storage_options=opts)
    session = Session(load_spec(spec))
    try:
        s3.fs.put_file(str(fam.experts[1] / "model.safetensors"),
                       f"{BUCKET}/victim/model.safetensors")
        with pytest.raises(SourceChanged, match=r"victim/model.safetensors: object replaced"):
            session.engine.materialise(tmp_path / "out")
    finally:
        session.close()


# -- published index sidecars -------------------------------------------------------------------
def float_bytes(model: Path) -> int:
    from mergefs.sources import open_source
    from mergefs.core.format import FLOAT_DTYPES

    return sum(t.size_bytes for t in open_source(model).tensors.values()
               if t.dtype in FLOAT_DTYPES)


def test_s3_sidecars_plan_without_reading_experts(tmp_path: Path, fam: Family,
                                                  s3: CountingMotoServer,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    upload_tree(s3.fs, fam.root, f"{BUCKET}/pub")
    experts = [f"s3://{BUCKET}/pub/expert-{i}" for i in range(3)]
    opts = s3_options(s3)
    pub = write_spec(tmp_path / "pub.yaml", str(fam.base), experts, storage_options=opts)
    assert cli.main(["index", str(pub), "--publish"]) == 0
    names = [n for n in s3.fs.ls(f"{BUCKET}/pub/expert-0") if "mergefs-index." in n]
    assert len(names) == 1 and names[0].endswith(f".{BLOCK}.safetensors")
    assert s3.fs.size(names[0]) < 16 << 10  # small

    local, local_out = local_merge(tmp_path, fam, budget="30%")
    spec = write_spec(tmp_path / "use.yaml", str(fam.base), experts, budget="30%",
                      storage_options=opts, remote={"coalesce_gap": 0})  # fresh index_dir
    s3.log.reset()
    caplog.set_level(logging.INFO, logger="mergefs")
    session = Session(load_spec(spec))
    try:
        for i in range(3):  # planning read each expert's header probe and sidecar, no more
            weights = s3.log.body_bytes(f"/pub/expert-{i}/model.safetensors")
            size = (fam.experts[i] / "model.safetensors").stat().st_size
            assert weights == min(size, HEADER_PROBE_BYTES) < size
            assert s3.log.body_bytes(f"/pub/expert-{i}/mergefs-index.") > 0
        assert "3 of 3 experts from published sidecars" in caplog.text
        assert not session.index.has_gram
        plan = session.plan
        assert np.array_equal(plan.selected, local.plan.selected)
        assert plan.bound_tight == pytest.approx(local.plan.bound_tight, rel=1e-12)
        assert plan.error_exact is None and plan.update_norm is None
        s3.log.reset()
        session.engine.materialise(tmp_path / "out")
    finally:
        session.close()
    for i in range(3):
        assert served_ranges(s3.log, f"/pub/expert-{i}/") == planned_runs(session, i)
    assert_same_dir(tmp_path / "out", local_out)

    # A replaced expert (same size and header, new ETag): its sidecar is ignored, it is read.
    s3.fs.copy(f"{BUCKET}/fam/expert-2/model.safetensors",
               f"{BUCKET}/pub/expert-1/model.safetensors")
    caplog.clear()
    again = write_spec(tmp_path / "again.yaml", str(fam.base), experts, budget="30%",
                       storage_options=opts)
    s3.log.reset()
    session = Session(load_spec(again))
    session.close()
    assert "ignoring stale index sidecar" in caplog.text and "ETag differs" in caplog.text
    assert "2 of 3 experts from published sidecars" in caplog.text
    assert s3.log.body_bytes("/pub/expert-1/model.safetensors") == \
        HEADER_PROBE_BYTES + float_bytes(fam.experts[1])  # read in full to plan
    assert s3.log.body_bytes("/pub/expert-0/model.safetensors") == HEADER_PROBE_BYTES


def test_file_url_sidecar_for_another_base_is_ignored(tmp_path: Path, fam: Family,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # A second family with the same shapes: its base has the same header but other bytes.
    other = make_family(tmp_path / "other", n_experts=1, seed=99)
    copy = tmp_path / "copy"  # weights under a name of their own: found by globbing
    shutil.copytree(fam.experts[0], copy)
    (copy / "model.safetensors").rename(copy / "weights.safetensors")
    spec = write_spec(tmp_path / "a.yaml", str(fam.base), [f"file://{copy}"])
    assert cli.main(["index", str(spec), "--publish"]) == 0
    assert len(list(copy.glob("mergefs-index.*.safetensors"))) == 1
    assert opened_files(str(copy)) == opened_files(f"file://{copy}") == ("weights.safetensors",)
    spec_b = write_spec(tmp_path / "b.yaml", str(other.base), [f"file://{copy}"])
    caplog.set_level(logging.INFO, logger="mergefs")
    session = Session(load_spec(spec_b))
    session.close()
    assert "published against a base whose bytes differ" in caplog.text
    assert session.index.has_gram  # read in full instead, exact Gram
    assert session.plan.error_exact is not None


def opened_files(model_dir: str) -> tuple[str, ...]:
    from mergefs.sources import open_source

    return open_source(model_dir).files


def test_publish_to_http_is_refused(tmp_path: Path, fam: Family, http: RangeHTTPServer,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path / "p.yaml", str(fam.base), [f"{http.url}/fam/expert-0"])
    assert cli.main(["index", str(spec), "--publish"]) == 1
    assert "HTTP sources are read-only" in capsys.readouterr().err


def test_remote_sources_have_no_local_files_and_send_no_advice(
        tmp_path: Path, fam: Family, http: RangeHTTPServer) -> None:
    """What callers outside sources/ ask of a source, answered by a remote one: no local files,
    ctimes or non-weight directory; prefetch advice and the check before reuse send nothing;
    publishing beside an HTTP source is refused, beside a writable store it round trips."""
    from mergefs.sources import open_source
    from mergefs.sources.base import ReadRange

    src = open_source(f"{http.url}/fam/expert-0")
    assert (src.local_files(), src.file_ctimes(), src.extra_dir()) == ([], {}, None)
    assert src.reads_gap_bytes and src.prefers_published_index
    before = src.counters.snapshot()
    src.will_need([ReadRange(src.files[0], 0, 64)])
    src.check_unchanged_for_reuse()
    assert src.counters.snapshot() == before
    with pytest.raises(SourceError, match="cannot publish a delta sidecar here: HTTP sources "
                       "are read-only, and so are slices over remote models"):
        src.check_writable_aux("a delta sidecar", "compress a local copy")
    copy = tmp_path / "copy"
    shutil.copytree(fam.experts[0], copy)
    src = open_source(f"file://{copy}")
    src.check_writable_aux("a delta sidecar", "compress a local copy")
    assert src.aux_reader("derived.bin") is None and src.read_aux("derived.bin") is None
    where = src.write_aux("derived.bin", b"0123456789", "derived file")
    assert where == f"file://{copy}/derived.bin" and src.read_aux("derived.bin") == b"0123456789"
    aux = src.aux_reader("derived.bin")
    assert aux is not None and (aux.where, aux.path) == (where, None) and aux.fetch is not None
    assert aux.fetch(2, 5) == b"234" and aux.coalesce_gap_bytes == src.options.gap_bytes


def test_a_role_over_a_remote_model_has_no_derived_files(tmp_path: Path, fam: Family,
                                                          http: RangeHTTPServer) -> None:
    """A recipe's role over a local and a remote model: its local model's files are guarded
    and advised, its reads may fetch gap bytes, and no sidecar is read or written beside it."""
    from mergefs.recipe.family import open_family
    from mergefs.sources.base import ReadRange
    from mergefs.spec.load import parse_spec

    cfg = {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(fam.experts[0]), "layer_range": [0, 1]}]},
        {"sources": [{"model": f"{http.url}/fam/expert-1", "layer_range": [0, 1]}]}]}
    role, experts = open_family(parse_spec(cfg, tmp_path))
    try:
        assert experts == [] and role.is_remote and role.reads_gap_bytes
        assert not role.prefers_published_index
        local = Path(fam.experts[0]).absolute()
        assert [p for _, p in role.local_files()][0] == local / "model.safetensors"
        assert list(role.file_ctimes()) == [str(local / "model.safetensors")]
        sent = len(http.log.requests())
        role.will_need([ReadRange(f, 0, 64) for f in role.files])
        role.check_unchanged_for_reuse()
        assert len(http.log.requests()) == sent  # advice and the reuse check go to the local model
        assert role.aux_reader("mergefs-delta.x.safetensors") is None
        with pytest.raises(SourceError, match="slices over remote models"):
            role.check_writable_aux("an index sidecar", "publish from a local copy")
    finally:
        role.close()


# -- credentials and spec validation ------------------------------------------------------------
def test_credentials_are_never_written(tmp_path: Path, fam: Family, s3: CountingMotoServer,
                                       caplog: pytest.LogCaptureFixture,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path / "cred.yaml", str(fam.base),
                      [f"s3://{BUCKET}/fam/expert-{i}" for i in range(3)], budget="50%",
                      storage_options=s3_options(s3, secret=True),
                      manifest=str(tmp_path / "cred.manifest.jsonl"))
    loaded = load_spec(spec)
    raw = json.dumps(loaded.raw)
    assert SECRET not in raw and KEY_ID not in raw and s3.endpoint in raw
    assert SECRET not in repr(loaded)
    caplog.set_level(logging.DEBUG)
    assert cli.main(["--debug", "merge", str(spec), str(tmp_path / "out")]) == 0
    assert cli.main(["replay", str(tmp_path / "cred.manifest.jsonl")]) == 0  # creds from env
    out, err = capsys.readouterr()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "cred.yaml"]
    assert any(p.suffix == ".jsonl" for p in written)
    assert any("index" in str(p) for p in written)
    for p in written:
        data = p.read_bytes()
        assert SECRET.encode() not in data and KEY_ID.encode() not in data, p
    for text in (out, err, caplog.text):
        assert SECRET not in text and KEY_ID not in text


@pytest.mark.parametrize("doc, key, absent", [
    ({"base_model": "s3://user:pw@bucket/base"}, "base_model", "pw"),
    ({"base_model": "https://host/base?X-Amz-Signature=abc"}, "base_model", "abc"),
    ({"index_dir": "s3://bucket/idx"}, "index_dir", None),
    ({"storage_options": ["secret"]}, "storage_options", "secret"),
    ({"models": [{"model": "s3://b/m", "storage_options": "key=secret"}]},
     "models[0].storage_options", "secret"),
    ({"remote": {"coalesce_gap": "lots"}}, "remote.coalesce_gap", None),
    ({"remote": {"retries": -1}}, "remote.retries", None),
    ({"base_model": "file://relative/base"}, "base_model", None),
])
def test_spec_remote_errors_name_the_key(tmp_path: Path, doc: dict[str, Any], key: str,
                                         absent: str | None) -> None:
    base: dict[str, Any] = {"merge_method": "task_arithmetic", "base_model": "./base",
                            "models": [{"model": "s3://b/m", "parameters": {"weight": 1.0}}]}
    for m in doc.get("models", []):
        m.setdefault("parameters", {"weight": 1.0})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**base, **doc}))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert f"{key}:" in msg, msg
    if absent is not None:
        assert absent not in msg.split(f"{key}:", 1)[1]


def test_storage_options_scoping(tmp_path: Path) -> None:
    path = write_spec(tmp_path / "s.yaml", "s3://b/base",
                      ["https://h/e0", "s3://b/e1"],
                      storage_options={"anon": False, "s3": {"endpoint_url": "http://x:1",
                                                             "secret": SECRET},
                                       "http": {"headers": {"Authorization": SECRET}}})
    doc = yaml.safe_load(path.read_text())
    doc["models"][1]["storage_options"] = {"key": KEY_ID}
    path.write_text(yaml.safe_dump(doc))
    spec = load_spec(path)
    assert dict(spec.source_options("s3://b/e1").storage_options) == {
        "anon": False, "endpoint_url": "http://x:1", "secret": SECRET, "key": KEY_ID}
    assert dict(spec.source_options("https://h/e0").storage_options) == {
        "anon": False, "headers": {"Authorization": SECRET}}
    assert spec.source_options("s3://b/base").storage_options["endpoint_url"] == "http://x:1"
    assert spec.raw["storage_options"] == {
        "anon": False, "s3": {"endpoint_url": "http://x:1", "secret": "<redacted>"},
        "http": {"headers": "<redacted>"}}
    assert spec.raw["models"][1]["storage_options"] == {"key": "<redacted>"}
    assert SECRET not in json.dumps(spec.raw) and KEY_ID not in json.dumps(spec.raw)
    assert spec.source_options(str(tmp_path)) is None


def test_remote_without_fsspec_extra_is_a_clear_error(tmp_path: Path, fam: Family,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec -> ImportError
    spec = write_spec(tmp_path / "nofs.yaml", str(fam.base), ["s3://b/m"])
    with pytest.raises(MergefsError, match=r"mergefs\[remote\]"):
        Session(load_spec(spec))


# -- mount --------------------------------------------------------------------------------------
@pytest.mark.mount
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_mount_with_remote_experts_serves_the_local_merge(
        tmp_path: Path, fam: Family, s3: CountingMotoServer, http: RangeHTTPServer,
        request: pytest.FixtureRequest) -> None:
    _, local_out = local_merge(tmp_path, fam, budget="40%")
    experts = [f"s3://{BUCKET}/fam/expert-0", f"{http.url}/fam/expert-1",
               f"s3://{BUCKET}/fam/expert-2"]
    spec = write_spec(tmp_path / "mnt.yaml", str(fam.base), experts, budget="40%",
                      storage_options=s3_options(s3, secret=True))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "mount.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mergefs.cli", "mount", str(spec),
                                 str(mnt), "--foreground"], stdout=fh, stderr=subprocess.STDOUT)

    def unmount() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)

    request.addfinalizer(unmount)
    deadline = time.monotonic() + 60
    while not (mnt / ".mergefs" / "stats.json").exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    for p in sorted(local_out.rglob("*")):
        if p.is_file() and p.relative_to(local_out).as_posix() not in (MARKER, *CARD_FILES):
            assert (mnt / p.relative_to(local_out)).read_bytes() == p.read_bytes(), p.name
    state = b"".join(p.read_bytes() for p in (mnt / ".mergefs").iterdir() if p.is_file())
    state += b"".join((mnt / f).read_bytes() for f in CARD_FILES)  # the spec, redacted
    assert SECRET.encode() not in state and KEY_ID.encode() not in state
    unmount()
    assert SECRET not in log.read_text()


# -- recipes over remote sources ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["slerp", "passthrough"])
def test_slices_over_http_equal_the_local_slices(tmp_path: Path, fam: Family,
                                                 http: RangeHTTPServer, method: str) -> None:
    """A slice merge and a self-stack whose models are HTTP URLs: the same bytes as the same
    recipe over the local directories, every weight read by ranges."""
    def doc(base: str, expert: str) -> dict[str, Any]:
        if method == "slerp":
            return {"merge_method": "slerp", "base_model": base, "parameters": {"t": [
                {"filter": "mlp", "value": [0.2, 0.8]}, {"value": 0.4}]},
                "slices": [{"sources": [{"model": base, "layer_range": [0, 1]},
                                        {"model": expert, "layer_range": [0, 1]}]}]}
        return {"merge_method": "passthrough", "slices": [
            {"sources": [{"model": base, "layer_range": [0, 1]}]},
            {"sources": [{"model": expert, "layer_range": [0, 1]}]}]}

    url = f"{http.url}/fam"
    paths = {}
    for name, (b, e) in {"local": (str(fam.base), str(fam.experts[0])),
                         "http": (f"{url}/base", f"{url}/{fam.experts[0].name}")}.items():
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump({**doc(b, e), "block_size": BLOCK,
                                        "index_dir": str(tmp_path / f"{name}-index")}))
        paths[name] = spec
    merge(paths["local"], tmp_path / "local-out")
    http.log.reset()
    merge(paths["http"], tmp_path / "http-out")
    assert_same_dir(tmp_path / "local-out", tmp_path / "http-out")
    assert http.log.requests(method="GET"), "nothing was read over HTTP"
    assert (tmp_path / "http-out" / "model.safetensors").stat().st_size > 0
    if method == "passthrough":  # layer 1 is the expert's layer 0, renumbered
        from safetensors import safe_open

        with safe_open(str(tmp_path / "http-out" / "model.safetensors"), "np") as f:
            assert "model.layers.1.mlp.up_proj.weight" in f.keys()  # noqa: SIM118 (safe_open is not a dict)


def test_http_sidecar_reads_fit_the_budget(tmp_path: Path, fam: Family) -> None:
    """Over HTTP, a budgeted merge with delta sidecars and a 1 MiB ``coalesce_gap`` joins
    sidecar ranges (and exact blocks) only while the gaps fit the budget's slack: planned
    plus gap bytes stay within the budget, it needs no more GETs than ``coalesce_gap: 0``
    (which reads a GET per run of adjacent ranges, and per shared range); its bytes equal the
    same merge over the local sidecars, its totals count the bytes and GETs the server sent,
    gap bytes included, and replay verifies its reads."""
    root = tmp_path / "served"
    shutil.copytree(fam.root, root / "fam")
    base = str(root / "fam" / "base")
    budget = "25%"
    local = write_spec(tmp_path / "local.yaml", base,
                       [str(root / "fam" / f"expert-{i}") for i in range(3)], budget=budget)
    assert cli.main(["compress", str(local), "--publish"]) == 0  # beside the served experts
    l_session, _ = merge(local, tmp_path / "local-out")
    srv = RangeHTTPServer(root).start()
    try:
        experts = [f"{srv.url}/fam/expert-{i}" for i in range(3)]
        runs: dict[str, tuple[Session, dict[str, Any], list[Any]]] = {}
        for name, gap in (("coalesced", "1MiB"), ("gap0", 0)):
            spec = write_spec(tmp_path / f"{name}.yaml", base, experts, budget=budget,
                              remote={"coalesce_gap": gap})
            srv.log.reset()
            session, totals = merge(spec, tmp_path / f"{name}-out")
            runs[name] = (session, totals, srv.log.requests("/mergefs-delta.", "GET"))
            assert_same_dir(tmp_path / f"{name}-out", tmp_path / "local-out")
        manifest = tmp_path / "http.manifest.jsonl"
        assert cli.main(["merge", str(tmp_path / "coalesced.yaml"), str(tmp_path / "cli-out"),
                         "--manifest", str(manifest)]) == 0
        assert cli.main(["replay", str(manifest)]) == 0
    finally:
        srv.stop()
    session, totals, gets = runs["coalesced"]
    levels = session.plan.levels
    assert levels is not None and np.array_equal(levels, l_session.plan.levels)
    lay = session.index.layout
    tensors_read = sum(bool(levels[i, int(lay.first_block[t]):int(lay.first_block[t + 1])].any())
                       for i in session.deltas for t in range(len(lay.tensors)))
    assert len(session.deltas) == 3 and tensors_read > 3
    opened = 3 * len(session.deltas)  # at open: header length, header, range table
    _, totals0, gets0 = runs["gap0"]
    assert len(gets0) - opened > 2 * tensors_read  # a GET per level run, and per shared range
    assert len(gets) <= len(gets0)
    header_bytes = sum(sc.header_bytes for sc in session.deltas.values())
    for tot, got in ((totals, gets), (totals0, gets0)):  # as the server counts them
        assert sum(tot["sidecar_reads"].values()) == len(got) - opened
        assert sum(tot["sidecar_bytes_read"].values()) == \
            sum(s.end - s.start for s in got) - header_bytes
        assert tot["expert_bytes_read"] == tot["expert_bytes_planned"] + \
            tot["expert_gap_bytes_read"] <= session.plan.budget_bytes
    assert sum(totals0["sidecar_gap_bytes_read"].values()) == 0
    assert sum(totals0["sidecar_bytes_read"].values()) == totals0["sidecar_bytes_planned"]
    gap = sum(totals["sidecar_gap_bytes_read"].values())
    assert gap <= totals["expert_gap_bytes_read"] <= totals["expert_gap_bytes_allowed"] == \
        session.plan.budget_bytes - session.plan.planned_bytes
    assert sum(totals["sidecar_bytes_read"].values()) - gap == totals["sidecar_bytes_planned"]


def test_s3_delta_sidecars_published_read_by_ranges_and_replayed(
        tmp_path: Path, fam: Family, s3: CountingMotoServer) -> None:
    """`mergefs compress` over s3:// experts uploads each delta sidecar beside its expert; a
    budgeted merge reads sidecar levels by ranges and gives the bytes the same merge gives over
    local copies with local sidecars; replay verifies every sidecar range it read."""
    local_fam = tmp_path / "local"
    shutil.copytree(fam.root, local_fam)
    upload_tree(s3.fs, fam.root, f"{BUCKET}/deltas")
    opts = s3_options(s3)
    budget = "25%"
    remote_experts = [f"s3://{BUCKET}/deltas/expert-{i}" for i in range(3)]
    local_experts = [str(local_fam / f"expert-{i}") for i in range(3)]
    remote = write_spec(tmp_path / "remote.yaml", str(local_fam / "base"), remote_experts,
                        budget=budget, storage_options=opts,
                        remote={"coalesce_gap": 0})  # a 1 MiB gap spans this small sidecar
    local = write_spec(tmp_path / "local.yaml", str(local_fam / "base"), local_experts,
                       budget=budget)
    for spec in (remote, local):
        assert cli.main(["compress", str(spec), "--publish"]) == 0
    names = [n for n in s3.fs.ls(f"{BUCKET}/deltas/expert-0") if "mergefs-delta." in n]
    assert len(names) == 1
    from mergefs.deltas.sidecar import open_remote_sidecar, open_sidecar

    local_sc = open_sidecar(next((local_fam / "expert-0").glob("mergefs-delta.*")))
    blob = s3.fs.cat(names[0])
    remote_sc = open_remote_sidecar(names[0], lambda a, b: blob[a:b], 0)
    # the same levels and payloads (the headers differ: each names its own expert)
    assert np.array_equal(remote_sc.range_xxh3, local_sc.range_xxh3)
    assert np.array_equal(remote_sc.range_resid, local_sc.range_resid, equal_nan=True)

    s3.log.reset()
    r_session, _ = merge(remote, tmp_path / "remote-out")
    sidecar_bytes = s3.log.body_bytes("/deltas/expert-0/mergefs-delta.")
    assert 0 < sidecar_bytes < s3.fs.size(names[0])  # read by ranges, not whole
    l_session, _ = merge(local, tmp_path / "local-out")
    assert r_session.plan.levels is not None and r_session.plan.levels.any()
    assert np.array_equal(r_session.plan.levels, l_session.plan.levels)
    assert_same_dir(tmp_path / "remote-out", tmp_path / "local-out")

    manifest = tmp_path / "remote.manifest.jsonl"
    assert cli.main(["merge", str(remote), str(tmp_path / "cli-out"), "--manifest",
                     str(manifest)]) == 0
    assert cli.main(["replay", str(manifest)]) == 0
