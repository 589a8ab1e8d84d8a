"""One function per ``mergefs`` command: its arguments turned into a call of :mod:`mergefs.ops`
(or of the mount's lifecycle and control), and what that returns printed (:mod:`.render`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from mergefs import ops
from mergefs.cli.render import (
    bound_in_words, merge_summary, plan_table, replay_checked, sweep_table, tensor_reads_table,
    tensor_table,
)
from mergefs.core.sizes import human_bytes
from mergefs.engine.session import Session, ensure_intermediates
from mergefs.methods import describe_methods
from mergefs.mount import control, lifecycle
from mergefs.plan.report import parse_grid, plot, run_sweep
from mergefs.spec.budget import parse_budget
from mergefs.spec.model import Spec


#: the width of tables written to a pipe, a file or a log (a terminal's own width otherwise):
#: wide enough that no tensor, variant or model name is ever cut (rich would assume 80)
PIPE_WIDTH = 10_000


def console() -> Console:
    """A console for stdout: the terminal's width, or :data:`PIPE_WIDTH` when stdout is not a
    terminal (tables are as wide as their content, never cut)."""
    out = Console()
    return out if out.is_terminal else Console(width=PIPE_WIDTH)


def _load(args: argparse.Namespace, any_variant: bool = False) -> Spec:
    """The spec; of a sweep spec, the ``--variant`` named (or, with ``any_variant``, the
    first: every variant has the same family and index); ``--budget`` applied."""
    budget = getattr(args, "budget", None)
    return ops.load(args.spec, strict=getattr(args, "strict", False),
                    variant=getattr(args, "variant", None), any_variant=any_variant,
                    budget=None if budget is None else parse_budget(budget, "--budget"))


def cmd_index(args: argparse.Namespace) -> int:
    if args.ray is not None:
        ops.require_ray(args.ray)  # before anything is opened or written
    spec = _load(args, any_variant=True)
    got = ops.index(spec, rebuild=args.rebuild, publish=args.publish, ray=args.ray)
    index = got.index
    print(f"{'built' if got.built else 'reused'} index {index.key[:16]} in {spec.index_dir}: "
          f"{got.experts} experts x {index.layout.n_blocks} blocks of "
          f"~{human_bytes(spec.block_size)}, {int(index.zero.sum())} zero-delta expert blocks")
    if args.tensors:
        console().print(tensor_table(index, args.tensors))
    for where in got.published:
        print(f"published {where}")
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    """Publish delta sidecars: refinement levels of every expert's delta."""
    if args.ray is not None:
        ops.require_ray(args.ray)
    verb = "published" if args.publish else "wrote"
    for where in ops.compress(_load(args), publish=args.publish, ray=args.ray):
        print(f"{verb} {where}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    spec = _load(args)
    session = ops.open_session(spec, progress=not args.json, sidecars=args.sidecars)
    try:
        if args.json:
            print(json.dumps(session.plan.report(), sort_keys=True))
        else:
            console().print(plan_table(spec, session))
            for line in [*sidecars_in_words(spec, session), *bound_in_words(
                    spec.method, session.plan.report())]:
                print(f"  {line}")
            if args.tensors:
                console().print(tensor_reads_table(session, args.tensors))
    finally:
        session.close()
    return 0


def sidecars_in_words(spec: Spec, session: Session) -> list[str]:
    """One line when delta sidecars matched: whose, from where (mergefs's store under
    index_dir, or published beside the experts), what the plan reads of them instead of exact
    blocks, and how to plan without them; none when no sidecar matched."""
    deltas, rep = session.deltas, session.plan.report()
    if not deltas:
        return []
    places = " and ".join(sorted({
        "index_dir" if Path(str(sc.path)).is_relative_to(spec.index_dir)
        else "beside the experts" for sc in deltas.values()}))
    whose = f"delta sidecars of {len(deltas)} of {len(session.experts)} experts (from {places})"
    if not rep.get("sidecar_bytes"):
        return [f"{whose} match, but this plan reads none of them"]
    return [f"uses {whose}: reads {human_bytes(rep['sidecar_bytes'])} of sidecar levels "
            f"instead of exact blocks ({rep['blocks_from_sidecar']} blocks); --no-sidecars "
            "plans without them"]


def cmd_merge(args: argparse.Namespace) -> int:
    if args.ray is not None:
        ops.require_ray(args.ray)  # before anything is opened or written
    result = ops.merge(_load(args), args.outdir, force=args.force, manifest=args.manifest,
                       ray=args.ray, sidecars=args.sidecars)
    print(merge_summary(args.outdir, result.totals, result.manifest))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    spec = _load(args, any_variant=True)  # validates the spec and the index dir first
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()] if args.budgets \
        else None  # a sweep spec: each variant at its own budget; else the default list
    for b in budgets or []:
        parse_budget(b, "--budgets")
    ensure_intermediates(spec)  # a multi-document spec: the models its final merge reads
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else []
    rows = run_sweep(args.spec, budgets, methods, parse_grid(args.grid or []),
                     strict=getattr(args, "strict", False), progress=not args.json)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        console().print(sweep_table(args.spec, rows))
    if args.plot:
        plot(rows, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    res = ops.replay(args.manifest, args.out, force=args.force)
    torn = f"; ignored {res.torn_lines} torn line(s)" if res.torn_lines else ""
    if res.variants:  # a sweep mount's manifest
        for name, r in res.variants:
            print(f"variant {name} OK (plan {r.plan_hash[:16]}): {replay_checked(r)}")
        unread = f"; nothing was read from {', '.join(res.unread_variants)}" \
            if res.unread_variants else ""
        print(f"replay OK: {len(res.variants)} variants, {res.outputs_verified} merged units "
              f"reproduced{unread}{torn}")
        return 0
    print(f"replay OK (plan {res.plan_hash[:16]}): {replay_checked(res)}{torn}")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    budget = None if args.budget is None else parse_budget(args.budget, "--budget")
    return ops.mount(args, args.spec, strict=getattr(args, "strict", False), budget=budget)


def cmd_reload(args: argparse.Namespace) -> int:
    return control.run_reload(args)


def cmd_umount(args: argparse.Namespace) -> int:
    return lifecycle.run_umount(args)


def cmd_stats(args: argparse.Namespace) -> int:
    return lifecycle.run_stats(args)


def cmd_methods(args: argparse.Namespace) -> int:
    rows = describe_methods()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        inputs = f"{r['inputs']['min']}..{r['inputs']['max'] or 'n'}"
        print(f"{r['name']:<17} base {r['base']:<9} inputs {inputs:<5} "
              f"bound {'yes' if r['additive_bound'] else 'no ':<4} block-wise {r['blockwise']}")
        print(f"    needs torch: {r['needs_torch']}")
        params = [f"{p['name']}{'*' if p['scope'] != 'global' else ''}="
                  f"{'required' if p['required'] else p['default']}" for p in r["parameters"]]
        print(f"    {'  '.join(params) or '(no parameters)'}")
    print("* per-model parameter (a global value is every model's default)")
    return 0
