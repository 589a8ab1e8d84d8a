"""Issue 13's targets table: the lazy path against materialising, side by side, cold, medians.

Its sections (``--sections``; each row: the command, cold or warm, the machine load, the median
of ``--repeats`` runs taken in interleaved rounds, variant order reversed every other round, so
that a change in machine load hits every variant alike):

- load      ``mergefs mount`` (+ ``--warm``) + ``from_pretrained(MNT)`` vs ``mergefs merge`` +
            ``from_pretrained(OUT)`` vs ``mergekit-yaml`` + ``from_pretrained``; full and 10%
- merge     ``mergefs merge --budget full|10%`` vs ``mergekit-yaml``; CPU seconds per GB merged
- serving   first sequential read through a fresh mount (cold sources; full, 10%, ``--warm``);
            read and mmap from mergefs' cache with the kernel's copy dropped (warm)
- index     ``mergefs index --rebuild`` vs a plain sequential read of the same files (cold)
- memory    peak RSS of a mount whose cache is a quarter of the model
- scaling   merge (CPU seconds per GB merged: user + sys of the process, not wall time) and
            mount + from_pretrained with 2 to 24 experts (``--scaling-experts``), on two model
            sizes (``--scaling-sizes``); ``--no-scaling-loads``: the merges only

    python -m bench targets --out results/targets            # ~20 minutes here
    python -m bench targets --sections load,merge --repeats 3
    python -m bench targets --sections load,merge --experts 4,8 --baseline OLD
    python -m bench targets --sections load,merge --family large --repeats 1
    python -m bench targets --sections scaling --scaling-sizes tiny --scaling-experts 8,16,24 \
        --no-scaling-loads --repeats 3 --baseline OLD --baseline-sections scaling

Families (made once with :func:`bench.families.make_synthetic`, then reused): ``small`` (150M
parameters x (1 + 8), bf16, 2.7 GB), ``tiny`` (40M x (1 + 24), 2.0 GB, the last 3 experts
LoRA-merged; for the scaling rows) and ``large`` (the issue's size: 500M x (1 + 8), ~9 GB;
``--family large`` runs the load and merge sections on it) under ``--families``. ``--baseline TREE`` runs the same commands with
``PYTHONPATH=TREE`` (a mergefs source tree, e.g. ``git archive`` of the code before) in the same
rounds. Results: ``<out>/<timestamp>/targets.json`` and ``targets.md`` (the table, written
after every row, so partial results survive).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench import families
from bench.common import (
    FAMILIES,
    MERGEFS,
    RESULTS,
    Results,
    Row,
    evict,
    find_mergekit,
    gbps,
    mergekit_cmd,
    mergekit_spec,
    q,
    read_files,
    read_mmap,
    run,
    timed_load,
    umount,
)

#: the families (``make_synthetic`` arguments; the tiny one has 24 experts for the scaling
#: rows, the last 3 LoRA-merged, so that 8, 16 and 24 experts read 8, 16 and 21 full deltas;
#: the others 8)
SHAPES: dict[str, dict[str, Any]] = {
    "small": {"params": 150_000_000, "layers": 12, "vocab": 16000, "n_experts": 8},
    "tiny": {"params": 40_000_000, "layers": 8, "vocab": 8000, "n_experts": 24, "n_lora": 3},
    # the size (~0.5B parameters per model): base 1 GB + 8 experts, ~9 GB
    "large": {"params": 500_000_000, "layers": 24, "vocab": 32000, "n_experts": 8},
}
SECTIONS = ("load", "merge", "serving", "index", "memory", "scaling")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class Targets:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.res = Results(args.out, vars(args))
        self.out, self.work, self.raw = self.res.out, self.res.work, self.res.raw
        self.log = self.res.log
        exe = find_mergekit()
        self.mergekit = str(exe) if exe else ""

    def row(self, section: str, figure: str, value: str, state: str, command: str,
            target: str = "", met: bool | None = None, **data: Any) -> None:
        """Add a row (the load average now in its metrics) and save the table."""
        self.res.add(Row(section, figure, "", state, value, {"load": os.getloadavg()[0], **data},
                         target=target, met=met if target else None, command=command))
        self.save()

    def save(self) -> None:
        self.res.write_json(self.out / "targets.json")
        (self.out / "targets.md").write_text(self.res.markdown())

    # -- families and specs -----------------------------------------------------------------
    def family(self, name: str) -> Path:
        fam = Path(self.args.families) / name
        if not (fam / "spec.yaml").exists():
            self.log(f"making family {name} in {fam}")
            families.make_synthetic(fam, **SHAPES[name], log=self.log)
        return fam

    def spec(self, fam: Path, n_experts: int = 8) -> Path:
        doc = yaml.safe_load((fam / "spec.yaml").read_text())
        if n_experts == len(doc["models"]):
            return fam / "spec.yaml"
        if n_experts > len(doc["models"]):
            raise SystemExit(f"{fam} has {len(doc['models'])} experts, not {n_experts} "
                             "(remove it to have it made again)")
        doc["models"] = doc["models"][:n_experts]
        path = fam / f"spec-{n_experts}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def mergekit_cmd(self, spec: Path, out: Path) -> list[str]:
        return mergekit_cmd(self.mergekit, mergekit_spec(spec), out)

    @staticmethod
    def model_bytes(fam: Path) -> int:
        return sum(p.stat().st_size for p in (fam / "base").glob("*.safetensors"))

    def baseline_env(self, baseline: bool) -> dict[str, str]:
        """The environment that runs the baseline mergefs (``--baseline``: its source tree)."""
        return {"PYTHONPATH": self.args.baseline} if baseline else {}

    def ensure_index(self, spec: Path) -> None:
        run(MERGEFS + ["index", spec])

    # -- load ----------------------------------------------------------------------------------
    def timed_load(self, cmds: list[list[str]], target: Path, baseline: bool = False
                   ) -> dict[str, Any]:
        return timed_load(cmds, target, self.baseline_env(baseline))

    def load_variants(self, fam: Path, spec: Path, budgets: tuple[str, ...], warm: bool,
                      mergekit: bool) -> list[tuple[str, list[list[str]], Path, Callable[[], None]]]:
        cache = str(int(self.model_bytes(fam) * 1.25))
        out: list[tuple[str, list[list[str]], Path, Callable[[], None]]] = []
        for budget in budgets:
            tag = budget.strip("%")
            # the default (--warm auto), the warm-up at mount time, and none
            for extra in ([], ["--warm"], ["--warm", "off"]) if warm else ([],):
                mnt = self.work / f"mnt-{fam.name}-{tag}{'-'.join(['', *extra])}"
                mnt.mkdir(exist_ok=True)
                out.append((f"mount{' '.join(['', *extra])} {budget}",
                            [[str(c) for c in MERGEFS + ["mount", spec, mnt, "--cache-size", cache,
                                                         "--budget", budget, *extra]]],
                            mnt, lambda m=mnt: umount(m)))
            o = self.work / f"merge-{fam.name}-{tag}"
            out.append((f"merge {budget}", [[str(c) for c in MERGEFS + [
                "merge", spec, o, "--budget", budget, "--force"]]], o,
                lambda o=o: shutil.rmtree(o, ignore_errors=True)))
        if warm and self.baseline_in("load"):
            # the same mount, the baseline code
            for budget in budgets:
                mnt = self.work / f"mnt-{fam.name}-{budget.strip('%')}-base"
                mnt.mkdir(exist_ok=True)
                out.append((f"baseline mount {budget}",
                            [[str(c) for c in MERGEFS + ["mount", spec, mnt, "--cache-size", cache,
                                                         "--budget", budget]]],
                            mnt, lambda m=mnt: umount(m)))
        if mergekit and self.mergekit:
            o = self.work / f"mergekit-{fam.name}"
            out.append(("mergekit-yaml", [self.mergekit_cmd(spec, o)], o,
                        lambda o=o: shutil.rmtree(o, ignore_errors=True)))
        return out

    def run_loads(self, fam: Path, spec: Path, variants: list[Any], repeats: int
                  ) -> dict[str, list[dict[str, Any]]]:
        results: dict[str, list[dict[str, Any]]] = {v[0]: [] for v in variants}
        for rnd in range(repeats):
            order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
            for name, cmds, target, cleanup in order:
                cleanup()
                evict(fam)
                try:
                    results[name].append(self.timed_load(cmds, target,
                                                         name.startswith("baseline")))
                    self.log(f"round {rnd + 1}: {name} + from_pretrained: "
                             f"{results[name][-1]['total']:.2f} s")  # partial results survive
                finally:
                    cleanup()
        return results

    def family_tag(self) -> str:
        return "" if self.args.family == "small" else f", {self.args.family}"

    def baseline_in(self, section: str) -> bool:
        return bool(self.args.baseline) and section in self.args.baseline_sections.split(",")

    def expert_counts(self) -> list[int]:
        return [int(k) for k in self.args.experts.split(",")]

    def section_load(self) -> None:
        for k in self.expert_counts():
            self.load_rows(k)

    def load_rows(self, n_experts: int) -> None:
        fam = self.family(self.args.family)
        spec = self.spec(fam, n_experts)
        self.ensure_index(spec)
        tag = f" ({n_experts} experts{self.family_tag()})"
        variants = self.load_variants(fam, spec, ("full", "10%"), warm=True, mergekit=True)
        res = self.run_loads(fam, spec, variants, self.args.repeats)
        self.raw[f"load-{n_experts}"] = res
        med = {k: median([r["total"] for r in v]) for k, v in res.items()}
        cmd = {v[0]: " && ".join(q(c) for c in v[1]) + " && from_pretrained(...)"
               for v in variants}
        for k, v in res.items():
            self.row("load", f"{k} + from_pretrained{tag}", f"{med[k]:.2f} s (prepare "
                     f"{median([r['prepare'] for r in v]):.2f} + load "
                     f"{median([r['load'] for r in v]):.2f}; runs "
                     f"{', '.join(format(r['total'], '.2f') for r in v)})", "cold", cmd[k])
        sums = {k: v[0]["checksum"] for k, v in res.items()}
        same = len({sums[k] for k in sums if "mergekit" not in k and "full" in k}) == 1
        self.row("load", f"mount and merge load the same weights (full){tag}",
                 "identical checksum" if same else "CHECKSUMS DIFFER", "-", "(same runs)",
                 "bit-identical", same)
        for mount in ("mount full", "mount --warm full", "mount --warm off full"):
            r = med[mount] / med["merge full"]
            self.row("load", f"{mount} + fp vs merge full + fp{tag}", f"{r:.2f}x the time", "cold",
                     "(ratio of the rows above)", "<= 0.8x", r <= 0.8)
        for mount in ("mount", "mount --warm", "mount --warm off"):
            r = med[f"{mount} 10%"] / med[f"{mount} full"]
            self.row("load", f"{mount} 10% vs full (+ fp){tag}", f"{r:.2f}", "cold",
                     "(ratio of the rows above)", "<= 0.4", r <= 0.4)
        for budget in ("full", "10%"):
            if f"baseline mount {budget}" in med:
                r = med[f"baseline mount {budget}"] / med[f"mount --warm {budget}"]
                self.row("load", f"mount --warm {budget} vs the baseline mount (+ fp){tag}",
                         f"{r:.2f}x faster", "cold", "(ratio of the rows above)")
        if "mergekit-yaml" in med:
            for mount in ("mount full", "mount --warm full"):
                r = med["mergekit-yaml"] / med[mount]
                self.row("load", f"{mount} + fp vs mergekit-yaml + fp{tag}", f"{r:.2f}x faster",
                         "cold", "(ratio of the rows above)", ">= 5x faster", r >= 5)

    # -- merge -----------------------------------------------------------------------------------
    def section_merge(self) -> None:
        for k in self.expert_counts():
            self.merge_rows(k)

    def merge_rows(self, n_experts: int) -> None:
        fam = self.family(self.args.family)
        spec = self.spec(fam, n_experts)
        self.ensure_index(spec)
        gb = self.model_bytes(fam) / 1e9
        tag = f" ({n_experts} experts{self.family_tag()})"
        variants: list[tuple[str, list[str], Path]] = []
        for budget in ("full", "10%"):
            for baseline in (False, True) if self.baseline_in("merge") else (False,):
                o = self.work / f"m-{budget.strip('%')}{'-base' if baseline else ''}"
                name = f"{'baseline ' if baseline else ''}mergefs merge --budget {budget}"
                variants.append((name, [str(c) for c in MERGEFS + [
                    "merge", spec, o, "--budget", budget, "--force"]], o))
        if self.mergekit:
            o = self.work / "mk"
            variants.append(("mergekit-yaml", self.mergekit_cmd(spec, o), o))
        walls: dict[str, list[float]] = {v[0]: [] for v in variants}
        cpus: dict[str, list[float]] = {v[0]: [] for v in variants}
        for rnd in range(self.args.repeats):
            for name, cmd, o in (variants if rnd % 2 == 0 else list(reversed(variants))):
                shutil.rmtree(o, ignore_errors=True)
                evict(fam)
                p = run(cmd, env=self.baseline_env(name.startswith("baseline")))
                walls[name].append(p.wall)
                cpus[name].append(p.cpu_seconds)
                self.log(f"round {rnd + 1}: {name}: {p.wall:.2f} s (CPU {p.cpu_seconds:.2f} s)")
                shutil.rmtree(o, ignore_errors=True)
        self.raw[f"merge-{n_experts}"] = {"walls": walls, "cpus": cpus}
        for name, cmd, _ in variants:
            self.row("merge", name + tag, f"{median(walls[name]):.2f} s; CPU "
                     f"{median(cpus[name]) / gb:.2f} s per GB merged (runs "
                     f"{', '.join(f'{w:.2f}' for w in walls[name])})", "cold", q(cmd))
        if self.mergekit:
            mk = median(walls["mergekit-yaml"])
            for budget, target in (("full", 6), ("10%", 20)):
                r = mk / median(walls[f"mergefs merge --budget {budget}"])
                self.row("merge", f"merge --budget {budget} vs mergekit-yaml{tag}",
                         f"{r:.2f}x faster", "cold", "(ratio of the rows above)",
                         f">= {target}x faster", r >= target)
        for budget in ("full", "10%") if self.baseline_in("merge") else ():
            r = median(walls[f"baseline mergefs merge --budget {budget}"]) / \
                median(walls[f"mergefs merge --budget {budget}"])
            self.row("merge", f"merge --budget {budget} vs the baseline merge{tag}",
                     f"{r:.2f}x faster", "cold", "(ratio of the rows above)")

    # -- serving ----------------------------------------------------------------------------------
    def mount_cmd(self, spec: Path, mnt: Path, cache: int, *extra: str) -> list[str]:
        return [str(c) for c in MERGEFS + ["mount", spec, mnt, "--cache-size", str(cache),
                                           *extra]]

    def section_serving(self) -> None:
        fam = self.family("small")
        spec = self.spec(fam)
        self.ensure_index(spec)
        cache = int(self.model_bytes(fam) * 1.25)
        mnt = self.work / "mnt-serve"
        mnt.mkdir(exist_ok=True)
        first: dict[str, list[float]] = {"full": [], "10%": [], "full --warm": []}
        if self.args.baseline:
            first.update({"baseline full": [], "baseline 10%": []})
        for _ in range(self.args.repeats):
            for case, rates in first.items():
                words = case.split()
                base = words[0] == "baseline"
                budget, *extra = words[1:] if base else words
                evict(fam)
                run(self.mount_cmd(spec, mnt, cache, "--budget", budget, *extra),
                    env=self.baseline_env(base))
                try:
                    n, s = read_files(sorted(mnt.glob("*.safetensors")))
                    rates.append(n / s / 1e9)
                finally:
                    umount(mnt)
        for case, xs in first.items():
            v = median(xs)
            self.row("serving", f"first sequential read, fresh mount ({case})",
                     f"{v:.3f} GB/s (runs {', '.join(f'{x:.3f}' for x in xs)})", "cold",
                     q(self.mount_cmd(spec, mnt, cache, "--budget",
                                      *case.replace("baseline ", "").split()))
                     + " && preadv 1 MiB over MNT/*.safetensors", ">= 0.5 GB/s", v >= 0.5)
        # warm: mergefs' cache holds the model, the kernel's copy is dropped before each pass
        for base in ([False, True] if self.args.baseline else [False]):
            rates = self.warm_rates(spec, mnt, cache, base)
            for kind, xs in rates.items():
                self.serving_row(spec, mnt, cache, kind, xs, base)

    def warm_rates(self, spec: Path, mnt: Path, cache: int, base: bool
                   ) -> dict[str, list[float]]:
        run(self.mount_cmd(spec, mnt, cache), env=self.baseline_env(base))
        try:
            files = sorted(mnt.glob("*.safetensors"))
            read_files(files)
            rates: dict[str, list[float]] = {"read": [], "mmap": []}
            for _ in range(self.args.repeats):
                for kind, fn in (("read", read_files), ("mmap", read_mmap)):
                    for f in files:
                        evict(f)
                    n, s = fn(files)
                    rates[kind].append(n / s / 1e9)
            self.raw[f"serving_stats{'_baseline' if base else ''}"] = json.loads(
                run(MERGEFS + ["stats", mnt, "--json"]).out)
        finally:
            umount(mnt)
        return rates

    def serving_row(self, spec: Path, mnt: Path, cache: int, kind: str, xs: list[float],
                    base: bool) -> None:
        v = median(xs)
        self.row("serving", f"{'baseline: ' if base else ''}{kind} from mergefs' cache, "
                 "kernel copy dropped",
                 f"{v:.2f} GB/s (runs {', '.join(f'{x:.2f}' for x in xs)})", "warm",
                 q(self.mount_cmd(spec, mnt, cache)) + " && read once; then fadvise "
                 f"DONTNEED + {'preadv 1 MiB' if kind == 'read' else 'mmap copy-out'}",
                 ">= 0.6 GB/s" if kind == "mmap" else "", v >= 0.6 if kind == "mmap"
                 else None)

    # -- index ----------------------------------------------------------------------------------
    def section_index(self) -> None:
        fam = self.family("small")
        spec = self.spec(fam)
        files = sorted(fam.rglob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        plain: list[float] = []
        build: list[float] = []
        for _ in range(self.args.repeats):
            evict(fam)
            n, s = read_files(files, 16 << 20)
            plain.append(gbps(n, s))
            evict(fam)
            p = run(MERGEFS + ["index", spec, "--rebuild"])
            build.append(total / p.wall / 1e9)
        r = median(build) / median(plain)
        self.row("index", "plain sequential read (16 MiB preadv)", f"{median(plain):.2f} GB/s",
                 "cold", "preadv loop over the family's files")
        self.row("index", "index build", f"{median(build):.2f} GB/s = {r:.2f} of the plain read",
                 "cold", q(MERGEFS + ["index", spec, "--rebuild"]), ">= 0.9", r >= 0.9)

    # -- memory ---------------------------------------------------------------------------------
    def section_memory(self) -> None:
        fam = self.family("small")
        spec = self.spec(fam)
        self.ensure_index(spec)
        cache = self.model_bytes(fam) // 4
        mnt = self.work / "mnt-mem"
        mnt.mkdir(exist_ok=True)
        evict(fam)
        run(self.mount_cmd(spec, mnt, cache))
        try:
            pid = json.loads((mnt / ".mergefs" / "stats.json").read_text())["pid"]
            files = sorted(mnt.glob("*.safetensors"))
            read_files(files)
            rng = random.Random(0)
            buf = bytearray(1 << 20)
            for _ in range(256):
                f = rng.choice(files)
                fd = os.open(f, os.O_RDONLY)
                size = os.fstat(fd).st_size
                os.preadv(fd, [buf], rng.randrange(0, max(1, size - len(buf))) // 4096 * 4096)
                os.close(fd)
            status = {}
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    status[key] = int(value.split()[0]) * 1024
            hwm = status.get("VmHWM", 0)
        finally:
            umount(mnt)
        over = hwm - cache
        self.row("memory", "mount peak RSS (VmHWM), cache = model / 4",
                 f"{hwm / 1e6:.0f} MB = cache + {over / 1e6:.0f} MB", "cold then warm",
                 q(self.mount_cmd(spec, mnt, cache)) + " && full read + 256 random 1 MiB",
                 "<= cache + 200 MB", over <= 200e6)
        # the peak holds file-backed pages (numba's and llvmlite's shared libraries, ~90 MB),
        # which the kernel can reclaim; the anonymous part is what the mount itself allocates
        anon, filed = status.get("RssAnon", 0), status.get("RssFile", 0)
        self.row("memory", "mount RSS at the end: anonymous / file-backed, cache = model / 4",
                 f"{anon / 1e6:.0f} MB = cache + {(anon - cache) / 1e6:.0f} MB / {filed / 1e6:.0f} MB",
                 "cold then warm", "the same run: /proc/PID/status RssAnon, RssFile")

    # -- scaling ----------------------------------------------------------------------------------
    def section_scaling(self) -> None:
        counts = [int(x) for x in self.args.scaling_experts.split(",")]
        trees = (False, True) if self.args.baseline and \
            "scaling" in self.args.baseline_sections.split(",") else (False,)
        for size in self.args.scaling_sizes.split(","):
            fam = self.family(size)
            gb = self.model_bytes(fam) / 1e9
            n_models = len(yaml.safe_load((fam / "spec.yaml").read_text())["models"])
            for k in [k for k in counts if k <= n_models]:
                spec = self.spec(fam, k)
                self.ensure_index(spec)
                o = self.work / "scale-out"
                cpu: dict[bool, list[float]] = {b: [] for b in trees}
                walls: dict[bool, list[float]] = {b: [] for b in trees}
                for r in range(self.args.repeats):  # interleaved rounds, order alternating
                    for baseline in (trees if r % 2 == 0 else trees[::-1]):
                        shutil.rmtree(o, ignore_errors=True)
                        evict(fam)
                        p = run(MERGEFS + ["merge", spec, o, "--force"],
                                env=self.baseline_env(baseline))
                        cpu[baseline].append(p.cpu_seconds / gb)
                        walls[baseline].append(p.wall)
                shutil.rmtree(o, ignore_errors=True)
                for baseline in trees:
                    self.row("scaling", f"{size} ({gb:.2f} GB model), {k} experts, merge"
                             + (" (baseline)" if baseline else ""),
                             f"CPU {median(cpu[baseline]):.2f} s/GB (runs "
                             + ", ".join(f"{c:.2f}" for c in cpu[baseline])
                             + f"); wall {median(walls[baseline]):.2f} s", "cold",
                             q(MERGEFS + ["merge", spec, "OUT", "--force"]),
                             cpu_s_per_gb=cpu[baseline], wall_s=walls[baseline],
                             baseline=baseline)
                if not self.args.scaling_loads:
                    continue
                variants = self.load_variants(fam, spec, ("full",), warm=False, mergekit=False)
                res = self.run_loads(fam, spec, variants, 1)
                mount = res["mount full"][0]["total"]
                merge = res["merge full"][0]["total"]
                self.row("scaling", f"{size} ({gb:.2f} GB model), {k} experts, load",
                         f"mount+fp {mount:.2f} s vs merge+fp {merge:.2f} s = "
                         f"{mount / merge:.2f}x", "cold", "load rows as above")

    def run(self) -> None:
        self.log(f"results in {self.out}")
        for s in self.args.sections.split(","):
            getattr(self, f"section_{s}")()
        self.save()
        self.log(f"done: {self.out / 'targets.md'}")


def main(argv: list[str] | None = None, prog: str = "python -m bench targets") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "targets"))
    ap.add_argument("--families", default=str(FAMILIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--experts", default="8", help="expert counts of the load and merge "
                    "sections, e.g. 4,8 (task arithmetic's kernel runs up to 4)")
    ap.add_argument("--family", default="small", choices=sorted(SHAPES),
                    help="the family of the load and merge sections (large: the issue's "
                    "~0.5B parameters per model, ~9 GB with 8 experts)")
    ap.add_argument("--scaling-experts", default="2,4,8,16",
                    help="expert counts of the scaling section (the tiny family has 24)")
    ap.add_argument("--scaling-sizes", default="tiny,small",
                    help="families of the scaling section")
    ap.add_argument("--no-scaling-loads", dest="scaling_loads", action="store_false",
                    help="the scaling section's merges only (no mount + from_pretrained rows)")
    ap.add_argument("--baseline", default="", help="a mergefs source tree (PYTHONPATH) to run "
                    "beside this one in the load and serving sections, e.g. the code before")
    ap.add_argument("--baseline-sections", default="load,merge,serving",
                    help="sections that run the baseline too")
    args = ap.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    Targets(args).run()
    return 0
