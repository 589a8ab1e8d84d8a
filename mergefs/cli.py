"""The ``mergefs`` command line: index, plan, merge, replay, mount, umount, stats.

Maps domain errors (:class:`MergefsError`) to one clear line on stderr and exit code 1 (2 for
usage errors); ``--debug`` shows tracebacks and debug logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import MergefsError
from .progress import byte_progress
from .spec import Spec, human_bytes, load_spec, parse_budget

log = logging.getLogger("mergefs")

EPILOG = """\
A spec is a mergekit YAML config (merge_method, base_model, models, parameters, dtype) plus
mergefs keys: budget (full, 10%, 0.1, 2GiB), block_size (1MiB), index_dir, cache, manifest.

typical session:
  mergefs index spec.yaml                  # one pass over base + experts, reused afterwards
  mergefs plan spec.yaml --budget 10%      # what 10% of expert bytes buys (bounds, blocks)
  mergefs merge spec.yaml out/ --budget 10%
  mergefs replay spec.manifest.jsonl       # re-read and verify every byte
  mergefs mount spec.yaml /mnt/merged      # lazy merged HF directory; from_pretrained works
"""


def _load(args: argparse.Namespace) -> Spec:
    spec = load_spec(args.spec)
    if getattr(args, "budget", None) is not None:
        try:
            spec = spec.with_budget(parse_budget(args.budget))
        except MergefsError as exc:
            raise MergefsError(f"--budget: {exc}") from None
        if spec.method == "slerp" and not spec.budget.is_full:
            raise MergefsError("--budget: slerp has no base deltas to skip; use --budget full")
    return spec


def _session(spec: Spec, manifest: Any = None, quiet: bool = False) -> Any:
    from .engine import Session, open_family
    from .index import build_layout, index_bytes_total

    base, experts = open_family(spec)
    total = index_bytes_total(base, experts, build_layout(base, spec.block_size))
    with byte_progress("indexing", total, enabled=not quiet) as tick:
        return Session(spec, manifest=manifest, on_index_bytes=tick, family=(base, experts))


def cmd_index(args: argparse.Namespace) -> int:
    from .engine import open_family
    from .index import build_layout, index_bytes_total, load_or_build

    spec = _load(args)
    base, experts = open_family(spec)
    total = index_bytes_total(base, experts, build_layout(base, spec.block_size))
    with byte_progress("indexing", total) as tick:
        # --rebuild and --publish read every source: sidecars are never built from sidecars.
        index, built = load_or_build(base, experts, spec.block_size, spec.index_dir, tick,
                                     rebuild=args.rebuild,
                                     sidecars=not (args.rebuild or args.publish))
    n_zero = int(index.zero.sum())
    print(f"{'built' if built else 'reused'} index {index.key[:16]} in {spec.index_dir}: "
          f"{len(experts)} experts x {index.layout.n_blocks} blocks of ~{human_bytes(spec.block_size)}"
          f", {n_zero} zero-delta expert blocks")
    if args.tensors:
        Console().print(_tensor_table(spec, index, args.tensors))
    if args.publish:
        from .sidecar import publish

        for where in publish(base, experts, index):
            print(f"published {where}")
    return 0


def _tensor_table(spec: Spec, index: Any, top: int) -> Table:
    """The ``top`` tensors by delta norm (summed over experts): where the merge update lives."""
    norms = index.tensor_norms()  # (N, T)
    lay = index.layout
    zero_share = []
    for t in range(len(lay.tensors)):
        blocks = lay.blocks_of(t)
        zero_share.append(float(index.zero[:, blocks.start:blocks.stop].mean()) if blocks else 1.0)
    order = sorted(range(len(lay.tensors)), key=lambda t: (-float(norms[:, t].sum()), t))[:top]
    table = Table(title=f"largest deltas by tensor (top {len(order)} of {len(lay.tensors)})")
    table.add_column("tensor")
    for i in range(norms.shape[0]):
        table.add_column(f"||D_{i}||", justify="right")
    table.add_column("zero-delta blocks", justify="right")
    for t in order:
        table.add_row(lay.tensors[t], *[f"{norms[i, t]:.4g}" for i in range(norms.shape[0])],
                      f"{zero_share[t]:.0%}")
    return table


def _plan_table(spec: Spec, session: Any) -> Table:
    plan = session.plan
    rep = plan.report()
    table = Table(title=f"plan {rep['plan_hash'][:16]}  ({spec.method}, budget "
                        f"{spec.budget.describe()})", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    pct = (lambda a, b: f"  ({100 * a / b:.1f}%)" if b else "")
    table.add_row("budget", f"{human_bytes(rep['budget_bytes'])}{pct(rep['budget_bytes'], rep['total_expert_bytes'])}")
    table.add_row("planned expert reads", f"{human_bytes(rep['planned_expert_bytes'])}"
                  f"{pct(rep['planned_expert_bytes'], rep['total_expert_bytes'])}")
    table.add_row("non-zero expert bytes", human_bytes(rep["nonzero_expert_bytes"]))
    table.add_row("all expert bytes", human_bytes(rep["total_expert_bytes"]))
    table.add_row("expert blocks read / total", f"{rep['blocks_read']} / {rep['blocks_total']}"
                  f"  ({rep['blocks_zero']} zero-delta)")
    if rep["bound_tight"] is not None:
        table.add_row("||E|| tight bound", f"{rep['bound_tight']:.6g}")
        table.add_row("||E|| loose bound", f"{rep['bound_loose']:.6g}")
        exact, update = rep["error_exact"], rep["update_norm"]
        table.add_row("||E|| exact (from index)",
                      "- (index from sidecars)" if exact is None else f"{exact:.6g}")
        table.add_row("||sum c_i D_i|| (merge update)", "-" if update is None else f"{update:.6g}")
        rel = rep["bound_relative_to_update"]
        table.add_row("tight bound / update", "-" if rel is None else f"{rel:.3%}")
    else:
        table.add_row("error bound", f"none ({spec.method} is not additive; exact at full)")
    return table


def cmd_plan(args: argparse.Namespace) -> int:
    spec = _load(args)
    session = _session(spec, quiet=args.json)
    try:
        if args.json:
            print(json.dumps(session.plan.report(), sort_keys=True))
        else:
            Console().print(_plan_table(spec, session))
    finally:
        session.close()
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from .manifest import ManifestWriter

    spec = _load(args)
    manifest = ManifestWriter(args.manifest or spec.manifest)
    session = _session(spec, manifest)
    try:
        out_bytes = sum(f.size_bytes for f in session.engine.out_files)
        with byte_progress("merging", out_bytes) as tick:
            session.engine.materialise(args.outdir, on_bytes=tick, overwrite=args.force)
        totals = session.finish()
    finally:
        session.close()
    read = totals["physical_bytes_read"]
    print(f"merged into {args.outdir} in {totals['wall_seconds']:.2f}s: read "
          f"{human_bytes(totals['expert_bytes_read'])} of {human_bytes(totals['total_expert_bytes'])} "
          f"expert bytes ({human_bytes(read['base'])} base); manifest {manifest.path}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import replay

    res = replay(args.manifest, args.out, overwrite=args.force)
    torn = f"; ignored {res.torn_lines} torn line(s)" if res.torn_lines else ""
    print(f"replay OK (plan {res.plan_hash[:16]}): {res.reads_verified} source ranges, "
          f"{res.outputs_verified} outputs, {res.tensors_verified} tensors verified{torn}")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from .mount import run_mount

    return run_mount(args, _load(args))


def cmd_umount(args: argparse.Namespace) -> int:
    from .mount import run_umount

    return run_umount(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from .mount import run_stats

    return run_stats(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mergefs",
        description="Budgeted, lazy, verifiable merging of model checkpoints (safetensors).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mergefs {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    budget_help = "override the spec's budget: full, 10%%, 0.1 or a size like 2GiB"

    s = sub.add_parser("index", help="build (or reuse) the block index of a spec's family",
                       description="Read base and experts once; store per-block delta norms, "
                       "hashes and zero flags under index_dir. Reused while sources are unchanged.")
    s.add_argument("spec")
    s.add_argument("--rebuild", action="store_true", help="rebuild even if a valid index exists")
    s.add_argument("--tensors", type=int, default=0, metavar="N",
                   help="also list the N tensors with the largest deltas (per-expert norms)")
    s.add_argument("--publish", action="store_true",
                   help="also write each expert's block index beside it "
                   "(mergefs-index.<base-key>.<block_size>.safetensors), so later plans over "
                   "remote experts need not read them")
    s.set_defaults(func=cmd_index)

    s = sub.add_parser("plan", help="show which expert blocks a budget reads and its error bound",
                       description="Plan the expert reads for a budget (deterministic) and report "
                       "bytes, blocks, bounds on the merge error and the plan hash.")
    s.add_argument("spec")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("merge", help="materialise the merge as a Hugging Face directory",
                       description="Read base + planned expert blocks, merge, write OUTDIR "
                       "(safetensors shards mirroring the base, non-weight files copied) and "
                       "a manifest of every byte read.")
    s.add_argument("spec")
    s.add_argument("outdir")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--manifest", help="manifest path (default: the spec's manifest key)")
    s.add_argument("--force", action="store_true", help="write into a non-empty OUTDIR")
    s.set_defaults(func=cmd_merge)

    s = sub.add_parser("replay", help="re-execute a manifest's plan and verify every byte",
                       description="Re-read every recorded source range, check its hash, "
                       "re-merge and check every output hash. Fails naming a changed source.")
    s.add_argument("manifest")
    s.add_argument("--out", help="also write the merged model here")
    s.add_argument("--force", action="store_true", help="write into a non-empty --out")
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("mount", help="mount the merge as a lazy read-only HF model directory",
                       description="Expose a virtual merged model directory at MOUNTPOINT; "
                       "tensor reads merge only the blocks they need (budgeted, cached). "
                       "Returns once the mount is ready unless --foreground.")
    s.add_argument("spec")
    s.add_argument("mountpoint")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--cache-size", help="memory cache of merged blocks (default: 1/4 of RAM, "
                   "at most 8GiB)")
    s.add_argument("--cache-dir", help="persistent cache of merged blocks, keyed by plan hash")
    s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C unmounts")
    s.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    s.add_argument("--warm", action="store_true",
                   help="merge the whole model (up to the cache size) at mount time and push it "
                        "into the kernel page cache")
    s.set_defaults(func=cmd_mount)

    s = sub.add_parser("umount", help="unmount (also clears a mount whose process died)")
    s.add_argument("mountpoint")
    s.set_defaults(func=cmd_umount)

    s = sub.add_parser("stats", help="print a mount's live counters")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print stats.json as is")
    s.set_defaults(func=cmd_stats)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="mergefs: %(message)s", stream=sys.stderr)
    for name in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp"):
        # Their debug logs show request headers (signatures, key ids): never on our stderr.
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except MergefsError as exc:
        if args.debug:
            raise
        print(f"mergefs: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if args.debug:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"mergefs: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mergefs: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
