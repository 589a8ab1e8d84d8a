#!/usr/bin/env python3
"""Delta sidecars (issue 14): energy kept, bound, bytes read and wall time per budget.

For a family made by ``scripts/make_family.py`` (a folder with ``spec.yaml``), publishes delta
sidecars (``mergefs compress``, timed) and then merges (``Session`` + ``materialise``, sources
evicted from the page cache first: cold) at budgets given as a share of the experts' *bf16*
bytes, with and without sidecars (exact row blocks), and reports per row:

- energy kept ``1 - ||M_B - M_full||^2 / ||M_full - W0||^2`` (whole model, and transformer
  layers only: tensors named ``*layers.*`` / ``*layer.*``),
- the planner's tight bound relative to ``||M_full - W0||`` and the measured ``||M_B - M_full||``,
- bytes read (exact expert bytes, sidecar bytes) and wall time of the merge,
- with ``--layers-only``, the same with the budget and the plan restricted to the layers.

Decode speed is measured separately (``decode`` section): the time to reconstruct every block of
every expert at its deepest level from sidecar bytes already in memory, against the time to
read the same blocks' exact bytes cold.

    python scripts/bench_sidecar.py --family /tmp/minilm --budgets 5,10,20,full
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from mergefs.compress import publish
from mergefs.engine import Session, open_family
from mergefs.index import load_or_build
from mergefs.plan import make_plan
from mergefs.spec import load_spec

LAYER = re.compile(r"(^|\.)layers?\.\d+\.")


def evict(*dirs: Path) -> None:
    os.sync()
    for d in dirs:
        for p in d.rglob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_f64(d: Path) -> dict[str, np.ndarray]:
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


DECODE = {"seconds": 0.0, "blocks": 0}


def _timed_reconstruct(orig: Any) -> Any:
    def wrapper(self: Any, i: int, name: str, e0: int, w0: Any, full: Any, blocks: Any) -> None:
        t0 = time.perf_counter()
        orig(self, i, name, e0, w0, full, blocks)
        DECODE["seconds"] += time.perf_counter() - t0
        DECODE["blocks"] += len(blocks)
    return wrapper


def replaced_read_seconds(s: Session, sources: list[Path]) -> tuple[float, int]:
    """Cold pread time of the exact expert bytes of every block the plan reconstructed."""
    if s.plan.levels is None:
        return 0.0, 0
    evict(*sources)
    lay = s.index.layout
    total, t0 = 0, time.perf_counter()
    for i, b in zip(*np.nonzero(s.plan.levels)):
        e = s.experts[int(i)]
        loc = e.tensors[lay.tensors[int(lay.tensor_of[b])]]
        item = (loc.end - loc.start) // max(1, int(np.prod(loc.shape)))
        start = loc.start + int(lay.elem_start[b]) * item
        end = loc.start + int(lay.elem_end[b]) * item
        fd = os.open(e.path_of(loc.file), os.O_RDONLY)
        try:
            total += len(os.pread(fd, end - start, start))
        finally:
            os.close(fd)
    return time.perf_counter() - t0, total


def merge(spec: Any, out: Path, sources: list[Path], *, budget: int | None, sidecars: bool,
          plan: Any = None) -> tuple[Session, float]:
    evict(*sources)
    DECODE.update(seconds=0.0, blocks=0)
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
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import make_family  # the experts' corpora: docstrings, licences; man pages held out

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.texts = make_family.corpus_manpages(200_000)[:n]
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
        from mergefs.deltas import find

        found = find(base, experts, index)
    plan = make_plan(spec, masked, budget, sidecars=found)
    for c in [base, *experts]:
        c.close()
    return plan, budget


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, required=True)
    p.add_argument("--spec", default="spec.yaml")
    p.add_argument("--budgets", default="5,10,20,full", help="%% of the experts' bf16 bytes")
    p.add_argument("--layers-only", action="store_true")
    p.add_argument("--no-compress", action="store_true", help="reuse published sidecars")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--embed-metric", action="store_true",
                   help="MiniLM: mean cosine of sentence embeddings to the full merge's")
    args = p.parse_args(argv)
    from mergefs.engine import Engine

    Engine._reconstruct = _timed_reconstruct(Engine._reconstruct)  # type: ignore[method-assign]
    spec = load_spec(str(args.family / args.spec))
    base_dir = Path(spec.base)
    sources = [base_dir, *[Path(e.path) for e in spec.experts]]
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
                       "bytes_read": tot["expert_bytes_read"],
                       "sidecar_bytes": sum(tot.get("sidecar_bytes_read", {}).values()),
                       "share_of_bf16": tot["expert_bytes_read"] / bf16_bytes,
                       "wall_s": round(wall, 2), "decode_s": round(DECODE["seconds"], 3),
                       "blocks_decoded": DECODE["blocks"]}
                if embed is not None:
                    row["cosine_to_full"] = cosine(embed(tmp / "b"), e_full)
                if sidecars and pct is not None:
                    secs, nbytes = replaced_read_seconds(s, sources)
                    row["replaced_exact_bytes"] = nbytes
                    row["replaced_exact_read_cold_s"] = round(secs, 3)
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
                           "wall_s": round(wall, 2)}
                    rows.append(row)
                    print(json.dumps(row))
                if pct is None:
                    break
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
