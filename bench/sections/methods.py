"""Peak RSS and wall time of the non-additive methods (issue 30): ``mergefs merge`` of ties,
dare_ties, della, slerp and model_stock on one family, cold, beside a baseline tree of mergefs
(``--baseline``) and ``mergekit-yaml`` (``--mergekit``), one run each in interleaved order.

    python -m bench methods --family results/families/small --baseline /tmp/old-tree \\
        --mergekit ties --out results/methods

Each row: the command, wall time, peak RSS (``wait4``), CPU seconds, the load average when it
started. Specs are written into ``--out`` with absolute model paths (ties from the family's
``spec-ties.yaml``; dare_ties and della with the same weights at density 0.5, della epsilon
0.1; slerp of the base and the first expert at t 0.5; model_stock of all experts); the index is
built once first (not timed). Results: ``<out>/methods.md`` and ``methods.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    FAMILIES, MERGEFS, evict, find_mergekit, loadavg, markdown, mergekit_cmd, mergekit_spec, q,
    run,
)

METHODS = ("ties", "dare_ties", "della", "slerp", "model_stock")


def _spec(family: Path, method: str, work: Path) -> Path:
    ties = yaml.safe_load((family / "spec-ties.yaml").read_text())
    base = str((family / ties["base_model"]).resolve())
    models = [{**m, "model": str((family / m["model"]).resolve())} for m in ties["models"]]
    doc: dict[str, Any] = {"merge_method": method, "base_model": base, "dtype": ties["dtype"],
                           "index_dir": str(work / "index")}
    if method == "ties":
        doc.update(models=models, parameters=ties["parameters"])
    elif method in ("dare_ties", "della"):
        extra = {"epsilon": 0.1} if method == "della" else {}
        doc.update(models=[{**m, "parameters": {**m["parameters"], "density": 0.5, **extra}}
                           for m in models])
    elif method == "slerp":
        doc.update(models=[{"model": models[0]["model"]}], parameters={"t": 0.5})
    else:
        doc.update(models=[{"model": m["model"]} for m in models])
    out = work / f"spec-{method}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def main(argv: list[str] | None = None, prog: str = "python -m bench methods") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default=str(FAMILIES / "small"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--baseline", metavar="TREE", help="a mergefs source tree to run beside")
    p.add_argument("--mergekit", default="", metavar="METHODS",
                   help="comma-separated methods to run with mergekit-yaml too")
    p.add_argument("--memory", metavar="SIZE", help="--memory for this tree's runs")
    p.add_argument("--out", default="results/methods")
    args = p.parse_args(argv)
    family = Path(args.family).resolve()
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    mk = find_mergekit() if args.mergekit else None
    rows: list[dict[str, Any]] = []
    for method in methods:
        spec = _spec(family, method, work)
        run(MERGEFS + ["index", spec])  # once, not timed
        variants: list[tuple[str, list[Any], dict[str, str] | None]] = [
            ("mergefs", MERGEFS + ["merge", spec, work / "out", "--force"]
             + (["--memory", args.memory] if args.memory else []), None)]
        if args.baseline:
            variants.append(("baseline", MERGEFS + ["merge", spec, work / "out", "--force"],
                             {"PYTHONPATH": str(Path(args.baseline).resolve())}))
        if mk is not None and method in args.mergekit.split(","):
            variants.append(("mergekit-yaml", mergekit_cmd(mk, mergekit_spec(spec), work / "mk"),
                             None))
        for name, cmd, env in variants:
            shutil.rmtree(work / "mk", ignore_errors=True)
            evict(family)
            load = loadavg()
            res = run(cmd, env=env, timeout=7200)
            row = {"method": method, "tool": name, "wall_s": round(res.wall, 1),
                   "peak_rss_gb": round(res.maxrss_bytes / 1e9, 2),
                   "cpu_s": round(res.cpu_seconds, 1), "load": load,
                   "command": q(cmd) if env is None else f"PYTHONPATH={args.baseline} {q(cmd)}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (work / "methods.json").write_text(json.dumps(rows, indent=2))
            (work / "methods.md").write_text(markdown(
                ["method", "tool", "wall s", "peak RSS GB", "CPU s", "load (1/5/15 min)"],
                [[r["method"], r["tool"], r["wall_s"], r["peak_rss_gb"], r["cpu_s"], r["load"]]
                 for r in rows]) + "\n")
    shutil.rmtree(work / "out", ignore_errors=True)
    shutil.rmtree(work / "mk", ignore_errors=True)
    return 0
