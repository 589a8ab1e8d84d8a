"""Model references as users write them: Hub ids and revisions from a fake Hugging Face cache,
mergekit's string and mapping forms, local paths shadowing ids, and the errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem
from families import Family, make_family, write_spec

from mergefs import cli
from mergefs.spec import refs as hub
from mergefs.core.errors import SpecError
from mergefs.spec.load import parse_spec
from hub_cache import COMMIT_A, COMMIT_B, COMMIT_C, cache_model


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("hub_family"), n_experts=2, seed=5)


@pytest.fixture(scope="module")
def cache(fam: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_cache")
    cache_model(root, "org/base", fam.base, COMMIT_A)
    cache_model(root, "org/math", fam.experts[0], COMMIT_B, refs=("main", "v1.0"))
    # org/code: main points at an older commit holding expert-1 under a newer branch name
    cache_model(root, "org/code", fam.base, COMMIT_A)
    cache_model(root, "org/code", fam.experts[1], COMMIT_C, refs=("dev",))
    cache_model(root, "solo", fam.experts[1], COMMIT_C)
    return root


@pytest.fixture
def offline(cache: Path) -> hub.HubConfig:
    return hub.HubConfig(cache, offline=True)


def snap(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit)


# -- parsing, as mergekit parses ----------------------------------------------------------------


@pytest.mark.parametrize("text", ["org/name", "org/name@main", "./local", "org/m@v1+org/lora",
                                  "org/m+org/lora@abc1234", "/abs/path@dev"])
def test_string_references_parse_as_mergekit_parses_them(text: str) -> None:
    from mergekit.common import ModelReference

    want = ModelReference.model_validate(text)
    got = hub.parse_reference(text, "spec: base_model")
    assert (got.model.path, got.model.revision) == (want.model.path, want.model.revision)
    assert (got.lora is None) == (want.lora is None)
    if got.lora is not None and want.lora is not None:
        assert (got.lora.path, got.lora.revision) == (want.lora.path, want.lora.revision)
    assert str(got) == str(want)


@pytest.mark.parametrize("value", [{"model": "org/name@dev"},
                                   {"model": {"path": "org/name", "revision": "dev"}},
                                   {"model": {"path": "org/name", "revision": "dev"},
                                    "lora": None}])
def test_mapping_references_parse_as_mergekit_parses_them(value: dict[str, Any]) -> None:
    from mergekit.common import ModelReference

    want = ModelReference.model_validate(value)
    got = hub.parse_reference(value, "spec: base_model")
    assert (got.model.path, got.model.revision, got.lora) == (want.model.path,
                                                              want.model.revision, None)


@pytest.mark.parametrize("value, needle", [
    ("a@b@c", "more than one '@'"),
    ("a+b+c", "MODEL+LORA"),
    ("org/name@", "invalid model reference"),
    ({"path": "org/name"}, "needs 'model'"),
    ({"model": {"path": "x", "rev": "y"}}, "base_model.model.rev"),
    ({"model": "x", "override_architecture": "LlamaForCausalLM"}, "override_architecture"),
    ({"model": {"path": ""}}, "base_model.model.path"),
    (7, "expected a path or Hub id"),
])
def test_malformed_references_name_the_key(value: Any, needle: str) -> None:
    with pytest.raises(SpecError, match="spec: base_model") as exc:
        hub.parse_reference(value, "spec: base_model")
    assert needle in str(exc.value)


@pytest.mark.parametrize("text, is_id", [("org/name", True), ("name", True), ("a.b/c-d_e", True),
                                         ("./name", False), ("org/name/x", False),
                                         ("../org", False), ("org--x/y", False),
                                         ("base/", False), ("/abs", False), ("org/na..me", False)])
def test_what_looks_like_a_hub_id(text: str, is_id: bool) -> None:
    assert hub.looks_like_repo_id(text) is is_id


# -- the cache and the environment --------------------------------------------------------------


def test_cache_dir_and_offline_follow_huggingface_hub_rules(tmp_path: Path) -> None:
    home = Path(os.path.expanduser("~"))
    assert hub.HubConfig.from_environ({}) == hub.HubConfig(home / ".cache/huggingface/hub")
    assert hub.HubConfig.from_environ({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == \
        tmp_path / "huggingface/hub"
    assert hub.HubConfig.from_environ({"HF_HOME": str(tmp_path)}).cache_dir == tmp_path / "hub"
    env = {"HF_HOME": "/elsewhere", "HF_HUB_CACHE": str(tmp_path / "c"), "HF_HUB_OFFLINE": "1"}
    assert hub.HubConfig.from_environ(env) == hub.HubConfig(tmp_path / "c", offline=True)
    assert not hub.HubConfig.from_environ({"HF_HUB_OFFLINE": "0"}).offline
    assert hub.HubConfig.from_environ({"HF_HUB_CACHE": "rel"}).cache_dir == Path("rel").absolute()


@pytest.mark.parametrize("revision, commit", [
    (None, COMMIT_B), ("main", COMMIT_B), ("v1.0", COMMIT_B),  # a branch and a tag
    (COMMIT_B, COMMIT_B), (COMMIT_B[:7], COMMIT_B),  # a commit and a prefix of one
])
def test_revisions_resolve_in_the_cache(cache: Path, revision: str | None, commit: str) -> None:
    found, why = hub.find_cached(cache, "org/math", revision)
    assert found is not None, why
    assert found == (commit, Path(snap(cache, "org/math", commit)))


@pytest.mark.parametrize("repo_id, revision", [("org/math", None), ("org/math", "v1.0"),
                                               ("org/math", COMMIT_B), ("org/code", "dev"),
                                               ("org/code", None), ("solo", None)])
def test_resolution_agrees_with_huggingface_hub(cache: Path, repo_id: str,
                                                revision: str | None) -> None:
    """The fake cache is one huggingface_hub reads, and resolves revisions the same way."""
    import huggingface_hub

    found, why = hub.find_cached(cache, repo_id, revision)
    assert found is not None, why
    theirs = huggingface_hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache,
                                                    revision=revision)
    assert isinstance(theirs, str) and Path(theirs) == found[1] / "config.json"
    info = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(cache).repos}
    assert found[0] in {rev.commit_hash for rev in info[repo_id].revisions}


def test_branch_differs_from_main(cache: Path) -> None:
    assert hub.find_cached(cache, "org/code", None)[0] == (COMMIT_A, Path(snap(cache, "org/code",
                                                                                COMMIT_A)))
    assert hub.find_cached(cache, "org/code", "dev")[0] == (COMMIT_C, Path(snap(cache, "org/code",
                                                                                 COMMIT_C)))


def test_a_partial_snapshot_is_not_cached(tmp_path: Path, fam: Family) -> None:
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text("{}")
    cache_model(tmp_path, "o/partial", only_config, COMMIT_A)
    found, why = hub.find_cached(tmp_path, "o/partial", None)
    assert found is None and "no .safetensors weights (a partial download)" in why


def test_ambiguous_prefix_and_dangling_ref(tmp_path: Path, fam: Family) -> None:
    cache_model(tmp_path, "o/m", fam.base, "abcdef0" + "1" * 33)
    cache_model(tmp_path, "o/m", fam.base, "abcdef0" + "2" * 33, refs=())
    found, why = hub.find_cached(tmp_path, "o/m", "abcdef0")
    assert found is None and "ambiguous" in why
    (tmp_path / "models--o--m" / "refs" / "gone").write_text("f" * 40)
    found, why = hub.find_cached(tmp_path, "o/m", "gone")
    assert found is None and "no such snapshot" in why


# -- specs ----------------------------------------------------------------------------------------


def hub_doc(**extra: Any) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": "org/base",
            "models": [{"model": "org/math@v1.0", "parameters": {"weight": 0.6}},
                       {"model": {"model": {"path": "org/code", "revision": "dev"}},
                        "parameters": {"weight": -0.3}}],
            "parameters": {"lambda": 0.8}, **extra}


def test_spec_resolves_ids_and_records_them_pinned(cache: Path, tmp_path: Path,
                                                   offline: hub.HubConfig) -> None:
    spec = parse_spec(hub_doc(), tmp_path, "spec.yaml", offline)
    assert spec.base == snap(cache, "org/base", COMMIT_A)
    assert [e.path for e in spec.experts] == [snap(cache, "org/math", COMMIT_B),
                                              snap(cache, "org/code", COMMIT_C)]
    assert spec.raw["base_model"] == {"model": {"path": "org/base", "revision": COMMIT_A},
                                      "resolved": spec.base}
    assert spec.raw["models"][1]["model"] == {"model": {"path": "org/code", "revision": COMMIT_C},
                                              "resolved": spec.experts[1].path}
    # the record is a fixed point, and is a config mergekit reads
    again = parse_spec(json.loads(json.dumps(spec.raw)), tmp_path, "m.jsonl", offline)
    assert again.raw == spec.raw and again.base == spec.base
    from mergekit.config import MergeConfiguration

    mk = MergeConfiguration.model_validate(dict(spec.raw, dtype="float32"))
    assert mk.base_model is not None and mk.base_model.model.revision == COMMIT_A


def test_plain_paths_record_as_before(fam: Family, tmp_path: Path,
                                      offline: hub.HubConfig) -> None:
    spec = parse_spec({"merge_method": "linear", "base_model": str(fam.base),
                       "models": [{"model": str(fam.experts[0]), "parameters": {"weight": 1}}]},
                      tmp_path, "s", offline)
    assert spec.raw["base_model"] == str(fam.base.resolve())
    assert spec.raw["models"][0]["model"] == str(fam.experts[0].resolve())


def test_base_listed_among_models_by_id(cache: Path, tmp_path: Path,
                                        offline: hub.HubConfig) -> None:
    doc = hub_doc(merge_method="linear", parameters={})
    doc["models"].insert(0, {"model": f"org/base@{COMMIT_A[:10]}", "parameters": {"weight": 0.1}})
    spec = parse_spec(doc, tmp_path, "s", offline)
    assert spec.base_weight == 0.1 and len(spec.experts) == 2
    assert spec.raw["models"][0]["model"]["model"]["path"] == "org/base"


def test_local_dir_shadows_an_id_like_path(fam: Family, cache: Path, tmp_path: Path,
                                           offline: hub.HubConfig) -> None:
    local = tmp_path / "org" / "base"
    local.parent.mkdir()
    local.symlink_to(fam.experts[0], target_is_directory=True)
    spec = parse_spec(hub_doc(), tmp_path, "s", offline)
    assert spec.base == str(fam.experts[0].resolve())  # the local path wins, as in mergekit
    assert spec.raw["base_model"] == spec.base
    assert spec.experts[0].path == snap(cache, "org/math", COMMIT_B)  # others still from the cache


def test_a_bare_name_is_a_path_unless_cached(cache: Path, tmp_path: Path,
                                             offline: hub.HubConfig) -> None:
    doc = hub_doc(models=[{"model": "solo", "parameters": {"weight": 1.0}},
                          {"model": "expert-x", "parameters": {"weight": 1.0}}])
    spec = parse_spec(doc, tmp_path, "s", offline)
    assert spec.experts[0].path == snap(cache, "solo", COMMIT_C)
    assert spec.experts[1].path == str(tmp_path / "expert-x")  # opening it will say it is missing


@pytest.mark.parametrize("ref, needles", [
    ("org/nothere", ["org/nothere", "not in the Hugging Face cache", "offline"]),
    ("org/math@v9", ["org/math@v9", "revision v9 is not in the Hugging Face cache", "offline"]),
    ("org/math@" + "e" * 40, ["org/math@eeee", "is not in the Hugging Face cache"]),
])
def test_missing_id_or_revision_names_the_id(ref: str, needles: list[str], cache: Path,
                                              tmp_path: Path, offline: hub.HubConfig) -> None:
    doc = hub_doc()
    doc["models"][1]["model"] = ref
    with pytest.raises(SpecError) as exc:
        parse_spec(doc, tmp_path, "spec.yaml", offline)
    msg = str(exc.value)
    assert msg.startswith("spec.yaml: models[1].model: ") and "\n" not in msg
    for needle in [*needles, str(cache), str(tmp_path / ref.split("@")[0])]:
        assert needle in msg, (needle, msg)


def test_lora_ids_resolve_from_the_cache(fam: Family, cache: Path, tmp_path: Path,
                                         offline: hub.HubConfig) -> None:
    from safetensors.numpy import save_file

    from mergefs.sources import open_source

    name = "model.layers.0.self_attn.q_proj.weight"
    out_dim, in_dim = open_source(fam.base).tensors[name].shape
    rng = np.random.default_rng(0)
    a = rng.normal(0, 0.1, (2, in_dim)).astype(np.float32)
    b = rng.normal(0, 0.1, (out_dim, 2)).astype(np.float32)
    made = tmp_path / "adapter"
    made.mkdir()
    (made / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                          "lora_alpha": 4}))
    save_file({f"base_model.model.{name[:-7]}.lora_A.weight": a,
               f"base_model.model.{name[:-7]}.lora_B.weight": b},
              str(made / "adapter_model.safetensors"))
    lora_cache = tmp_path / "cache"
    shutil.copytree(cache, lora_cache, symlinks=True)
    cache_model(lora_cache, "org/lora", made, COMMIT_C, refs=("v1",))
    doc = hub_doc()
    doc["models"][0]["model"] = "org/base+org/lora@v1"
    spec = parse_spec(doc, tmp_path, "s", hub.HubConfig(lora_cache, offline=True))
    path = hub.join_lora(snap(lora_cache, "org/base", COMMIT_A), snap(lora_cache, "org/lora",
                                                                      COMMIT_C))
    assert spec.experts[0].path == path
    assert spec.raw["models"][0]["model"] == {
        "model": {"path": "org/base", "revision": COMMIT_A},
        "lora": {"path": "org/lora", "revision": COMMIT_C}, "resolved": path}
    base = open_source(spec.base)
    src = open_source(path, None, base)
    want = np.frombuffer(base.read_tensor(name), np.float32).reshape(out_dim, in_dim) + 2 * (
        b @ a)
    got = np.frombuffer(src.read_tensor(name), np.float32).reshape(out_dim, in_dim)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    doc["models"][0]["model"] = "org/base+org/lora@v2"
    with pytest.raises(SpecError, match=r"models\[0\]\.model \(lora\): org/lora@v2: .*revision "
                                        "v2 is not in the Hugging Face cache"):
        parse_spec(doc, tmp_path, "s", hub.HubConfig(lora_cache, offline=True))


# -- not cached, online: the Hub's filesystem, by ranges ----------------------------------------


def test_uncached_id_reads_remotely_pinned_to_the_hubs_commit(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str | None]] = []

    def commit(repo_id: str, revision: str | None, where: str, head: str) -> str:
        asked.append((repo_id, revision))
        return "d" * 40

    monkeypatch.setattr(hub, "hub_commit", commit)
    doc = hub_doc()
    doc["models"][0]["model"] = "org/remote@dev"
    spec = parse_spec(doc, tmp_path, "s", hub.HubConfig(cache))
    assert asked == [("org/remote", "dev")]
    url = "hf://org/remote@" + "d" * 40
    assert spec.experts[0].path == url and spec.source_options(url) is not None
    assert spec.raw["models"][0]["model"] == {"model": {"path": "org/remote",
                                                        "revision": "d" * 40}, "resolved": url}


def test_unreachable_hub_is_one_line_naming_the_id(cache: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def unreachable(self: Any, repo_id: str, **kw: Any) -> Any:
        raise ConnectionError("Name or service not known\nmore detail")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    doc = hub_doc(base_model="org/offgrid@main")
    with pytest.raises(SpecError) as exc:
        parse_spec(doc, tmp_path, "spec.yaml", hub.HubConfig(cache))
    msg = str(exc.value)
    assert msg.startswith("spec.yaml: base_model: org/offgrid@main: no local path ")
    assert str(cache) in msg and "Hub is unreachable (ConnectionError: Name or service not known)" \
        in msg and "\n" not in msg


# -- through the CLI: equal to the merge from plain paths ---------------------------------------


#: the model card's files: they name the models as the spec gives them (here a URL or an id,
#: there a path) and the output directory, so two merges of the same weights differ there
CARD_FILES = ("README.md", "mergekit_config.yml")


def sha256_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()
            and p.relative_to(root).as_posix() not in (".mergefs/merge.json",  # which run
                                                       *CARD_FILES)}


def test_cli_merge_from_ids_equals_merge_from_paths(
        fam: Family, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = {"budget": "60%", "block_size": 1024}
    plain = write_spec(tmp_path / "plain.yaml", fam, "task_arithmetic", weights=[0.6, -0.3],
                       parameters={"lambda": 0.8},
                       extra={**extra, "index_dir": str(tmp_path / "idx-plain")})
    ids = tmp_path / "ids.yaml"
    ids.write_text(yaml.safe_dump(hub_doc(**extra, index_dir=str(tmp_path / "idx-ids"))))
    assert cli.main(["merge", str(plain), str(tmp_path / "out-plain")]) == 0
    assert cli.main(["merge", str(ids), str(tmp_path / "out-ids")]) == 0
    want, got = sha256_tree(tmp_path / "out-plain"), sha256_tree(tmp_path / "out-ids")
    assert "model.safetensors" in got and got == want

    header = json.loads((tmp_path / "ids.manifest.jsonl").read_text().splitlines()[0])
    assert header["spec"]["base_model"]["model"] == {"path": "org/base", "revision": COMMIT_A}
    assert header["sources"]["base"]["root"] == snap(cache, "org/base", COMMIT_A)
    assert cli.main(["replay", str(tmp_path / "ids.manifest.jsonl")]) == 0
    assert "replay OK" in capsys.readouterr().out


def test_cli_error_for_a_missing_id_is_one_line(cache: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(hub_doc(base_model="org/base@nope")))
    assert cli.main(["plan", str(spec)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "base_model: org/base@nope: " in err[0]
    assert "revision nope is not in the Hugging Face cache" in err[0]


class FakeHfFileSystem(MemoryFileSystem):
    """An in-memory stand-in for huggingface_hub's HfFileSystem (``hf://org/name@rev/file``)."""

    protocol = "hf"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        return super()._strip_protocol(str(path).removeprefix("hf://"))


def test_cli_merge_with_an_uncached_id_reads_it_through_hf_urls(
        fam: Family, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    commit = "d" * 40
    FakeHfFileSystem.store.clear()
    fs = FakeHfFileSystem(skip_instance_cache=True)
    for f in fam.experts[1].iterdir():
        fs.pipe_file(f"hf://org/remote@{commit}/{f.name}", f.read_bytes())
    registry = importlib.import_module("fsspec.registry")._registry
    monkeypatch.setitem(registry, "hf", FakeHfFileSystem)
    monkeypatch.setattr(hub, "hub_commit", lambda *a: commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    extra = {"block_size": 1024}
    plain = write_spec(tmp_path / "plain.yaml", fam, "task_arithmetic", weights=[0.6, -0.3],
                       parameters={"lambda": 0.8},
                       extra={**extra, "index_dir": str(tmp_path / "idx-plain")})
    doc = hub_doc(**extra, index_dir=str(tmp_path / "idx-ids"))
    doc["models"][1]["model"] = "org/remote"
    ids = tmp_path / "ids.yaml"
    ids.write_text(yaml.safe_dump(doc))
    assert cli.main(["merge", str(plain), str(tmp_path / "out-plain")]) == 0
    assert cli.main(["merge", str(ids), str(tmp_path / "out-ids")]) == 0
    assert sha256_tree(tmp_path / "out-ids") == sha256_tree(tmp_path / "out-plain")
    header = json.loads((tmp_path / "ids.manifest.jsonl").read_text().splitlines()[0])
    assert header["sources"]["org/remote"]["root"] == f"hf://org/remote@{commit}"
