"""Files mergefs derives from the experts (issue 28, item 5): `mergefs plan` says when delta
sidecars changed what it reads, and ``--no-sidecars`` plans (and merges) without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families import make_family, write_spec

from mergefs import cli
from mergefs.deltas import publish as compress
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
