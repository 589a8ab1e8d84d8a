"""Files mergefs derives from the experts (issue 28, item 5): `mergefs compress` keeps its delta
sidecars in mergefs's own store under the spec's ``index_dir`` and writes nothing into a source
unless asked (``--publish``); `mergefs plan` says when delta sidecars changed what it reads, and
``--no-sidecars`` plans (and merges) without them."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from bench.servers import RangeHTTPServer
from families import Family, make_family, write_spec

from mergefs import cli
from mergefs.deltas import publish as compress
from mergefs.engine.session import Session
from mergefs.index.blocks import load_or_build
from mergefs.recipe.family import open_family
from mergefs.spec.load import load_spec

BLOCK = 512
WEIGHTS = [0.5, -0.3, 0.8]


def _published(tmp_path: Path, seed: int) -> Path:
    """A family with delta sidecars published beside its experts; its spec."""
    fam = make_family(tmp_path / "fam", seed=seed)
    spec_path = write_spec(tmp_path / "spec.yaml", fam, weights=WEIGHTS,
                           extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx")})
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    try:
        index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
        assert len(compress.publish(base, experts, index)) == 3
    finally:
        for c in [base, *experts]:
            c.close()
    return spec_path


def test_plan_says_when_sidecars_changed_what_it_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _published(tmp_path, seed=24)
    assert cli.main(["plan", str(spec), "--budget", "5%"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "delta sidecars of" in ln)
    assert "uses delta sidecars of 3 of 3 experts (from beside the experts)" in line
    assert "instead of exact blocks" in line and "--no-sidecars" in line
    assert cli.main(["plan", str(spec), "--budget", "5%", "--no-sidecars"]) == 0
    assert "delta sidecars of" not in capsys.readouterr().out
    assert cli.main(["plan", str(spec), "--budget", "full"]) == 0
    assert "match, but this plan reads none of them" in capsys.readouterr().out


def test_no_sidecars_plans_and_merges_exact_blocks_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _published(tmp_path, seed=25)
    plans = {}
    for flags in ((), ("--no-sidecars",)):
        assert cli.main(["plan", str(spec), "--json", "--budget", "5%", *flags]) == 0
        plans[flags] = json.loads(capsys.readouterr().out)
    assert plans[()]["sidecar_bytes"] > 0
    assert "sidecar_bytes" not in plans[("--no-sidecars",)]
    assert plans[()]["plan_hash"] != plans[("--no-sidecars",)]["plan_hash"]
    manifest = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(spec), str(tmp_path / "out"), "--budget", "5%",
                     "--no-sidecars", "--manifest", str(manifest)]) == 0
    header = json.loads(manifest.read_text().splitlines()[0])
    assert "levels" not in header and \
        header["plan_hash"] == plans[("--no-sidecars",)]["plan_hash"]


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime_ns), by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(Path(dirpath) / f)
            out[str((Path(dirpath) / f).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _family(tmp_path: Path, seed: int) -> tuple[Family, Path, Path]:
    fam = make_family(tmp_path / "fam", seed=seed)
    idx = tmp_path / "idx"
    spec = write_spec(tmp_path / "spec.yaml", fam, weights=WEIGHTS,
                      extra={"block_size": BLOCK, "index_dir": str(idx)})
    return fam, spec, idx


def _plan_json(spec: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert cli.main(["plan", str(spec), "--json", "--budget", "5%", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_compress_writes_nothing_into_the_sources_and_plans_use_its_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fam, spec, idx = _family(tmp_path, seed=21)
    assert cli.main(["index", str(spec)]) == 0
    capsys.readouterr()
    before = _listing(fam.root)
    assert cli.main(["compress", str(spec)]) == 0
    out = capsys.readouterr().out
    assert _listing(fam.root) == before  # not a byte into any expert (or the base)
    written = [Path(line.split(" ", 1)[1]) for line in out.splitlines()
               if line.startswith("wrote ")]
    assert len(written) == 3 and "published" not in out
    assert all(p.is_file() and p.is_relative_to(idx / "sidecars") for p in written)
    assert len({p.parent for p in written}) == 3  # one folder per expert's bytes
    rep = _plan_json(spec, capsys)
    assert 0 < rep["sidecar_bytes"] <= rep["planned_expert_bytes"] <= rep["budget_bytes"]
    assert rep["blocks_from_sidecar"] > 0
    assert "sidecar_bytes" not in _plan_json(spec, capsys, "--no-sidecars")
    assert cli.main(["plan", str(spec), "--budget", "5%"]) == 0
    assert "uses delta sidecars of 3 of 3 experts (from index_dir)" in capsys.readouterr().out


def test_compress_publish_writes_beside_the_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fam, spec, idx = _family(tmp_path, seed=22)
    assert cli.main(["compress", str(spec), "--publish"]) == 0
    out = capsys.readouterr().out
    assert out.count("published ") == 3
    for i in range(3):
        assert len(list((fam.root / f"expert-{i}").glob("mergefs-delta.*.safetensors"))) == 1
    assert not (idx / "sidecars").exists()
    assert _plan_json(spec, capsys)["sidecar_bytes"] > 0


def test_a_stored_sidecar_serves_only_its_own_expert(tmp_path: Path) -> None:
    """The store is keyed by each expert's bytes (the experts of this family have the same file
    names, sizes and headers): with the experts listed in another order every stored sidecar
    is still found for its own expert."""
    fam, spec_path, idx = _family(tmp_path, seed=23)
    spec = load_spec(str(spec_path))
    base, experts = open_family(spec)
    try:
        index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
        paths = compress.publish(base, experts, index, store=spec.index_dir)
    finally:
        for c in [base, *experts]:
            c.close()
    assert len(set(paths)) == 3
    order = [fam.experts[2], fam.experts[0], fam.experts[1]]
    swapped = write_spec(tmp_path / "swapped.yaml", replace(fam, experts=order),
                         weights=WEIGHTS, extra={"block_size": BLOCK, "index_dir": str(idx)})
    s = Session(load_spec(str(swapped)))
    try:
        got = {i: str(sc.path) for i, sc in s.deltas.items()}
    finally:
        s.close()
    assert got == {0: paths[2], 1: paths[0], 2: paths[1]}


def test_compress_over_read_only_remote_experts_keeps_its_sidecars_locally(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Experts over HTTP (read-only): `mergefs compress` writes into the local store instead of
    refusing, and a later plan over the same URLs uses those sidecars; `--publish` is refused
    there."""
    root = tmp_path / "served"
    fam = make_family(root / "fam", seed=26)
    srv = RangeHTTPServer(root).start()
    try:
        experts = [f"{srv.url}/fam/expert-{i}" for i in range(3)]
        spec = tmp_path / "http.yaml"
        spec.write_text(json.dumps({
            "merge_method": "task_arithmetic", "base_model": str(fam.base),
            "models": [{"model": e, "parameters": {"weight": w}}
                       for e, w in zip(experts, WEIGHTS)],
            "block_size": BLOCK, "index_dir": str(tmp_path / "idx")}))
        before = _listing(root)
        assert cli.main(["compress", str(spec), "--publish"]) == 1
        assert cli.main(["compress", str(spec)]) == 0
        assert _listing(root) == before
        capsys.readouterr()
        rep = _plan_json(spec, capsys)
    finally:
        srv.stop()
    assert rep["sidecar_bytes"] > 0 and rep["blocks_from_sidecar"] > 0
