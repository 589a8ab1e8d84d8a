"""Merge methods side by side on a masked-LM MiniLM family (issue 32): held-out masked-LM loss
per domain of each method's merge, at each budget, beside the base and each expert alone.

For a family made by ``python -m bench.families minilm`` (``family.json``, ``eval/<corpus>.json``
and a spec, default ``spec-full.yaml``: the three full fine-tunes, weight 0.5 each), writes one
spec per method (:func:`method_spec`) into the work folder (``--work``, default a temporary
one), builds the block index once (timed, a row of its own), then for each method and budget
merges with mergefs in this process (``mergefs.open(spec).merge(out, budget=B)``; the sources
evicted from the page cache first: cold sources, index warm) and computes the masked-LM loss on
each corpus' held-out passages (:class:`bench.families.MlmLoss`: fixed masks, the base's
tokenizer, the family's sequence length). Budgets are mergefs' own (``10%``: of the experts'
bytes as stored, float32 here). With ``--sidecars`` the experts' delta sidecars are written
first (``mergefs compress`` into the work folder's index store, timed) and the budgeted merges
plan with them; without, they read exact blocks only. Printed per row: method, budget, loss per corpus,
their mean, the merge's wall time and the expert bytes it read; then a markdown table. The
load average (1 minute) is printed before and after.

Parameters: each method's registry defaults, except ``weight`` (the spec's, per model, where the
method requires a per-model mixing weight: not tsv_m, whose optional weight scales each delta
before its SVD) and :data:`OVERRIDES` (``density`` 0.5 for the TIES sparsifier,
as the family's ``spec-ties.yaml``); the spec's global parameters are dropped (its ``lambda:
1.0`` is task_arithmetic's default, and ``lambda`` means a TALL threshold to the consensus
methods). ``--param METHOD:KEY=VALUE`` sets more (``consensus_ta:k=2`` for the paper's
consensus). A method this mergefs does not have is a row saying so, not an error.

    python -m bench methods-quality --family /tmp/mlm-family --budgets full,10%
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import mergefs
from bench import families
from mergefs import ops
from bench.common import evict
from mergefs import methods as registry
from mergefs.methods import Scope

#: the methods compared by default: issue 32's against task_arithmetic and TIES
DEFAULT_METHODS = ("task_arithmetic", "ties", "tsv_m", "iso_c", "iso_cts", "magmax",
                   "consensus_ta", "consensus_ties")
#: parameters set beyond the registry defaults (and the spec's weights), per method
OVERRIDES: dict[str, dict[str, Any]] = {"ties": {"density": 0.5},
                                        "consensus_ties": {"density": 0.5}}


def method_spec(doc: Mapping[str, Any], method: str, family: Path,
                overrides: Mapping[str, Any] | None = None) -> dict[str, Any] | str:
    """The spec ``doc`` (a family's, paths relative to ``family``) with ``merge_method:
    method``, absolute paths, the models' weights where the method requires a per-model weight,
    and ``overrides`` (default :data:`OVERRIDES`' for the method); every other parameter the
    method's default. A string says why there is none (unknown method, a required parameter
    unset)."""
    m = registry.get(method)
    if m is None:
        return "not in this mergefs' method registry (mergefs methods)"
    extra = dict(OVERRIDES.get(method, {}) if overrides is None else overrides)
    defs = {p.name: p for p in m.params}
    unknown = sorted(set(extra) - set(defs))
    if unknown:
        return f"{method} has no parameter {', '.join(unknown)}"
    per_model = {k for k, p in defs.items() if p.scope != Scope.GLOBAL}
    # the spec's weights are mixing weights: only where the method requires one (tsv_m's
    # optional per-model weight, a scale before each SVD, keeps its default)
    mixing = "weight" in per_model and defs["weight"].required
    models = []
    for entry in doc["models"]:
        params = {k: v for k, v in (entry.get("parameters") or {}).items()
                  if k == "weight" and mixing}
        params.update({k: v for k, v in extra.items() if k in per_model})
        models.append({"model": str((family / entry["model"]).resolve()),
                       **({"parameters": params} if params else {})})
    given = set(extra) | ({"weight"} if mixing else set())
    missing = [k for k, p in defs.items() if p.required and k not in given]
    if missing:
        return f"{method} needs {', '.join(missing)} (set it with --param {method}:KEY=VALUE)"
    out = {k: v for k, v in doc.items() if k not in ("models", "parameters", "merge_method",
                                                      "index_dir", "manifest")}
    out.update(merge_method=method, base_model=str((family / doc["base_model"]).resolve()),
               models=models)
    glob = {k: v for k, v in extra.items() if k not in per_model}
    if glob:
        out["parameters"] = glob
    return out


def budget_label(text: str) -> str:
    """``full``, or a percentage of the expert bytes: ``10`` and ``10%`` are ``10%``."""
    text = text.strip()
    return "full" if text == "full" else f"{text.rstrip('%')}%"


def run(family: Path, spec_name: str, methods: Sequence[str], budgets: Sequence[str],
        work: Path, *, params: Mapping[str, Mapping[str, Any]] | None = None,
        sidecars: bool = False,
        evaluate: Callable[[Path], dict[str, float]] | None = None,
        emit: Callable[[dict[str, Any]], None] = lambda row: None) -> list[dict[str, Any]]:
    """Every row: ``index`` (and ``compress`` with ``sidecars``: delta sidecars written into
    the work folder's index store, which budgeted merges then plan with), then ``reference``
    (base, each expert alone), then ``merge`` (or ``skipped``) per method and budget. ``evaluate`` (default :class:`bench.families.MlmLoss`
    of the family) maps a model folder to corpus -> loss; ``emit`` sees each row as it is made.
    Specs, manifests and the index stay in ``work``; each merge's output is removed once
    evaluated."""
    doc = yaml.safe_load((family / spec_name).read_text())
    base = (family / doc["base_model"]).resolve()
    experts = [(family / e["model"]).resolve() for e in doc["models"]]
    evaluate = evaluate or families.MlmLoss(family, base)
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        losses = row.get("loss")
        if losses:
            row["mean"] = round(math.fsum(losses.values()) / len(losses), 4)
        rows.append(row)
        emit(row)

    specs: dict[str, Path] = {}
    for method in methods:
        got = method_spec(doc, method, family, (params or {}).get(method))
        if isinstance(got, str):
            add({"row": "skipped", "method": method, "why": got})
            continue
        got["index_dir"] = str(work / "index")  # one index for every method: the same family
        specs[method] = work / f"spec-{method}.yaml"
        specs[method].write_text(yaml.safe_dump(got, sort_keys=False))
    if specs:
        evict(base, *experts)
        t0 = time.perf_counter()
        first = mergefs.open(next(iter(specs.values())))
        first.index()
        add({"row": "index", "cache": "cold", "wall_s": round(time.perf_counter() - t0, 2)})
        if sidecars:
            t0 = time.perf_counter()
            ops.compress(first.spec, progress=False)
            add({"row": "compress", "wall_s": round(time.perf_counter() - t0, 2)})
    for name, d in (("base", base), *((f"{p.name} alone", p) for p in experts)):
        add({"row": "reference", "method": name, "budget": "-", "loss": evaluate(d)})
    for method, spec_path in specs.items():
        m = mergefs.open(spec_path)
        for b in budgets:
            label = budget_label(b)
            out = work / f"out-{method}-{label.rstrip('%')}"
            shutil.rmtree(out, ignore_errors=True)
            manifest = work / f"{out.name}.manifest.jsonl"
            manifest.unlink(missing_ok=True)  # this folder's own, from an earlier run
            evict(base, *experts)
            t0 = time.perf_counter()
            result = m.merge(out, budget=label, manifest=manifest)
            wall = time.perf_counter() - t0
            tot = result.totals
            add({"row": "merge", "method": method, "budget": label, "cache": "cold",
                 "sidecars": sidecars,
                 "loss": evaluate(out), "wall_s": round(wall, 2),
                 "expert_bytes_read": tot["expert_bytes_read"],
                 "total_expert_bytes": tot["total_expert_bytes"],
                 "sidecar_bytes_read": sum(tot.get("sidecar_bytes_read", {}).values()),
                 "spec": str(spec_path), "command": f"mergefs merge {spec_path} OUT "
                 f"--budget {label}"})
            shutil.rmtree(out, ignore_errors=True)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the reference and merge rows (skipped methods after it)."""
    corpora = next((list(r["loss"]) for r in rows if r.get("loss")), [])
    head = ["method", "budget", *corpora, "mean", "merge wall (cold)", "expert bytes read"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["row"] not in ("reference", "merge"):
            continue
        read = f"{r['expert_bytes_read'] / r['total_expert_bytes']:.1%}" \
            if r["row"] == "merge" and r["total_expert_bytes"] else "-"
        wall = f"{r['wall_s']:.2f} s" if "wall_s" in r else "-"
        budget = f"{r['budget']}, sidecars" if r.get("sidecars") and r["budget"] != "full" \
            else r["budget"]
        cells = [r["method"], budget, *(f"{r['loss'][c]:.3f}" for c in corpora),
                 f"{r['mean']:.3f}", wall, read]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\n{r['method']}: {r['why']}" for r in rows if r["row"] == "skipped"]
    return "\n".join(lines)


def parse_params(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``METHOD:KEY=VALUE`` items (VALUE read as YAML) -> method -> {key: value}, on top of
    :data:`OVERRIDES`."""
    out: dict[str, dict[str, Any]] = {k: dict(v) for k, v in OVERRIDES.items()}
    for item in items:
        method, sep, rest = item.partition(":")
        key, eq, value = rest.partition("=")
        if not (sep and eq and method and key):
            raise SystemExit(f"--param: expected METHOD:KEY=VALUE, got {item!r}")
        out.setdefault(method, {})[key] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None, prog: str = "python -m bench methods-quality") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, required=True,
                   help="a masked-LM MiniLM family (python -m bench.families minilm)")
    p.add_argument("--spec", default="spec-full.yaml", help="the family's spec to start from")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--budgets", default="full,10%",
                   help="comma-separated: full, or a percentage of the expert bytes")
    p.add_argument("--param", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="a parameter beyond the defaults (repeatable)")
    p.add_argument("--sidecars", action="store_true",
                   help="write delta sidecars (mergefs compress, into the work folder's index "
                   "store) first: budgeted merges plan with them")
    p.add_argument("--work", type=Path, help="specs, manifests, index (default: a temporary "
                   "folder, removed afterwards)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if not (args.family / "eval").is_dir():
        print(f"{prog}: {args.family} has no eval/: not a masked-LM family", flush=True)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-methods-quality-"))
    load = [os.getloadavg()[0]]
    print(json.dumps({"row": "load", "loadavg_1min": round(load[0], 2)}), flush=True)
    try:
        rows = run(args.family, args.spec, [m for m in args.methods.split(",") if m],
                   [b for b in args.budgets.split(",") if b], work,
                   params=parse_params(args.param), sidecars=args.sidecars,
                   emit=lambda row: print(json.dumps(row), flush=True))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    print(json.dumps({"row": "load", "loadavg_1min": round(load[1], 2)}), flush=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"load_1min": load, "rows": rows}, indent=1) + "\n")
    return 0
