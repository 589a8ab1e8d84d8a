"""Regression tests for bugs found in review: each failed before its fix.

- a floating tensor with zero columns (shape ``(n, 0)``) crashed block layout;
- ``replay --out`` of a mount's manifest (units of single blocks) and of a merge manifest
  written with another unit size failed with "replay read ... that the manifest does not
  record", because materialise re-split the tensors into its own units;
- malformed manifests escaped as tracebacks (KeyError, TypeError) instead of one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from families import make_family
from safetensors.numpy import save_file
from viewcases import materialise, write_case_spec

from mergefs import cli
from mergefs.engine import merger as engine_mod
from mergefs.core.cache import UnitCache
from mergefs.engine.session import Session
from mergefs.core.errors import ManifestError
from mergefs.engine.manifest import ManifestWriter, read_manifest
from mergefs.engine.replay import replay
from mergefs.core.sizes import human_bytes
from mergefs.spec.load import load_spec
from mergefs.mount.session import MountSession
from mergefs.mount.view import View

# -- zero-size tensors --------------------------------------------------------------------------


def _odd_shapes_family(root: Path) -> Path:
    """Base + 2 float32 experts with zero-size, zero-column, scalar and ragged tensors."""
    rng = np.random.default_rng(0)
    shapes = {"a": (7, 5), "scalar": (), "empty": (0,), "no_rows": (0, 6), "no_cols": (5, 0),
              "vec": (37,)}
    base = {k: np.asarray(rng.normal(size=s), dtype=np.float32) for k, s in shapes.items()}
    base["ids"] = np.arange(6, dtype=np.int64)
    models = {"base": base}
    for i in range(2):
        models[f"e{i}"] = {
            k: (v if v.dtype != np.float32 else
                np.asarray(v + np.float32(0.1) * np.asarray(rng.normal(size=v.shape),
                                                            dtype=np.float32), dtype=np.float32))
            for k, v in base.items()}
    for name, tensors in models.items():
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / "model.safetensors"))
        (root / name / "config.json").write_text("{}")
    spec = {"merge_method": "task_arithmetic", "base_model": "base",
            "models": [{"model": "e0", "parameters": {"weight": 0.5}},
                       {"model": "e1", "parameters": {"weight": -0.25}}],
            "block_size": 64, "index_dir": str(root / "idx"), "budget": "50%"}
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_zero_column_tensor_merges_and_mounts(tmp_path: Path) -> None:
    spec_path = _odd_shapes_family(tmp_path)
    out = materialise(spec_path, tmp_path / "out")
    data = (out / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert header["no_cols"]["shape"] == [5, 0]
    assert header["no_cols"]["data_offsets"][0] == header["no_cols"]["data_offsets"][1]
    session = Session(load_spec(spec_path))
    view = View(MountSession.of(session), UnitCache(1 << 20))
    try:
        assert view.read_path("model.safetensors") == data
        for start in range(0, len(data), 7):
            assert view.read_path("model.safetensors", start, 13) == data[start:start + 13]
    finally:
        view.close()
        session.close()


# -- replay --out ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def review_family(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_family(tmp_path_factory.mktemp("review_family"), dtype="bfloat16", seed=11)


def test_replay_out_of_a_mount_manifest(tmp_path: Path, review_family) -> None:  # type: ignore[no-untyped-def]
    spec_path = write_case_spec(tmp_path / "spec.yaml", review_family, "dare_ties",
                                tmp_path / "idx")
    spec = load_spec(spec_path)
    want = materialise(spec_path, tmp_path / "want")
    session = Session(spec, manifest=ManifestWriter(spec.manifest))
    view = View(MountSession.of(session), UnitCache(4096))  # tiny cache: units are merged (and recorded) twice
    try:
        view.read_path("model.safetensors")
        view.read_path("model.safetensors")
    finally:
        view.close()
        session.finish()
        session.close()
    res = replay(spec.manifest, out=tmp_path / "again")
    assert res.outputs_verified == len({(o["tensor"], o["b0"], o["b1"])
                                        for o in read_manifest(spec.manifest).outputs})
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (want / "model.safetensors").read_bytes()


def _partial_mount_manifest(tmp_path: Path, family):  # type: ignore[no-untyped-def]
    """The spec of a mount's manifest (through the view) that read a few tensors only."""
    spec_path = write_case_spec(tmp_path / "spec.yaml", family, "task_arithmetic",
                                tmp_path / "idx")
    spec = load_spec(spec_path)
    session = Session(spec, manifest=ManifestWriter(spec.manifest))
    view = View(MountSession.of(session), UnitCache(1 << 20), readahead_units=0)
    try:
        view.read_path("model.safetensors", 0, 20000)  # a few tensors only
    finally:
        view.close()
        session.finish()
        session.close()
    return spec


def test_replay_out_refuses_a_partial_mount_manifest(tmp_path: Path,
                                                     review_family) -> None:  # type: ignore[no-untyped-def]
    spec = _partial_mount_manifest(tmp_path, review_family)
    assert replay(spec.manifest).outputs_verified > 0  # what was recorded verifies
    with pytest.raises(ManifestError, match="without --out"):
        replay(spec.manifest, out=tmp_path / "again")


def test_replay_summary_of_a_mount_manifest_says_what_it_checked(  # type: ignore[no-untyped-def]
        tmp_path: Path, review_family, capsys: pytest.CaptureFixture[str]) -> None:
    """A mount records source reads and merged units, not whole tensors: the summary once said
    "0 tensors verified" after verifying every recorded read and unit."""
    spec = _partial_mount_manifest(tmp_path, review_family)
    contents = read_manifest(spec.manifest)
    reads = {(r["source"], r["file"], r["start"], r["end"]) for r in contents.reads}
    units = {(o["tensor"], o["b0"], o["b1"]) for o in contents.outputs}
    tensors = {o["tensor"] for o in contents.outputs}
    assert reads and units and not contents.tensors
    capsys.readouterr()
    assert cli.main(["replay", str(spec.manifest)]) == 0
    line = capsys.readouterr().out.strip()
    read_bytes = sum(e - s for _, _, s, e in reads)
    noun = "tensor" if len(tensors) == 1 else "tensors"
    assert line == (f"replay OK (plan {contents.header['plan_hash'][:16]}): {len(reads)} source "
                    f"ranges ({human_bytes(read_bytes)}) re-read and matched, {len(units)} "
                    f"merged units of {len(tensors)} {noun} reproduced"), line
    res = replay(spec.manifest)
    assert (res.reads_verified, res.bytes_verified, res.outputs_verified) == \
        (len(reads), read_bytes, len(units))


def test_replay_out_with_another_unit_size(tmp_path: Path, review_family,  # type: ignore[no-untyped-def]
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spec_path = write_case_spec(tmp_path / "spec.yaml", review_family, "linear",
                                tmp_path / "idx", budget="full")
    manifest = tmp_path / "m.jsonl"
    monkeypatch.setattr(engine_mod, "UNIT_ELEMS", 1000)  # an older or newer build's units
    assert cli.main(["merge", str(spec_path), str(tmp_path / "out"), "--manifest",
                     str(manifest)]) == 0
    monkeypatch.undo()
    res = replay(manifest, out=tmp_path / "again")
    assert res.tensors_verified == len(read_manifest(manifest).tensors)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (tmp_path / "out" / "model.safetensors").read_bytes()


# -- malformed manifests: one line, no traceback --------------------------------------------------


@pytest.fixture(scope="module")
def good_manifest(tmp_path_factory: pytest.TempPathFactory,
                  review_family) -> list[dict]:  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("good_manifest")
    spec_path = write_case_spec(d / "spec.yaml", review_family, "task_arithmetic", d / "idx")
    assert cli.main(["merge", str(spec_path), str(d / "out"), "--manifest",
                     str(d / "m.jsonl")]) == 0
    return [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]


def _drop(key: str):  # type: ignore[no-untyped-def]
    def edit(recs: list[dict]) -> None:
        del recs[0][key]
    return edit


def _set_header(key: str, value: object):  # type: ignore[no-untyped-def]
    def edit(recs: list[dict]) -> None:
        recs[0][key] = value
    return edit


def _first(kind: str, key: str, value: object):  # type: ignore[no-untyped-def]
    def edit(recs: list[dict]) -> None:
        next(r for r in recs if r["type"] == kind)[key] = value
    return edit


@pytest.mark.parametrize("edit", [
    _drop("spec"), _drop("selected"), _drop("sources"), _drop("plan_hash"),
    _set_header("spec", [1, 2]), _set_header("selected", "all"),
    _set_header("selected", [[[0, 10**9]]] * 3), _set_header("sources", 5),
    _first("output", "tensor", "no.such.tensor"), _first("output", "b1", 10**9),
    _first("read", "start", None), _first("output", "xxh3", None),
], ids=["no-spec", "no-selected", "no-sources", "no-plan-hash", "spec-list", "selected-str",
        "selected-range", "sources-int", "unknown-tensor", "block-range", "read-start",
        "output-hash"])
def test_malformed_manifest_is_one_line_error(tmp_path: Path, good_manifest: list[dict], edit,  # type: ignore[no-untyped-def]
                                              capsys: pytest.CaptureFixture[str]) -> None:
    recs = json.loads(json.dumps(good_manifest))
    edit(recs)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    capsys.readouterr()
    assert cli.main(["replay", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mergefs: error:"), err


# -- readahead into a cache that cannot hold the unit ---------------------------------------------


def test_no_readahead_of_units_the_cache_cannot_hold(tmp_path: Path,
                                                     review_family) -> None:  # type: ignore[no-untyped-def]
    """A unit larger than the cache is dropped as soon as it is merged: merging it ahead of the
    reader only doubles the work (the reader merges it again)."""
    spec_path = write_case_spec(tmp_path / "spec.yaml", review_family, "task_arithmetic",
                                tmp_path / "idx")
    session = Session(load_spec(spec_path))
    view = View(MountSession.of(session), UnitCache(64), readahead_units=4)  # every unit is > 64 bytes
    try:
        fh = view.open_path("model.safetensors")
        size = view.attr(view.inode_of("model.safetensors")).size_bytes
        for start in range(0, size, 4096):
            view.read(fh, start, 4096)
        assert view.stats()["readahead"]["units_scheduled"] == 0
    finally:
        view.close()
        session.close()
