"""One function per ``mergefs`` command: its arguments turned into a call of :mod:`mergefs.ops`
(or of the mount's lifecycle and control), and what that returns printed (:mod:`.render`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from rich.console import Console

from mergefs import ops
from mergefs.cli.render import (
    bound_in_words, gc_summary, merge_summary, plan_table, replay_checked, sweep_table, tensor_reads_table,
    tensor_table,
)
from mergefs.core.errors import MergefsError
from mergefs.core.sizes import human_bytes, parse_size
from mergefs.engine.layout import OutputOptions, parse_shard_size
from mergefs.engine.session import Session, ensure_intermediates
from mergefs.methods import describe_methods
from mergefs.mount import control, lifecycle
from mergefs.plan.report import parse_grid, plot, run_sweep
from mergefs.spec.budget import parse_budget
from mergefs.spec.model import Spec


log = logging.getLogger(__name__)

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
    got = ops.index(spec, rebuild=args.rebuild, publish=args.publish, ray=args.ray,
                    exact=args.exact)
    index = got.index
    print(f"{'built' if got.built else 'reused'} index {index.key[:16]} in {spec.index_dir}: "
          f"{got.experts} experts x {index.layout.n_blocks} blocks of "
          f"~{human_bytes(spec.block_size)}, {int(index.zero.sum())} zero-delta expert blocks")
    if index.gram_exact is not None and not index.gram_exact.all():
        pairs = int((~index.gram_exact).sum()) // 2
        print(f"  {pairs} expert pairs have estimated cross terms (from sketches); "
              "`mergefs index --exact` computes them exactly")
    if args.tensors:
        console().print(tensor_table(index, args.tensors))
    for where in got.published:
        print(f"published {where}")
    return 0


def cmd_index_gc(args: argparse.Namespace) -> int:
    """Collect an index directory: what was removed (or would be), by kind, and the total."""
    try:
        cap = None if args.max_size is None else parse_size(args.max_size, "--max-size")
    except ValueError as exc:
        raise MergefsError(str(exc)) from None
    got = ops.index_gc(args.specs, index_dir=args.index_dir, max_size_bytes=cap,
                       keep_days=args.keep_days, dry_run=args.dry_run,
                       strict=getattr(args, "strict", False))
    for line in gc_summary(got):
        print(line)
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


#: mergekit-yaml's GPU flags: mergefs computes on the CPU
GPU_FLAGS = ("cuda", "low_cpu_memory", "read_to_gpu", "multi_gpu", "gpu_rich")


def mergekit_flags(args: argparse.Namespace) -> None:
    """What mergekit-yaml's flags do before the spec is read: refuse the two mergefs cannot
    honour (one line each), set the log level (--quiet, -v), the Hub cache
    (--transformers-cache) and say in one log line each what mergefs does instead of a GPU
    flag or --lora-merge-dtype."""
    if not args.safe_serialization:
        raise MergefsError("--no-safe-serialization: mergefs writes safetensors only (no "
                           "pickled weights); leave the flag out")
    if args.unsafe_truncate_embeddings:
        # mergekit truncates only when the vocabularies differ; mergefs refuses differing
        # shapes (check_coordinates names the tensor), so where a merge runs it changes nothing
        log.info("--unsafe-truncate-embeddings: nothing to truncate unless the vocabularies "
                 "differ, which mergefs refuses; a tokenizer: block merges them")
    if args.verbosity >= 2 or args.debug:
        logging.getLogger().setLevel(logging.DEBUG)
    elif args.quiet and not args.verbosity:
        logging.getLogger().setLevel(logging.WARNING)
    if args.transformers_cache is not None:
        # the CLI is the edge where the environment is set; spec loading reads it
        os.environ["HF_HUB_CACHE"] = os.path.abspath(args.transformers_cache)
    gpu = [f"--{f.replace('_', '-')}" for f in GPU_FLAGS if getattr(args, f)]
    if args.device not in (None, "cpu"):
        gpu.append(f"--device {args.device}")
    if gpu:
        log.warning("%s: mergefs has no GPU support; it reads into host memory and merges on "
                    "the CPU", " ".join(gpu))
    if args.lora_merge_dtype is not None:
        log.warning("--lora-merge-dtype %s: not applied; mergefs applies a LoRA adapter in its "
                    "weight's own dtype (W + delta in float32, rounded once)",
                    args.lora_merge_dtype)


def output_options(args: argparse.Namespace, spec: Spec) -> OutputOptions:
    """The merge's weight layout and files, from mergekit-yaml's flags."""
    try:
        shard_bytes = parse_shard_size(args.out_shard_size)
    except ValueError as exc:
        raise MergefsError(str(exc)) from None
    return OutputOptions(shard_bytes=shard_bytes, copy_tokenizer=args.copy_tokenizer,
                         model_card=args.write_model_card,
                         config_text=ops.config_text(spec) if args.write_model_card else None)


def memory_arg(value: str) -> int:
    """``--memory``'s bytes (more than 0), or one line saying what is wrong."""
    try:
        out = parse_size(value, "--memory")
    except ValueError as exc:
        raise MergefsError(str(exc)) from None
    if out <= 0:
        raise MergefsError("--memory: must be more than 0")
    return out


def cmd_merge(args: argparse.Namespace) -> int:
    mergekit_flags(args)
    if args.ray is not None:
        ops.require_ray(args.ray)  # before anything is opened or written
    budget = None if args.budget is None else parse_budget(args.budget, "--budget")
    spec = ops.load(args.spec, strict=getattr(args, "strict", False), variant=args.variant,
                    budget=budget,
                    intermediate_dir=args.intermediate_dir, seed=args.random_seed)
    if args.memory is not None:
        spec = spec.with_memory(memory_arg(args.memory))
    if args.lazy is not None and not spec.intermediates:
        raise MergefsError(f"--{'' if args.lazy else 'no-'}lazy: {args.spec} is not a "
                           "multi-document spec (it has no named merges)")
    outdir = args.outdir if args.outdir is not None else args.out_path
    result = ops.merge(spec, outdir, force=args.force, manifest=args.manifest,
                       ray=args.ray, sidecars=args.sidecars, threads=args.num_threads or 2,
                       progress=not args.quiet, output=output_options(args, spec),
                       lazy=args.lazy)
    print(merge_summary(outdir, result.totals, result.manifest))
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
    memory = None if args.memory is None else memory_arg(args.memory)
    return ops.mount(args, args.spec, strict=getattr(args, "strict", False), budget=budget,
                     memory_bytes=memory)


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
        print(f"    paper: {r['paper']['name']}"
              + (f" <{r['paper']['url']}>" if r['paper']['url'] else ""))
        print(f"    memory: {r['memory']}")
        params = [f"{p['name']}{'*' if p['scope'] != 'global' else ''}="
                  f"{'required' if p['required'] else p['default']}" for p in r["parameters"]]
        print(f"    {'  '.join(params) or '(no parameters)'}")
    print("* per-model parameter (a global value is every model's default)")
    print("memory: bytes a tensor's merge holds at its peak; n elements, k models besides the "
          "base, s and o source and output bytes per element (docs/operators.md, Memory)")
    return 0
