"""mergefs beside the MergePipe paper's own system (arXiv 2605.29489) and mergekit, on one family.

MergePipe's reference implementation (https://github.com/wyy-code/mergepipe) is run, never
imported into mergefs: its driver ``example_usage_explain_lineage.py`` (what its
``scripts/merge_fast_io_budget.sh`` runs) with ``PYTHONPATH=SRC/src:SRC/src/mergepipe`` (its
``storage/transaction.py`` imports ``catalog.db`` as a top-level module). Get it with
``git clone https://github.com/wyy-code/mergepipe SRC`` (or ``git archive`` of a mirror).

What runs, cold (every file of the family dropped from the page cache before each run), in
``--repeats`` interleaved rounds (order reversed every other round):

- ``mergefs merge SPEC OUT --budget B`` for each budget (``spec-avg.yaml``: task_arithmetic,
  weight 1/K per expert, lambda 1: base + the mean of the deltas, MergePipe's AVG operator);
- MergePipe with the same expert bytes budget: ``--io-budget-mb`` = B x the experts' file bytes
  / MiB (its knob: "expert I/O budget in MB"); full = ``--disable-budget --io-budget-mb 0`` (no
  gate). Its ``avg`` strategy knobs (``--top-p 1 --ties-thr 0 --dare-scale 0``), its default
  block of 640000 elements, ``--analyze-all`` (so every tensor gets a sketch and the planner
  picks AVG, not TIES, for it); its ANALYZE pass runs once, before the rounds, into a database
  that every run starts from a copy of (as ``merge_fast_io_budget.sh``, "use cached ANALYZE");
- ``mergekit-yaml`` on the same spec (full only: it has no budget).

Per run: wall time, bytes read from disk by the whole process tree (``read_bytes`` of
``/proc/self/io`` of a wrapper process after it reaped the command: the kernel adds a reaped
child's counters to its parent's; ``rchar`` too), peak RSS (``ru_maxrss`` of the wrapper, the
largest of the tree), and the bytes of the expert files and of the base in the page cache after
the run (``fincore``: what was read of each, readahead included). After the rounds: each budgeted output's deviation from the same tool's
full output (relative Frobenius norm over all tensors, float64: of the full output,
and of its merged delta, full - base), and the full outputs against
each other. Results: ``<out>/<timestamp>/mergepipe.json`` and ``mergepipe.md``.

    python -m bench mergepipe --mergepipe-src /tmp/mergepipe            # ~15 min here
    python -m bench mergepipe --mergepipe-src SRC --budgets 10%,full --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from bench import families
from bench.common import (
    FAMILIES,
    MERGEFS,
    PY,
    RESULTS,
    Proc,
    Results,
    Row,
    evict,
    find_mergekit,
    fmt_bytes,
    mergekit_cmd,
    mergekit_spec,
    q,
    run,
)

#: the family (``make_synthetic`` arguments): ~100M parameters x (1 + 4), bf16, 1 GB
SHAPE: dict[str, Any] = {"params": 100_000_000, "layers": 12, "vocab": 16000, "n_experts": 4}
#: runs the command given after it, reaps it, then prints its own /proc/self/io (which now
#: holds the reaped tree's counters) minus what it had read before, as JSON on stderr's last line
WRAPPER = r"""
import json, subprocess, sys
def io():
    with open('/proc/self/io') as fh:
        return {k: int(v) for k, v in (ln.split(':') for ln in fh)}
before = io()
rc = subprocess.call(sys.argv[1:])
after = io()
print(json.dumps({k: after[k] - before[k] for k in after}), file=sys.stderr)
sys.exit(rc)
"""
DRIVER = "example_usage_explain_lineage.py"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def cached(rs: list[dict[str, Any]], key: str, of: int = 0) -> str:
    xs = [r[key] for r in rs if r.get(key) is not None]
    if not xs:
        return "-"
    return fmt_bytes(median(xs)) + (f" ({median(xs) / of:.0%})" if of else "")


def budget_fraction(budget: str) -> float | None:
    """``10%`` -> 0.1, ``full`` -> None."""
    if budget == "full":
        return None
    return float(budget.rstrip("%")) / 100 if budget.endswith("%") else float(budget)


def rel_frobenius(a_dir: Path, b_dir: Path, base_dir: Path) -> tuple[float, float]:
    """sqrt(sum ||a - b||^2) over every tensor of ``b`` (float64), divided by sqrt(sum ||b||^2)
    and by sqrt(sum ||b - base||^2) (the merged delta of ``b``)."""
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as fh:
                out.update({k: (f, k) for k in fh.keys()})  # noqa: SIM118
        return out

    ta, tb, t0 = tensors(a_dir), tensors(b_dir), tensors(base_dir)
    missing = set(tb) - set(ta)
    if missing:
        raise RuntimeError(f"{a_dir} lacks {len(missing)} tensors of {b_dir}")
    num = den = den_delta = 0.0
    for name, (fb, _) in tb.items():
        a, b, w0 = (get(t[name][0], name) for t in (ta, tb, t0))
        num += float(((a - b) ** 2).sum())
        den += float((b**2).sum())
        den_delta += float(((b - w0) ** 2).sum())
    return (math.sqrt(num / den) if den else float("nan"),
            math.sqrt(num / den_delta) if den_delta else float("nan"))


def get(path: Path, name: str) -> Any:
    import torch
    from safetensors import safe_open

    with safe_open(path, "pt") as fh:
        return fh.get_tensor(name).to(torch.float64)


def out_dtypes(d: Path) -> str:
    from safetensors import safe_open

    seen: set[str] = set()
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            seen |= {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}  # noqa: SIM118
    return ",".join(sorted(seen))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.res = Results(args.out, vars(args))
        self.work, self.raw, self.log = self.res.work, self.res.raw, self.res.log
        self.src = Path(args.mergepipe_src).resolve()
        if not (self.src / DRIVER).is_file():
            raise SystemExit(f"{self.src / DRIVER} not found: get MergePipe with "
                             f"git clone https://github.com/wyy-code/mergepipe {self.src}")
        self.py = args.mergepipe_python or PY
        self.fam = self.family()
        self.base = self.fam / "base"
        self.experts = sorted(p for p in self.fam.iterdir()
                              if p.is_dir() and p.name.startswith("expert-"))
        self.expert_bytes = sum(f.stat().st_size for e in self.experts
                                for f in e.glob("*.safetensors"))
        self.family_bytes = self.expert_bytes + sum(
            f.stat().st_size for f in self.base.glob("*.safetensors"))
        self.spec = self.avg_spec()
        exe = find_mergekit()
        self.mergekit = str(exe) if exe and not args.no_mergekit else ""
        self.raw["family"] = {"dir": str(self.fam), "experts": [e.name for e in self.experts],
                              "expert_bytes": self.expert_bytes}
        self.raw["mergepipe"] = {"src": str(self.src), "commit": self.src_commit()}

    def src_commit(self) -> str:
        p = run(["git", "-C", self.src, "rev-parse", "HEAD"], check=False)
        return p.out.strip() if p.rc == 0 else "(not a git checkout)"

    def family(self) -> Path:
        fam = Path(self.args.family).resolve()
        if not (fam / "spec.yaml").exists():
            self.log(f"making family in {fam}")
            families.make_synthetic(fam, **SHAPE, log=self.log)
        return fam

    def avg_spec(self) -> Path:
        """task_arithmetic, weight 1/K each, lambda 1: base + mean delta (MergePipe's AVG)."""
        doc = yaml.safe_load((self.fam / "spec.yaml").read_text())
        k = len(doc["models"])
        for m in doc["models"]:
            m["parameters"] = {"weight": 1 / k}
        doc["parameters"] = {"lambda": 1.0}
        path = self.fam / "spec-avg.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    # -- commands -----------------------------------------------------------------------------
    def env_mergepipe(self) -> dict[str, str]:
        return {"PYTHONPATH": f"{self.src / 'src'}:{self.src / 'src' / 'mergepipe'}"}

    def mergepipe_cmd(self, db: Path, out: Path, model_id: str, budget: str,
                      stop_after: str = "none") -> list[str]:
        frac = budget_fraction(budget)
        knobs = (["--disable-budget", "--io-budget-mb", "0"] if frac is None else
                 ["--io-budget-mb", str(round(frac * self.expert_bytes / 2**20))])
        return [self.py, DRIVER, "--db", str(db), "--base", str(self.base),
                "--experts", *map(str, self.experts), "--out", str(out), "--model-id", model_id,
                "--experts-kind", "weights", "--backend", "pt", "--device", "cpu",
                "--block-size", str(self.args.block_size), "--top-p", "1.0", "--ties-thr", "0",
                "--dare-scale", "0", "--scoring", "l2cos", "--analyze-all", *knobs,
                "--stop-after", stop_after]

    def shown(self, cmd: list[str], mergepipe: bool) -> str:
        line = q(cmd).replace(str(self.fam) + "/", "FAM/").replace(str(self.work) + "/", "")
        if mergepipe:
            line = (f"cd {self.src} && PYTHONPATH=src:src/mergepipe "
                    + line.replace(self.py, "python"))
        return line

    def variants(self) -> list[dict[str, Any]]:
        out = []
        for b in self.args.budgets.split(","):
            tag = b.strip("%")
            o = self.work / f"mergefs-{tag}"
            out.append({"tool": "mergefs", "budget": b, "out": o, "result": o,
                        "cmd": [str(c) for c in MERGEFS + ["merge", self.spec, o,
                                                           "--budget", b, "--force"]]})
            o = self.work / f"mergepipe-{tag}"
            out.append({"tool": "MergePipe", "budget": b, "out": o, "result": o / f"m{tag}",
                        "cmd": self.mergepipe_cmd(self.work / "db.sqlite", o, f"m{tag}", b)})
        if self.mergekit:
            o = self.work / "mergekit"
            out.append({"tool": "mergekit", "budget": "full", "out": o, "result": o,
                        "cmd": mergekit_cmd(self.mergekit, mergekit_spec(self.spec), o)})
        return out

    def measure(self, v: dict[str, Any]) -> dict[str, Any]:
        mp = v["tool"] == "MergePipe"
        shutil.rmtree(v["out"], ignore_errors=True)
        if mp:
            shutil.copy(self.analyzed, self.work / "db.sqlite")
        evict(self.fam, self.work / "db.sqlite")
        p: Proc = run([PY, "-c", WRAPPER, *v["cmd"]], cwd=self.src if mp else None,
                      env=self.env_mergepipe() if mp else None)
        io = json.loads(p.err.strip().splitlines()[-1])
        r = {"wall": p.wall, "read_bytes": io["read_bytes"], "rchar": io["rchar"],
             "base_cached": self.resident([self.base]),
             "experts_cached": self.resident(self.experts),
             "write_bytes": io["write_bytes"], "maxrss": p.maxrss_bytes, "cpu": p.cpu_seconds,
             "load": os.getloadavg()[0]}
        if mp:
            m = re.search(r"expert_io_mb=([\d.]+) \(before=([\d.]+)\)", p.out)
            s = re.search(r"Budget scale:\s+x([\d.]+)", p.out)
            if m and s:
                r.update(plan_expert_mib=float(m[1]), plan_expert_mib_before=float(m[2]),
                         budget_scale=float(s[1]))
            man = v["result"] / "manifest.json"
            if man.exists():
                r["manifest_io"] = {k: val for k, val in json.loads(man.read_text()).items()
                                    if "io" in k.lower()}
        return r

    @staticmethod
    def resident(dirs: list[Path]) -> int | None:
        """Page-cache bytes of the weight files under ``dirs`` (``fincore``): after a cold run,
        what the run read of them, readahead included."""
        files = [str(f) for d in dirs for f in sorted(d.glob("*.safetensors"))]
        p = run(["fincore", "-b", "-n", "-o", "RES", *files], check=False)
        return sum(int(x) for x in p.out.split()) if p.rc == 0 else None

    # -- the run -------------------------------------------------------------------------------
    def analyze(self) -> None:
        """MergePipe's ANALYZE once (cached beside the family, keyed by block size)."""
        self.analyzed = self.fam / ".mergepipe" / f"analyzed-{self.args.block_size}.sqlite"
        if self.analyzed.exists():
            self.log(f"MergePipe ANALYZE cached: {self.analyzed}")
            return
        self.analyzed.parent.mkdir(exist_ok=True)
        tmp = self.work / "analyze.sqlite"
        cmd = self.mergepipe_cmd(tmp, self.work / "analyze-out", "analyze", "full", "analyze")
        evict(self.fam)
        self.log("MergePipe ANALYZE (once) ...")
        p = run([PY, "-c", WRAPPER, *cmd], cwd=self.src, env=self.env_mergepipe())
        io = json.loads(p.err.strip().splitlines()[-1])
        shutil.copy(tmp, self.analyzed)
        self.row("MergePipe ANALYZE (once, cached for every merge)",
                 f"{p.wall:.1f} s; read {fmt_bytes(io['read_bytes'])}; peak RSS "
                 f"{fmt_bytes(p.maxrss_bytes)}", "cold", self.shown(cmd, True),
                 wall=p.wall, read_bytes=io["read_bytes"], maxrss=p.maxrss_bytes)

    def row(self, case: str, result: str, cache: str, command: str, **data: Any) -> None:
        self.res.add(Row("mergepipe", case, self.fam.name, cache, result,
                         {"load": os.getloadavg()[0], **data}, command=command))
        self.save()

    def save(self) -> None:
        self.res.write_json(self.res.out / "mergepipe.json")
        (self.res.out / "mergepipe.md").write_text(self.res.markdown())

    def run(self) -> None:
        self.log(f"family {self.fam}: {len(self.experts)} experts, "
                 f"{fmt_bytes(self.expert_bytes)} of expert files")
        run(MERGEFS + ["index", self.spec])
        self.analyze()
        variants = self.variants()
        res: dict[str, list[dict[str, Any]]] = {f"{v['tool']} {v['budget']}": [] for v in variants}
        for rnd in range(self.args.repeats):
            order = variants if rnd % 2 == 0 else list(reversed(variants))
            for v in order:
                key = f"{v['tool']} {v['budget']}"
                res[key].append(self.measure(v))
                self.log(f"round {rnd + 1}: {key}: {res[key][-1]['wall']:.2f} s, read "
                         f"{fmt_bytes(res[key][-1]['read_bytes'])}")
        self.raw["runs"] = res
        evict(self.work)
        full = {v["tool"]: v["result"] for v in variants if v["budget"] == "full"}
        for v in variants:
            key = f"{v['tool']} {v['budget']}"
            rs = res[key]
            dev, dev_delta = ((0.0, 0.0) if v["budget"] == "full" else
                              rel_frobenius(v["result"], full[v["tool"]], self.base))
            rb = median([r["read_bytes"] for r in rs])
            extra = ""
            if "plan_expert_mib" in rs[-1]:
                extra = (f"; its plan: expert I/O {rs[-1]['plan_expert_mib']:.0f} MiB "
                         f"(of {rs[-1]['plan_expert_mib_before']:.0f}), top_p x"
                         f"{rs[-1]['budget_scale']:.3f}")
            self.row(key, f"{median([r['wall'] for r in rs]):.2f} s (runs "
                     f"{', '.join(format(r['wall'], '.2f') for r in rs)}); read_bytes "
                     f"{fmt_bytes(rb)} ({rb / self.family_bytes:.0%} of the family's bytes; rchar "
                     f"{fmt_bytes(median([r['rchar'] for r in rs]))}); expert files in page "
                     f"cache after {cached(rs, 'experts_cached', self.expert_bytes)}, base "
                     f"{cached(rs, 'base_cached')}; peak RSS "
                     f"{fmt_bytes(max(r['maxrss'] for r in rs))}; deviation from its full "
                     f"{dev:.3g} ({dev_delta:.3g} of its merged delta); writes {out_dtypes(v['result'])}{extra}", "cold",
                     self.shown(v["cmd"], v["tool"] == "MergePipe"), deviation=dev, deviation_of_delta=dev_delta,
                     read_bytes=rb, runs=rs)
        ref = full["mergefs"]
        for tool, d in full.items():
            if tool != "mergefs":
                dev, dev_delta = rel_frobenius(d, ref, self.base)
                self.row(f"{tool} full vs mergefs full", f"relative Frobenius {dev:.3g} "
                         f"({dev_delta:.3g} of mergefs' merged delta)", "-",
                         "(outputs of the rows above)")
        self.save()
        print(self.res.markdown())
        print(f"results: {self.res.out}")


def main(argv: list[str] | None = None, prog: str = "python -m bench mergepipe") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mergepipe-src", default=str(RESULTS / "mergepipe-src"),
                    help="a checkout of github.com/wyy-code/mergepipe (default %(default)s)")
    ap.add_argument("--mergepipe-python", default="",
                    help="the interpreter that runs MergePipe (needs numpy, safetensors, torch; "
                         "default this one)")
    ap.add_argument("--family", default=str(FAMILIES / "mp100"),
                    help="made here if missing: 100M parameters x (1 + 4), bf16")
    ap.add_argument("--budgets", default="10%,30%,full")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=640000,
                    help="MergePipe's block in elements (its script's default)")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "mergepipe"))
    args = ap.parse_args(argv)
    if "full" not in args.budgets.split(","):
        ap.error("--budgets must include full (the reference of the deviations)")
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
