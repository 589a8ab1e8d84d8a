"""The model card (README.md): mergekit's front matter and sections, and mergefs's figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from families import Family, make_family
from hub_cache import COMMIT_A, COMMIT_B, cache_model
from mergekit.card import generate_card
from mergekit.config import MergeConfiguration

from mergefs import ops
from mergefs.engine.card import model_card
from mergefs.engine.session import Session
from mergefs.spec import refs as hub
from mergefs.spec.load import load_spec, parse_spec


def front_matter(text: str) -> dict[str, Any]:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return make_family(tmp_path_factory.mktemp("card_family"), n_experts=2, seed=3)


def spec_doc(fam: Family, method: str = "task_arithmetic", **extra: Any) -> dict[str, Any]:
    return {"merge_method": method, "base_model": str(fam.base),
            "models": [{"model": str(e), "parameters": {"weight": 0.5}} for e in fam.experts],
            **extra}


def card_of(fam: Family, tmp_path: Path, doc: dict[str, Any], name: str = "my-merge"
            ) -> tuple[str, Session]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**doc, "block_size": "4KiB",
                                    "index_dir": str(tmp_path / "index")}))
    session = Session(load_spec(path))
    try:
        card = model_card(session.spec, session.engine.plan, name, path.read_text(),
                          manifest="spec.manifest.jsonl").decode()
    finally:
        session.close()
    return card, session


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "slerp"])
def test_front_matter_and_sections_are_mergekits(fam: Family, tmp_path: Path,
                                                 method: str) -> None:
    doc = spec_doc(fam, method, **({"parameters": {"t": 0.3}} if method == "slerp" else {}))
    if method == "slerp":
        doc["models"] = [{"model": str(fam.base)}, {"model": str(fam.experts[0])}]
    if method == "ties":
        doc["parameters"] = {"density": 0.5}
    card, _ = card_of(fam, tmp_path, doc)
    config_text = yaml.safe_dump(doc)
    theirs = generate_card(MergeConfiguration.model_validate(doc), config_text, "my-merge")
    assert front_matter(card) == front_matter(theirs)
    # mergekit's headings and method sentence, word for word
    for line in theirs.splitlines():
        if line.startswith(("#", "This model was merged using")):
            assert line in card.splitlines(), line
    # the same bullets (mergekit orders them as a Python set does)
    bullets = sorted(x for x in theirs.splitlines() if x.startswith("* "))
    assert sorted(x for x in card.splitlines() if x.startswith("* ")) == bullets


def test_mergefs_figures_are_the_plans(fam: Family, tmp_path: Path) -> None:
    card, session = card_of(fam, tmp_path, spec_doc(fam, budget="30%"))
    plan = session.engine.plan
    assert f"`{plan.plan_hash}`" in card
    assert f"{plan.planned_bytes:,} bytes" in card
    assert "mergefs replay spec.manifest.jsonl" in card
    assert "error bound, ‖E‖ ≤ (tight)" in card and "not read and count as unchanged" in card
    # two experts, no exact pair: the error is an estimate and says so, with its interval
    assert plan.estimated() and "estimated error ‖E‖ (from sketches) | ≈ " in card
    assert "with probability ≥ 95%" in card and "exact error" not in card
    full, session = card_of(fam, tmp_path, spec_doc(fam, "ties", parameters={"density": 0.5}))
    assert "ties is not additive" in full and "This is the full merge" in full
    assert session.engine.plan.plan_hash != plan.plan_hash


def test_hub_ids_go_into_base_model_and_links(fam: Family, tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    cache_model(cache, "org/base", fam.base, COMMIT_A)
    cache_model(cache, "org/math", fam.experts[0], COMMIT_B)
    doc = {"merge_method": "task_arithmetic", "base_model": "org/base",
           "models": [{"model": "org/math", "parameters": {"weight": 0.5}},
                      {"model": str(fam.experts[1]), "parameters": {"weight": 0.5}}]}
    spec = parse_spec(doc, tmp_path, str(tmp_path / "s.yaml"), hub.HubConfig(cache, offline=True))

    class NoPlan:  # the card reads these figures only
        budget_bytes = planned_bytes = total_expert_bytes = 100
        blocks_read = blocks_total = 4
        blocks_zero = sidecar_bytes = 0
        bound_tight = error_exact = 0.0
        update_norm = 1.0
        bound_output_tight = None
        plan_hash = "abc"

        def estimated(self) -> list[str]:
            return []

    card = model_card(spec, NoPlan(), "", yaml.safe_dump(doc)).decode()  # type: ignore[arg-type]
    theirs = generate_card(MergeConfiguration.model_validate(doc), yaml.safe_dump(doc), "")
    ours, mk = front_matter(card), front_matter(theirs)
    # the same ids; mergekit's in a Python set's order (varies by run), ours in the spec's
    assert ours["base_model"] == ["org/base", "org/math"]
    assert sorted(mk["base_model"]) == ours["base_model"]
    assert {**ours, "base_model": None} == {**mk, "base_model": None} == {
        "base_model": None, "library_name": "transformers", "tags": ["mergekit", "merge"]}
    assert "using [org/base](https://huggingface.co/org/base) as a base" in card
    assert "* [org/math](https://huggingface.co/org/math)" in card
    assert "# Untitled Model (1)" in card


def test_card_names_no_private_directory(tmp_path: Path) -> None:
    """A spec written with relative paths: mergefs's section of the card names the manifest by
    its file name only (it is kept beside the spec), not by an absolute path that mergekit's
    card never shows; mergekit_config.yml is the text as written."""
    make_family(tmp_path / "fam", n_experts=2, seed=3)
    doc = {"merge_method": "task_arithmetic", "base_model": "fam/base",
           "models": [{"model": f"fam/expert-{k}", "parameters": {"weight": 0.5}}
                      for k in range(2)], "block_size": "4KiB", "index_dir": "index"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = ops.merge(load_spec(path), tmp_path / "out", progress=False)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"mergefs replay {result.manifest.name}\n" in card
    assert str(tmp_path) not in card  # models too: as written, relative to the spec
    assert "using fam/base as a base" in card and "* fam/expert-1" in card
    assert str(tmp_path) not in (tmp_path / "out" / "mergekit_config.yml").read_text()
