"""The sections of ``python -m bench``: one module each (``-`` in a name is ``_`` in the
module's), each with ``main(argv, prog) -> int``. Imported only when run: some import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable

#: section name -> one line of what it measures
SECTIONS: dict[str, str] = {
    "table": "the benchmark table (issue 5): index, budget sweep, mergekit, time to a loaded "
             "model, serving, memory, MiniLM sweep, sweep mount, remote; JSON, CSV, plots",
    "targets": "issue 13's targets: mount vs merge vs mergekit (+ from_pretrained), merge, "
               "serving, index, memory, scaling; interleaved rounds, medians",
    "start": "fixed costs: mount from exec to ready, and merge, for several source trees",
    "sweepmount": "a 9-variant sweep through one mount vs nine mounts vs nine mergekit runs",
    "sidecar": "delta sidecars: energy kept, bounds, bytes, masked-LM loss, wall time per "
               "budget (merge, mount, HTTP)",
    "decode": "delta sidecar decoding alone, by route and thread count, vs the reads it "
              "replaces",
    "pairindex": "adding an expert to an indexed family vs building the whole index again",
    "growindex": "bytes read adding experts one at a time (2 -> 16, dense): exact Gram pairs "
                 "on every addition vs sketches",
    "ray": "index and merge on a local Ray cluster with 1, 2, 4 worker processes vs local",
    "profile-index": "where an index build's time goes: imports, numba, each stage",
    "mergepipe": "mergefs beside the MergePipe paper's own system and mergekit: wall time, "
                 "bytes read, peak RSS, deviation at 10%, 30% and full budgets, cold",
    "methods": "peak RSS and wall time of ties, dare_ties, della, slerp and model_stock, cold, "
               "beside a baseline tree and mergekit-yaml (issue 30)",
    "methods-quality": "merge methods side by side on a masked-LM MiniLM family: held-out "
                       "masked-LM loss per domain, full and budgeted, beside base and experts",
    "fuzz-format": "coverage-guided fuzzing of the safetensors header parser (atheris)",
    "families": "make a benchmark family on disk (python -m bench.families)",
}


def entry(name: str) -> Callable[..., int]:
    """The ``main`` of section ``name`` (imports its module)."""
    if name == "families":
        return importlib.import_module("bench.families").main  # type: ignore[no-any-return]
    module = importlib.import_module(f"bench.sections.{name.replace('-', '_')}")
    return module.main  # type: ignore[no-any-return]
