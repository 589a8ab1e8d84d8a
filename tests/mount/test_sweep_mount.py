"""Sweep mounts through real FUSE mounts: every variant of a grid in one mount, shared reads,
from_pretrained on two variants, reload while reading. Mounts come from the ``mounts`` fixture
(tests/test_mount.py), always unmounted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_family, write_spec
from mounting import merge, run_cli, sha256
from viewcases import tree

from mergefs import cli
from mergefs.engine.manifest import read_manifest, read_sweep_manifest
from mergefs.spec.variants import expand, load_variants

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                       reason="needs /dev/fuse and fusermount3"),
]

GRID = {"weight": [0.2, 0.5, 0.8], "budget": ["10%", "50%", "full"]}


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("sweep_mount_family"), n_experts=3, seed=5)


def sweep_spec(path: Path, fam: Family, sweep: dict[str, Any] | None = None,
               variants: list[dict[str, Any]] | None = None, method: str = "task_arithmetic",
               block_size: int | str = 1024) -> Path:
    write_spec(path, fam, method, extra={"block_size": block_size,
                                         "index_dir": str(path.parent / "index")})
    doc = yaml.safe_load(path.read_text())
    if sweep is not None:
        doc["sweep"] = sweep
    if variants is not None:
        doc["variants"] = variants
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def merge_variant(spec: Path, name: str, out: Path) -> dict[str, Any]:
    """``mergefs merge --variant NAME`` (in process); returns its manifest's totals."""
    manifest = Path(str(out) + ".manifest.jsonl")
    assert cli.main(["merge", str(spec), str(out), "--variant", name, "--manifest",
                     str(manifest)]) == 0
    totals = read_manifest(manifest).totals
    assert totals is not None
    return totals


def test_names_are_stable_readable_and_safe() -> None:
    doc = {"merge_method": "linear", "models": [{"model": "a"}, {"model": "b"}],
           "sweep": {"weight": [0.5, [0.2, 0.8]], "budget": ["10%"],
                     "parameters.lambda": [1, 2]},
           "variants": [{"name": "mine", "budget": "full"}]}
    names = [v.name for v in expand(doc, "s.yaml")]
    assert names == ["mine", "weight-0.5_lambda-1", "weight-0.5_lambda-2",
                     "weight-0.2+0.8_lambda-1", "weight-0.2+0.8_lambda-2"]
    assert names == [v.name for v in expand(doc, "s.yaml")]
    with pytest.raises(Exception, match="safe directory name"):
        expand({**doc, "variants": [{"name": "../x"}]}, "s.yaml")
    with pytest.raises(Exception, match="cannot change 'block_size'"):
        expand({**doc, "variants": [{"name": "x", "block_size": 64}]}, "s.yaml")


def test_grid_mount_equals_merges_and_shares_reads(tmp_path: Path, fam: Family,
                                                   mounts: Any) -> None:
    spec = sweep_spec(tmp_path / "sweep.yaml", fam, GRID)
    m = mounts.start(spec)
    doc = json.loads((m.path / "variants.json").read_text())
    names = [v["name"] for v in doc["variants"]]
    assert len(names) == 9 and sorted(os.listdir(m.path)) == sorted(
        [*names, ".mergefs", "variants.json"])
    by_name = {v["name"]: v for v in doc["variants"]}
    assert by_name["weight-0.5_budget-10pct"]["settings"] == {"weight": 0.5, "budget": "10%"}
    assert [e["parameters"]["weight"] for e in
            by_name["weight-0.5_budget-10pct"]["spec"]["models"]] == [0.5] * 3
    # every file of every variant, read through the mount variant after variant
    alone: dict[str, dict[str, Any]] = {}
    for name in names:
        out = tmp_path / f"out-{name}"
        alone[name] = merge_variant(spec, name, out)
        want = {rel: sha256(p) for rel, p in tree(out).items()}
        got = {rel: sha256(p) for rel, p in tree(m.path / name).items()}
        assert got == want, name
        for key in ("bound_tight", "bound_output_tight"):  # both bounds, as a merge reports
            assert by_name[name][key] == alone[name][key], (name, key)
    stats = m.stats()
    assert stats["kind"] == "sweep" and stats["read_errors"] == 0
    shared = stats["shared"]["physical_bytes_read"]
    separately = {src: sum(t["physical_bytes_read"][src] for t in alone.values())
                  for src in shared}
    # the sweep read less than the nine variants read separately, and each base block once
    assert sum(shared.values()) < sum(separately.values())
    one_base = {t["physical_bytes_read"]["base"] for t in alone.values()}
    assert len(one_base) == 1 and shared["base"] == one_base.pop()
    for src in shared:
        if src != "base":  # at most every block of the expert, whatever nine plans read
            assert shared[src] <= max(t["total_expert_bytes"] for t in alone.values()) // 3 + 1
    assert stats["shared"]["source_cache"]["hit_bytes"] > 0
    assert stats["shared"]["units_shared"] > 0  # budget-only differences share merged units
    for name in names:
        assert stats["variants"][name]["served_bytes"] > 0
    mounts.stop(m)
    sweep_manifest = read_sweep_manifest(os.path.realpath(tmp_path / "sweep.manifest.jsonl"))
    assert sorted(sweep_manifest.variants) == sorted(names)
    res = run_cli("replay", str(tmp_path / "sweep.manifest.jsonl"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(" OK (plan ") == 9


def test_from_pretrained_two_variants(tmp_path: Path, llama_family: Family,
                                      mounts: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = sweep_spec(tmp_path / "sweep.yaml", llama_family, variants=[
        {"name": "soft", "weight": 0.2, "budget": "50%"},
        {"name": "strong", "weight": 1.0}], block_size="4KiB")
    m = mounts.start(spec)
    ids = torch.tensor([[1, 5, 9, 42, 7, 100, 3]])
    logits = {}
    with torch.no_grad():
        models = {n: AutoModelForCausalLM.from_pretrained(m.path / n).eval()
                  for n in ("soft", "strong")}  # both alive in one process
        for name, model in models.items():
            merge_variant(spec, name, tmp_path / f"out-{name}")
            want = AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{name}").eval()(ids)
            logits[name] = model(ids).logits
            assert torch.equal(logits[name], want.logits)
    assert not torch.equal(logits["soft"], logits["strong"])
    assert m.stats()["read_errors"] == 0


def test_reload_adds_variants_while_reading_and_survives_a_broken_spec(
        tmp_path: Path, fam: Family, mounts: Any) -> None:
    variants = [{"name": "a", "weight": 0.3}]
    spec = sweep_spec(tmp_path / "sweep.yaml", fam, variants=variants)
    out_a = merge(spec_for(spec, "a", tmp_path), tmp_path / "out-a")
    m = mounts.start(spec, "--cache-size", "16KiB", "--source-cache-size", "16KiB")
    want_a = (out_a / "model.safetensors").read_bytes()
    with open(m.path / "a" / "model.safetensors", "rb", buffering=0) as held:
        head = held.read(len(want_a) // 2)
        variants.append({"name": "b", "weight": 0.9, "budget": "20%"})
        sweep_spec(spec, fam, variants=variants)
        res = run_cli("reload", str(m.path))
        assert res.returncode == 0, res.stderr
        assert "added b" in res.stdout
        assert head + held.read() == want_a  # the open handle kept reading correctly
    assert sorted(os.listdir(m.path)) == [".mergefs", "a", "b", "variants.json"]
    merge_variant(spec, "b", tmp_path / "out-b")
    assert sha256(m.path / "b" / "model.safetensors") == sha256(
        tmp_path / "out-b" / "model.safetensors")
    before = (m.path / "variants.json").read_text()
    spec.write_text(spec.read_text().replace("task_arithmetic", "no_such_method"))
    res = run_cli("reload", str(m.path))
    assert res.returncode == 1 and "reload failed" in res.stderr and "no_such_method" in res.stderr
    assert "Traceback" not in res.stderr
    after = json.loads((m.path / "variants.json").read_text())
    assert [v["name"] for v in after["variants"]] == ["a", "b"]
    assert after["variants"] == json.loads(before)["variants"]
    assert sha256(m.path / "a" / "model.safetensors") == sha256(out_a / "model.safetensors")
    assert "reload of" in m.log.read_text() and "mount is unchanged" in m.log.read_text()
    # a variant the spec no longer lists is still served (flagged), until unmounted
    sweep_spec(spec, fam, variants=variants[1:])
    res = run_cli("reload", str(m.path))
    assert res.returncode == 0 and "still served until unmounted: a" in res.stdout, res.stderr
    flags = {v["name"]: v["removed"] for v in
             json.loads((m.path / "variants.json").read_text())["variants"]}
    assert flags == {"a": True, "b": False}
    assert sha256(m.path / "a" / "model.safetensors") == sha256(out_a / "model.safetensors")


def spec_for(spec: Path, name: str, tmp: Path) -> Path:
    """A plain spec file equal to variant ``name`` of ``spec`` (for ``merge`` of test_mount)."""
    doc = yaml.safe_load(spec.read_text())
    (v,) = [v for v in expand(doc, str(spec)) if v.name == name]
    path = tmp / f"plain-{name}.yaml"
    path.write_text(yaml.safe_dump(v.doc, sort_keys=False))
    return path


def test_threads_reading_every_variant_with_tiny_caches(tmp_path: Path, fam: Family,
                                                        mounts: Any) -> None:
    import random
    import threading

    spec = sweep_spec(tmp_path / "sweep.yaml", fam,
                      {"merge_method": ["task_arithmetic", "ties"], "budget": ["30%", "full"]})
    names = [v.name for v in expand(yaml.safe_load(spec.read_text()), str(spec))]
    want = {}
    for name in names:
        merge_variant(spec, name, tmp_path / f"out-{name}")
        want[name] = (tmp_path / f"out-{name}" / "model.safetensors").read_bytes()
    # caches far below the sweep: evictions in both, units and source blocks shared and dropped
    m = mounts.start(spec, "--cache-size", "16KiB", "--source-cache-size", "16KiB")
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        fds = {n: os.open(m.path / n / "model.safetensors", os.O_RDONLY) for n in names}
        try:
            for _ in range(150):
                name = rng.choice(names)
                blob = want[name]
                off = rng.randrange(len(blob))
                size = rng.randrange(1, 30000)
                if os.pread(fds[name], size, off) != blob[off:off + size]:
                    errors.append(f"{name} [{off}, +{size})")
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = m.stats()
    assert stats["read_errors"] == 0 and stats["shared"]["source_cache"]["evictions"] > 0


def test_units_from_an_earlier_mounts_disk_cache_keep_the_manifest_replayable(
        tmp_path: Path, fam: Family) -> None:
    """A second sweep mount over the same cache dir serves units it neither read nor merged:
    they are not recorded as shared outputs (replay failed on them: review finding)."""
    from mergefs.core.cache import UnitCache
    from mergefs.engine.manifest import ManifestWriter
    from mergefs.engine.replay import replay
    from mergefs.mount.session import MountSession
    from mergefs.mount.view import View

    spec = sweep_spec(tmp_path / "sweep.yaml", fam, {"budget": ["20%", "60%", "full"]})

    def run(manifest: Path) -> dict[str, Any]:
        sw = MountSession(spec, load_variants(spec), ManifestWriter(manifest), sweep=True,
                          source_cache_bytes=64 << 20)
        view = View(sw, UnitCache(8 << 20, tmp_path / "ucache", sw.cache_namespace))
        try:
            for name in sw.variants:
                view.read_path(f"{name}/model.safetensors")
            return view.stats()
        finally:
            view.close()
            sw.finish()
            sw.close()

    first = run(tmp_path / "m1.jsonl")
    assert first["shared"]["units_merged"] > 0
    second = run(tmp_path / "m2.jsonl")
    assert second["shared"]["units_merged"] == 0  # everything came from the disk cache
    assert sum(v["units_from_disk_cache"] for v in second["variants"].values()) > 0
    assert second["shared"]["units_shared"] == 0
    from mergefs.core.errors import ManifestError

    replay(tmp_path / "m1.jsonl")
    with pytest.raises(ManifestError, match="no variant of the sweep was read; nothing to "
                                            "verify"):  # as a plain mount's manifest
        replay(tmp_path / "m2.jsonl")


def test_a_source_restored_after_a_change_is_served_again(tmp_path: Path, fam: Family) -> None:
    """A changed expert block fails the read (never wrong bytes); once the file holds its
    indexed bytes again, every variant serves it again: the shared source blocks do not keep
    the changed bytes (review finding: EIO until evicted)."""
    import shutil

    from mergefs.core.cache import UnitCache
    from mergefs.core.errors import SourceChanged
    from mergefs.engine.manifest import ManifestWriter
    from mergefs.mount.session import MountSession
    from mergefs.mount.view import View

    local = tmp_path / "fam"
    shutil.copytree(fam.root, local)
    fam2 = Family(local / "base", [local / e.name for e in fam.experts], local, fam.dtype,
                  fam.tensor_names)
    spec = sweep_spec(tmp_path / "sweep.yaml", fam2, {"weight": [0.3, 0.7]})
    weights = fam2.experts[0] / "model.safetensors"
    original = weights.read_bytes()
    st = weights.stat()
    sw = MountSession(spec, load_variants(spec), ManifestWriter(tmp_path / "m.jsonl"),
                      sweep=True, source_cache_bytes=64 << 20)
    view = View(sw, UnitCache(0, None, None))  # no merged-unit cache: every read merges
    try:
        names = list(sw.variants)
        import json

        n = int.from_bytes(original[:8], "little")
        lm_head = json.loads(original[8:8 + n])["lm_head.weight"]["data_offsets"]
        changed = bytearray(original)
        changed[8 + n + (lm_head[0] + lm_head[1]) // 2] ^= 0xFF  # inside lm_head's data
        weights.write_bytes(bytes(changed))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        for n in names:
            with pytest.raises(SourceChanged):
                view.read_path(f"{n}/model.safetensors")
        weights.write_bytes(original)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        got = {n: view.read_path(f"{n}/model.safetensors") for n in names}
    finally:
        view.close()
        sw.finish()
        sw.close()
    for n in names:
        merge_variant(spec, n, tmp_path / f"out-{n}")
        assert got[n] == (tmp_path / f"out-{n}" / "model.safetensors").read_bytes()


def test_replay_of_a_sweep_refuses_altered_records(tmp_path: Path, fam: Family) -> None:
    """A read two variants both recorded, altered in one; a variant's records deleted: replay
    fails for both (review finding: the last record of a range won, deletions went unseen)."""
    import json

    from mergefs.core.cache import UnitCache
    from mergefs.core.errors import ManifestError
    from mergefs.engine.manifest import ManifestWriter
    from mergefs.engine.replay import replay
    from mergefs.mount.session import MountSession
    from mergefs.mount.view import View

    spec = sweep_spec(tmp_path / "sweep.yaml", fam, {"weight": [0.3, 0.7]})
    manifest = tmp_path / "m.jsonl"
    sw = MountSession(spec, load_variants(spec), ManifestWriter(manifest), sweep=True,
                      source_cache_bytes=0)  # no source cache: both variants read
    view = View(sw, UnitCache(0, None, None))
    try:
        for name in sw.variants:
            view.read_path(f"{name}/model.safetensors")
    finally:
        view.close()
        sw.finish()
        sw.close()
    replay(manifest)
    recs = [json.loads(line) for line in manifest.read_text().splitlines()]
    by_range: dict[tuple[Any, ...], list[int]] = {}
    for i, r in enumerate(recs):
        if r.get("type") == "read":
            by_range.setdefault((r["source"], r["file"], r["start"], r["end"]), []).append(i)
    twice = next(v for v in by_range.values() if len(v) > 1)
    altered = [dict(r) for r in recs]
    altered[twice[-1]]["xxh3"] = "0" * 16
    bad = tmp_path / "altered.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in altered))
    with pytest.raises(ManifestError, match="recorded twice with different hashes"):
        replay(bad)
    gone = recs[-1]["variants"][-1] if recs[-1].get("type") == "totals" else None
    assert gone is not None
    kept = [r for r in recs if r.get("variant") != gone or r.get("kind") == "sweep"]
    bad.write_text("".join(json.dumps(r) + "\n" for r in kept))
    with pytest.raises(ManifestError, match=f"no records of: {gone}"):
        replay(bad)
