"""The benchmark table (issue 5): one table, JSON + CSV + PNG plots under
``<out>/<timestamp>/``.

Its sections (``--sections``; each row says whether its sources were cold or warm in the page
cache):

- index     block-index build throughput vs a plain sequential read of the same files (cold)
- sweep     budget sweep 1..100% for task_arithmetic and ties: expert bytes read (mergefs'
            counters and the block device's), wall time, tight/loose bounds, measured deviation
            from the full merge relative to the weights and to the merge update (cold)
- mergekit  ``mergekit-yaml`` on the same spec (mergefs-only keys stripped into a copy): wall
            time, device bytes, peak RSS, output agreement with mergefs (cold)
- load      time to a loaded model: mount + from_pretrained, merge + from_pretrained,
            mergekit-yaml + from_pretrained (cold)
- serving   sequential and random reads of the mounted weights (first read merges; then warm in
            the kernel's page cache, and warm in mergefs' own cache), vs the materialised file
- memory    peak RSS of the mount process with a cache smaller than the model
- real      the budget sweep on the real all-MiniLM-L6-v2 family (fine-tuned experts)
- sweepmount a 9-variant sweep (weight x budget) through one mount vs nine separate mounts vs
            nine mergekit-yaml runs: wall, source bytes read, bytes written (cold;
            ``python -m bench sweepmount`` runs it alone)
- remote    experts served over HTTP Range and S3 (moto), base local, both on 127.0.0.1 in
            this process: bytes over the wire and requests counted at the server, wall time,
            full vs 10% budget, with and without published index sidecars; output sha256
            compared with the local merge (cold: served files evicted first)

Cold runs call ``os.sync()`` and then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every source
file (and on outputs) first; warm runs do not. Every row carries the command that reproduces it.

    python -m bench table --quick --out /tmp/bench      # tiny family, a few minutes
    python -m bench table                               # full run (~0.5B x 9, MiniLM family)
    python -m bench table --sections mergekit           # one section
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
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
    device_of,
    device_read_bytes,
    evict,
    find_mergekit,
    fmt_bytes,
    gbps,
    mergekit_cmd,
    mergekit_spec,
    mount_available,
    not_run,
    proc_field,
    q,
    read_files,
    run,
    run_py,
    timed_load,
    tree_sha256,
    umount,
    weight_files,
)
from bench.servers import MOTO_ENV

BUDGETS = ("1%", "2%", "5%", "10%", "25%", "50%", "full")
SECTIONS = ("index", "sweep", "mergekit", "load", "serving", "memory", "real", "sweepmount",
            "remote")

# --------------------------------------------------------------------------------------------
# safetensors reading for comparisons (no mergefs import: an independent reader)


def tensor_map(model_dir: Path) -> dict[str, tuple[Path, int, int, str]]:
    out = {}
    for f in weight_files(model_dir):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, v in header.items():
            if name == "__metadata__":
                continue
            s, e = v["data_offsets"]
            out[name] = (f, 8 + n + s, 8 + n + e, v["dtype"])
    return out


def read_f32(loc: tuple[Path, int, int, str]) -> np.ndarray | None:
    f, s, e, dtype = loc
    with open(f, "rb") as fh:
        fh.seek(s)
        raw = fh.read(e - s)
    if dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "F16":
        return np.frombuffer(raw, "<f2").astype(np.float32)
    if dtype == "F32":
        return np.frombuffer(raw, "<f4")
    return None  # integer tensors are not merged


def deviation(budget_dir: Path, full_dir: Path, base_dir: Path) -> dict[str, float]:
    """||M_B - M_full||, ||M_full||, ||M_full - W0|| (float64 sums over all float tensors)."""
    mb, mf, w0 = tensor_map(budget_dir), tensor_map(full_dir), tensor_map(base_dir)
    err = full = upd = 0.0
    for name, loc in mf.items():
        f = read_f32(loc)
        if f is None:
            continue
        b = read_f32(mb[name])
        z = read_f32(w0[name])
        f64 = f.astype(np.float64)
        err += float(np.sum((b.astype(np.float64) - f64) ** 2))
        full += float(np.sum(f64 * f64))
        upd += float(np.sum((f64 - z.astype(np.float64)) ** 2))
    return {"err_norm": math.sqrt(err), "full_norm": math.sqrt(full),
            "update_norm_out": math.sqrt(upd),
            "rel_weights": math.sqrt(err / full) if full else float("nan"),
            "rel_update": math.sqrt(err / upd) if upd else float("nan")}


def agreement(a_dir: Path, b_dir: Path) -> dict[str, Any]:
    """Max abs difference of two outputs, and the max difference in units in the last place
    of the output dtype at the larger magnitude of each differing pair."""
    ma, mb = tensor_map(a_dir), tensor_map(b_dir)
    max_abs = 0.0
    max_ulps = 0.0
    differing = total = 0
    missing = sorted(set(ma) ^ set(mb))
    mantissa = {"BF16": 8, "F16": 11, "F32": 24}
    for name in sorted(set(ma) & set(mb)):
        a, b = read_f32(ma[name]), read_f32(mb[name])
        if a is None or b is None:
            continue
        total += a.size
        d = a != b
        if not d.any():
            continue
        differing += int(d.sum())
        diff = np.abs(a[d].astype(np.float64) - b[d])
        max_abs = max(max_abs, float(np.max(diff)))
        mag = np.maximum(np.abs(a[d]), np.abs(b[d])).astype(np.float64)
        _, e = np.frexp(mag)
        ulp = np.ldexp(1.0, e - mantissa.get(mb[name][3], 24))
        max_ulps = max(max_ulps, float(np.max(diff / ulp)))
    return {"max_abs_diff": max_abs, "max_ulps": max_ulps, "elements_differing": differing,
            "elements": total, "tensor_names_only_in_one": missing}


# --------------------------------------------------------------------------------------------
# the bench


class Table:
    """One run of the table: its sections add rows to ``self.res`` (:class:`Results`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.res = Results(args.out, {**vars(args), "out": str(args.out)})
        self.out, self.work, self.raw = self.res.out, self.res.work, self.res.raw
        self.raw["sweeps"] = {}
        self.log, self.add = self.res.log, self.res.add
        self.repeats = args.repeats if args.repeats else (1 if self.quick else 3)
        self.mount_ok: bool | None = None
        self.mergekit_exe: Path | None = None
        self.full_outputs: dict[str, Path] = {}
        self.sweep_results: dict[tuple[str, str], list[dict[str, Any]]] = {}

    # -- families ----------------------------------------------------------------------------
    def synthetic_family(self) -> Path:
        if self.quick:
            root = self.out / "families" / "tiny"
            families.make_synthetic(root, params=5_000_000, layers=4, n_experts=8,
                                    vocab=4096, seed=0, log=self.log)
            return root
        root = Path(self.args.families).resolve() / "synthetic"
        info_path = root / "family.json"
        want = families.solve_shape(self.args.params, self.args.layers, 32000).params()
        if info_path.is_file():
            info = json.loads(info_path.read_text())
            if info.get("params_per_model") == want and \
                    len(info.get("experts", [])) == self.args.experts:
                self.log(f"reusing {root}")
                return root
        families.make_synthetic(root, params=self.args.params, layers=self.args.layers,
                                n_experts=self.args.experts, seed=0, log=self.log)
        return root

    def real_family(self) -> Path:
        root = (self.out / "families" / "minilm") if self.quick else \
            Path(self.args.families).resolve() / "minilm"
        if (root / "family.json").is_file() and not self.quick:
            self.log(f"reusing {root}")
            return root
        steps = 3 if self.quick else self.args.real_steps
        families.make_minilm(root, n_experts=4, steps=steps,
                             head_steps=steps if self.quick else 300, log=self.log)
        return root

    # -- index -----------------------------------------------------------------------------
    def section_index(self, fam: Path, label: str) -> None:
        base, experts = families.family_dirs(fam)
        files = weight_files(base, *experts)
        total = sum(f.stat().st_size for f in files)
        plain, build = [], []
        plain_code = f"""
            import os, time, json
            files = {[str(f) for f in files]!r}
            buf = bytearray(16 << 20)
            t = time.perf_counter(); n = 0
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                off = 0
                while True:
                    k = os.preadv(fd, [buf], off)
                    if not k: break
                    off += k; n += k
                os.close(fd)
            print(json.dumps({{"seconds": time.perf_counter() - t, "bytes": n}}))
        """
        build_code = f"""
            import time, json
            from mergefs.spec.load import load_spec
            from mergefs.recipe.family import open_family
            from mergefs.index.layout import build_layout
            from mergefs.index.blocks import build_index
            spec = load_spec({str(fam / 'spec.yaml')!r})
            base, experts = open_family(spec)
            layout = build_layout(base, spec.block_size)
            t = time.perf_counter()
            build_index(base, experts, layout)
            s = time.perf_counter() - t
            n = sum(c.counters.bytes_read for c in [base, *experts])
            print(json.dumps({{"seconds": s, "bytes": n}}))
        """
        for _ in range(self.repeats):
            evict(fam)
            r, _ = run_py(plain_code)
            plain.append(r["seconds"])
            evict(fam)
            r, _p = run_py(build_code)
            build.append(r["seconds"])
        tp = gbps(total, statistics.median(plain))
        tb = gbps(total, statistics.median(build))
        ratio = tb / tp
        cmd_plain = f"cat {q([base])}/*.safetensors ... > /dev/null  (16 MiB preads, one thread)"
        self.add(Row("index", "plain sequential read", label, "cold", f"{tp:.2f} GB/s",
                     {"bytes": total, "seconds": plain, "gbps": tp}, command=cmd_plain))
        self.add(Row("index", "index build (2 threads)", label, "cold", f"{tb:.2f} GB/s",
                     {"bytes": total, "seconds": build, "gbps": tb, "ratio_to_plain": ratio},
                     versus=f"{ratio:.0%} of plain read", target=">= 80% of plain read",
                     met=ratio >= 0.8,
                     command=q(MERGEFS + ["index", fam / "spec.yaml", "--rebuild"])))
        run(MERGEFS + ["index", fam / "spec.yaml"])  # leave a valid index for the sweeps

    # -- sweep -----------------------------------------------------------------------------
    def merge_once(self, spec: Path, outdir: Path, budget: str, cold: bool, fam: Path
                   ) -> dict[str, Any]:
        if outdir.exists():
            shutil.rmtree(outdir)
        manifest = self.work / f"{outdir.name}.manifest.jsonl"
        manifest.unlink(missing_ok=True)  # each run writes a new manifest (never overwritten)
        dev = device_of(fam)
        if cold:
            evict(fam)
        d0 = device_read_bytes(dev)
        cmd = MERGEFS + ["merge", spec, outdir, "--budget", budget, "--manifest", manifest]
        p = run(cmd)
        d1 = device_read_bytes(dev)
        totals = {}
        for line in manifest.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("type") == "totals":
                totals = rec
        return {"wall": p.wall, "cpu": p.cpu_seconds, "maxrss": p.maxrss_bytes,
                "device_bytes": (d1 - d0) if d0 is not None and d1 is not None else None,
                "totals": totals, "command": q(cmd)}

    def section_sweep(self, fam: Path, label: str, methods: Sequence[tuple[str, str]],
                      section: str = "sweep") -> None:
        base, _ = families.family_dirs(fam)
        for method, spec_name in methods:
            spec = fam / spec_name
            results = []
            full_dir = self.work / f"{label}-{method}-full"
            budgets = BUDGETS if not (self.quick and method != "task_arithmetic") \
                else ("10%", "full")
            order = ["full"] + [b for b in budgets if b != "full"]
            by_budget: dict[str, dict[str, Any]] = {}
            for budget in order:
                reps = self.repeats if (method == "task_arithmetic" and budget in ("10%", "full")) \
                    else 1
                outdir = full_dir if budget == "full" else self.work / f"{label}-{method}-b"
                runs = [self.merge_once(spec, outdir, budget, True, fam) for _ in range(reps)]
                r = runs[-1]
                r["walls"] = [x["wall"] for x in runs]
                r["wall"] = statistics.median(r["walls"])
                if budget != "full":
                    r["deviation"] = deviation(outdir, full_dir, base)
                    shutil.rmtree(outdir)
                else:
                    r["deviation"] = {"err_norm": 0.0, "rel_weights": 0.0, "rel_update": 0.0}
                r["budget"] = budget
                by_budget[budget] = r
            self.full_outputs[f"{label}:{method}"] = full_dir
            full_wall = by_budget["full"]["wall"]
            full_read = by_budget["full"]["totals"].get("expert_bytes_read", 0)
            for budget in budgets:
                r = by_budget[budget]
                t = r["totals"]
                read = t.get("expert_bytes_read", 0)
                total = t.get("total_expert_bytes", 0)
                dev = r["deviation"]
                speedup = full_wall / r["wall"] if r["wall"] else float("nan")
                result = (f"{r['wall']:.2f} s, experts read {fmt_bytes(read)} "
                          f"({100 * read / total:.1f}% of all)" if total else f"{r['wall']:.2f} s")
                met = None
                target = ""
                if budget == "10%" and method == "task_arithmetic" and section == "sweep":
                    ok_bytes = read <= 0.10 * total
                    ok_time = speedup >= 5
                    ok_dev = dev["rel_weights"] <= 1e-3
                    met = ok_bytes and ok_time and ok_dev
                    target = ("bytes <= 10%: " + ("yes" if ok_bytes else "NO")
                              + f"; >= 5x faster than full: {'yes' if ok_time else 'NO'}"
                              + f"; dev/|W| <= 1e-3: {'yes' if ok_dev else 'NO'}")
                bound = t.get("bound_tight")
                versus = (f"{speedup:.2f}x vs full; dev/|W| {dev['rel_weights']:.2e}, "
                          f"dev/|update| {dev['rel_update']:.1%}")
                if bound is not None and t.get("update_norm"):
                    versus += f"; tight bound/|update| {bound / t['update_norm']:.1%}"
                self.add(Row(section, f"{method} budget {budget}", label, "cold", result,
                             {"wall": r["wall"], "walls": r["walls"], "cpu": r["cpu"],
                              "expert_bytes_read": read, "total_expert_bytes": total,
                              "base_bytes_read": t.get("physical_bytes_read", {}).get("base"),
                              "device_bytes_read": r["device_bytes"],
                              "planned_expert_bytes": t.get("expert_bytes_planned"),
                              "bound_tight": bound, "bound_loose": t.get("bound_loose"),
                              "error_exact_index": t.get("error_exact"),
                              "update_norm_index": t.get("update_norm"),
                              "speedup_vs_full": speedup, "maxrss": r["maxrss"], **dev},
                             versus=versus, target=target, met=met, command=r["command"]))
                results.append({"budget": budget, "read": read, "total": total,
                                "full_read": full_read, "wall": r["wall"], **dev,
                                "bound_tight": bound, "bound_loose": t.get("bound_loose"),
                                "error_exact": t.get("error_exact")})
            self.sweep_results[(label, method)] = results
            self.raw["sweeps"][f"{label}:{method}"] = results
        # one warm pair for reference: the same merges with the sources in the page cache
        if section == "sweep":
            spec = fam / methods[0][1]
            for budget in ("10%", "full"):
                outdir = self.work / f"{label}-warm"
                self.merge_once(spec, outdir, budget, False, fam)  # fill the page cache
                r = self.merge_once(spec, outdir, budget, False, fam)
                shutil.rmtree(outdir)
                t = r["totals"]
                self.add(Row(section, f"{methods[0][0]} budget {budget}", label, "warm",
                             f"{r['wall']:.2f} s, experts read "
                             f"{fmt_bytes(t.get('expert_bytes_read'))}",
                             {"wall": r["wall"], "cpu": r["cpu"]}, command=r["command"]))

    # -- mergekit --------------------------------------------------------------------------
    def mergekit(self) -> Path | None:
        """mergekit-yaml (installed into results/.mergekit-venv if not found), or None when
        ``--quick`` without ``--mergekit``."""
        if self.quick and not self.args.mergekit:
            return None
        if self.mergekit_exe is None:
            self.mergekit_exe = find_mergekit(install=True, log=self.log)
        return self.mergekit_exe

    def section_mergekit(self, fam: Path, label: str) -> None:
        """mergekit vs mergefs, in interleaved pairs (mergefs full, mergekit, ...) so that a
        change in machine load hits both sides alike; medians of the pairs."""
        exe = self.mergekit()
        if exe is None:
            why = "mergekit skipped (--quick)" if self.quick and not self.args.mergekit \
                else "mergekit not installable"
            self.add(not_run("mergekit", "mergekit-yaml task_arithmetic full", label, why,
                             "mergefs full <= 0.5x mergekit wall"))
            return
        spec = fam / "spec.yaml"
        out = self.work / f"{label}-mergekit"
        mf_full = self.work / f"{label}-mk-mergefs-full"
        mf_10 = self.work / f"{label}-mk-mergefs-10"
        dev = device_of(fam)
        mk_walls: list[float] = []
        mf_runs: list[dict[str, Any]] = []
        mf10_runs: list[dict[str, Any]] = []
        cmd: list[str | Path] = []
        p = None
        dev_bytes = None
        for _ in range(1 if self.quick else self.repeats):
            mf_runs.append(self.merge_once(spec, mf_full, "full", True, fam))
            if out.exists():
                shutil.rmtree(out)
            evict(fam)
            d0 = device_read_bytes(dev)
            cmd = mergekit_cmd(exe, mergekit_spec(spec), out)
            p = run(cmd)
            d1 = device_read_bytes(dev)
            mk_walls.append(p.wall)
            dev_bytes = (d1 - d0) if d0 is not None and d1 is not None else None
            mf10_runs.append(self.merge_once(spec, mf_10, "10%", True, fam))
        assert p is not None
        wall = statistics.median(mk_walls)
        mf_wall = statistics.median(r["wall"] for r in mf_runs)
        mf10_wall = statistics.median(r["wall"] for r in mf10_runs)
        agree = agreement(out, mf_full)
        # mergekit's `dtype` is its compute dtype (bf16 here); mergefs always computes in float32
        # and `dtype` is only its output dtype. The same arithmetic in mergekit: float32 compute.
        spec32 = mergekit_spec(spec, "-f32", dtype="float32", out_dtype="bfloat16")
        out32 = self.work / f"{label}-mergekit-f32"
        cmd32 = mergekit_cmd(exe, spec32, out32)
        run(cmd32)
        agree32 = agreement(out32, mf_full)
        shutil.rmtree(out32, ignore_errors=True)
        self.raw["mergekit"] = {"walls": mk_walls, "mergefs_full_walls": [r["wall"] for r in mf_runs],
                                "mergefs_10_walls": [r["wall"] for r in mf10_runs],
                                "device_bytes": dev_bytes, "agreement_same_spec": agree,
                                "agreement_f32_compute": agree32, "maxrss": p.maxrss_bytes}
        mf = mf_runs[-1]
        self.add(Row("mergekit", "mergekit-yaml task_arithmetic (reads everything)", label,
                     "cold", f"{wall:.2f} s, device read {fmt_bytes(dev_bytes)}",
                     {"wall": wall, "walls": mk_walls, "device_bytes_read": dev_bytes,
                      "maxrss": p.maxrss_bytes, "cpu": p.cpu_seconds},
                     versus=f"peak RSS {fmt_bytes(p.maxrss_bytes)}", command=q(cmd)))
        ratio = mf_wall / wall
        self.add(Row("mergekit", "mergefs merge full vs mergekit (paired runs)", label, "cold",
                     f"{mf_wall:.2f} s vs {wall:.2f} s",
                     {"ratio": ratio, "mergefs_walls": [r["wall"] for r in mf_runs],
                      "mergekit_walls": mk_walls, "mergefs_device_bytes": mf["device_bytes"],
                      "mergekit_device_bytes": dev_bytes, "mergefs_maxrss": mf["maxrss"]},
                     versus=f"{ratio:.2f}x mergekit's wall time; mergefs read "
                            f"{fmt_bytes(mf['device_bytes'])} from disk, peak RSS "
                            f"{fmt_bytes(mf['maxrss'])}",
                     target="<= 0.5x", met=ratio <= 0.5, command=mf["command"]))
        mf10 = mf10_runs[-1]
        self.add(Row("mergekit", "mergefs merge 10% vs mergekit (paired runs)", label, "cold",
                     f"{mf10_wall:.2f} s vs {wall:.2f} s",
                     {"ratio": mf10_wall / wall, "mergefs_walls": [r["wall"] for r in mf10_runs],
                      "mergefs_device_bytes": mf10["device_bytes"]},
                     versus=f"{wall / mf10_wall:.1f}x faster; read "
                            f"{fmt_bytes(mf10['device_bytes'])} from disk",
                     command=mf10["command"]))
        for name, a, c, note in (
                ("output agreement, same spec (mergekit computes in bf16)", agree, cmd,
                 ("mergekit's dtype: bfloat16 is its compute dtype: deltas, products and sums "
                  "are rounded to bf16; mergefs computes in float32 (docs/operators.md)")),
                ("output agreement, mergekit computing in float32", agree32, cmd32,
                 "same spec with dtype: float32, out_dtype: bfloat16 for mergekit")):
            ok = a["max_ulps"] <= 1 and not a["tensor_names_only_in_one"]
            self.add(Row("mergekit", name, label, "-",
                         f"max |diff| {a['max_abs_diff']:.3g} = {a['max_ulps']:.2f} ulp of "
                         f"the output dtype; {a['elements_differing']} of {a['elements']} "
                         f"elements differ", a,
                         target="within the output dtype's rounding (<= 1 ulp)", met=ok,
                         command=q(c), note=note))
        for d in (out, mf_full, mf_10):
            shutil.rmtree(d, ignore_errors=True)

    # -- mount helpers -----------------------------------------------------------------------
    def mount_available(self) -> bool:
        if self.mount_ok is None:
            self.mount_ok = mount_available()
            if not self.mount_ok:
                self.log("mount not available (mergefs mount --help, /dev/fuse, fusermount3)")
        return self.mount_ok

    def mount(self, spec: Path, mnt: Path, cache: str, budget: str = "full") -> dict[str, Any]:
        mnt.mkdir(parents=True, exist_ok=True)
        run(MERGEFS + ["mount", spec, mnt, "--cache-size", cache, "--budget", budget])
        return self.stats(mnt)

    def stats(self, mnt: Path) -> dict[str, Any]:
        return json.loads(run(MERGEFS + ["stats", mnt, "--json"]).out)  # type: ignore[no-any-return]

    # -- time to a loaded model ---------------------------------------------------------------
    def section_load(self, fam: Path, label: str, model_bytes: int) -> None:
        spec = fam / "spec.yaml"
        mnt = self.work / "mnt-load"
        results: dict[str, dict[str, Any]] = {}
        variants: list[tuple[str, list[list[str]], Path, Callable[[], None]]] = []
        out_merge = self.work / f"{label}-load-merge"
        cache = str(max(64 << 20, int(model_bytes * 1.25)))
        for budget in ("full",) if self.quick else ("full", "10%"):
            if self.mount_available():
                mnt_b = Path(f"{mnt}-{budget.strip('%')}")
                mnt_b.mkdir(parents=True, exist_ok=True)
                variants.append((f"mergefs mount ({budget}) + from_pretrained",
                                 [[str(c) for c in MERGEFS + ["mount", spec, mnt_b,
                                                              "--cache-size", cache,
                                                              "--budget", budget]]],
                                 mnt_b, lambda m=mnt_b: umount(m)))
            variants.append((f"mergefs merge ({budget}) + from_pretrained",
                             [[str(c) for c in MERGEFS + ["merge", spec, out_merge, "--budget",
                                                          budget, "--force"]]],
                             out_merge, lambda: shutil.rmtree(out_merge, ignore_errors=True)))
        exe = self.mergekit()
        out_mk = self.work / f"{label}-load-mergekit"
        if exe is not None:
            variants.append(("mergekit-yaml + from_pretrained",
                             [mergekit_cmd(exe, mergekit_spec(spec), out_mk)], out_mk,
                             lambda: shutil.rmtree(out_mk, ignore_errors=True)))
        for name, cmds, target, cleanup in variants:
            times = []
            for _ in range(1):
                cleanup()
                evict(fam)
                try:
                    times.append(timed_load(cmds, target))
                finally:
                    cleanup()
            best = sorted(times, key=lambda r: r["total"])[len(times) // 2]
            best["totals"] = [t["total"] for t in times]
            results[name] = best
            self.add(Row("load", name, label, "cold",
                         f"{best['total']:.2f} s (prepare {best['prepare']:.2f} s + "
                         f"from_pretrained {best['load']:.2f} s)", best,
                         command=" && ".join(q(c) for c in cmds)
                         + " && python -c 'AutoModelForCausalLM.from_pretrained(...)'"))
        self.raw["load"] = results
        mk = results.get("mergekit-yaml + from_pretrained")
        mount_full = results.get("mergefs mount (full) + from_pretrained")
        merge_full = results.get("mergefs merge (full) + from_pretrained")
        if mount_full and merge_full:
            same = mount_full["checksum"] == merge_full["checksum"]
            self.add(Row("load", "mount vs merge: same weights loaded", label, "-",
                         "identical checksum" if same else "CHECKSUMS DIFFER",
                         {"mount": mount_full["checksum"], "merge": merge_full["checksum"]},
                         target="bit-identical", met=same))
        if mk is None:
            self.add(not_run("load", "mount + from_pretrained vs mergekit", label,
                             "mergekit skipped (--quick)" if self.quick else "mergekit missing",
                             ">= 2x faster"))
        elif mount_full is None:
            self.add(not_run("load", "mount + from_pretrained vs mergekit", label,
                             "mount not available", ">= 2x faster"))
        else:
            speed = mk["total"] / mount_full["total"]
            self.add(Row("load", "mount (full) + from_pretrained vs mergekit", label, "cold",
                         f"{speed:.2f}x faster", {"speedup": speed}, target=">= 2x faster",
                         met=speed >= 2))

    # -- serving ---------------------------------------------------------------------------
    def section_serving(self, fam: Path, label: str, model_bytes: int) -> None:
        if not self.mount_available():
            for case in ("first read (merging)", "second read (page cache)",
                         "warm read (mergefs cache)", "random 1 MiB reads"):
                self.add(not_run("serving", f"mount sequential {case}", label,
                                 "mount not available",
                                 ">= 1 GB/s" if "warm" in case else ""))
            return
        spec = fam / "spec.yaml"
        mnt = self.work / "mnt-serve"
        cache = str(max(64 << 20, int(model_bytes * 1.5)))
        full_dir = self.full_outputs.get(f"{label}:task_arithmetic")
        if full_dir is None or not full_dir.exists():  # the sweep did not run: make one
            full_dir = self.work / f"{label}-serve-full"
            run(MERGEFS + ["merge", spec, full_dir, "--force"])
        mount_cmd = q(MERGEFS + ["mount", spec, mnt, "--cache-size", cache])
        umount(mnt)
        evict(fam)
        self.mount(spec, mnt, cache)
        try:
            files = weight_files(mnt)
            n, s = read_files(files, 1 << 20, "seq")
            first = gbps(n, s)
            self.add(Row("serving", "mount sequential first read (merging)", label, "cold",
                         f"{first:.2f} GB/s", {"bytes": n, "seconds": s},
                         command=mount_cmd + " && cat MNT/*.safetensors > /dev/null"))
            n, s = read_files(files, 1 << 20, "seq")
            second = gbps(n, s)
            self.add(Row("serving", "mount sequential second read (kernel page cache)", label,
                         "warm", f"{second:.2f} GB/s", {"bytes": n, "seconds": s},
                         target=">= 1 GB/s", met=second >= 1.0, command="(again)"))
            for f in files:  # drop the kernel's copy: reads now reach mergefs' own cache
                evict(f)
            n, s = read_files(files, 1 << 20, "seq")
            fuse_warm = gbps(n, s)
            self.add(Row("serving", "mount sequential read (mergefs cache, through FUSE)",
                         label, "warm", f"{fuse_warm:.2f} GB/s", {"bytes": n, "seconds": s},
                         target=">= 1 GB/s", met=fuse_warm >= 1.0,
                         command="fadvise DONTNEED on MNT files, then read again"))
            for f in files:
                evict(f)
            count = 256 if self.quick else 1024
            n, s = read_files(files, 1 << 20, "random", count)
            self.add(Row("serving", "mount random 1 MiB reads (mergefs cache)", label, "warm",
                         f"{gbps(n, s):.2f} GB/s ({count / s:.0f} reads/s)",
                         {"bytes": n, "seconds": s, "reads": count}))
            n, s = read_files(files, 1 << 20, "random", count, seed=1)
            n2, s2 = read_files(files, 1 << 20, "random", count, seed=1)
            self.add(Row("serving", "mount random 1 MiB reads, second pass (page cache)",
                         label, "warm", f"{gbps(n2, s2):.2f} GB/s", {"bytes": n2,
                                                                      "seconds": s2}))
            st1 = self.stats(mnt)
            self.raw["serving_stats"] = st1
        finally:
            umount(mnt)
        if full_dir is not None and full_dir.exists():
            mfiles = weight_files(full_dir)
            read_files(mfiles, 1 << 20, "seq")  # warm it
            n, s = read_files(mfiles, 1 << 20, "seq")
            self.add(Row("serving", "materialised file sequential read", label, "warm",
                         f"{gbps(n, s):.2f} GB/s", {"bytes": n, "seconds": s},
                         versus=f"mount page-cache read {second:.2f} GB/s, "
                                f"mergefs-cache read {fuse_warm:.2f} GB/s"))
            count = 256 if self.quick else 1024
            n, s = read_files(mfiles, 1 << 20, "random", count)
            self.add(Row("serving", "materialised file random 1 MiB reads", label, "warm",
                         f"{gbps(n, s):.2f} GB/s", {"bytes": n, "seconds": s}))

    # -- memory ----------------------------------------------------------------------------
    def section_memory(self, fam: Path, label: str, model_bytes: int) -> None:
        cache_bytes = (4 << 20) if self.quick else (256 << 20)
        target = f"<= cache + 300 MB = {fmt_bytes(cache_bytes + 300e6)}"
        if not self.mount_available():
            self.add(not_run("memory", "mount peak RSS, cache < model", label,
                             "mount not available", target))
            return
        spec = fam / "spec.yaml"
        mnt = self.work / "mnt-mem"
        umount(mnt)
        evict(fam)
        st = self.mount(spec, mnt, str(cache_bytes))
        pid = st.get("pid")
        try:
            files = weight_files(mnt)
            read_files(files, 1 << 20, "seq")
            for f in files:
                evict(f)
            read_files(files, 1 << 20, "random", 256)
            hwm = proc_field(f"/proc/{pid}/status", "VmHWM", lambda v: int(v.split()[0]) * 1024)
            rss = proc_field(f"/proc/{pid}/status", "VmRSS", lambda v: int(v.split()[0]) * 1024)
            stats = self.stats(mnt)
        finally:
            umount(mnt)
        ok = hwm is not None and hwm <= cache_bytes + 300e6
        self.add(Row("memory", f"mount peak RSS, cache {fmt_bytes(cache_bytes)} < model "
                               f"{fmt_bytes(model_bytes)}", label, "cold",
                     f"{fmt_bytes(hwm)} peak ({fmt_bytes(rss)} now)",
                     {"vm_hwm": hwm, "vm_rss": rss, "cache_bytes": cache_bytes,
                      "cache_stats": stats.get("cache")}, target=target, met=ok,
                     command=q(MERGEFS + ["mount", spec, "MNT", "--cache-size",
                                          str(cache_bytes)])
                     + " && cat MNT/*.safetensors >/dev/null; grep VmHWM /proc/PID/status"))

    # -- output ----------------------------------------------------------------------------
    def plots(self) -> list[str]:
        try:
            import matplotlib
        except ImportError:
            self.log("installing matplotlib into this interpreter (not a mergefs dependency)")
            p = subprocess.run([PY, "-m", "pip", "install", "-q", "matplotlib"], check=False)
            if p.returncode != 0:
                self.log("matplotlib unavailable: no plots")
                return []
            import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        made = []
        for (label, method), res in self.sweep_results.items():
            res = [r for r in res if r["total"] and r["budget"] != "full"]  # full: error 0
            if not res:
                continue
            x = [100 * r["read"] / r["total"] for r in res]
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
            err = [max(r["err_norm"], 1e-12) for r in res]
            a1.plot(x, err, "o-", label="measured ||M_B - M_full||")
            if res[0]["bound_tight"] is not None:
                a1.plot(x, [max(r["bound_tight"] or 0, 1e-12) for r in res], "s--",
                        label="tight bound")
                a1.plot(x, [max(r["bound_loose"] or 0, 1e-12) for r in res], "^--",
                        label="loose bound")
                a1.plot(x, [max(r["error_exact"] or 0, 1e-12) for r in res], "x:",
                        label="exact ||E|| from the index (before output rounding)")
            a1.set_yscale("log")
            a1.set_xlabel("expert bytes read (% of all expert bytes; full budget: error 0)")
            a1.set_ylabel("Frobenius norm")
            a1.set_title(f"{label} {method}: deviation vs bytes read")
            a1.legend(fontsize=7)
            a2.plot(x, [r["wall"] for r in res], "o-")
            for r, xi in zip(res, x):
                a2.annotate(r["budget"], (xi, r["wall"]), fontsize=7)
            a2.set_xlabel("expert bytes read (% of all expert bytes)")
            a2.set_ylabel("wall time, cold (s)")
            a2.set_title("merge wall time (cold)")
            fig.tight_layout()
            path = self.out / f"sweep-{label}-{method}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path.name)
        serving = [r for r in self.res.rows if r.section == "serving" and "GB/s" in r.result]
        if serving:
            fig, ax = plt.subplots(figsize=(9, 3.6))
            vals = [float(r.result.split()[0]) for r in serving]
            ax.barh([f"{r.case} [{r.cache}]" for r in serving], vals)
            ax.set_xlabel("GB/s")
            ax.set_title("serving throughput")
            fig.tight_layout()
            path = self.out / "serving.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path.name)
        return made

    def write(self) -> None:
        self.raw["plots"] = self.plots()
        self.res.write()

    # -- remote ----------------------------------------------------------------------------
    def remote_family(self) -> tuple[Path, str]:
        real = Path(self.args.families).resolve() / "minilm"
        if (real / "family.json").is_file():
            self.log(f"remote: reusing {real}")
            return real, "minilm-real"
        root = (self.out / "families" / "remote") if self.quick else \
            Path(self.args.families).resolve() / "synthetic-remote"
        if not (root / "family.json").is_file():
            families.make_synthetic(root, params=5_000_000 if self.quick else 30_000_000,
                                       layers=4 if self.quick else 8, n_experts=4,
                                       vocab=4096 if self.quick else 32000, seed=0,
                                       log=self.log)
        return root, "synthetic-remote"

    def section_remote(self) -> None:
        """Experts over HTTP Range (RangeHTTPServer) and S3 (moto), base local; bytes and
        requests counted at the server, full vs 10% budget, with and without published
        sidecars. Servers: bench/servers.py, 127.0.0.1 only, in this process."""
        try:
            import moto.moto_server.werkzeug_app  # noqa: F401 (moto[server])
            import s3fs

            from bench.servers import CountingMotoServer, RangeHTTPServer, upload_tree
        except ImportError as e:
            self.add(not_run("remote", "remote experts", "-", f"missing {e.name} "
                             "(pip install 'mergefs[remote]' moto[server])"))
            return
        fam, label = self.remote_family()
        base, experts = families.family_dirs(fam)
        spec0 = yaml.safe_load((fam / "spec.yaml").read_text())
        root = self.work / "remote"
        served = root / "served"
        expert_bytes = sum(f.stat().st_size for f in weight_files(*experts))
        # Two served copies of the experts (hard links): plain/ never gets sidecars, pub/ does.
        for kind in ("plain", "pub"):
            for e in experts:
                for src in e.rglob("*"):
                    if src.is_file():
                        dst = served / kind / e.name / src.relative_to(e)
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        try:
                            os.link(src, dst)
                        except OSError:
                            shutil.copy2(src, dst)
        env = MOTO_ENV
        unset = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
        saved = {k: os.environ.get(k) for k in (*env, *unset)}
        os.environ.update(env)  # moto's dummy credentials, for this process and the merges
        for k in unset:
            os.environ.pop(k, None)
        counter = [0]

        def write_spec(urls: list[str], budget: str, opts: dict[str, Any] | None = None) -> Path:
            counter[0] += 1
            doc = {k: v for k, v in spec0.items() if k not in ("models", "base_model")}
            doc["base_model"] = str(base)
            doc["models"] = [{"model": u, "parameters": m.get("parameters", {})}
                             for u, m in zip(urls, spec0["models"])]
            doc["budget"] = budget
            doc["index_dir"] = str(root / "idx" / f"run{counter[0]}")  # fresh: no local index
            if opts:
                doc["storage_options"] = opts
            p = root / "specs" / f"run{counter[0]}.yaml"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(yaml.safe_dump(doc, sort_keys=False))
            return p

        def merge(spec: Path, budget: str) -> tuple[Proc, dict[str, Any], dict[str, str], list[str]]:
            out = root / "out" / spec.stem
            manifest = root / f"{spec.stem}.manifest.jsonl"
            manifest.unlink(missing_ok=True)  # a manifest is never overwritten: a fresh one
            evict(served, base)
            cmd = MERGEFS + ["merge", spec, out, "--budget", budget, "--manifest", manifest]
            p = run(cmd)
            totals: dict[str, Any] = {}
            for line in manifest.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("type") == "totals":
                    totals = {**totals, **rec}
                elif rec.get("type") == "header":  # the budget the expert reads must fit
                    totals["budget_bytes"] = rec.get("budget_bytes")
            sums = tree_sha256(out)
            shutil.rmtree(out, ignore_errors=True)
            return p, totals, sums, [str(c) for c in cmd]

        http = s3 = None
        try:
            # HTTP is read-only: publish sidecars locally into the served pub/ tree first.
            pub_local = write_spec([str(served / "pub" / e.name) for e in experts], "full")
            run(MERGEFS + ["index", pub_local, "--publish"])
            http = RangeHTTPServer(served).start()
            s3 = CountingMotoServer().start()
            fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True)
            fs.mkdir("bench")
            for e in experts:
                upload_tree(fs, served / "plain" / e.name, f"bench/plain/{e.name}")
                upload_tree(fs, served / "plain" / e.name, f"bench/pub/{e.name}")
            s3opts = {"s3": {"endpoint_url": s3.endpoint}}
            pub_s3 = write_spec([f"s3://bench/pub/{e.name}" for e in experts], "full", s3opts)
            s3.log.reset()
            p = run(MERGEFS + ["index", pub_s3, "--publish"])
            pub_bytes, pub_reqs = s3.log.body_bytes(), len(s3.log.requests())
            self.add(Row("remote", "S3: mergefs index --publish (one-time)", label, "cold",
                         f"{fmt_bytes(pub_bytes)}, {pub_reqs} req, {p.wall:.2f} s",
                         {"wire_bytes": pub_bytes, "requests": pub_reqs, "wall": p.wall,
                          "expert_bytes": expert_bytes},
                         command=q(MERGEFS + ["index", pub_s3, "--publish"]) +
                         "  # moto S3 started by python -m bench table --sections remote"))
            for budget in ("full", "10%"):
                ref_spec = write_spec([str(e) for e in experts], budget)
                pl, _, ref_sums, _ = merge(ref_spec, budget)
                self.add(Row("remote", f"local reference merge, budget {budget}", label, "cold",
                             f"{pl.wall:.2f} s", {"wall": pl.wall, "sha256": ref_sums},
                             command=q(MERGEFS + ["merge", ref_spec, "OUT", "--budget", budget])))
                for proto in ("HTTP", "S3"):
                    for kind in ("plain", "pub"):
                        if proto == "HTTP":
                            srv, opts = http, None
                            urls = [f"{http.url}/{kind}/{e.name}" for e in experts]
                        else:
                            srv, opts = s3, s3opts
                            urls = [f"s3://bench/{kind}/{e.name}" for e in experts]
                        spec = write_spec(urls, budget, opts)
                        srv.log.reset()
                        p, totals, sums, cmd = merge(spec, budget)
                        wire, reqs = srv.log.body_bytes(), len(srv.log.requests())
                        same = sums == ref_sums
                        side = "published sidecars" if kind == "pub" else "no sidecars"
                        self.add(Row(
                            "remote", f"{proto} experts, budget {budget}, {side}", label, "cold",
                            f"{fmt_bytes(wire)} over the wire, {reqs} req, {p.wall:.2f} s",
                            {"wire_bytes": wire, "requests": reqs, "wall": p.wall,
                             "expert_bytes": expert_bytes, "local_wall": pl.wall,
                             "physical_bytes_read": totals.get("physical_bytes_read"),
                             "physical_requests": totals.get("physical_requests"),
                             **{k: totals.get(k) for k in (
                                 "budget_bytes", "expert_bytes_planned", "expert_bytes_read",
                                 "expert_gap_bytes_allowed", "expert_gap_bytes_read")},
                             "same_as_local": same},
                            versus=f"{wire / expert_bytes:.0%} of expert bytes; output "
                                   + ("sha256 = local" if same else "DIFFERS from local"),
                            target="output = local merge", met=same,
                            command=q(cmd).replace(str(root) + "/", "") +
                            f"  # {proto} server started by python -m bench table --sections remote"))
        finally:
            for srv in (http, s3):
                if srv is not None:
                    srv.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(served, ignore_errors=True)

    # -- sweep mount (issue 15) -------------------------------------------------------------
    def section_sweepmount(self) -> None:
        """:mod:`bench.sections.sweepmount`: one 9-variant sweep mount vs 9 mounts vs 9
        mergekit runs."""
        from bench.sections import sweepmount

        params, layers = (5_000_000, 4) if self.quick else (60_000_000, 8)
        root = (self.out / "families" / "sweep") if self.quick else \
            Path(self.args.families).resolve() / "sweep"
        fam = sweepmount.make(root, params, layers, 3, self.log)
        sweepmount.section(self.res, fam, f"synthetic-{params / 1e6:.0f}M-x3")

    # -- driver ----------------------------------------------------------------------------
    def run(self) -> None:
        sections = set(self.args.sections.split(",")) if self.args.sections else None

        def want(name: str) -> bool:
            return sections is None or name in sections

        synthetic = {"index", "sweep", "mergekit", "load", "serving", "memory"}
        try:
            if sections is None or sections & synthetic:
                fam = self.synthetic_family()
                info = json.loads((fam / "family.json").read_text())
                label = "synthetic-tiny" if self.quick else "synthetic-0.5B"
                self.raw["family"] = info
                model_bytes = info["model_bytes"]
                run(MERGEFS + ["index", fam / "spec.yaml"])
            if want("index"):
                self.section_index(fam, label)
            if want("sweep"):
                self.section_sweep(fam, label, [("task_arithmetic", "spec.yaml"),
                                                ("ties", "spec-ties.yaml")])
            if want("mergekit"):
                self.section_mergekit(fam, label)
            if want("load"):
                self.section_load(fam, label, model_bytes)
            if want("serving"):
                self.section_serving(fam, label, model_bytes)
            if want("memory"):
                self.section_memory(fam, label, model_bytes)
            if want("real") and (self.args.real or not self.quick):
                real = self.real_family()
                self.raw["real_family"] = json.loads((real / "family.json").read_text())
                run(MERGEFS + ["index", real / "spec.yaml"])
                self.section_sweep(real, "minilm-real", [("task_arithmetic", "spec.yaml"),
                                                         ("ties", "spec-ties.yaml")],
                                   section="real")
            elif want("real"):
                self.add(not_run("real", "MiniLM fine-tunes budget sweep", "minilm-real",
                                 "skipped in --quick (use --real)"))
            if want("sweepmount") and (not self.quick or sections is not None):
                self.section_sweepmount()
            elif want("sweepmount"):
                self.add(not_run("sweepmount", "9-variant sweep mount vs 9 mounts vs mergekit",
                                 "-", "skipped in --quick (use --sections sweepmount)"))
            if want("remote") and (not self.quick or sections is not None):
                self.section_remote()
            elif want("remote"):
                self.add(not_run("remote", "remote experts (HTTP, S3)", "-",
                                 "skipped in --quick (use --sections remote)"))
        finally:
            self.write()
            if not self.args.keep_work:
                shutil.rmtree(self.work, ignore_errors=True)


def main(argv: list[str] | None = None, prog: str = "python -m bench table") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny synthetic family, 1 repeat, no mergekit and no real family")
    p.add_argument("--out", default=str(RESULTS), help="results root (default results/)")
    p.add_argument("--families", default=str(FAMILIES),
                   help="where the full run's families are made (and reused)")
    p.add_argument("--params", type=families.parse_count, default=500_000_000)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--real-steps", type=int, default=40, help="fine-tuning steps per MiniLM expert")
    p.add_argument("--repeats", type=int, help="repeats of the headline runs (median reported)")
    p.add_argument("--mergekit", action="store_true", help="run mergekit even with --quick")
    p.add_argument("--real", action="store_true", help="run the MiniLM family even with --quick")
    p.add_argument("--sections", help="comma-separated subset: " + ",".join(SECTIONS))
    p.add_argument("--keep-work", action="store_true", help="keep merged outputs")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS) if args.sections else set()
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    Table(args).run()
    return 0
