"""Merge cases shared by the view and mount tests: one spec per operator, and their materialised
merges (written by the engine's ``materialise``, the same bytes ``mergefs merge`` writes)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from families import Family, write_spec

BLOCK = 512  # bytes: two 48-wide fp32 rows a block; tensors span up to ~100 blocks
WEIGHTS = [0.5, -0.3, 0.8]
BUDGET = "40%"

# case -> (method, global parameters, per-model parameters)
CASES: dict[str, tuple[str, dict[str, Any], list[dict[str, Any]] | None]] = {
    "linear": ("linear", {}, None),
    "task_arithmetic": ("task_arithmetic", {"lambda": 0.7}, None),
    "ties": ("ties", {}, [{"density": 0.5}, {"density": 0.3}, {"density": 0.8}]),
    # without the L1 rescale DARE is elementwise: block-wise units (rescaled DARE: whole tensors)
    "dare_linear": ("dare_linear", {"seed": 5, "rescale": False},
                    [{"density": 0.6}, {"density": 0.4}, {"density": 0.9}]),
    "dare_ties": ("dare_ties", {"lambda": 1.3},
                  [{"density": 0.6}, {"density": 0.5}, {"density": 0.7}]),
    "breadcrumbs": ("breadcrumbs", {"gamma": 0.05},
                    [{"density": 0.7}, {"density": 0.6}, {"density": 0.9}]),
    "slerp": ("slerp", {"t": 0.3}, None),
}


def write_case_spec(path: Path, fam: Family, case: str, index_dir: Path, *,
                    budget: str | None = BUDGET, **extra: Any) -> Path:
    """A spec for ``case`` over ``fam`` (slerp: first expert only, full budget)."""
    method, params, model_params = CASES[case]
    if method == "slerp":
        fam = dataclasses.replace(fam, experts=fam.experts[:1])
        budget = None
    n = len(fam.experts)
    top: dict[str, Any] = {"block_size": BLOCK, "index_dir": str(index_dir),
                           "manifest": str(path.with_suffix(".manifest.jsonl")), **extra}
    if budget is not None:
        top["budget"] = budget
    return write_spec(path, fam, method, weights=None if method == "slerp" else WEIGHTS[:n],
                      parameters=params or None,
                      model_parameters=model_params[:n] if model_params else None, extra=top)


def session_of(view: Any) -> Any:
    """The engine session of a plain spec's view (its one variant, served at the root)."""
    from mergefs.mount.session import ROOT

    return view.mount.variants[ROOT].session


def open_view(session: Any, cache: Any, **kw: Any) -> Any:
    """A view over a session the caller opened (and closes): a plain mount without FUSE."""
    from mergefs.mount.session import MountSession
    from mergefs.mount.view import View

    return View(MountSession.of(session), cache, **kw)


#: the model card: named after its directory and naming its manifest, so a mount's and a merge's
#: of the same spec differ there by design (tests/cli/test_mergekit_flags.py checks the card)
CARD = "README.md"


def tree(root: Path, skip_hidden: bool = True, card: bool = False) -> dict[str, Path]:
    """Every file under ``root`` by relative path (hidden entries skipped; the model card
    only with ``card``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip_hidden:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if skip_hidden and f.startswith("."):
                continue
            p = Path(dirpath) / f
            rel = p.relative_to(root).as_posix()
            if rel != CARD or card:
                out[rel] = p
    return out


def materialise(spec_path: Path, out: Path) -> Path:
    """Write the merge of ``spec_path`` to ``out`` with ``Engine.materialise``; returns ``out``."""
    from mergefs.engine.session import Session
    from mergefs.spec.load import load_spec

    session = Session(load_spec(spec_path))
    try:
        session.engine.materialise(out)
    finally:
        session.close()
    return out
