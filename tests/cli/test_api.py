"""The Python API (docs/api.md): open, index, plan, merge, mount, replay."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from families import Family, make_family, write_spec
from reference import read_tensor, reference_merge_dir

import mergefs
from mergefs.core.errors import MergefsError


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("api_family"), n_experts=2, seed=33)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_open_plan_merge_replay(tmp_path: Path, fam: Family) -> None:
    spec_path = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.8, -0.3],
                           extra={"block_size": 1024, "index_dir": str(tmp_path / "idx")})
    m = mergefs.open(spec_path)
    assert m.spec.method == "task_arithmetic"
    index = m.index()
    assert index.norms.shape[0] == 2
    full, tenth = m.plan("full"), m.plan("10%")
    assert full.planned_bytes == full.nonzero_expert_bytes
    assert 0 < tenth.planned_bytes <= tenth.budget_bytes == full.total_expert_bytes // 10
    assert tenth.report()["bound_tight"] > 0 == full.report()["bound_tight"]
    with pytest.raises(MergefsError, match="ambiguous"):
        m.plan("10")

    res = m.merge(tmp_path / "out")
    assert res.manifest.is_file() and res.totals["expert_bytes_read"] == full.planned_bytes
    for name, want in reference_merge_dir(spec_path).items():
        assert read_tensor(res.outdir, name).tobytes() == want.tobytes(), name
    assert mergefs.replay(res.manifest).outputs_verified > 0
    # the API keeps the CLI's safety rules
    with pytest.raises(MergefsError, match="source"):
        m.merge(fam.base, force=True)
    with pytest.raises(MergefsError, match="not empty"):
        m.merge(tmp_path / "out")
    again = m.merge(tmp_path / "out", budget="10%", force=True)
    assert again.manifest != res.manifest and res.manifest.is_file()
    assert again.totals["expert_bytes_read"] == tenth.planned_bytes


def test_open_a_dict_spec(tmp_path: Path, fam: Family) -> None:
    m = mergefs.open({"merge_method": "linear", "base_model": str(fam.base),
                      "models": [{"model": str(e), "parameters": {"weight": 1.0}}
                                 for e in fam.experts],
                      "index_dir": str(tmp_path / "idx"), "block_size": 1024}, base_dir=tmp_path)
    assert m.plan().planned_bytes > 0


@pytest.mark.mount
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_mount_equals_merge(tmp_path: Path, fam: Family) -> None:
    spec_path = write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic",
                           extra={"block_size": 1024, "index_dir": str(tmp_path / "idx")})
    m = mergefs.open(spec_path)
    out = m.merge(tmp_path / "out", budget="40%").outdir
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with m.mount(mnt, budget="40%", cache_size="1MiB") as mounted:
        assert sha(mnt / "model.safetensors") == sha(out / "model.safetensors")
        assert mounted.stats()["budget_bytes"] == m.plan("40%").budget_bytes
    assert not os.path.ismount(mnt)
