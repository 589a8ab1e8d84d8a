"""`mergefs merge CONFIG OUT [flags]` as a drop-in for `mergekit-yaml CONFIG OUT [flags]`: a table
of mergekit-yaml 0.1.5 invocations run through both (mergekit in-process, mergefs through
``mergefs.cli.app.main``) on one tiny Llama family with real tokenizer files, comparing the
output directories: every tensor's bytes, the shard layout (files, which tensors in which
shard, the index), the set of files, the model card's front matter and mergekit_config.yml.
Then what only mergefs has to show: --random-seed, --out-shard-size base, replay of a
mergekit-layout merge, and mergekit-multi's -I/--lazy/--out-path."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")
pytest.importorskip("transformers")

from families import Family, make_llama_family
from mergekit.scripts.run_yaml import main as mergekit_yaml
from safetensors import safe_open

from mergefs.cli.app import main as mergefs_main
from mergefs.core.cache import UnitCache
from mergefs.engine.layout import OutputOptions
from mergefs.engine.session import Session
from mergefs.mount.session import MountSession
from mergefs.mount.view import ROOT_INODE, View
from mergefs.spec.load import load_spec

def config(fam: Family) -> dict[str, Any]:
    """The merge, models by absolute path (mergekit's card asks the Hub about relative ones)."""
    return {"merge_method": "task_arithmetic", "base_model": str(fam.base),
            "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.6}},
                       {"model": str(fam.experts[1]), "parameters": {"weight": -0.3}}],
            "dtype": "float32"}
#: a file of the base that mergekit does not copy and mergefs keeps ("nothing lost")
OTHER_FILE = "notes.txt"
GPU = ("--cuda", "--read-to-gpu", "--multi-gpu", "--gpu-rich", "--low-cpu-memory")

#: mergekit-yaml invocations: (flags, flags mergekit runs with, or None for the same). GPU flags
#: cannot run mergekit on this CPU-only machine: it runs without them (what mergefs does
#: instead); nor -j in-process more than once (torch sets its interop threads only once): it
#: runs without it (threads change no byte)
CASES: list[tuple[list[str], list[str] | None]] = [
    ([], None),
    (["--out-shard-size", "100K"], None),
    (["--out-shard-size", "1M"], None),
    (["--out-shard-size", "150000"], None),
    (["--out-shard-size", "-5K"], None),  # mergekit: no shard limit, one file
    (["--out-shard-size", "0"], None),
    (["--unsafe-truncate-embeddings"], None),  # equal vocabularies: nothing to truncate
    (["--no-copy-tokenizer"], None),
    (["--copy-tokenizer"], None),
    (["--no-write-model-card"], None),
    (["--write-model-card"], None),
    (["--random-seed", "7"], None),
    (["--allow-crimes"], None),
    (["--trust-remote-code"], None),
    (["--lora-merge-cache", "LORA_CACHE"], None),
    (["--lora-merge-dtype", "bfloat16"], None),
    (["-j", "2"], []),
    (["--num-threads", "1"], []),
    (["--safe-serialization"], None),
    (["--quiet"], None),
    (["-v"], None),
    (["-vv"], None),
    (["--lazy-unpickle"], None),
    (["--low-cpu-memory"], []),
    (["--clone-tensors"], None),
    (["--async-write"], None),
    (["--write-threads", "2"], None),
    (["--transformers-cache", "HF_CACHE"], None),
    (["--cuda"], []),
    (["--device", "cuda"], []),
    (["--device", "cpu"], None),
    (["--read-to-gpu"], []),
    (["--multi-gpu"], []),
    (["--gpu-rich"], []),
    (["--out-shard-size", "1M", "--no-copy-tokenizer"], None),
    (["--random-seed", "7", "--cuda", "-j", "2"], ["--random-seed", "7"]),
    (["--out-shard-size", "200K", "--no-write-model-card", "--quiet", "--clone-tensors"], None),
]


def _tokenizer_files(path: Path) -> None:
    """A word-level tokenizer saved by transformers (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json): what mergekit copies without loading it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(125)]]  # the family's vocab 128
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """The tiny Llama family, the base saved in 100KB shards (so mergekit's layout differs from
    the base's), every model with tokenizer files; the base also has a README.md of its own
    (never passed off as the merge's card) and another file."""
    f = make_llama_family(tmp_path_factory.mktemp("mk_flags"), n_experts=2, sharded=True)
    for d in (f.base, *f.experts):
        (d / "tokenizer.json").unlink()
        _tokenizer_files(d)
    (f.base / "README.md").write_text("# the base model's own card\n")
    (f.base / OTHER_FILE).write_text("kept\n")
    (f.root / "merge.yaml").write_text(yaml.safe_dump(config(f), sort_keys=False))
    return f


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hub requests: the models are local directories."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_mergekit(fam: Family, out: Path, flags: list[str]) -> None:
    try:
        mergekit_yaml([str(fam.root / "merge.yaml"), str(out), "--quiet", *flags],
                      standalone_mode=False)
    finally:
        logging.getLogger().setLevel(logging.WARNING)


def run_mergefs(fam: Family, out: Path, flags: list[str], *, spec: str = "merge.yaml") -> int:
    try:
        return mergefs_main(["merge", str(fam.root / spec), str(out), *flags])
    finally:
        logging.getLogger().setLevel(logging.WARNING)


def _resolve(flags: list[str], tmp: Path) -> list[str]:
    return [str(tmp / f) if f in ("LORA_CACHE", "HF_CACHE") else f for f in flags]


def tensors(out: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor of an output directory: name -> (file, raw bytes)."""
    got: dict[str, tuple[str, bytes]] = {}
    for p in sorted(out.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for name in f.keys():
                got[name] = (p.name, f.get_tensor(name).contiguous().view(torch.uint8)
                             .numpy().tobytes())
    return got


def front_matter(card: Path) -> Any:
    text = card.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def compare(mk: Path, fs: Path) -> None:
    """The output directories of mergekit (``mk``) and mergefs (``fs``) agree."""
    a, b = tensors(mk), tensors(fs)
    assert sorted(a) == sorted(b)
    for name, (file, data) in a.items():
        assert b[name] == (file, data), f"{name}: file or bytes differ"
    files_mk = {p.name for p in mk.iterdir()}
    files_fs = {p.name for p in fs.iterdir() if not p.name.startswith(".")}
    assert files_fs - files_mk == {OTHER_FILE}, files_fs ^ files_mk
    assert files_mk <= files_fs
    index = "model.safetensors.index.json"
    if (mk / index).exists():
        want, got = json.loads((mk / index).read_text()), json.loads((fs / index).read_text())
        assert list(got["weight_map"].items()) == list(want["weight_map"].items())
        assert got["metadata"]["total_size"] == want["metadata"]["total_size"]
    for f in sorted(files_mk):  # every shard byte for byte (header, order, data)
        if f.endswith(".safetensors") or f in ("tokenizer.json", "tokenizer_config.json",
                                               "mergekit_config.yml"):
            assert (mk / f).read_bytes() == (fs / f).read_bytes(), f
    if (mk / "README.md").exists():
        assert front_matter(fs / "README.md") == front_matter(mk / "README.md")
        assert "# " + fs.name in (fs / "README.md").read_text()
    config = json.loads((fs / "config.json").read_text())
    assert config["num_hidden_layers"] == json.loads((mk / "config.json").read_text())[
        "num_hidden_layers"]


@pytest.mark.parametrize("flags,mk_flags", CASES, ids=[" ".join(c[0]) or "none" for c in CASES])
def test_flag(fam: Family, tmp_path: Path, flags: list[str], mk_flags: list[str] | None,
              caplog: pytest.LogCaptureFixture) -> None:
    out_mk, out_fs = tmp_path / "mk" / "merged", tmp_path / "fs" / "merged"
    run_mergekit(fam, out_mk, _resolve(flags if mk_flags is None else mk_flags, tmp_path))
    with caplog.at_level(logging.INFO):
        assert run_mergefs(fam, out_fs, _resolve(flags, tmp_path)) == 0
    compare(out_mk, out_fs)
    logged = caplog.text
    if any(f in GPU or f == "--device" and "cuda" in flags for f in flags):
        assert "no GPU support" in logged and "on the CPU" in logged
    if "--lora-merge-dtype" in flags:
        assert "--lora-merge-dtype bfloat16: not applied" in logged


@pytest.mark.parametrize("flag,words", [
    ("--no-safe-serialization", "safetensors only"),
])
def test_refused(fam: Family, tmp_path: Path, flag: str, words: str,
                 capsys: pytest.CaptureFixture[str]) -> None:
    assert run_mergefs(fam, tmp_path / "out", [flag]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and words in err, err
    assert not (tmp_path / "out").exists()


def test_help_lists_every_mergekit_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option of mergekit-yaml 0.1.5 is in `mergefs merge --help`, in its own group."""
    with pytest.raises(SystemExit):
        mergefs_main(["merge", "--help"])
    text = capsys.readouterr().out
    assert "mergekit-yaml options:" in text and "mergekit-multi options:" in text
    for param in mergekit_yaml.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert opt in text, opt


def test_random_seed_sets_the_masks(fam: Family, tmp_path: Path) -> None:
    """--random-seed changes DARE's masks as the spec's parameters.seed does; other seeds give
    other masks."""
    dare = {**config(fam), "merge_method": "dare_ties", "parameters": {"density": 0.5}}
    (fam.root / "dare.yaml").write_text(yaml.safe_dump(dare))
    (fam.root / "dare7.yaml").write_text(yaml.safe_dump(
        {**dare, "parameters": {"density": 0.5, "seed": 7}}))
    flag = ["--out-shard-size", "base"]
    assert run_mergefs(fam, tmp_path / "cli7", ["--random-seed", "7", *flag],
                       spec="dare.yaml") == 0
    assert run_mergefs(fam, tmp_path / "spec7", flag, spec="dare7.yaml") == 0
    assert run_mergefs(fam, tmp_path / "seed0", flag, spec="dare.yaml") == 0
    seven, spec7, zero = (tensors(tmp_path / n) for n in ("cli7", "spec7", "seed0"))
    assert seven == spec7
    name = "model.layers.0.mlp.up_proj.weight"
    assert seven[name] != zero[name]


def test_shard_size_base_keeps_every_tensor(fam: Family, tmp_path: Path) -> None:
    """--out-shard-size base mirrors the base's weight files (as mergefs wrote before); every
    tensor's bytes equal those of mergekit's layout (the default)."""
    assert run_mergefs(fam, tmp_path / "base", ["--out-shard-size", "base"]) == 0
    assert run_mergefs(fam, tmp_path / "default", []) == 0
    mirrored, default = tensors(tmp_path / "base"), tensors(tmp_path / "default")
    assert {n: d for n, (_, d) in mirrored.items()} == {n: d for n, (_, d) in default.items()}
    base_files = sorted(p.name for p in fam.base.glob("*.safetensors"))
    assert sorted({f for f, _ in mirrored.values()}) == base_files and len(base_files) > 1
    assert {f for f, _ in default.values()} == {"model.safetensors"}


def test_replay_writes_the_same_files(fam: Family, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The layout and the card are recorded: replay --out rebuilds the merge file for file."""
    out, manifest = tmp_path / "merged", tmp_path / "m.jsonl"
    assert run_mergefs(fam, out, ["--out-shard-size", "300K", "--no-copy-tokenizer",
                                  "--manifest", str(manifest)]) == 0
    assert mergefs_main(["replay", str(manifest), "--out", str(tmp_path / "again")]) == 0
    capsys.readouterr()
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir()
                           if not p.name.startswith("."))
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    assert "tokenizer.json" not in names and "README.md" in names
    for n in names:
        assert (out / n).read_bytes() == (tmp_path / "again" / n).read_bytes(), n


def test_multi_document_flags(fam: Family, tmp_path: Path) -> None:
    """mergekit-multi's flags: -I puts the named merges there, --out-path names the output;
    --lazy skips a directory that holds any model (mergekit's test), the default only a
    mergefs merge of the same plan, --no-lazy none."""
    docs = [{"name": "mid", "merge_method": "linear", "dtype": "float32",
             "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 0.5}},
                        {"model": str(fam.experts[1]), "parameters": {"weight": 0.5}}]},
            {"merge_method": "task_arithmetic", "base_model": str(fam.base),
             "dtype": "float32",
             "models": [{"model": "mid", "parameters": {"weight": 0.5}}]}]
    (fam.root / "multi.yaml").write_text(yaml.safe_dump_all(docs))
    inter = tmp_path / "inter"

    def merge(out: str, *flags: str) -> int:
        cwd = os.getcwd()
        os.chdir(fam.root)
        try:
            return mergefs_main(["merge", "multi.yaml", "--out-path", str(tmp_path / out),
                                 "-I", str(inter), *flags])
        finally:
            os.chdir(cwd)

    def stamp() -> int:
        return (inter / "mid" / "config.json").stat().st_mtime_ns

    assert merge("o1") == 0 and (tmp_path / "o1" / "config.json").exists()
    first = stamp()
    assert merge("o2") == 0 and stamp() == first  # the same plan: skipped
    assert merge("o3", "--no-lazy") == 0 and stamp() != first  # merged again
    # a model mergefs did not write: --lazy uses it (mergekit-multi); the default refuses to
    # replace it (one line), as any merge into a directory mergefs did not write
    shutil.rmtree(inter / "mid")
    shutil.copytree(fam.experts[0], inter / "mid")
    kept = stamp()
    assert merge("o4", "--lazy") == 0 and stamp() == kept
    assert tensors(tmp_path / "o4") != tensors(tmp_path / "o1")
    assert merge("o5") == 1 and stamp() == kept and not (tmp_path / "o5").exists()


def test_view_serves_the_merged_files(fam: Family, tmp_path: Path) -> None:
    """The mount's view (no FUSE) of a merge with mergekit's layout serves exactly the files
    `Engine.materialise` writes: the same names, bytes, shards and card (named alike)."""
    out = tmp_path / "served"
    output = OutputOptions(shard_bytes=300_000, copy_tokenizer=False, config_text="# mine\n")
    session = Session(load_spec(fam.root / "merge.yaml"), output=output)
    try:
        session.engine.materialise(out)
        view = View(MountSession.of(session), UnitCache(1 << 20), name=out.name)
        try:
            served = {}
            for name, attr in view.readdir(ROOT_INODE):
                if name.startswith("."):
                    continue
                fh = view.open(attr.inode)
                served[name] = b"".join(bytes(view.read(fh, off, 1 << 16))
                                        for off in range(0, attr.size_bytes, 1 << 16))
        finally:
            view.close()
    finally:
        session.close()
    written = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert served == written
    assert written["mergekit_config.yml"] == b"# mine\n" and "tokenizer.json" not in written
    assert sum(n.endswith(".safetensors") for n in written) > 1
