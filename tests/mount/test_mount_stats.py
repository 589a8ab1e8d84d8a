"""Issue 28 (C), item 9: ``mergefs stats`` counts the weight bytes readers received.

Pages the mount pushes into the kernel's page cache (units merged ahead of a reader, or by
``--warm``) are read without a FUSE request, so counting FUSE reads alone reported less than a
``cat`` of the file had read (84.6 MB of 90.9 MB). ``served_bytes.weights`` now counts both, each
also on its own: ``weights_fuse_reads`` + ``weights_pushed``. Real mounts, always unmounted.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from families import Family, make_family, write_spec
from mounting import MOUNT_MARKS, merge, run_cli
pytestmark = MOUNT_MARKS

SHAPES = {  # float32, about 6 MiB per model: several readahead windows and merge units
    "model.embed_tokens.weight": (2048, 256),
    "model.layers.0.mlp.up_proj.weight": (1024, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 1024),
    "model.norm.weight": (256,),
    "lm_head.weight": (2048, 256),
}


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("served_family"), n_experts=2, seed=9,
                       shapes=SHAPES, zero_tensors=())


def spec_for(tmp_path: Path, fam: Family) -> Path:
    return write_spec(tmp_path / "spec.yaml", fam, "task_arithmetic", weights=[0.6, 0.4],
                      extra={"block_size": 64 << 10, "index_dir": str(tmp_path / "idx"),
                             "budget": "full"})


def wait_warm(m: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while True:
        warm = m.stats()["kernel_pages"]["warm"]
        if warm["seconds"] is not None and not warm["running"]:
            assert warm["errors"] == 0 and warm["units"] > 0, warm
            return
        assert time.monotonic() < deadline, warm
        time.sleep(0.05)


def cat(path: Path) -> bytes:
    return subprocess.run(["cat", str(path)], capture_output=True, check=True).stdout


def check_served(m: Any, size_bytes: int) -> dict[str, Any]:
    """Every counter of served weight bytes, after one ``cat`` of the only weight file."""
    stats = m.stats()
    served = stats["served_bytes"]
    pushed = stats["kernel_pages"]["stored_bytes"]
    assert served["weights_pushed"] == pushed
    assert served["weights"] == served["weights_fuse_reads"] + pushed
    # what the reader received is in these counters: each byte reached it through a FUSE read
    # or a pushed page (a page can come both ways when a push races a read of it: at most one
    # unit's pages over)
    assert served["weights"] >= size_bytes, served
    assert stats["read_errors"] == 0
    return stats


def test_cat_of_a_warmed_mount_is_all_served(tmp_path: Path, fam: Family, mounts: Any) -> None:
    spec = spec_for(tmp_path, fam)
    out = merge(spec, tmp_path / "out")
    want = (out / "model.safetensors").read_bytes()
    m = mounts.start(spec, "--warm")
    wait_warm(m)
    assert m.stats()["served_bytes"]["weights_fuse_reads"] == 0  # nobody read yet
    assert cat(m.path / "model.safetensors") == want
    stats = check_served(m, len(want))
    # the warm-up pushed (nearly) everything: the cat was served by pushed pages
    assert stats["served_bytes"]["weights_pushed"] > len(want) // 2
    # each push hands over one unit's bytes widened to whole pages: at most two pages more
    pushes = stats["kernel_pages"]["store_calls"]
    assert stats["served_bytes"]["weights"] <= len(want) + 2 * 4096 * pushes
    # `mergefs stats` says what the figure is made of
    res = run_cli("stats", str(m.path))
    assert res.returncode == 0, res.stderr
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip()
            for ln in res.stdout.splitlines() if ln.count("│") == 3}
    assert rows["by FUSE reads"] and rows["by pages pushed into the page cache"], res.stdout
    assert rows["weight bytes served"].endswith("(weight files: 6.00 MiB)"), res.stdout
    res = run_cli("stats", str(m.path), "--json")
    assert json.loads(res.stdout)["served_bytes"]["weights"] >= len(want)


def test_cat_of_a_mount_counts_pushed_pages(tmp_path: Path, fam: Family, mounts: Any) -> None:
    """The issue's case: a cat of a fresh mount, the units merged ahead of it pushed."""
    spec = spec_for(tmp_path, fam)
    out = merge(spec, tmp_path / "out")
    want = (out / "model.safetensors").read_bytes()
    m = mounts.start(spec)
    assert cat(m.path / "model.safetensors") == want
    stats = check_served(m, len(want))
    assert stats["served_bytes"]["weights_fuse_reads"] <= len(want)  # each page read once
