"""``mergefs index gc``: each removal rule on its own (unreached pieces, temporaries of dead
builds, the size cap in least-recently-used order, records left pointing at nothing), the
dry run, and pieces a live registration holds. The real mount's registration:
tests/mount/test_mount_gc.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from families import Family, make_family, write_spec

from mergefs.cli.app import main
from mergefs.index.blocks import load_or_build
from mergefs.index.build import BuildReport
from mergefs.index.collect import collect, register_live
from mergefs.sources import open_source

BLOCK = 1024
DAY = 86400.0


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("gc") / "fam", n_experts=3, dtype="float32",
                       seed=5)


def index_of(fam: Family, which: list[int], idx: Path) -> tuple[set[str], BuildReport]:
    base, experts = open_source(fam.base), [open_source(fam.experts[i]) for i in which]
    report = BuildReport()
    try:
        index, _ = load_or_build(base, experts, BLOCK, idx, report=report)
    finally:
        for c in [base, *experts]:
            c.close()
    return set(index.pieces), report


def age(idx: Path, days: float, only: set[str] | None = None) -> None:
    """Make pieces (and usage records) look ``days`` old."""
    t = time.time() - days * DAY
    for p in (idx / "pieces").iterdir():
        if p.name.startswith("usage-"):
            doc = json.loads(p.read_text())
            if only is None or set(doc["pieces"]) <= only:
                doc["used_unix"] = t
                p.write_text(json.dumps(doc))
        if only is None or p.name in only or not p.name.endswith(".safetensors"):
            os.utime(p, (t, t))


def names(idx: Path) -> set[str]:
    return {p.name for p in (idx / "pieces").glob("*.safetensors")}


def test_unreached_pieces_go_and_their_records_with_them(fam: Family, tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0, 1], idx)
    other, _ = index_of(fam, [2], idx)
    only_other = other - used  # expert 2's piece (the base piece is shared)
    assert len(only_other) == 1 and used | other == names(idx)
    age(idx, 40)
    index_of(fam, [0, 1], idx)  # used again today: its usage record is recent
    dry = collect(idx, dry_run=True)
    assert {r.name for r in dry.removed if r.kind == "unreached"} == only_other
    assert names(idx) == used | other  # a dry run removes nothing
    got = collect(idx)
    assert {r.name for r in got.removed if r.kind == "unreached"} == only_other
    assert names(idx) == used
    # expert 2's source record points at content with no piece left: removed too
    records = [r.name for r in got.removed if r.kind == "record"]
    assert len(records) == 1 and records[0].startswith("source-")
    assert got.freed_bytes() == sum(r.size_bytes for r in got.removed) > 0
    # what is kept still serves: nothing read, nothing built
    _, again = index_of(fam, [0, 1], idx)
    assert again.bytes_read == {} and again.experts_built == []


def test_young_pieces_and_pieces_of_the_given_specs_stay(fam: Family, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    idx = tmp_path / "idx"
    extra = {"block_size": BLOCK, "index_dir": str(idx)}
    spec = write_spec(tmp_path / "two.yaml", dataclasses.replace(fam, experts=fam.experts[:2]),
                      extra=extra)
    used, _ = index_of(fam, [0, 1], idx)
    other, _ = index_of(fam, [2], idx)
    assert collect(idx, reached=set()).removed == []  # written minutes ago: a build's
    age(idx, 1)  # a day old: recent enough for the 30 days rule, not kept by a spec
    assert collect(idx, dry_run=True).removed == []
    assert main(["index", "gc", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove 1 pieces no recent spec reaches" in out and names(idx) == used | other
    assert main(["index", "gc", str(spec)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("removed 1 pieces no recent spec reaches") and len(out) == 5
    assert out[-1].startswith("freed ") and f"kept {len(used)} pieces" in out[-1]
    assert names(idx) == used


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temporaries_of_dead_builds_go_and_a_live_builds_stay(fam: Family,
                                                                tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    index_of(fam, [0], idx)
    folder = idx / "pieces"
    dead = folder / f".expert-0123.safetensors.tmp-{_dead_pid()}-140000"
    live = folder / f".expert-4567.safetensors.tmp-{os.getpid()}-140001"
    for p in (dead, live):
        p.write_bytes(b"x" * 100)
        os.utime(p, (time.time() - DAY,) * 2)  # older than a write takes
    got = collect(idx)
    assert [(r.kind, r.name) for r in got.removed] == [("temporary", dead.name)]
    assert live.exists() and not dead.exists()


def test_size_cap_removes_least_recently_used_first(fam: Family, tmp_path: Path) -> None:
    idx = tmp_path / "idx"
    sets = [index_of(fam, [i], idx)[0] for i in range(3)]
    base = set.intersection(*sets)
    own = [next(iter(s - base)) for s in sets]  # each expert's piece
    folder = idx / "pieces"
    when = {own[0]: 100.0, own[1]: 300.0, own[2]: 200.0}  # expert 0 least recently used
    for p in folder.glob("usage-*.json"):
        doc = json.loads(p.read_text())
        mine = next(n for n in own if n in doc["pieces"])
        doc["used_unix"] = time.time() - 10 * DAY + when[mine]
        p.write_text(json.dumps(doc))
    for p in folder.iterdir():
        os.utime(p, (time.time() - 20 * DAY,) * 2)
    total = sum(p.stat().st_size for p in folder.iterdir())
    cap = total - (folder / own[0]).stat().st_size - 1  # one byte short after the first
    got = collect(idx, max_size_bytes=cap)
    assert [r.name for r in got.removed if r.kind == "over the size cap"] == [own[0], own[2]]
    assert names(idx) == base | {own[1]}


def test_a_live_registration_keeps_its_pieces(fam: Family, tmp_path: Path) -> None:
    """What a running mount does (:func:`register_live`); a dead one's registration is
    dropped. tests/mount/test_mount_gc.py does it with a real mount."""
    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0, 1], idx)
    age(idx, 100)
    reg = register_live(idx, used)
    assert reg is not None
    try:
        got = collect(idx, max_size_bytes=0)
        assert got.removed == [] or all(r.name not in used for r in got.removed)
        assert names(idx) == used and got.live_pieces == len(used)
    finally:
        reg.close()
    got = collect(idx)
    assert {r.name for r in got.removed if r.kind == "unreached"} == used and names(idx) == set()
    stale = idx / "pieces" / "live-999999-0.json"  # a registration no process holds
    stale.write_text(json.dumps({"pid": 999999, "pieces": []}))
    collect(idx)
    assert not stale.exists()


def test_index_max_size_collects_after_a_build_never_its_own_pieces(fam: Family,
                                                                    tmp_path: Path) -> None:
    """The spec key ``index_max_size``: after each build, least recently used pieces of
    other families go until the folder fits; the family just built keeps all of its own."""
    from mergefs.core.errors import SpecError
    from mergefs.spec.load import load_spec

    idx = tmp_path / "idx"
    first, _ = index_of(fam, [0], idx)
    for p in (idx / "pieces").iterdir():
        os.utime(p, (time.time() - DAY,) * 2)
    base, experts = open_source(fam.base), [open_source(fam.experts[1])]
    try:  # a cap below what the new family alone needs
        index, built = load_or_build(base, experts, BLOCK, idx, max_size_bytes=1)
    finally:
        for c in [base, *experts]:
            c.close()
    assert built and names(idx) == set(index.pieces)  # expert 0's piece went, none of its own
    assert not first <= names(idx) and set(index.pieces) & first  # (the shared base piece)
    spec = write_spec(tmp_path / "s.yaml", fam, extra={"index_max_size": "2GiB"})
    assert load_spec(spec).index_max_size_bytes == 2 << 30
    assert load_spec(write_spec(tmp_path / "n.yaml", fam)).index_max_size_bytes is None
    with pytest.raises(SpecError, match="index_max_size"):
        load_spec(write_spec(tmp_path / "bad.yaml", fam, extra={"index_max_size": "lots"}))


def test_an_index_of_the_earlier_format_is_collected(fam: Family, tmp_path: Path) -> None:
    """Pieces of another format version are never read again: unreached at once, and the
    source records of that format (no content digest) with them."""
    from safetensors.numpy import save_file

    import numpy as np

    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0], idx)
    folder = idx / "pieces"
    old = folder / ("expert-" + "0" * 32 + ".safetensors")
    save_file({"zero": np.zeros(3, dtype=bool)}, str(old), metadata={
        "mergefs_index_version": "3"})
    record = folder / "source-0123456789abcdef.json"  # format 3's identity record
    record.write_text(json.dumps({"root": "/old", "files": []}))
    got = collect(idx)
    assert [(r.kind, r.name) for r in got.removed] == [("unreached", old.name),
                                                        ("record", record.name)]
    assert names(idx) == used


def test_a_gc_racing_a_registration_never_drops_it(fam: Family, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection that runs while a mount is registering (after its file is created,
    before it is locked) must not take the file for a dead one's and remove it: the mount's
    pieces would then be unprotected for as long as it runs."""
    import fcntl

    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0, 1], idx)
    real = fcntl.flock
    raced: list[Path] = []

    def flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH and not raced:  # the registration, about to lock its file
            raced.append(idx)
            collect(idx)  # pieces are young: only the registration is at stake
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    reg = register_live(idx, used)
    monkeypatch.setattr(fcntl, "flock", real)
    assert raced and reg is not None
    try:
        assert reg.path.exists()
        age(idx, 100)
        got = collect(idx)
        assert names(idx) == used and got.live_pieces == len(used)
    finally:
        reg.close()


def test_young_pieces_stay_under_the_size_cap(fam: Family, tmp_path: Path) -> None:
    """Pieces written in the last minutes (a concurrent build's, before its usage record)
    are never removed, the size cap included (docs/cli.md, "Never removed")."""
    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0, 1], idx)
    got = collect(idx, max_size_bytes=0)
    assert [r for r in got.removed if r.kind != "record"] == [] and names(idx) == used
    age(idx, 1)
    got = collect(idx, max_size_bytes=0)
    assert {r.name for r in got.removed if r.kind == "over the size cap"} == used


def test_a_fresh_temporary_of_a_pid_unknown_here_stays(fam: Family, tmp_path: Path) -> None:
    """On a shared index_dir, a temporary being written by another machine's build has a pid
    unknown here: removing it would fail that build's rename. Only old ones go."""
    idx = tmp_path / "idx"
    index_of(fam, [0], idx)
    other = idx / "pieces" / f".expert-89ab.safetensors.tmp-{_dead_pid()}-140002"
    other.write_bytes(b"x" * 100)
    assert [r for r in collect(idx).removed if r.kind == "temporary"] == [] and other.exists()


def test_gc_of_a_directory_that_does_not_exist_says_so(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """A mistyped --index-dir is an error naming it, not a run that freed 0 B."""
    missing = tmp_path / "no-such-index"
    assert main(["index", "gc", "--index-dir", str(missing)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(missing) in err[0] and not missing.exists()


def test_gc_with_a_multi_document_spec_merges_nothing_and_keeps_every_merge_pieces(
        fam: Family, tmp_path: Path) -> None:
    """``index gc SPEC`` of a multi-document spec: the named merges are not made (gc writes
    no model, even with --dry-run), and the pieces of each merge the spec makes are kept,
    the intermediate ones included (not only the final merge's)."""
    import yaml

    idx, inter = tmp_path / "idx", tmp_path / "inter"
    docs = [{"name": "soup", "merge_method": "task_arithmetic", "base_model": str(fam.base),
             "dtype": "float32", "block_size": BLOCK, "index_dir": str(idx),
             "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.5}},
                        {"model": str(fam.experts[1]), "parameters": {"weight": 0.5}}]},
            {"merge_method": "task_arithmetic", "base_model": str(fam.base), "dtype": "float32",
             "block_size": BLOCK, "index_dir": str(idx), "intermediate_dir": str(inter),
             "models": [{"model": "soup", "parameters": {"weight": 0.5}},
                        {"model": str(fam.experts[2]), "parameters": {"weight": 0.5}}]}]
    spec = tmp_path / "multi.yaml"
    spec.write_text(yaml.safe_dump_all(docs))
    index_of(fam, [0], idx)  # so that the index directory exists
    assert main(["index", "gc", str(spec), "--dry-run"]) == 0
    assert not inter.exists()  # no merge made by gc
    assert main(["merge", str(spec), str(tmp_path / "out")]) == 0
    made = names(idx)
    age(idx, 1)
    assert main(["index", "gc", str(spec)]) == 0
    assert names(idx) == made  # both merges' pieces reached


def test_a_file_that_vanishes_while_listed_is_skipped(fam: Family, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A concurrent build renames its temporaries (and another gc removes files) while a
    collection lists the folder: a file gone between listing and stat is skipped, not an
    error (``index_max_size`` collects after every build)."""
    idx = tmp_path / "idx"
    used, _ = index_of(fam, [0], idx)
    going = idx / "pieces" / f".expert-cdef.safetensors.tmp-{os.getpid()}-140003"
    going.write_bytes(b"x")
    real, seen = Path.stat, []

    def stat(self: Path, **kw: object) -> os.stat_result:
        if self.name == going.name:
            seen.append(self)
            if len(seen) > 1:  # listed as a file, then renamed away before its stat
                raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, **kw)  # type: ignore[arg-type]

    phantom = idx / "pieces" / "expert-gone.safetensors"  # listed, removed before its stat
    listing = Path.iterdir

    def iterdir(self: Path):  # type: ignore[no-untyped-def]
        yield from listing(self)
        if self == idx / "pieces":
            yield phantom

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    got = collect(idx, max_size_bytes=0)
    assert seen and names(idx) == used and got.kept_pieces == len(used)


def test_the_command_is_named_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    """Errors list the commands as a user types them: `index gc`, never an internal name."""
    with pytest.raises(SystemExit):
        main(["no-such-command"])
    err = capsys.readouterr().err
    assert "'index gc'" in err and "index-gc" not in err
