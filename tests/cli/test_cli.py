"""The command line: help, one-line errors with exit status 1, plan table, merge and replay."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_family, write_spec
from reference import read_tensor, reference_merge_dir, tensor_names

from mergefs import cli
from mergefs.core.errors import SpecError
from cli_checks import assert_one_line_error, mergefs_argv

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("index", "plan", "merge", "replay", "mount", "umount", "stats")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*mergefs_argv(), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("cli_family"), n_experts=2, seed=21)


def spec_file(tmp_path: Path, fam: Family, name: str = "spec.yaml", **extra: Any) -> Path:
    return write_spec(tmp_path / name, fam, "task_arithmetic", weights=[0.7, -0.2],
                      parameters={"lambda": 0.9},
                      extra={"block_size": 1024, "index_dir": str(fam.root / "idx"), **extra})


# -- help and errors (real processes) -----------------------------------------------------------


def test_help_lists_every_command() -> None:
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for cmd in COMMANDS:
        assert f"\n    {cmd} " in proc.stdout, cmd
    assert "budget" in proc.stdout


def test_bad_spec_key_is_one_line(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam, slices=[{"sources": []}])
    assert_one_line_error(run("plan", str(spec)), str(spec), "slices")
    spec = spec_file(tmp_path, fam, name="typo.yaml", mystery="10%")
    # mergekit ignores unknown keys: a warning naming the key; --strict makes it an error
    assert_one_line_error(run("--strict", "merge", str(spec), str(tmp_path / "out")), "mystery")
    assert_one_line_error(run("merge", "--strict", str(spec), str(tmp_path / "out")), "mystery")
    assert not (tmp_path / "out").exists()
    proc = run("plan", str(spec))
    assert proc.returncode == 0 and "mystery: ignored" in proc.stderr


def test_pickle_checkpoint_dir_is_refused(tmp_path: Path, fam: Family) -> None:
    pickled = tmp_path / "torch-base"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle: never loaded
    shutil.copy(fam.base / "config.json", pickled / "config.json")
    doc = yaml.safe_load(spec_file(tmp_path, fam).read_text())
    doc["base_model"] = str(pickled)
    spec = tmp_path / "torch.yaml"
    spec.write_text(yaml.safe_dump(doc))
    line = assert_one_line_error(run("plan", str(spec)), str(pickled / "pytorch_model.bin"))
    assert "pickle" in line.split("pytorch_model.bin", 1)[1]  # says why, after the path


def test_missing_base_dir(tmp_path: Path, fam: Family) -> None:
    doc = yaml.safe_load(spec_file(tmp_path, fam).read_text())
    doc["base_model"] = "./no-such-base"
    spec = tmp_path / "missing.yaml"
    spec.write_text(yaml.safe_dump(doc))
    line = assert_one_line_error(run("index", str(spec)), "no-such-base")
    assert str((tmp_path / "no-such-base").resolve()) in line


def test_missing_manifest_for_replay(tmp_path: Path) -> None:
    assert_one_line_error(run("replay", str(tmp_path / "nope.jsonl")), "nope.jsonl")


# -- merge then replay, end to end (real processes) ---------------------------------------------


def test_merge_then_replay_end_to_end(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam, budget="40%")
    out = tmp_path / "merged"
    proc = run("merge", str(spec), str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "merged into" in proc.stdout and "Traceback" not in proc.stderr
    manifest = tmp_path / "spec.manifest.jsonl"  # default: beside the spec, named after it
    assert manifest.is_file() and manifest.is_symlink()  # points at this run's own manifest
    assert sorted(p.name for p in out.iterdir()) == [
        ".mergefs", "README.md", "config.json", "mergekit_config.yml", "model.safetensors",
        "tokenizer.json"]  # as mergekit-yaml writes it, with the model card
    assert json.loads((out / ".mergefs" / "merge.json").read_text())["manifest"] == \
        str(manifest.resolve())
    assert tensor_names(out) == tensor_names(fam.base)

    proc = run("replay", str(manifest))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("replay OK")

    again = tmp_path / "replayed"
    proc = run("replay", str(manifest), "--out", str(again))
    assert proc.returncode == 0, proc.stderr
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    # full budget through the CLI equals the reference merge
    full = tmp_path / "full"
    proc = run("merge", str(spec), str(full), "--budget", "full",
               "--manifest", str(tmp_path / "full.jsonl"))
    assert proc.returncode == 0, proc.stderr
    for name, want in reference_merge_dir(spec).items():
        assert read_tensor(full, name).tobytes() == want.tobytes(), name


# -- in-process ---------------------------------------------------------------------------------


def test_plan_prints_a_table(tmp_path: Path, fam: Family,
                             capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_file(tmp_path, fam, budget="25%")
    capsys.readouterr()
    assert cli.main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    for row in ("budget", "planned expert reads", "non-zero expert bytes", "all expert bytes",
                "expert blocks read / total", "tight bound", "loose bound", "exact",
                "merge update"):
        assert row in out, row
    assert cli.main(["plan", str(spec), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan_hash"][:16] in out
    assert f"{rep['blocks_read']} / {rep['blocks_total']}" in out
    # a non-additive method says it has no bound
    ties = write_spec(tmp_path / "ties.yaml", fam, "ties", extra={"block_size": 1024})
    assert cli.main(["plan", str(ties)]) == 0
    assert "not additive" in capsys.readouterr().out


def test_index_built_then_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own = make_family(tmp_path / "fam", n_experts=2, seed=3)
    spec = write_spec(tmp_path / "s.yaml", own, "linear", extra={"block_size": 2048})
    capsys.readouterr()
    assert cli.main(["index", str(spec)]) == 0
    assert capsys.readouterr().out.startswith("built index")
    assert cli.main(["index", str(spec)]) == 0
    assert capsys.readouterr().out.startswith("reused index")
    assert cli.main(["index", str(spec), "--rebuild"]) == 0
    assert capsys.readouterr().out.startswith("built index")
    assert (tmp_path / ".mergefs" / "index").is_dir()  # default index_dir beside the spec


def test_errors_in_process(tmp_path: Path, fam: Family,
                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_file(tmp_path, fam)
    capsys.readouterr()
    assert cli.main(["plan", str(spec), "--budget", "lots"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mergefs: error: --budget")

    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("keep")
    assert cli.main(["merge", str(spec), str(out), "--manifest", str(tmp_path / "m1.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0]
    # --force replaces only an earlier merge output, never a folder of the user's
    assert cli.main(["merge", str(spec), str(out), "--force",
                     "--manifest", str(tmp_path / "m2.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not written by mergefs" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["x"] and (out / "x").read_text() == "keep"
    prev = tmp_path / "prev"
    assert cli.main(["merge", str(spec), str(prev), "--manifest", str(tmp_path / "m3.jsonl")]) == 0
    (prev / "stale.safetensors").write_bytes(b"old")
    assert cli.main(["merge", str(spec), str(prev), "--force",
                     "--manifest", str(tmp_path / "m4.jsonl")]) == 0
    assert not (prev / "stale.safetensors").exists()  # replaced as a whole: nothing stale
    assert (prev / "model.safetensors").exists()

    with pytest.raises(SystemExit) as exc:  # usage errors: argparse, status 2
        cli.main(["merge", str(spec)])
    assert exc.value.code == 2
    capsys.readouterr()


def test_debug_shows_the_exception(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam, mystery=1, strict=True)
    with pytest.raises(SpecError):
        cli.main(["--debug", "plan", str(spec)])
    proc = run("--debug", "plan", str(spec))
    assert proc.returncode == 1 and "Traceback" in proc.stderr


# -- usability (issue 10) -------------------------------------------------------------------------


def test_version_debug_after_command_and_positional_help(tmp_path: Path, fam: Family) -> None:
    from mergefs.core.version import __version__

    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"mergefs {__version__}"
    # --debug after the subcommand: a traceback instead of the one-line error
    proc = run("plan", str(tmp_path / "missing.yaml"), "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    for cmd in COMMANDS:
        proc = run(cmd, "--help")
        assert proc.returncode == 0, cmd
        positional = proc.stdout.split("positional arguments:")[1].split("options:")[0]
        lines = [ln for ln in positional.splitlines() if ln.strip()]
        # every positional has a help text (on its own line or after the name)
        names = [ln.split()[0] for ln in lines if ln.startswith("  ") and not
                 ln.startswith("   ")]
        assert names, (cmd, proc.stdout)
        for name in names:
            line = next(ln for ln in lines if ln.split()[0] == name)
            assert len(line.split()) > 1 or lines.index(line) + 1 < len(lines), (cmd, name)


def test_plan_names_experts_and_lists_tensors(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam, budget="30%")
    proc = run("plan", str(spec), "--tensors", "3")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for e in fam.experts:
        assert f"reads of {e.name}" in text  # experts by name, never expert:0
    assert "expert:0" not in text
    assert "expert reads by tensor (top 3 of" in text
    assert "skipped" in text and "zero-delta" in text
    assert "of the merge update" in text  # the bound in words


def test_ray_flag_without_ray_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        family_f32: Family) -> None:
    from mergefs.engine.ray_merge import INSTALL_HINT

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({
        "merge_method": "linear", "base_model": str(family_f32.base),
        "models": [{"model": str(e), "parameters": {"weight": 0.5}}
                   for e in family_f32.experts[:2]], "index_dir": str(tmp_path / "idx")}))
    for argv in (["merge", str(spec), str(tmp_path / "out"), "--ray"],
                 ["index", str(spec), "--ray", "10.0.0.1:6379"]):
        assert cli.main(argv) == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"mergefs: error: {INSTALL_HINT}"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "idx").exists()
