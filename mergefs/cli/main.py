"""The ``mergefs`` command line: index, plan, sweep, merge, replay, mount, reload, umount, stats.

Maps domain errors (:class:`MergefsError`) to one clear line on stderr and exit code 1 (2 for
usage errors); ``--debug`` shows tracebacks and debug logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from mergefs.core.version import __version__
from mergefs.core.errors import MergefsError
from mergefs.core.progress import byte_progress
from mergefs.spec.model import Spec
from mergefs.core.sizes import human_bytes
from mergefs.spec.load import load_spec
from mergefs.spec.budget import parse_budget

log = logging.getLogger("mergefs")

EPILOG = """\
A spec is a mergekit YAML config (merge_method, base_model, models, parameters, dtype) plus
mergefs keys: budget (full, 10%, 0.1, 2GiB), block_size (1MiB), index_dir, cache, manifest,
decode_limit (none; N: with local delta sidecars, decode at most N x the exact read it replaces).

typical session:
  mergefs index spec.yaml                  # one pass over base + experts, reused afterwards
  mergefs plan spec.yaml --budget 10%      # what 10% of expert bytes buys (bounds, blocks)
  mergefs merge spec.yaml out/ --budget 10%
  mergefs replay spec.manifest.jsonl       # re-read and verify every byte
  mergefs mount spec.yaml /mnt/merged      # lazy merged HF directory; from_pretrained works

sweeps (see `mergefs mount --help`, `mergefs reload --help`):
  mergefs sweep spec.yaml --budgets 1%,10%,full --plot s.png   # what budgets buy, no reads
  mergefs mount sweep.yaml /mnt/sweep      # every variant of a sweep: spec, one mount
  mergefs reload /mnt/sweep                # add the variants an edited sweep.yaml lists
"""


def _sources(spec: Spec) -> list[str]:
    """Every local or remote source the spec reads (outputs must never land in one)."""
    return spec.model_paths


def _load(args: argparse.Namespace, any_variant: bool = False) -> Spec:
    """The spec; of a sweep spec, the ``--variant`` named (or, with ``any_variant``, the
    first: every variant has the same family and index)."""
    from mergefs.engine.output import check_writes
    from mergefs.spec.variants import is_sweep, load_variant, load_variants, read_doc

    strict = getattr(args, "strict", False)
    variant = getattr(args, "variant", None)
    if is_sweep(read_doc(args.spec)):
        if variant is not None:
            spec = load_variant(args.spec, variant, strict)
        elif any_variant:
            spec = load_variants(args.spec, strict)[0][1]
        else:
            names = [v.name for v, _ in load_variants(args.spec, strict)]
            raise MergefsError(f"{args.spec} is a sweep of {len(names)} variants: choose one with "
                               f"--variant NAME ({', '.join(names[:6])}"
                               f"{', ...' if len(names) > 6 else ''}), or mount them all")
    elif variant is not None:
        raise MergefsError(f"--variant: {args.spec} has no sweep or variants")
    else:
        spec = load_spec(args.spec, strict=strict)
    check_writes(_sources(spec), index_dir=spec.index_dir)
    if getattr(args, "budget", None) is not None:
        spec = spec.with_budget(parse_budget(args.budget, "--budget"))
    return spec


def _session(spec: Spec, manifest: Any = None, quiet: bool = False,
             family: Any = None, ray: str | None = None) -> Any:
    from mergefs.engine.session import Session, prepare_family
    from mergefs.index.layout import build_layout
    from mergefs.index.blocks import index_bytes_total

    base, experts = family if family is not None else prepare_family(spec)
    runner = _ray_runner(ray, spec, base, experts)
    total = index_bytes_total(base, experts, build_layout(base, spec.block_size))
    with byte_progress("indexing", total, enabled=not quiet) as tick:
        return Session(spec, manifest=manifest, on_index_bytes=tick, family=(base, experts),
                       index_runner=runner)


def _ray_runner(ray: str | None, spec: Spec, base: Any, experts: Any) -> Any:
    """The index build's chunk runner for ``--ray [ADDRESS]`` (None: local threads)."""
    if ray is None:
        return None
    from mergefs.engine.ray_index import RayChunkRunner

    return RayChunkRunner(spec, base, experts, ray or None)


def _require_ray(args: argparse.Namespace) -> None:
    """With ``--ray``, fail first (one line saying how to install it) if Ray is missing."""
    if getattr(args, "ray", None) is not None:
        from mergefs.engine.ray_merge import check_reachable, require_ray

        require_ray()
        check_reachable(args.ray or None)


def _indexed(spec: Spec, base: Any, experts: Any, ray: str | None = None,
             **options: Any) -> tuple[Any, bool]:
    """Build or reuse the block index with a progress bar (``options``: load_or_build's);
    ``ray``: build it on the Ray cluster at that address ("" for the default one)."""
    from mergefs.index.layout import build_layout
    from mergefs.index.blocks import index_bytes_total, load_or_build

    runner = _ray_runner(ray, spec, base, experts)
    total = index_bytes_total(base, experts, build_layout(base, spec.block_size))
    with byte_progress("indexing", total) as tick:
        got = load_or_build(base, experts, spec.block_size, spec.index_dir, tick, runner=runner,
                            **options)
    if runner is not None and runner.parts:
        nodes = {p["worker"]["node"] for p in runner.parts}
        print(f"indexed on Ray: {len(runner.parts)} tasks on {len(nodes)} node(s)")
    return got


def cmd_index(args: argparse.Namespace) -> int:
    from mergefs.engine.session import prepare_family

    _require_ray(args)
    spec = _load(args, any_variant=True)
    base, experts = prepare_family(spec)
    # --rebuild and --publish read every source: sidecars are never built from sidecars.
    index, built = _indexed(spec, base, experts, args.ray, rebuild=args.rebuild,
                            sidecars=not (args.rebuild or args.publish))
    n_zero = int(index.zero.sum())
    print(f"{'built' if built else 'reused'} index {index.key[:16]} in {spec.index_dir}: "
          f"{len(experts)} experts x {index.layout.n_blocks} blocks of ~{human_bytes(spec.block_size)}"
          f", {n_zero} zero-delta expert blocks")
    if args.tensors:
        Console().print(_tensor_table(spec, index, args.tensors))
    if args.publish:
        from mergefs.index.published import publish

        for where in publish(base, experts, index):
            print(f"published {where}")
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    """Publish delta sidecars (issue 14): refinement levels of every expert's delta."""
    from mergefs.deltas.publish import publish
    from mergefs.engine.session import prepare_family

    _require_ray(args)
    spec = _load(args)
    base, experts = prepare_family(spec)
    index, _ = _indexed(spec, base, experts, args.ray, sidecars=False)
    if args.ray is not None:
        from mergefs.engine.ray_index import publish_deltas

        written = publish_deltas(spec, base, experts, index, args.ray or None)
    else:
        written = publish(base, experts, index)
    for where in written:
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
    if "sidecar_bytes" in rep:  # delta sidecars (issue 14)
        table.add_row("  of which delta sidecar reads", f"{human_bytes(rep['sidecar_bytes'])}"
                      f"  ({rep['blocks_from_sidecar']} blocks reconstructed)")
        if rep["replaced_read_seconds_model"]:  # local sidecars: what decoding costs
            limit = rep["decode_limit"]
            table.add_row("  modelled decode, one thread",
                          f"{rep['decode_seconds_model']:.3g} s against "
                          f"{rep['replaced_read_seconds_model']:.3g} s to read the exact bytes "
                          f"it replaces (limit: {f'{limit:g}x' if limit else 'none'})")
    table.add_row("non-zero expert bytes", human_bytes(rep["nonzero_expert_bytes"]))
    table.add_row("all expert bytes", human_bytes(rep["total_expert_bytes"]))
    table.add_row("expert blocks read / total", f"{rep['blocks_read']} / {rep['blocks_total']}"
                  f"  ({rep['blocks_zero']} zero-delta)")
    block_bytes = session.index.expert_block_bytes()  # (N, B): experts' dtypes may differ
    sidecar = plan.sidecar_bytes_by_expert
    for i, label in enumerate(session.engine.labels):
        got, all_i = int((block_bytes[i] * plan.selected[i]).sum()), int(block_bytes[i].sum())
        if sidecar is None:
            table.add_row(f"  reads of {label}", f"{human_bytes(got)} of "
                          f"{human_bytes(all_i)}{pct(got, all_i)}")
        else:  # exact blocks + the delta sidecar ranges: the rows add up to the planned reads
            table.add_row(f"  reads of {label}", f"{human_bytes(got)} exact + "
                          f"{human_bytes(sidecar[i])} sidecar of {human_bytes(all_i)}"
                          f"{pct(got + sidecar[i], all_i)}")
    if rep["bound_tight"] is not None:
        table.add_row("||E|| tight bound, before output rounding", f"{rep['bound_tight']:.6g}")
        table.add_row("||E|| loose bound, before output rounding", f"{rep['bound_loose']:.6g}")
        if rep.get("bound_output_tight") is not None:
            table.add_row("||E|| tight bound of the output bytes",
                          f"{rep['bound_output_tight']:.6g}")
            table.add_row("||E|| loose bound of the output bytes",
                          f"{rep['bound_output_loose']:.6g}")
        exact, update = rep["error_exact"], rep["update_norm"]
        table.add_row("||E|| exact (from index)",
                      "- (reconstructed blocks)" if exact is None and plan.levels is not None
                      else "- (index from sidecars)" if exact is None else f"{exact:.6g}")
        table.add_row("||sum c_i D_i|| (merge update)", "-" if update is None else f"{update:.6g}")
    return table


def bound_in_words(method: str, rep: dict[str, Any]) -> list[str]:
    """What the bound means for this plan, in plain words (a few short lines)."""
    tight, exact, update = rep["bound_tight"], rep["error_exact"], rep["update_norm"]
    if tight is None:
        return [(f"{method} is not additive: no error bound; exact at the full budget, and "
                 "`mergefs merge` reports the measured deviation")]
    if rep["planned_expert_bytes"] >= rep["nonzero_expert_bytes"]:
        return ["every non-zero expert block is read: the merge is exact"]
    if not update:
        return [(f"the merged model differs from the full merge by at most {tight:.4g} "
                 "(Frobenius norm over all tensors)")]
    rel = tight / update
    lines = []
    if rel <= 1:
        lines.append(f"guaranteed: the budgeted merge differs from the full-budget merge by at "
                     f"most {rel:.1%} of the norm of the merge update (the change the experts "
                     "make to the base)")
    else:
        lines.append(f"the guaranteed bound ({rel:.0%} of the norm of the merge update) is "
                     "larger than the update itself: this budget guarantees nothing useful")
    if exact is not None:
        kept = 1 - (exact / update) ** 2
        lines.append(f"measured from the index: the error is {exact / update:.1%} of the "
                     f"norm of the merge update ({kept:.1%} of its energy kept)")
    return lines


def _tensor_reads_table(session: Any, top: int) -> Table:
    """Per tensor: expert bytes, how much the plan reads, skips and finds zero (top by bytes)."""
    lay = session.index.layout
    plan = session.plan
    block_bytes = session.index.expert_block_bytes()  # (N, B)
    total_t = np.bincount(lay.tensor_of, weights=block_bytes.sum(axis=0),
                          minlength=len(lay.tensors))
    read_t = np.bincount(lay.tensor_of, weights=(plan.selected * block_bytes).sum(axis=0),
                         minlength=len(lay.tensors))
    zero_t = np.bincount(lay.tensor_of, weights=(session.index.zero * block_bytes).sum(axis=0),
                         minlength=len(lay.tensors))
    order = sorted(range(len(lay.tensors)), key=lambda t: (-total_t[t], t))[:top]
    table = Table(title=f"expert reads by tensor (top {len(order)} of {len(lay.tensors)} by "
                        "bytes)")
    for col in ("tensor", "expert bytes", "read", "skipped", "zero-delta"):
        table.add_column(col, justify="left" if col == "tensor" else "right")
    for t in order:
        skipped = total_t[t] - read_t[t] - zero_t[t]
        table.add_row(lay.tensors[t], human_bytes(total_t[t]), human_bytes(read_t[t]),
                      human_bytes(max(skipped, 0)), human_bytes(zero_t[t]))
    return table


def cmd_plan(args: argparse.Namespace) -> int:
    spec = _load(args)
    session = _session(spec, quiet=args.json)
    try:
        if args.json:
            print(json.dumps(session.plan.report(), sort_keys=True))
        else:
            Console().print(_plan_table(spec, session))
            for line in bound_in_words(spec.method, session.plan.report()):
                print(f"  {line}")
            if args.tensors:
                Console().print(_tensor_reads_table(session, args.tensors))
    finally:
        session.close()
    return 0


def _open_manifest(spec: Spec, explicit: str | None) -> Any:
    """The run's manifest writer: ``explicit`` exactly (refused if it exists), else a new
    timestamped file beside the spec's ``manifest`` path, which then points at it."""
    from mergefs.engine.manifest import ManifestWriter

    if explicit:
        return ManifestWriter(explicit)
    return ManifestWriter.for_run(spec.manifest)


def cmd_merge(args: argparse.Namespace) -> int:
    from mergefs.engine.session import prepare_family
    from mergefs.engine.output import check_outdir, check_outside, check_source_files, check_writes

    _require_ray(args)  # before anything is opened or written
    spec = _load(args)
    out = Path(args.outdir)
    # Everything is validated before the manifest or any output exists.
    check_writes(_sources(spec), outdir=out, manifest=args.manifest or spec.manifest)
    check_outside(out, spec=spec.source, manifest=args.manifest or spec.manifest,
                  index_dir=spec.index_dir, cache_dir=spec.cache_dir)
    check_outdir(out, args.force)
    if args.ray is None:  # numba and the kernel module load while the family opens
        from mergefs.methods import kernels
        from mergefs.engine.merger import may_use_kernels

        if may_use_kernels(spec):
            kernels.start_warm_up(full=False)
    family = prepare_family(spec)
    check_source_files(out, [family[0], *family[1]])
    manifest = _open_manifest(spec, args.manifest)
    session = _session(spec, manifest, family=family, ray=args.ray)
    try:
        out_bytes = sum(f.size_bytes for f in session.engine.out_files)
        with byte_progress("merging", out_bytes) as tick:
            if args.ray is not None:
                from mergefs.engine import ray_merge as rayexec

                rayexec.materialise(session, out, args.ray or None, on_bytes=tick,
                                    overwrite=args.force)
            else:
                session.engine.materialise(out, on_bytes=tick, overwrite=args.force)
        totals = session.finish()
    finally:
        manifest.close()
        session.close()
    read = totals["physical_bytes_read"]
    vocab = totals.get("expert_bytes_vocabulary", 0)
    whole = f", plus {human_bytes(vocab)} of vocabulary tensors read whole for the tokenizer " \
        "merge" if vocab else ""
    print(f"merged into {args.outdir} in {totals['wall_seconds']:.2f}s: read "
          f"{human_bytes(totals['expert_bytes_read'])} expert bytes ("
          f"{human_bytes(totals['expert_bytes_planned'])} planned of "
          f"{human_bytes(totals['total_expert_bytes'])} in blocks{whole}) and "
          f"{human_bytes(read['base'])} base; manifest {manifest.path}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mergefs.plan.report import parse_grid, plot, run_sweep

    _load(args, any_variant=True)  # validates the spec and the index dir first
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()] if args.budgets \
        else None  # a sweep spec: each variant at its own budget; else the default list
    for b in budgets or []:
        parse_budget(b, "--budgets")
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else []
    rows = run_sweep(args.spec, budgets, methods, parse_grid(args.grid or []),
                     strict=getattr(args, "strict", False), progress=not args.json)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
        table = Table(title=f"what budgets buy ({args.spec}; from the index, nothing read)")
        for col in ("variant", "budget", "expert bytes read", "bound / update",
                    "error / update", "update energy kept"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        for r in rows:
            err = None if r.error_exact is None or not r.update_norm else \
                r.error_exact / r.update_norm
            read = f"{human_bytes(r.planned_bytes)} ({pct(r.planned_bytes / r.total_expert_bytes if r.total_expert_bytes else 0)})"
            table.add_row(r.variant, r.budget, read,
                          pct(r.bound_share) if r.bound_share is not None else
                          ("no bound" if r.bound_tight is None else "-"),
                          pct(err), pct(r.energy_kept))
        Console().print(table)
    if args.plot:
        plot(rows, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from mergefs.engine.replay import replay

    res = replay(args.manifest, args.out, overwrite=args.force)
    torn = f"; ignored {res.torn_lines} torn line(s)" if res.torn_lines else ""
    if res.variants:  # a sweep mount's manifest
        for name, r in res.variants:
            print(f"variant {name} OK (plan {r.plan_hash[:16]}): {_replay_checked(r)}")
        unread = f"; nothing was read from {', '.join(res.unread_variants)}" \
            if res.unread_variants else ""
        print(f"replay OK: {len(res.variants)} variants, {res.outputs_verified} merged units "
              f"reproduced{unread}{torn}")
        return 0
    print(f"replay OK (plan {res.plan_hash[:16]}): {_replay_checked(res)}{torn}")
    return 0


def _replay_checked(res: Any) -> str:
    """What a replay checked, in words: a mount's manifest records reads and merged units, a
    merge's also whole tensors (checked only when ``--out`` writes them)."""
    tensors = "tensor" if res.output_tensors == 1 else "tensors"
    whole = f", {res.tensors_verified} whole tensors reproduced" if res.tensors_verified else ""
    return (f"{res.reads_verified} source ranges ({human_bytes(res.bytes_verified)}) re-read "
            f"and matched, {res.outputs_verified} merged units of {res.output_tensors} "
            f"{tensors} reproduced{whole}")


def cmd_mount(args: argparse.Namespace) -> int:
    from mergefs.mount.lifecycle import run_mount
    from mergefs.engine.output import check_writes
    from mergefs.spec.variants import is_sweep, load_variants, read_doc

    if not is_sweep(read_doc(args.spec)):
        return run_mount(args, _load(args))
    args.spec = os.path.abspath(args.spec)  # the daemon re-reads it at a reload, from /
    if args.budget is not None:
        raise MergefsError("--budget: a sweep spec sets its budgets (sweep: budget: [...]); "
                           "mount it without --budget")
    found = load_variants(args.spec, strict=getattr(args, "strict", False))
    check_writes(_sources(found[0][1]), index_dir=found[0][1].index_dir)
    return run_mount(args, found[0][1], variants=found)


def cmd_reload(args: argparse.Namespace) -> int:
    from mergefs.mount.control import run_reload

    return run_reload(args)


def cmd_umount(args: argparse.Namespace) -> int:
    from mergefs.mount.lifecycle import run_umount

    return run_umount(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from mergefs.mount.lifecycle import run_stats

    return run_stats(args)


def cmd_methods(args: argparse.Namespace) -> int:
    from mergefs.methods import describe_methods

    rows = describe_methods()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        inputs = f"{r['inputs']['min']}..{r['inputs']['max'] or 'n'}"
        print(f"{r['name']:<17} base {r['base']:<9} inputs {inputs:<5} "
              f"bound {'yes' if r['additive_bound'] else 'no ':<4} block-wise {r['blockwise']}")
        params = [f"{p['name']}{'*' if p['scope'] != 'global' else ''}="
                  f"{'required' if p['required'] else p['default']}" for p in r["parameters"]]
        print(f"    {'  '.join(params) or '(no parameters)'}")
    print("* per-model parameter (a global value is every model's default)")
    return 0


def _paragraphs(*texts: str) -> str:
    """Descriptions for the raw formatter (kept for the examples in epilogs): wrapped here."""
    return "\n\n".join(textwrap.fill(t, 79) for t in texts)


def _add_ray(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"run on a Ray cluster ({what}): ADDRESS like 10.0.0.1:6379; without "
                   "it, RAY_ADDRESS or the cluster `ray start` runs here (else a local one). "
                   "Sources must be URLs or paths every node sees. Needs mergefs[ray]")


SPEC_HELP = "the merge spec: a mergekit YAML config, plus optional mergefs keys"
VARIANT_HELP = ("of a sweep spec (sweep: / variants:), the variant NAME, as its directory in a "
                "sweep mount is named (see MOUNTPOINT/variants.json)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mergefs",
        description="Budgeted, lazy, verifiable merging of model checkpoints (safetensors).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"mergefs {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # --debug is accepted after the subcommand too (SUPPRESS: it does not reset the global one)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and debug logs")
    p.add_argument("--strict", action="store_true",
                   help="spec keys and parameters that mergekit ignores are errors, not warnings")
    common.add_argument("--strict", action="store_true", default=argparse.SUPPRESS,
                        help="spec keys and parameters that mergekit ignores are errors, not "
                        "warnings")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    budget_help = ("override the spec's budget: full, 10%%, 0.1 (a fraction) or a size with a "
                   "unit like 2GiB or 500MB; a bare number above 1 is refused as ambiguous")

    manifest_help = ("write the manifest exactly here (must not exist); default: a new "
                     "timestamped file beside the spec's `manifest` path, which then points to it")

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    s = add("index", help="build (or reuse) the block index of a spec's family",
            description="Read base and experts once; store per-block delta norms, "
            "hashes and zero flags under index_dir. Reused while sources are unchanged.")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("--rebuild", action="store_true", help="rebuild even if a valid index exists")
    s.add_argument("--tensors", type=int, default=0, metavar="N",
                   help="also list the N tensors with the largest deltas (per-expert norms)")
    s.add_argument("--publish", action="store_true",
                   help="also write each expert's block index beside it "
                   "(mergefs-index.<base-key>.<block_size>.safetensors), so later plans over "
                   "remote experts need not read them")
    _add_ray(s, "tasks per run of blocks, every expert of them; the driver assembles the index")
    s.set_defaults(func=cmd_index)

    s = add("compress", help="publish compressed delta sidecars beside each expert",
            description=_paragraphs(
                "Write per expert mergefs-delta.<base-key>.<block_size>.safetensors: "
                "refinement levels of its delta (low rank at mixed precision, quantised "
                "residual, sparse exact values) per row block, with exact residual norms, so "
                "that budgeted merges read a few bits per element instead of skipping blocks.",
                "Plans, merges and mounts then use the sidecars by themselves when they match "
                "the indexed base and expert bytes; a full budget still reads exact blocks."),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="example (on three full fine-tunes of MiniLM, 10% of the bytes kept 99.7% "
            "of the\nmerge update: docs/benchmarks.md, issue 14):\n"
            "  mergefs compress spec.yaml\n"
            "  mergefs plan spec.yaml --budget 10%      # the sidecar bytes and the bound\n"
            "  mergefs merge spec.yaml out/ --budget 10%")
    s.add_argument("spec", help=SPEC_HELP)
    _add_ray(s, "one task per expert, and the index if it must be built")
    s.set_defaults(func=cmd_compress)

    s = add("plan", help="show which expert blocks a budget reads and its error bound",
            description="Plan the expert reads for a budget (deterministic) and report "
            "bytes, blocks, bounds on the merge error (and what they mean as a share of the "
            "merge update) and the plan hash. Reads only the index.")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--tensors", type=int, default=0, metavar="N",
                   help="also list the N largest tensors with the bytes read, skipped and zero")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.add_argument("--variant", metavar="NAME", help=VARIANT_HELP)
    s.set_defaults(func=cmd_plan)

    s = add("sweep", help="what a range of budgets (and methods, coefficients) buys, from "
            "the index alone",
            description="Plan the spec at every budget (and method and --grid point) from the "
            "block index, reading no expert bytes once the index exists, and print bytes read, "
            "the error bound and the exact error as shares of the merge update, and the share "
            "of the update's energy kept. --plot writes a PNG. A sweep spec (sweep: / "
            "variants:, see `mergefs mount --help`) without --methods or --grid: one row per "
            "variant (named as in the sweep mount) at its own budget, or at each --budgets.",
            epilog="example: mergefs sweep spec.yaml --budgets 1%,5%,10%,20%,50%,full "
            "--grid parameters.lambda=0.5,1.0 --plot sweep.png")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("--budgets", help="comma-separated budgets (default: 1%%,2%%,5%%,10%%,20%%,"
                   "50%%,full; for a sweep spec, each variant's own budget)")
    s.add_argument("--methods", help="comma-separated merge methods to compare (default: the "
                   "spec's)")
    s.add_argument("--grid", action="append", metavar="KEY=V1,V2",
                   help="a coefficient grid over a spec key, e.g. parameters.lambda=0.5,1 or "
                   "models.0.parameters.weight=0.2,0.4 (repeat for a product)")
    s.add_argument("--plot", metavar="PNG", help="also write a plot of the sweep")
    s.add_argument("--json", action="store_true", help="print the rows as JSON")
    s.set_defaults(func=cmd_sweep)

    s = add("merge", help="materialise the merge as a Hugging Face directory",
            description="Read base + planned expert blocks, merge, write OUTDIR "
            "(safetensors shards mirroring the base, non-weight files copied, config.json with "
            "the output dtype) and a manifest of every byte read. OUTDIR appears only when "
            "complete; an interrupted merge leaves no partial output.")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("outdir", help="output directory (new or empty; never a source)")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--manifest", metavar="PATH", help=manifest_help)
    s.add_argument("--force", action="store_true",
                   help="replace an earlier merge output in OUTDIR as a whole")
    s.add_argument("--variant", metavar="NAME", help=VARIANT_HELP)
    _add_ray(s, "one task per output shard, and the index if it must be built; OUTDIR must "
             "lie on storage every node sees")
    s.set_defaults(func=cmd_merge)

    s = add("replay", help="re-execute a manifest's plan and verify every byte",
            description="Re-read every recorded source range, check its hash, "
            "re-merge and check every output hash. Fails naming a changed source, and fails for "
            "a manifest of an interrupted run (no totals) or one that records no output.")
    s.add_argument("manifest", help="a manifest written by merge or mount (or its pointer)")
    s.add_argument("--out", help="also write the merged model here")
    s.add_argument("--force", action="store_true", help="replace an earlier merge output in --out")
    s.set_defaults(func=cmd_replay)

    s = add("mount", help="mount the merge (or every variant of a sweep) as lazy read-only HF "
            "model directories",
            description=_paragraphs("Expose a virtual merged model directory at MOUNTPOINT; "
            "tensor reads merge only the blocks they need (budgeted, cached). "
            "Returns once the mount is ready unless --foreground. Keep it mounted while a "
            "model loaded from it lives: transformers maps the weight files.",
            "A sweep spec (a `sweep:` grid and/or a `variants:` list, see `mergefs reload "
            "--help`) mounts every variant as MOUNTPOINT/<variant>/, with "
            "MOUNTPOINT/variants.json describing each (name, settings, full resolved spec, "
            "plan). Variants share one index, one source-block cache (a block read for one "
            "variant is not read again for another while cached) and one merged-unit cache "
            "keyed by content (a unit identical across variants is merged once). Each "
            "variant's files equal `mergefs merge --variant NAME`. .mergefs/stats.json reports "
            "per variant and shared; the manifest records every variant for `mergefs replay`."),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="a sweep spec (beside the usual keys):\n"
            "  sweep:\n"
            "    weight: [0.3, 0.5, 0.7]      # every model's weight (or a list per model)\n"
            "    budget: [10%, 50%, full]\n"
            "    merge_method: [task_arithmetic, ties]\n"
            "    parameters.lambda: [0.5, 1.0]   # any key by dotted path\n"
            "  variants:                      # named variants, listed first\n"
            "    - {name: strong, parameters.lambda: 1.5}\n\n"
            "  mergefs mount sweep.yaml /mnt/sweep\n"
            "  ls /mnt/sweep                  # weight-0.3_budget-10pct/ ... variants.json\n"
            "  mergefs reload /mnt/sweep      # after editing sweep.yaml: adds new variants")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("mountpoint", help="an existing empty directory")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--manifest", metavar="PATH", help=manifest_help)
    s.add_argument("--cache-size", help="memory cache of merged blocks (default: 1/4 of RAM, "
                   "at most 8GiB)")
    s.add_argument("--cache-dir", help="persistent cache of merged blocks, keyed by plan hash")
    s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C unmounts")
    s.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    s.add_argument("--warm", action="store_true",
                   help="merge the whole model (up to the cache size) at mount time and push it "
                        "into the kernel page cache")
    s.add_argument("--source-cache-size", metavar="SIZE",
                   help="sweep mounts: memory for source blocks shared by the variants "
                   "(default: the --cache-size; 0 turns sharing of reads off)")
    s.set_defaults(func=cmd_mount)

    s = add("reload", help="re-read a sweep mount's spec and add its new variants",
            description=_paragraphs("Re-read the spec file a sweep mount was started with (the server does "
            "it; SIGHUP to the server is the same) and add every variant it now lists as a new "
            "directory, without unmounting: readers of the other variants keep reading. All or "
            "nothing: a spec that fails to parse, changes the family (base, experts, block "
            "size) or changes a variant under the same name leaves the mount as it was; the "
            "error is printed here (exit 1) and logged by the mount. A variant the spec no "
            "longer lists keeps being served, flagged \"removed\" in variants.json, until "
            "unmounted (so nobody reading it is cut off); to change a variant, add it under a "
            "new name."),
            epilog="example: echo '  - {name: w09, weight: 0.9}' >> sweep.yaml  # under variants:"
            "\n         mergefs reload /mnt/sweep",
            formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("mountpoint", help="where a sweep spec is mounted")
    s.set_defaults(func=cmd_reload)

    s = add("methods", help="list the merge methods, their parameters and defaults",
            description="Every merge method (mergekit's 20), from the registry the engine "
            "uses: parameters with defaults (* per model), whether it needs a base, how many "
            "inputs, whether budgets have an error bound, and whether it merges block-wise.")
    s.add_argument("--json", action="store_true", help="print the list as JSON")
    s.set_defaults(func=cmd_methods)

    s = add("umount", help="unmount (also clears a mount whose process died)",
            description="Unmount MOUNTPOINT and wait for its server to record the manifest's "
            "totals. A mount still in use (a process holds a file open or mapped) is refused, "
            "naming the processes; --lazy detaches it anyway.")
    s.add_argument("mountpoint", help="where a mergefs merge is mounted")
    s.add_argument("--lazy", action="store_true",
                   help="detach now even if in use; the server stays until the last user closes")
    s.set_defaults(func=cmd_umount)

    s = add("stats", help="print a mount's live counters (and its last read errors)")
    s.add_argument("mountpoint", help="where a mergefs merge is mounted")
    s.add_argument("--json", action="store_true", help="print stats.json as is")
    s.set_defaults(func=cmd_stats)
    return p


def _join_option_values(argv: list[str]) -> list[str]:
    """``--budget -5%`` -> ``--budget=-5%``: argparse would take a value starting with '-' for
    an option and never pass it to the budget parser."""
    out: list[str] = []
    k = 0
    while k < len(argv):
        a = argv[k]
        if a in ("--budget", "--cache-size") and k + 1 < len(argv) \
                and argv[k + 1].startswith("-") and argv[k + 1][1:2] not in ("-", ""):
            out.append(f"{a}={argv[k + 1]}")
            k += 2
            continue
        out.append(a)
        k += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_option_values(list(sys.argv[1:] if argv is None else argv)))
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
