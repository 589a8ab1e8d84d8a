"""``python -m bench methods-quality`` (issue 32's benchmark row) on a tiny stand-in for the
masked-LM MiniLM family: a 1-layer BERT with an MLM head and three perturbed "experts", a
word-level vocabulary, held-out passages in ``eval/``. Checks the specs it writes for every
method, and that its rows measure what they say: the reference rows are the models' own losses,
the task_arithmetic row at the full budget is the loss of ``W0 + 0.5 * sum(D_i)`` computed here,
and the 10% rows read at most 10% of the expert bytes. No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from bench import families
from bench.sections import methods_quality as mq
from mergefs import methods as registry

pytest.importorskip("transformers")

WORDS = ("the a of to and is in it for on with as file option value licence copy "
         "function returns list name page user shall may not any under").split()


def _tiny_mlm_family(root: Path) -> Path:
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    base = root / "base"
    BertForMaskedLM(cfg).save_pretrained(base)
    (base / "vocab.txt").write_text("\n".join(vocab) + "\n")
    w0 = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(1)
    names = []
    for k in range(3):
        d = root / f"expert-{k}"
        d.mkdir()
        for f in ("config.json", "vocab.txt"):
            (d / f).write_bytes((base / f).read_bytes())
        save_file({n: (v + rng.normal(0, 0.05, v.shape).astype(v.dtype)) if v.dtype.kind == "f"
                   else v for n, v in w0.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        names.append(d.name)
    (root / "eval").mkdir()
    for c in ("docs", "licences"):
        texts = [" ".join(rng.choice(WORDS, 12)) for _ in range(6)]
        (root / "eval" / f"{c}.json").write_text(json.dumps(texts))
    (root / "family.json").write_text(json.dumps({"seq_len": 16, "experts": names}))
    (root / "spec-full.yaml").write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": "./base",
        "models": [{"model": f"./{n}", "parameters": {"weight": 0.5}} for n in names],
        "parameters": {"lambda": 1.0}, "dtype": "float32", "budget": "full",
        "block_size": "4KiB"}, sort_keys=False))
    return root


@pytest.fixture(autouse=True)
def _offline_for_this_test_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.families' loss sets HF_HUB_OFFLINE with os.environ.setdefault; set here, it is
    undone after the test (leaked, it changed the tokenizer_config.json that later tests'
    mount subprocesses write: transformers saves local_files_only)."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_mlm_family(tmp_path_factory.mktemp("mlm"))


def test_spec_for_every_method(family: Path) -> None:
    """Every default method present in the registry gets a spec mergefs accepts, with the
    spec's weights where the method requires a per-model weight and density 0.5 for TIES'
    sparsifier; the others a row saying why."""
    import mergefs

    doc = yaml.safe_load((family / "spec-full.yaml").read_text())
    for method in mq.DEFAULT_METHODS:
        got = mq.method_spec(doc, method, family)
        if registry.get(method) is None:
            assert isinstance(got, str) and "registry" in got
            continue
        assert isinstance(got, dict), (method, got)
        assert got["merge_method"] == method and got["block_size"] == "4KiB"
        assert Path(got["base_model"]) == (family / "base").resolve()
        m = mergefs.open(got, base_dir=family)  # validates (strict keys: warnings only)
        assert m.spec.method == method
        per = [e.get("parameters", {}) for e in got["models"]]
        mixing = any(p.name == "weight" and p.required for p in registry.get(method).params)
        assert all(p.get("weight") == 0.5 for p in per) == mixing, (method, per)
        assert mixing or all("weight" not in p for p in per), (method, per)
        assert all(p.get("density") == (0.5 if method in ("ties", "consensus_ties") else None)
                   for p in per), (method, per)
        assert "lambda" not in got.get("parameters", {}), method  # the spec's global dropped
    assert "no parameter" in str(mq.method_spec(doc, "magmax", family, {"density": 0.5}))
    k2 = mq.method_spec(doc, "consensus_ta", family, {"k": 2})
    assert isinstance(k2, dict) and all(e["parameters"]["k"] == 2 for e in k2["models"])


def test_rows_measure_the_merges(family: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    methods = ["task_arithmetic", "ties", "magmax", "no_such_method"]
    methods += ["tsv_m"] if registry.get("tsv_m") is not None else []
    seen: list[dict[str, Any]] = []
    rows = mq.run(family, "spec-full.yaml", methods, ["full", "10"], tmp_path / "work",
                  emit=seen.append)
    assert seen == rows
    by = {(r["row"], r.get("method"), r.get("budget")): r for r in rows}
    assert by[("skipped", "no_such_method", None)]["why"].startswith("not in this mergefs")
    assert ("index", None, None) in by
    ev = families.MlmLoss(family, family / "base")
    for name in ("base", "expert-0 alone", "expert-2 alone"):
        ref = by[("reference", name, "-")]
        d = family / ("base" if name == "base" else name.split()[0])
        assert ref["loss"] == ev(d)
        assert ref["mean"] == round(math.fsum(ref["loss"].values()) / 2, 4)
    for method in (m for m in methods if m != "no_such_method"):
        full, tenth = by[("merge", method, "full")], by[("merge", method, "10%")]
        assert set(full["loss"]) == {"docs", "licences"}
        assert all(math.isfinite(v) for v in [*full["loss"].values(), *tenth["loss"].values()])
        assert full["expert_bytes_read"] == full["total_expert_bytes"] > 0
        assert 0 < tenth["expert_bytes_read"] <= 0.10 * tenth["total_expert_bytes"]
    # task arithmetic at the full budget is W0 + 0.5 * sum(D_i): its loss, computed here
    w0 = load_file(str(family / "base" / "model.safetensors"))
    ws = [load_file(str(family / f"expert-{k}" / "model.safetensors")) for k in range(3)]
    ta = tmp_path / "ta"
    ta.mkdir()
    (ta / "config.json").write_bytes((family / "base" / "config.json").read_bytes())
    save_file({n: (v + np.float32(0.5) * sum((w[n] - v for w in ws), np.zeros_like(v)))
               .astype(v.dtype) for n, v in w0.items()}, str(ta / "model.safetensors"))
    want = ev(ta)
    got = by[("merge", "task_arithmetic", "full")]["loss"]
    assert got == pytest.approx(want, abs=2e-4)
    assert got != by[("merge", "ties", "full")]["loss"]  # the methods differ
    text = mq.table(rows)
    assert "| task_arithmetic | 10% |" in text and "| base | - |" in text
    assert "no_such_method: not in this mergefs" in text


def test_sidecars_plan_the_budgeted_rows(family: Path, tmp_path: Path) -> None:
    """With ``sidecars``, the delta sidecars are written into the work folder's store (not
    beside the experts) and the 10% merge reads some of them, within the budget."""
    before = sorted(p.name for p in family.rglob("*"))
    rows = mq.run(family, "spec-full.yaml", ["task_arithmetic"], ["10%"], tmp_path / "work",
                  sidecars=True, evaluate=lambda d: {"x": 1.0})
    assert [r["row"] for r in rows] == ["index", "compress", "reference", "reference",
                                        "reference", "reference", "merge"]
    merge = rows[-1]
    assert merge["sidecars"] and merge["sidecar_bytes_read"] > 0
    assert merge["expert_bytes_read"] <= 0.10 * merge["total_expert_bytes"]
    assert sorted(p.name for p in family.rglob("*")) == before  # nothing written into sources
    assert "| task_arithmetic | 10%, sidecars |" in mq.table(rows)
