"""Bad input through the real command line (``.venv/bin/mergefs`` in a subprocess): one line on
stderr naming the file (or option) and the problem, exit status 1, no traceback.

The in-process rules are tested where they live (test_format, test_checkpoint, test_spec); this
table checks that each kind of bad input also reaches the user as one clear line. Cases already
run through the real CLI in test_cli.py (unknown/unsupported spec keys, a pickle base directory,
a missing base, a missing manifest) are not repeated.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from families import Family, make_family, write_spec
from safetensors.numpy import load_file, save_file
from cli_checks import assert_one_line_error, mergefs_argv

from mergefs.core.format import HEADER_SIZE_CAP

BLOCK = 1024


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("bad_input_family"), n_experts=2, seed=33)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("bad_input_sharded"), n_experts=1, seed=34,
                       sharded=True)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*mergefs_argv(), *args], capture_output=True, text=True, timeout=60,
                          check=False)


@dataclass
class Ctx:
    """What a case may use: a scratch directory and the two families (never modify those)."""

    tmp: Path
    fam: Family
    sharded: Family

    def expert_copy(self, k: int = 1, fam: Family | None = None) -> Path:
        src = (fam or self.fam).experts[k]
        dst = self.tmp / f"copy-{src.name}"
        shutil.copytree(src, dst)
        return dst

    def spec(self, *, experts: list[Path] | None = None, base: Path | None = None,
             fam: Family | None = None, doc_edit: Callable[[dict[str, Any]], None] | None = None,
             **extra: Any) -> Path:
        f = fam or self.fam
        if experts is not None or base is not None:
            f = Family(base or f.base, experts or f.experts, f.root, f.dtype, f.tensor_names)
        path = write_spec(self.tmp / "spec.yaml", f, "task_arithmetic",
                          extra={"block_size": BLOCK, "index_dir": str(self.tmp / "idx"),
                                 **extra})
        if doc_edit is not None:
            doc = yaml.safe_load(path.read_text())
            doc_edit(doc)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path


def _rewrite_safetensors(model: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> Path:
    path = model / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


# Each case: build bad input under ctx.tmp, return (argv, needles that the one line must hold).
Case = Callable[[Ctx], tuple[list[str], list[str]]]


def truncated_data(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path), "data buffer"]


def truncated_header(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    path.write_bytes(path.read_bytes()[:8 + n // 2])
    return ["plan", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path),
                                                                       "past the end"]


def empty_file(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    path.write_bytes(b"")
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path), "8-byte"]


def garbage_header(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    blob = bytearray(path.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    blob[8:8 + n] = bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8))
    blob[8] = ord("{")
    path.write_bytes(bytes(blob))
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path), "header"]


def header_not_json(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    body = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]' + b" " * 8  # no '}'
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 4)
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path), "JSON"]


def header_100gb(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 100 * 10**9) + b"{}" + b" " * 6)
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [
        str(path), f"{HEADER_SIZE_CAP}-byte cap"]


def pickle_named_safetensors(c: Ctx) -> tuple[list[str], list[str]]:
    """A pickle renamed to .safetensors is read as safetensors (and refused), never unpickled."""
    expert = c.expert_copy()
    path = expert / "model.safetensors"
    path.write_bytes(b"\x80\x04\x95" + b"\x00" * 64 + b"cos\nsystem\n.")
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [str(path), "header"]


def pickle_bare_expert(c: Ctx) -> tuple[list[str], list[str]]:
    path = c.tmp / "expert.bin"
    path.write_bytes(b"\x80\x02}q\x00.")
    return ["plan", str(c.spec(experts=[c.fam.experts[0], path]))], [str(path), "pickle"]


def pickle_expert_dir(c: Ctx) -> tuple[list[str], list[str]]:
    d = c.tmp / "torch-expert"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    return ["merge", str(c.spec(experts=[c.fam.experts[0], d])), str(c.tmp / "out")], [
        str(d / "pytorch_model.bin"), "pickle"]


def no_weights(c: Ctx) -> tuple[list[str], list[str]]:
    d = c.tmp / "empty-expert"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return ["index", str(c.spec(experts=[c.fam.experts[0], d]))], [str(d), "no model.safetensors"]


def shard_index_missing_file(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy(0, c.sharded)
    idx = expert / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    name = min(doc["weight_map"])
    doc["weight_map"][name] = "model-00009-of-00009.safetensors"
    idx.write_text(json.dumps(doc))
    return ["index", str(c.spec(fam=c.sharded, experts=[expert]))], [
        str(idx), "model-00009-of-00009.safetensors", "does not exist"]


def shard_index_missing_tensor(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy(0, c.sharded)
    idx = expert / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["ghost.weight"] = min(doc["weight_map"].values())
    idx.write_text(json.dumps(doc))
    return ["plan", str(c.spec(fam=c.sharded, experts=[expert]))], [str(idx), "'ghost.weight'"]


def expert_renamed_tensor(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    _rewrite_safetensors(expert, lambda t: t.update({"model.renamed.weight":
                                                     t.pop("model.norm.weight")}))
    return ["plan", str(c.spec(experts=[c.fam.experts[0], expert]))], [
        str(expert), "coordinate system", "model.renamed.weight: not in base",
        "model.norm.weight: missing"]


def expert_other_shape(c: Ctx) -> tuple[list[str], list[str]]:
    expert = c.expert_copy()
    _rewrite_safetensors(expert, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-2]}))
    return ["merge", str(c.spec(experts=[c.fam.experts[0], expert])), str(c.tmp / "out")], [
        str(expert), "lm_head.weight", "[254, 48] vs base", "[256, 48]"]


def expert_other_dtype(c: Ctx) -> tuple[list[str], list[str]]:
    # Floating dtypes may differ (promoted for compute); a non-floating tensor's may not.
    expert = c.expert_copy()
    _rewrite_safetensors(expert, lambda t: t.update(
        {"buffers.position_ids": t["buffers.position_ids"].astype(np.int32)}))
    return ["index", str(c.spec(experts=[c.fam.experts[0], expert]))], [
        str(expert), "buffers.position_ids: I32[", "vs base I64["]


def unknown_method(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(doc_edit=lambda d: d.update(merge_method="frankenmerge"))
    return ["plan", str(spec)], [str(spec), "merge_method", "'frankenmerge' is not supported"]


def unknown_global_parameter(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(doc_edit=lambda d: d.update(parameters={"epsilon": 0.1}))
    return ["--strict", "merge", str(spec), str(c.tmp / "out")], [
        str(spec), "parameters.epsilon", "has no parameter 'epsilon'", "strict"]


def unknown_model_parameter(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(doc_edit=lambda d: d["models"][1]["parameters"].update(gamma=0.5))
    return ["--strict", "plan", str(spec)], [str(spec), "models[1].parameters.gamma",
                                             "has no parameter 'gamma'"]


def parameter_out_of_range(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(doc_edit=lambda d: d.update(merge_method="ties", parameters={"density": 7}))
    return ["plan", str(spec)], [str(spec), "parameters.density", "must be <= 1.0"]


def spec_budget_nan(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(budget="nan")
    return ["plan", str(spec)], [str(spec), "budget", "'nan'"]


def spec_not_yaml(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.tmp / "broken.yaml"
    spec.write_text("merge_method: [linear\nmodels: {\n")
    return ["plan", str(spec)], [str(spec), "not valid YAML"]


def spec_missing(c: Ctx) -> tuple[list[str], list[str]]:
    return ["merge", str(c.tmp / "nope.yaml"), str(c.tmp / "out")], [
        str(c.tmp / "nope.yaml"), "cannot read spec"]


def bad_block_size(c: Ctx) -> tuple[list[str], list[str]]:
    spec = c.spec(doc_edit=lambda d: d.update(block_size="-4KiB"))
    return ["index", str(spec)], [str(spec), "block_size"]


def cache_size(value: str) -> Case:
    def case(c: Ctx) -> tuple[list[str], list[str]]:
        mnt = c.tmp / "mnt"
        mnt.mkdir()
        return ["mount", str(c.spec()), str(mnt), "--cache-size", value], ["--cache-size",
                                                                          repr(value)]
    return case


def budget_flag(value: str) -> Case:
    def case(c: Ctx) -> tuple[list[str], list[str]]:
        # --budget=VALUE: argparse would take "-10%" after a space for an option
        return ["plan", str(c.spec()), f"--budget={value}"], ["--budget", repr(value)]
    return case


def merge_budget_flag(value: str) -> Case:
    def case(c: Ctx) -> tuple[list[str], list[str]]:
        return ["merge", str(c.spec()), str(c.tmp / "out"), "--budget", value], ["--budget"]
    return case


def mountpoint_missing(c: Ctx) -> tuple[list[str], list[str]]:
    mnt = c.tmp / "no-such-dir"
    return ["mount", str(c.spec()), str(mnt)], [str(mnt), "does not exist"]


def mountpoint_not_empty(c: Ctx) -> tuple[list[str], list[str]]:
    mnt = c.tmp / "busy"
    mnt.mkdir()
    (mnt / "keep.txt").write_text("x")
    return ["mount", str(c.spec()), str(mnt)], [str(mnt), "not empty"]


def mountpoint_is_a_file(c: Ctx) -> tuple[list[str], list[str]]:
    mnt = c.tmp / "file"
    mnt.write_text("x")
    return ["mount", str(c.spec()), str(mnt)], [str(mnt), "not a directory"]


CASES: dict[str, Case] = {
    "truncated data": truncated_data,
    "truncated header": truncated_header,
    "empty weights file": empty_file,
    "garbage header bytes": garbage_header,
    "header not JSON": header_not_json,
    "header declares 100 GB": header_100gb,
    "pickle named .safetensors": pickle_named_safetensors,
    "pickle file as expert": pickle_bare_expert,
    "pickle directory as expert": pickle_expert_dir,
    "expert without weights": no_weights,
    "shard index names a missing file": shard_index_missing_file,
    "shard index names a missing tensor": shard_index_missing_tensor,
    "expert with other tensor names": expert_renamed_tensor,
    "expert with another shape": expert_other_shape,
    "expert with another dtype": expert_other_dtype,
    "unknown method": unknown_method,
    "unknown global parameter": unknown_global_parameter,
    "unknown model parameter": unknown_model_parameter,
    "parameter out of range": parameter_out_of_range,
    "spec budget nan": spec_budget_nan,
    "spec not YAML": spec_not_yaml,
    "spec missing": spec_missing,
    "negative block_size": bad_block_size,
    "--budget -1": merge_budget_flag("-1"),
    "--budget -0.5": merge_budget_flag("-0.5"),
    "--budget=-10%": budget_flag("-10%"),
    "--budget=-2GiB": budget_flag("-2GiB"),
    "--budget 150%": budget_flag("150%"),
    "--budget 1.5": lambda c: (["plan", str(c.spec()), "--budget", "1.5"],
                               ["--budget", "1.5 is ambiguous", "1.5%"]),
    "--budget 10": lambda c: (["plan", str(c.spec()), "--budget", "10"],
                              ["--budget", "10 is ambiguous", "10%", "10B"]),
    "--budget lots": budget_flag("lots"),
    "--budget nan": budget_flag("nan"),
    "--budget inf": budget_flag("inf"),
    "--budget infinity": budget_flag("Infinity"),
    "--budget empty": budget_flag(" "),
    "--cache-size -5": cache_size("-5"),
    "--cache-size lots": cache_size("lots"),
    "mountpoint missing": mountpoint_missing,
    "mountpoint not empty": mountpoint_not_empty,
    "mountpoint is a file": mountpoint_is_a_file,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(case: str, tmp_path: Path, fam: Family,
                                     sharded: Family) -> None:
    argv, needles = CASES[case](Ctx(tmp_path, fam, sharded))
    assert_one_line_error(run(*argv), *needles)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_mountpoint_already_mounted_is_one_clear_line(tmp_path: Path, fam: Family) -> None:
    ctx = Ctx(tmp_path, fam, fam)
    spec = ctx.spec()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    first = run("mount", str(spec), str(mnt))  # daemon: returns once the mount answers
    try:
        assert first.returncode == 0, first.stderr
        assert_one_line_error(run("mount", str(spec), str(mnt)), str(mnt), "already mounted",
                              "mergefs umount")
    finally:
        assert run("umount", str(mnt)).returncode == 0
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
