"""Delta sidecars (issue 14): energy kept, bound, bytes read and wall time per budget.

For a family made by :mod:`bench.families` (a folder with ``spec.yaml``), publishes delta
sidecars (``mergefs compress``, timed) and then merges (``Session`` + ``materialise``, sources
evicted from the page cache first: cold) at budgets given as a share of the experts' *bf16*
bytes, with and without sidecars (exact row blocks), and reports per row:

- energy kept ``1 - ||M_B - M_full||^2 / ||M_full - W0||^2`` (whole model, and transformer
  layers only: tensors named ``*layers.*`` / ``*layer.*``),
- the planner's tight bound relative to ``||M_full - W0||`` and the measured ``||M_B - M_full||``,
- bytes read (exact expert bytes, sidecar bytes) and wall time of the merge,
- with ``--layers-only``, the same with the budget and the plan restricted to the layers.

``--rate-distortion`` prints, instead, what ideal coders would keep at 5/10/20% of bf16 bytes
(:func:`rate_distortion`), to compare the sidecars' figures with.

For a masked-LM MiniLM family (``python -m bench.families minilm``: ``eval/<corpus>.json``
beside the experts) every merge's masked-LM loss on each corpus' held-out passages is reported
too (fixed masks; :func:`bench.families.mlm_loss`). ``--mount`` also serves each sidecar budget through
``mergefs mount SPEC MNT --budget B`` and reads every file (cold sources): wall time, and whether
the bytes equal ``materialise`` at the same budget. ``--http`` serves the experts (and their
published sidecars) over HTTP Range from this process and merges from the URLs, to see what the
sidecars save where reads are slower than decoding.

Decode cost per sidecar row: ``decode_s`` (``Engine._reconstruct``: reading the sidecar ranges
and decoding, summed over the engine's worker threads), ``decode_compute_s`` (the decoding alone,
:func:`mergefs.deltas.decode.decode_into`), and beside them ``replaced_exact_read_cold_s``, the cold
pread of the exact expert bytes those blocks replace, by one thread and (``_2threads_s``) by two
as the engine's workers read. ``python -m bench decode`` times the decoding alone, by one
and two threads, by the sidecars' own arithmetic and by earlier versions' on the same blocks.

    python -m bench sidecar --family /tmp/minilm --budgets 5,10,20,full
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from safetensors.numpy import load_file

from bench import families
from bench.common import MERGEFS, evict, run
from mergefs.deltas.publish import publish
from mergefs.engine.session import Session
from mergefs.index.blocks import load_or_build
from mergefs.plan.planner import make_plan
from mergefs.recipe.family import open_family
from mergefs.spec.load import load_spec

LAYER = re.compile(r"(^|\.)layers?\.\d+\.")


def load_f64(d: Path) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401 (numpy then knows the "bfloat16" safetensors asks for)

    out = {}
    for p in sorted(d.glob("*.safetensors")):
        if "mergefs-" in p.name:
            continue
        for k, v in load_file(str(p)).items():
            if v.dtype.kind == "f" or str(v.dtype) == "bfloat16":
                out[k] = v.astype(np.float64)
    return out


def energy(got: dict[str, np.ndarray], full: dict[str, np.ndarray], w0: dict[str, np.ndarray],
           names: list[str]) -> tuple[float, float, float]:
    """(energy kept, ||M_B - M_full||, ||M_full - W0||) over ``names``."""
    err = sum(float(((got[k] - full[k]) ** 2).sum()) for k in names)
    upd = sum(float(((full[k] - w0[k]) ** 2).sum()) for k in names)
    return 1 - err / upd if upd else 1.0, err ** 0.5, upd ** 0.5


DECODE = {"seconds": 0.0, "blocks": 0, "compute": 0.0}


def _timed_reconstruct(orig: Any) -> Any:
    def wrapper(self: Any, i: int, name: str, e0: int, w0: Any, full: Any, blocks: Any) -> None:
        t0 = time.perf_counter()
        orig(self, i, name, e0, w0, full, blocks)
        DECODE["seconds"] += time.perf_counter() - t0
        DECODE["blocks"] += len(blocks)
    return wrapper


def _timed_decode_into(orig: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        orig(*args, **kwargs)
        DECODE["compute"] += time.perf_counter() - t0
    return wrapper


def replaced_read_seconds(s: Session, sources: list[Path], threads: int = 1
                          ) -> tuple[float, int]:
    """Cold pread time (wall) of the exact expert bytes of every block the plan reconstructed,
    one pread per block; ``threads`` > 1: the blocks in that many contiguous shares, read
    concurrently (as the engine's workers read units)."""
    if s.plan.levels is None:
        return 0.0, 0
    evict(*sources)
    lay = s.index.layout
    spans = []
    for i, b in zip(*np.nonzero(s.plan.levels)):
        e = s.experts[int(i)]
        loc = e.tensors[lay.tensors[int(lay.tensor_of[b])]]
        item = (loc.end - loc.start) // max(1, int(np.prod(loc.shape)))
        spans.append((e.path_of(loc.file), loc.start + int(lay.elem_start[b]) * item,
                      loc.start + int(lay.elem_end[b]) * item))

    def read(share: list[tuple[Any, int, int]]) -> int:
        got = 0
        for path, start, end in share:
            fd = os.open(path, os.O_RDONLY)
            try:
                got += len(os.pread(fd, end - start, start))
            finally:
                os.close(fd)
        return got

    cut = np.linspace(0, len(spans), threads + 1).astype(int)
    shares = [spans[a:b] for a, b in itertools.pairwise(cut)]
    t0 = time.perf_counter()
    if threads == 1:
        total = read(spans)
    else:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, shares))
    return time.perf_counter() - t0, total


def merge(spec: Any, out: Path, sources: list[Path], *, budget: int | None, sidecars: bool,
          plan: Any = None) -> tuple[Session, float]:
    """``Session`` + ``materialise`` into ``out``, sources evicted first (cold)."""
    evict(*sources)
    DECODE.update(seconds=0.0, blocks=0, compute=0.0)
    t0 = time.perf_counter()
    s = Session(spec, budget_bytes=budget, sidecars=sidecars, plan=plan)
    shutil.rmtree(out, ignore_errors=True)
    s.engine.materialise(out)
    wall = time.perf_counter() - t0
    s.finish()
    s.close()
    return s, wall


class Embedder:
    """Sentence embeddings (mean-pooled, normalised) of held-out passages, for MiniLM merges:
    the task metric is the mean cosine between a budgeted merge's embeddings and the full
    merge's (all-MiniLM-L6-v2 ships without a masked-LM head, so no masked-LM loss)."""

    def __init__(self, tokenizer_dir: Path, n: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        # the experts' corpora: docstrings, licences; man pages held out
        self.texts = families.corpus_manpages(200_000)[:n]
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def __call__(self, model_dir: Path) -> np.ndarray:
        import torch
        from transformers import AutoModel

        model = AutoModel.from_pretrained(model_dir).eval()
        enc = self.tok(self.texts, padding=True, truncation=True, max_length=128,
                       return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float64)


def through_mount(spec_path: Path, budget: int, sources: list[Path], tmp: Path,
                  expect: Path) -> dict[str, Any]:
    """Mount ``spec_path`` at ``budget`` bytes (cold sources), read every file; time and
    whether each file equals the materialised merge ``expect``."""
    mnt = tmp / "mnt"
    mnt.mkdir(exist_ok=True)
    evict(*sources)
    t0 = time.perf_counter()
    run([*MERGEFS, "mount", spec_path, mnt, "--budget", f"{budget}B"])
    try:
        ready = time.perf_counter() - t0
        same = True
        for f in sorted(expect.iterdir()):
            if not f.name.endswith(".safetensors") or "mergefs-" in f.name:
                continue
            got = hashlib.sha256((mnt / f.name).read_bytes()).hexdigest()
            same &= got == hashlib.sha256(f.read_bytes()).hexdigest()
        wall = time.perf_counter() - t0
    finally:
        run([*MERGEFS, "umount", mnt], check=False)
    return {"mount_ready_s": round(ready, 2), "mount_read_all_s": round(wall, 2),
            "mount_same_bytes_as_merge": same}


def http_spec(spec_path: Path) -> tuple[Path, Any]:
    """A copy of the spec whose experts are URLs of an HTTP Range server over the family
    folder (their published delta sidecars beside them), the base local, a fresh index_dir;
    returns (its path, the started server)."""
    from bench.servers import RangeHTTPServer

    family = spec_path.parent.resolve()
    server = RangeHTTPServer(family).start()
    doc = yaml.safe_load(spec_path.read_text())
    doc["base_model"] = str((family / doc["base_model"]).resolve())
    for m in doc["models"]:
        rel = (family / m["model"]).resolve().relative_to(family)
        m["model"] = f"{server.url}/{rel.as_posix()}"
    work = Path(tempfile.mkdtemp(prefix="bench-sidecar-http-"))
    doc["index_dir"] = str(work / "index")
    out = work / spec_path.name
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out, server


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum(axis=1).mean())


def layers_only_plan(spec: Any, pct: float, sidecars: bool) -> tuple[Any, int]:
    """A plan whose budget is pct of the layers' bf16 bytes and that reads only layer blocks."""
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    lay = index.layout
    is_layer = np.asarray([bool(LAYER.search(lay.tensors[t])) for t in lay.tensor_of])
    masked = dataclasses.replace(index, zero=index.zero | ~is_layer[None, :])
    elems = (lay.elem_end - lay.elem_start) * is_layer
    budget = int(pct * 2 * elems.sum() * len(experts))
    found = {}
    if sidecars:
        from mergefs.deltas.sidecar import find

        found = find(base, experts, index)
    plan = make_plan(spec, masked, budget, sidecars=found)
    for c in [base, *experts]:
        c.close()
    return plan, budget


#: Lloyd-Max scalar quantiser of a unit Gaussian: mean squared error at 0, 1, 2, ... bits
LLOYD_MAX = np.array([1, 0.3634, 0.1175, 0.03454, 0.009497, 0.002499, 0.000642, 0.000163,
                      4.11e-5, 1.03e-5, 2.6e-6, 6.5e-7, 1.6e-7])


def rate_distortion(spec: Any, pcts: list[float]) -> list[dict[str, Any]]:
    """Energy of the merge update an ideal coder keeps at ``pct`` of the experts' bf16 bytes.

    Each 2-D delta ``c_i D_i`` (of the changed rows only, when fewer than half change) is taken
    as a Gaussian source: ``p = min(m, n)`` components of ``N = max(m, n)`` coefficients of
    variance ``s_k^2 / N`` from its singular values ``s_k``; the experts' errors add (the
    planner's model). 1-D tensors are read exactly (32 bits per element). Three coders share
    one bit budget over all tensors in scope: reverse water-filling (the rate-distortion
    bound; ideal vector coding, the singular basis free), transform coding with integer-bit
    Lloyd-Max scalar quantisers per coefficient (basis free), and low rank with both factors at
    Lloyd-Max bits (the basis paid: ``m + n`` values per component and bit).
    """
    base = {k: v for k, v in load_f64(Path(spec.base)).items()}
    experts = [load_f64(Path(e.path)) for e in spec.experts]
    coeffs = spec.expert_coefficients()
    out = []
    for scope in ("layers", "model"):
        lam, cnt, fac = [], [], []
        elems = n1 = 0
        e1 = tot = 0.0
        for name in sorted(base):
            if scope == "layers" and not LAYER.search(name):
                continue
            for c, e in zip(coeffs, experts):
                d = c * (e[name] - base[name])
                tot += float((d ** 2).sum())
                elems += d.size
                if d.ndim < 2 or min(d.shape) < 2:
                    e1 += float((d ** 2).sum())
                    n1 += d.size
                    continue
                d = d.reshape(d.shape[0], -1)
                changed = (d != 0).any(axis=1)
                if changed.mean() < 0.5:
                    d = d[changed]
                if d.size == 0:
                    continue
                sv = np.linalg.svd(d, compute_uv=False)
                lam.append(sv ** 2 / max(d.shape))
                cnt.append(np.full(sv.size, max(d.shape), dtype=np.float64))
                fac.append(np.full(sv.size, sum(d.shape), dtype=np.float64))
        lam_a, cnt_a, fac_a = np.concatenate(lam), np.concatenate(cnt), np.concatenate(fac)
        for pct in pcts:
            bits = pct * 16 * elems - 32 * n1
            lo, hi = 1e-300, float(lam_a.max())
            for _ in range(300):
                th = (lo * hi) ** 0.5
                rate = float((cnt_a * 0.5 * np.log2(np.maximum(lam_a / th, 1))).sum())
                lo, hi = (th, hi) if rate > bits else (lo, th)
            wf = 1 - (float((cnt_a * np.minimum(lam_a, th)).sum()) + 0.0) / tot
            gain = (lam_a[:, None] * (LLOYD_MAX[:-1] - LLOYD_MAX[1:])[None, :]).ravel()
            cost = np.repeat(cnt_a, LLOYD_MAX.size - 1)
            o = np.argsort(-gain, kind="stable")
            take = o[np.cumsum(cost[o]) <= bits]
            sq = (float((gain[take] * cost[take]).sum()) + e1) / tot
            err = 1 - (1 - LLOYD_MAX) ** 2  # both factors quantised
            g2 = ((lam_a * cnt_a)[:, None] * (err[:-1] - err[1:])[None, :]).ravel()
            c2 = np.repeat(fac_a, LLOYD_MAX.size - 1)
            o = np.argsort(-(g2 / c2), kind="stable")
            take = o[np.cumsum(c2[o]) <= bits]
            lr = (float(g2[take].sum()) + e1) / tot
            out.append({"row": "rate-distortion", "scope": scope, "budget": round(pct * 100, 2),
                        "bits_per_element": round(pct * 16, 2), "water_filling": round(wf, 4),
                        "lloyd_max_transform": round(sq, 4),
                        "lowrank_lloyd_max": round(lr, 4)})
            print(json.dumps(out[-1]))
    return out


def main(argv: list[str] | None = None, prog: str = "python -m bench sidecar") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, required=True)
    p.add_argument("--spec", default="spec.yaml")
    p.add_argument("--budgets", default="5,10,20,full", help="%% of the experts' bf16 bytes")
    p.add_argument("--layers-only", action="store_true")
    p.add_argument("--no-compress", action="store_true", help="reuse published sidecars")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--embed-metric", action="store_true",
                   help="MiniLM: mean cosine of sentence embeddings to the full merge's")
    p.add_argument("--http", action="store_true",
                   help="serve the experts over HTTP Range (bench/servers.py, 127.0.0.1, in this "
                   "process; the base stays local) and merge from the URLs: sidecars must be "
                   "published already (implies --no-compress)")
    p.add_argument("--mount", action="store_true",
                   help="also serve each sidecar budget through mergefs mount and read it all")
    p.add_argument("--decode-limit", default=None,
                   help="plan with this spec decode_limit (a number, or none) instead of the "
                   "spec's own: written to a copy of the spec beside it, so the mount plans "
                   "the same")
    p.add_argument("--rate-distortion", action="store_true",
                   help="print what ideal coders keep at the budgets, and stop")
    args = p.parse_args(argv)
    if args.rate_distortion:
        rd = rate_distortion(load_spec(str(args.family / args.spec)),
                             [float(b) / 100 for b in args.budgets.split(",") if b != "full"])
        if args.json:
            args.json.write_text(json.dumps(rd, indent=1) + "\n")
        return 0
    from mergefs.engine.merger import Engine

    Engine._reconstruct = _timed_reconstruct(Engine._reconstruct)  # type: ignore[method-assign]
    from mergefs.deltas import decode as deltadecode

    deltadecode.decode_into = _timed_decode_into(deltadecode.decode_into)  # the kernel alone
    spec_path = args.family / args.spec
    if args.decode_limit is not None:
        doc = yaml.safe_load(spec_path.read_text())
        doc["decode_limit"] = args.decode_limit if args.decode_limit == "none" \
            else float(args.decode_limit)
        spec_path = spec_path.with_name(f"{spec_path.stem}.decode-{args.decode_limit}.yaml")
        spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    server = None
    if args.http:
        spec_path, server = http_spec(spec_path)
        args.no_compress = True
    spec = load_spec(str(spec_path))
    base_dir = Path(spec.base)
    sources = [base_dir, args.family] if server else \
        [base_dir, *[Path(e.path) for e in spec.experts]]
    base, experts = open_family(spec)
    index, _ = load_or_build(base, experts, spec.block_size, spec.index_dir)
    lay = index.layout
    total_elems = int((lay.elem_end - lay.elem_start).sum()) * len(experts)
    bf16_bytes = 2 * total_elems
    rows: list[dict[str, Any]] = []
    if not args.no_compress:
        t0 = time.perf_counter()
        paths = publish(base, experts, index)
        sizes = [Path(q).stat().st_size for q in paths]
        rows.append({"row": "compress", "seconds": round(time.perf_counter() - t0, 2),
                     "sidecar_bytes": sum(sizes),
                     "sidecar_share_of_bf16": sum(sizes) / bf16_bytes})
        print(json.dumps(rows[-1]))
    for c in [base, *experts]:
        c.close()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
    try:
        s_full, wall_full = merge(spec, tmp / "full", sources, budget=None, sidecars=False)
        full = load_f64(tmp / "full")
        w0 = load_f64(base_dir)
        embed = Embedder(base_dir) if args.embed_metric else None
        e_full = embed(tmp / "full") if embed else None
        mlm = families.MlmLoss(args.family, base_dir) if (args.family / "eval").is_dir() \
            else None
        if mlm is not None:
            for what, d in (("base", base_dir), ("full merge", tmp / "full")):
                rows.append({"row": "mlm_loss", "model": what, "loss": mlm(d)})
                print(json.dumps(rows[-1]))
        if embed is not None:
            rows.append({"row": "embed", "what": "base (no expert read) vs full merge",
                         "cosine": cosine(embed(base_dir), e_full)})
            print(json.dumps(rows[-1]))
        names = sorted(full)
        layer_names = [k for k in names if LAYER.search(k)]
        rows.append({"row": "full", "wall_s": round(wall_full, 2),
                     "expert_bytes_read": s_full.totals_record()["expert_bytes_read"]})
        print(json.dumps(rows[-1]))
        for b in args.budgets.split(","):
            pct = None if b == "full" else float(b) / 100
            for sidecars in (False, True):
                budget = None if pct is None else int(pct * bf16_bytes)
                if server is not None:
                    server.log.reset()
                s, wall = merge(spec, tmp / "b", sources, budget=budget, sidecars=sidecars)
                got = load_f64(tmp / "b")
                kept, err, upd = energy(got, full, w0, names)
                kept_l, _, _ = energy(got, full, w0, layer_names)
                tot = s.totals_record()
                row = {"row": "model", "budget": b, "sidecars": sidecars,
                       "kept": round(kept, 5), "kept_layers": round(kept_l, 5),
                       "err_rel": err / upd,
                       "bound_rel": (s.plan.bound_tight / upd) if s.plan.bound_tight is not None
                       else None,
                       # the bound on the output bytes (rounding included): what err_rel,
                       # measured on the output files, must stay below
                       "bound_output_rel": (s.plan.bound_output_tight / upd)
                       if s.plan.bound_output_tight is not None else None,
                       "bytes_read": tot["expert_bytes_read"],
                       "sidecar_bytes": sum(tot.get("sidecar_bytes_read", {}).values()),
                       "sidecar_gap_bytes": sum(tot.get("sidecar_gap_bytes_read", {}).values()),
                       "share_of_bf16": tot["expert_bytes_read"] / bf16_bytes,
                       "wall_s": round(wall, 2), "blocks_decoded": DECODE["blocks"],
                       "decode_s": round(DECODE["seconds"], 3),
                       "decode_compute_s": round(DECODE["compute"], 3),
                       "decode_model_s": s.plan.decode_seconds,
                       "replaced_read_model_s": s.plan.replaced_read_seconds,
                       "decode_limit": s.plan.decode_limit}
                if sidecars and pct is not None and server is None:  # the reads it replaces
                    secs, nbytes = replaced_read_seconds(s, sources)
                    row["replaced_exact_read_cold_s"] = round(secs, 3)
                    row["replaced_exact_read_cold_2threads_s"] = round(
                        replaced_read_seconds(s, sources, 2)[0], 3)
                    row["replaced_exact_bytes"] = nbytes
                if server is not None:  # GETs of the merge (its index is already built)
                    got_requests = [r for r in server.log.served if r.method == "GET"]
                    row["http_gets"] = len(got_requests)
                    row["http_sidecar_gets"] = sum("mergefs-delta" in r.path
                                                   for r in got_requests)
                if embed is not None:
                    row["cosine_to_full"] = cosine(embed(tmp / "b"), e_full)
                if mlm is not None and pct is not None:
                    row["mlm_loss"] = mlm(tmp / "b")
                if args.mount and sidecars and pct is not None:
                    row.update(through_mount(spec_path, budget, sources, tmp,
                                             tmp / "b"))
                rows.append(row)
                print(json.dumps(row))
                if pct is not None and args.layers_only:
                    plan, lb = layers_only_plan(spec, pct, sidecars)
                    s, wall = merge(spec, tmp / "b", sources, budget=None, sidecars=sidecars,
                                    plan=plan)
                    got = load_f64(tmp / "b")
                    kept_l, err_l, upd_l = energy(got, full, w0, layer_names)
                    tot = s.totals_record()
                    row = {"row": "layers", "budget": b, "sidecars": sidecars,
                           "kept_layers": round(kept_l, 5), "err_rel": err_l / upd_l,
                           "bytes_read": tot["expert_bytes_read"], "budget_bytes": lb,
                           "wall_s": round(wall, 2), "decode_s": round(DECODE["seconds"], 3),
                           "decode_compute_s": round(DECODE["compute"], 3),
                           "decode_model_s": plan.decode_seconds,
                           "replaced_read_model_s": plan.replaced_read_seconds}
                    if sidecars:
                        row["replaced_exact_read_cold_s"] = round(
                            replaced_read_seconds(s, sources)[0], 3)
                    rows.append(row)
                    print(json.dumps(row))
                if pct is None:
                    break
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.stop()
            shutil.rmtree(spec_path.parent, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0

