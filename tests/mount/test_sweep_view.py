"""The sweep view without a mount: methods x budgets equal `mergefs merge --variant`, content
keys never share units across methods, and the sweep manifest replays."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from families import Family, make_family, write_spec

from mergefs import cli
from mergefs.core.cache import UnitCache
from mergefs.core.errors import SpecError
from mergefs.engine.manifest import ManifestWriter, read_sweep_manifest
from mergefs.engine.replay import replay
from mergefs.mount.session import MountSession
from mergefs.mount.view import View
from mergefs.spec.variants import load_variants


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("sweep_view_family"), n_experts=2, seed=7,
                       sharded=True)


def test_methods_by_budgets_equal_merges_and_replay(tmp_path: Path, fam: Family) -> None:
    spec = write_spec(tmp_path / "sweep.yaml", fam, "task_arithmetic", parameters={"density": 0.5},
                      extra={"block_size": 512, "index_dir": str(tmp_path / "index")})
    doc = yaml.safe_load(spec.read_text())
    doc["sweep"] = {"merge_method": ["task_arithmetic", "ties"], "budget": ["20%", "full"]}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    names = [v.name for v, _ in load_variants(spec)]
    assert names == ["method-task-arithmetic_budget-20pct", "method-task-arithmetic_budget-full",
                     "method-ties_budget-20pct", "method-ties_budget-full"]
    manifest = ManifestWriter(tmp_path / "sweep.jsonl")
    sweep = MountSession(spec, load_variants(spec), manifest, sweep=True,
                         source_cache_bytes=8 << 20)
    view = View(sweep, UnitCache(8 << 20))
    try:
        keys = {n: {s.key for path, _, wf in view.weight_files() if path.startswith(n + "/")
                    for s in wf.segments if s.merged} for n in names}
        assert not keys[names[0]] & keys[names[2]]  # another method: never the same unit
        for name in names:
            out = tmp_path / f"out-{name}"
            assert cli.main(["merge", str(spec), str(out), "--variant", name, "--manifest",
                             str(out) + ".jsonl"]) == 0
            for f in sorted(p.name for p in out.iterdir()  # the card: named after its dir
                            if not p.name.startswith(".") and p.name != "README.md"):
                assert view.read_path(f"{name}/{f}") == (out / f).read_bytes(), (name, f)
        stats = view.stats()
        # every base byte read once for the four variants (the shared source-block cache)
        assert stats["shared"]["physical_bytes_read"]["base"] == sum(
            t.size_bytes for t in sweep.base.tensors.values())
    finally:
        view.close()
        sweep.finish()
        sweep.close()
    contents = read_sweep_manifest(tmp_path / "sweep.jsonl")
    assert sorted(contents.variants) == sorted(names) and contents.totals is not None
    res = replay(tmp_path / "sweep.jsonl")
    assert [n for n, _ in res.variants] == sorted(names)
    assert res.outputs_verified == sum(len(c.outputs) for c in contents.variants.values())


def test_a_variant_may_not_change_the_family(tmp_path: Path, fam: Family) -> None:
    spec = write_spec(tmp_path / "sweep.yaml", fam, "task_arithmetic",
                      extra={"block_size": 512, "index_dir": str(tmp_path / "index")})
    doc = yaml.safe_load(spec.read_text())
    doc["variants"] = [{"name": "a"}, {"name": "b", "models.0.model": str(fam.base)}]
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(SpecError, match="cannot change 'models'"):
        load_variants(spec)


def test_sweep_table_of_a_sweep_spec_equals_plan_per_variant(tmp_path: Path, fam: Family,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    import json

    spec = write_spec(tmp_path / "sweep.yaml", fam, "task_arithmetic",
                      extra={"block_size": 512, "index_dir": str(tmp_path / "index")})
    doc = yaml.safe_load(spec.read_text())
    doc["sweep"] = {"weight": [0.3, 0.6], "budget": ["10%", "40%"]}
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert cli.main(["sweep", str(spec), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in rows] == [v.name for v, _ in load_variants(spec)]
    for r in rows:
        assert cli.main(["plan", str(spec), "--variant", r["variant"], "--json"]) == 0
        want = json.loads(capsys.readouterr().out)
        assert r["planned_bytes"] == want["planned_expert_bytes"]
        assert r["bound_tight"] == pytest.approx(want["bound_tight"], rel=1e-12)
    assert rows[0]["budget"] == "10%" and rows[1]["budget"] == "40%"
