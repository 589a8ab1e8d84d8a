"""The first hour with mergefs (issue 28): what a new user runs into before a merge works.

A weights file passed as a spec or manifest, typos in top-level spec keys, the plan's words for
methods without a bound, tables cut in pipes, an output directory that --force cannot replace,
a spec passed to replay, a byte budget above every expert byte, --strict where it means nothing,
and the README's first page. Each through the real command line where the user meets it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from families import DEFAULT_SHAPES, Family, make_family, make_llama_family, write_spec
from cli_checks import assert_one_line_error, mergefs_argv

import mergefs
from mergefs.cli.render import bound_in_words
from mergefs.core.errors import MergefsError, SpecError
from mergefs.recipe.family import open_family
from mergefs.spec.load import load_spec
from mergefs.spec.variants import load_variants

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 1024
#: longer than an 80-column table leaves for a name
LONG_TENSOR = "model.layers.0.self_attn.a_projection_whose_name_is_longer_than_a_table_cell.weight"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess, stdout and stderr piped (not a terminal)."""
    return subprocess.run([*mergefs_argv(), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("first_hour_family"), n_experts=2, seed=28)


def spec_file(tmp_path: Path, fam: Family, name: str = "spec.yaml", method: str =
              "task_arithmetic", **extra: Any) -> Path:
    params = {"lambda": 0.9} if method == "task_arithmetic" else {"density": 0.5}
    return write_spec(tmp_path / name, fam, method, weights=[0.7, -0.2], parameters=params,
                      extra={"block_size": BLOCK, "index_dir": str(tmp_path / "idx"), **extra})


def edited(path: Path, name: str, edit: Any) -> Path:
    """A copy of spec ``path`` named ``name`` with ``edit(doc)`` applied."""
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    out = path.with_name(name)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


# -- (2) a weights file given as the spec or the manifest ----------------------------------------

SPEC_COMMANDS = {
    "plan": lambda w, tmp: ["plan", w],
    "index": lambda w, tmp: ["index", w],
    "sweep": lambda w, tmp: ["sweep", w],
    "merge": lambda w, tmp: ["merge", w, str(tmp / "out")],
    "mount": lambda w, tmp: ["mount", w, str(tmp / "mnt")],
}


@pytest.mark.parametrize("command", list(SPEC_COMMANDS))
def test_weights_file_as_spec_is_one_line(command: str, tmp_path: Path, fam: Family) -> None:
    weights = str(fam.base / "model.safetensors")
    line = assert_one_line_error(run(*SPEC_COMMANDS[command](weights, tmp_path)),
                                 f"{weights}: not a YAML spec", "not UTF-8 text",
                                 "weights file")
    assert "Unicode" not in line
    assert not (tmp_path / "out").exists()


def test_weights_file_as_manifest_is_one_line(fam: Family) -> None:
    weights = str(fam.base / "model.safetensors")
    assert_one_line_error(run("replay", weights), f"{weights}: not a mergefs manifest",
                          "not UTF-8 text", "weights file")


def test_weights_file_through_the_api_is_a_mergefs_error(fam: Family) -> None:
    weights = fam.base / "model.safetensors"
    with pytest.raises(SpecError, match=r"^" + re.escape(f"{weights}: not a YAML spec")):
        mergefs.open(weights)
    with pytest.raises(SpecError, match="not UTF-8 text"):
        load_variants(weights)  # what a sweep mount's reload reads
    with pytest.raises(MergefsError, match=re.escape(f"{weights}: not a mergefs manifest")):
        mergefs.replay(weights)


# -- (3) typos in top-level keys -----------------------------------------------------------------


@pytest.mark.parametrize("typo,meant", [("budgt", "budget"), ("merge_methd", "merge_method"),
                                        ("base_modle", "base_model"), ("blocksize", "block_size"),
                                        ("model", "models"), ("sweeps", "sweep")])
def test_top_level_key_typo_is_an_error_naming_the_key(typo: str, meant: str, tmp_path: Path,
                                                        fam: Family) -> None:
    def rename(doc: dict[str, Any]) -> None:
        if meant in doc:
            doc[typo] = doc.pop(meant)
        else:
            doc[typo] = {"budgt": "10%", "sweeps": {"budget": ["10%"]}}.get(typo, "10%")

    spec = edited(spec_file(tmp_path, fam), f"{typo}.yaml", rename)
    for strict in (False, True):
        with pytest.raises(SpecError) as exc:
            load_spec(spec, strict=strict)
        assert str(exc.value) == f"{spec}: {typo}: unknown key; did you mean `{meant}`?"


def test_budget_typo_stops_the_merge(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam, budgt="10%")
    assert_one_line_error(run("merge", str(spec), str(tmp_path / "out")),
                          "budgt: unknown key; did you mean `budget`?")
    assert not (tmp_path / "out").exists()


def test_unknown_key_not_close_to_a_known_one_stays_a_warning(tmp_path: Path,
                                                              fam: Family) -> None:
    spec = spec_file(tmp_path, fam, my_notes="first try")
    proc = run("plan", str(spec))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("my_notes: ignored") == 1
    assert_one_line_error(run("plan", "--strict", str(spec)), "my_notes")


@pytest.mark.parametrize("given,missing,method", [("method", "merge_method", None),
                                                  ("base", "base_model", "ties")])
def test_missing_required_key_names_the_unknown_key_given(given: str, missing: str,
                                                          method: str | None, tmp_path: Path,
                                                          fam: Family) -> None:
    def rename(doc: dict[str, Any]) -> None:
        if method is not None:
            doc["merge_method"] = method
            doc["parameters"] = {"density": 0.5}
        doc[given] = doc.pop(missing)

    spec = edited(spec_file(tmp_path, fam), f"{given}.yaml", rename)
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    msg = str(exc.value)
    assert msg.startswith(f"{spec}: {missing}: required"), msg
    assert f"did you mean `{missing}` instead of `{given}`?" in msg, msg


@pytest.mark.parametrize("key,meant", [("budgt", "budget"), ("weigth", "weight"),
                                       ("parameter.lambda", "parameters.lambda")])
def test_sweep_key_typo_is_an_error(key: str, meant: str, tmp_path: Path, fam: Family) -> None:
    spec = edited(spec_file(tmp_path, fam), "sweep.yaml",
                  lambda d: d.update(sweep={key: [0.5, 0.7] if key != "budgt" else
                                            ["10%", "full"]}))
    with pytest.raises(SpecError, match=re.escape(f"unknown key; did you mean `{meant}`?")):
        load_variants(spec)


# -- (4) the plan's words for a method without a bound ------------------------------------------


def test_plan_without_a_bound_promises_no_measurement(tmp_path: Path, fam: Family) -> None:
    rep = {"bound_tight": None, "error_exact": None, "update_norm": None,
           "planned_expert_bytes": 10, "nonzero_expert_bytes": 100}
    words = " ".join(bound_in_words("ties", rep))
    assert "reports the measured deviation" not in words
    assert "no error bound" in words and "exact at the full budget" in words
    assert "--budget full" in words and "compare" in words  # how to measure it yourself
    proc = run("plan", str(spec_file(tmp_path, fam, method="ties")), "--budget", "30%")
    assert proc.returncode == 0, proc.stderr
    assert "reports the measured deviation" not in proc.stdout
    assert "does not measure" in " ".join(proc.stdout.split())


# -- (6) tables in a pipe keep every name whole ---------------------------------------------------


def test_tables_keep_whole_names_when_piped(tmp_path_factory: pytest.TempPathFactory) -> None:
    shapes = {**DEFAULT_SHAPES, LONG_TENSOR: (48, 48)}
    fam = make_family(tmp_path_factory.mktemp("long_names"), n_experts=2, seed=6,
                      shapes=shapes)
    tmp = tmp_path_factory.mktemp("long_names_spec")
    spec = str(spec_file(tmp, fam))
    for argv in (["index", spec, "--tensors", "20"], ["plan", spec, "--tensors", "20"]):
        proc = run(*argv)
        assert proc.returncode == 0, proc.stderr
        assert LONG_TENSOR in proc.stdout, (argv, proc.stdout)
        assert "…" not in proc.stdout, (argv, proc.stdout)
    proc = run("sweep", spec, "--budgets", "10%,full", "--methods", "task_arithmetic,linear",
               "--grid", "models.0.parameters.weight=0.25,0.5")
    assert proc.returncode == 0, proc.stderr
    assert "task_arithmetic models.0.weight=0.25" in proc.stdout, proc.stdout
    assert "…" not in proc.stdout, proc.stdout


# -- (7) an output directory that is not empty ----------------------------------------------------


def test_outdir_not_empty_suggests_only_what_works(tmp_path: Path, fam: Family) -> None:
    spec = str(spec_file(tmp_path, fam))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    line = assert_one_line_error(run("merge", spec, str(mine)), str(mine), "not empty",
                                 "not written by mergefs")
    assert "use --force" not in line  # --force would be refused for this folder
    line = assert_one_line_error(run("merge", spec, str(mine), "--force"), "not written by mergefs")
    assert (mine / "notes.txt").read_text() == "keep"

    earlier = tmp_path / "earlier"
    assert run("merge", spec, str(earlier)).returncode == 0
    line = assert_one_line_error(run("merge", spec, str(earlier)), "not empty", "--force")
    assert run("merge", spec, str(earlier), "--force").returncode == 0  # as suggested


def test_unwritable_outdir_names_the_outdir_not_the_staging_name(tmp_path: Path,
                                                                 fam: Family) -> None:
    """A merge into a directory that cannot be created names that directory, never the hidden
    staging name beside it (``.out.mergefs-partial-<pid>``)."""
    spec = str(spec_file(tmp_path, fam))
    assert run("index", spec).returncode == 0  # its log line is not the error's
    line = assert_one_line_error(run("merge", spec, "/proc/out"), "/proc/out",
                                 "cannot write the merged model")
    assert "mergefs-partial" not in line


# -- (10) replay of a spec, a budget above everything, --strict and help ---------------------------


def test_replay_of_a_spec_names_its_manifest(tmp_path: Path, fam: Family) -> None:
    spec = spec_file(tmp_path, fam)
    line = assert_one_line_error(run("replay", str(spec)), str(spec), "merge spec, not a manifest",
                                 "spec.manifest.jsonl")
    assert "no header record" not in line


def test_budget_above_all_expert_bytes_says_so_once(tmp_path: Path, fam: Family) -> None:
    spec = str(spec_file(tmp_path, fam))
    for argv in (["plan", spec, "--budget", "2GB"], ["merge", spec, str(tmp_path / "out"),
                                                     "--budget", "2GB"]):
        proc = run(*argv)
        assert proc.returncode == 0, proc.stderr
        said = [ln for ln in proc.stderr.splitlines() if "more than all expert bytes" in ln]
        assert len(said) == 1, proc.stderr
        assert "budget 1.86 GiB" in said[0] and "reading everything" in said[0], said
    proc = run("plan", spec, "--budget", "10%")
    assert "more than all expert bytes" not in proc.stderr


@pytest.mark.mount
@pytest.mark.skipif(not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_mount_budget_above_all_expert_bytes_says_so(tmp_path: Path, fam: Family) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        proc = run("mount", str(spec_file(tmp_path, fam)), str(mnt), "--budget", "2GB")
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count("more than all expert bytes") == 1, proc.stderr
    finally:
        run("umount", str(mnt))
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


def test_strict_is_offered_only_where_a_spec_is_read() -> None:
    for command in ("index", "compress", "plan", "sweep", "merge", "mount"):
        proc = run(command, "--help")
        assert proc.returncode == 0 and "--strict" in proc.stdout, command
    for command in ("replay", "umount", "stats", "reload", "methods"):
        proc = run(command, "--help")
        assert proc.returncode == 0 and "--strict" not in proc.stdout, command
    proc = run("--strict", "methods")
    assert proc.returncode == 2 and "--strict" in proc.stderr  # a usage error, not ignored


def test_stats_help_has_a_description() -> None:
    proc = run("stats", "--help")
    assert proc.returncode == 0
    description = proc.stdout.split("\n\n")[1]
    assert not description.startswith(("positional", "options")), proc.stdout
    assert "stats.json" in description or "counters" in description, proc.stdout


# -- (11) the README's first page ------------------------------------------------------------------


def test_readme_first_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = text.split("\n## ", 1)[0]
    assert not re.search(r"\d+(\.\d+)?\s*(x|×|%|GiB|MiB|s)\b", intro), "figures in the intro"
    assert "arXiv 2605.29489" in text and "MergePipe" in text
    assert not re.search(r"\bissue \d+|#\d+\b", text, re.I)
    api = text.split("## Python API", 1)[1]
    assert "import mergefs" in api and "from transformers import" in api
    assert re.search(r"mountpoint must be an existing", text)
    assert "--warm" in text or "docs/cli.md" in text
    assert re.search(r"test suite takes about \d+ minutes", text)
    assert "(measured)" not in text  # no method's deviation is measured for you


# -- a model path that does not exist names the spec key that gives it --------------------------

def test_missing_model_path_names_the_spec_key(tmp_path: Path, fam: Family) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["models"][1]["model"] = "./no-such-expert"
    spec = edited(spec_file(tmp_path, fam), "missing.yaml", edit)
    line = assert_one_line_error(run("merge", str(spec), str(tmp_path / "out")),
                                 f"{spec}: models[1].model: ./no-such-expert: no such file or "
                                 "directory")
    assert str(tmp_path / "no-such-expert") in line
    assert not (tmp_path / "out").exists()


def test_missing_slice_model_names_the_slice_key(tmp_path: Path) -> None:
    fam = make_llama_family(tmp_path / "fam", n_experts=1, seed=3)
    doc = {"merge_method": "passthrough", "dtype": "float32",
           "slices": [{"sources": [{"model": str(fam.base), "layer_range": [0, 1]}]},
                      {"sources": [{"model": "../gone", "layer_range": [0, 1]}]}]}
    spec = tmp_path / "slices.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(SpecError, match=re.escape(
            f"{spec}: slices[1].sources[0].model: ../gone: no such file or directory")):
        open_family(load_spec(spec))
