"""What the CLI prints: tables (rich) and sentences made from reports; no I/O but stdout."""

from __future__ import annotations
from collections.abc import Sequence
from typing import Any
import numpy as np
from rich.markup import escape
from rich.table import Table
from mergefs.spec.model import Spec
from mergefs.core.sizes import human_bytes
from mergefs.index.collect import Collected


def tensor_table(index: Any, top: int) -> Table:
    """The ``top`` tensors by delta norm (summed over experts): where the merge update lives."""
    norms = index.tensor_norms()  # (N, T)
    lay = index.layout
    zero_share = []
    for t in range(len(lay.tensors)):
        blocks = lay.blocks_of(t)
        zero_share.append(float(index.zero[:, blocks.start:blocks.stop].mean()) if blocks else 1.0)
    order = sorted(range(len(lay.tensors)), key=lambda t: (-float(norms[:, t].sum()), t))[:top]
    table = Table(title=f"largest deltas by tensor (top {len(order)} of {len(lay.tensors)})")
    table.add_column("tensor", overflow="fold")  # a narrow terminal folds names, never cuts
    for i in range(norms.shape[0]):
        table.add_column(f"||D_{i}||", justify="right")
    table.add_column("zero-delta blocks", justify="right")
    for t in order:
        table.add_row(lay.tensors[t], *[f"{norms[i, t]:.4g}" for i in range(norms.shape[0])],
                      f"{zero_share[t]:.0%}")
    return table


def plan_table(spec: Spec, session: Any) -> Table:
    plan = session.plan
    rep = plan.report()
    table = Table(title=f"plan {rep['plan_hash'][:16]}  ({spec.method}, budget "
                        f"{spec.budget.describe()})", show_header=False)
    table.add_column("what", style="bold", overflow="fold")
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
        est = rep["estimated"]
        table.add_row("||E|| estimated (from sketches)" if "error_exact" in est
                      else "||E|| exact (from index)",
                      "- (reconstructed blocks)" if exact is None and plan.levels is not None
                      else "- (index from sidecars)" if exact is None
                      else figure(rep["error"]))
        table.add_row("||sum c_i D_i|| (merge update)" + (
            ", estimated" if "update_norm" in est else ""),
            "-" if update is None else figure(rep["update"]))
    return table


def figure(fig: dict[str, Any]) -> str:
    """An exact figure, or an estimate with its interval."""
    if fig["exact"]:
        return f"{fig['value']:.6g}"
    return escape(f"≈{fig['value']:.6g} (in [{fig['low']:.4g}, {fig['high']:.4g}] with "
                  f"probability ≥ {fig['probability']:.0%})")


def bound_in_words(method: str, rep: dict[str, Any]) -> list[str]:
    """What the bound means for this plan, in plain words (a few short lines)."""
    tight, exact, update = rep["bound_tight"], rep["error_exact"], rep["update_norm"]
    if tight is None:  # nothing in mergefs measures it: say how to, not that it is done
        return [f"{method} is not additive: no error bound, and mergefs does not measure the "
                "deviation; the merge is exact at the full budget",
                "to measure what this budget costs: `mergefs merge` at --budget full and at this "
                "budget into two directories and compare their tensors"]
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
    if rep["estimated"]:
        lines.append("estimated from the index's sketches (`mergefs index --exact` computes "
                     "the cross terms exactly): the merge update's norm, so the share above, "
                     "and the error below; the bound itself uses exact norms only")
    if exact is not None:
        kept = 1 - (exact / update) ** 2
        err, upd = rep["error"], rep["update"]
        lines.append(f"{'estimated' if rep['estimated'] else 'measured'} from the index: the "
                     f"error is {exact / update:.1%} of the norm of the merge update "
                     f"({kept:.1%} of its energy kept)" + (
                         "" if err["exact"] and upd["exact"] else
                         f"; error within [{err['low']:.4g}, {err['high']:.4g}], update within "
                         f"[{upd['low']:.4g}, {upd['high']:.4g}], each with probability "
                         f"≥ {min(err['probability'], upd['probability']):.0%}"))
    return lines


def tensor_reads_table(session: Any, top: int) -> Table:
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
        table.add_column(col, justify="left" if col == "tensor" else "right",
                         overflow="fold" if col == "tensor" else "ellipsis")
    for t in order:
        skipped = total_t[t] - read_t[t] - zero_t[t]
        table.add_row(lay.tensors[t], human_bytes(total_t[t]), human_bytes(read_t[t]),
                      human_bytes(max(skipped, 0)), human_bytes(zero_t[t]))
    return table


def replay_checked(res: Any) -> str:
    """What a replay checked, in words: a mount's manifest records reads and merged units, a
    merge's also whole tensors (checked only when ``--out`` writes them)."""
    tensors = "tensor" if res.output_tensors == 1 else "tensors"
    whole = f", {res.tensors_verified} whole tensors reproduced" if res.tensors_verified else ""
    return (f"{res.reads_verified} source ranges ({human_bytes(res.bytes_verified)}) re-read "
            f"and matched, {res.outputs_verified} merged units of {res.output_tensors} "
            f"{tensors} reproduced{whole}")


def sweep_table(spec_path: str, rows: Sequence[Any]) -> Table:
    """``mergefs sweep``'s rows: what each budget (and variant) buys."""
    pct = (lambda x: "-" if x is None else f"{100 * x:.1f}%")
    est = any(r.estimated for r in rows)
    table = Table(title=f"what budgets buy ({spec_path}; from the index, nothing read)",
                  caption=escape("≈: estimated from the index's sketches, [low-high] holding "
                                 "with probability ≥ 90% (each norm's interval ≥ 95%); "
                                 "`mergefs index --exact` makes them exact") if est else None)
    rng = (lambda on, lo, hi: "" if not on or lo is None or hi is None
           else escape(f" [{pct(lo)}-{pct(hi)}]"))
    for col in ("variant", "budget", "expert bytes read", "bound / update",
                "error / update", "update energy kept"):
        table.add_column(col, justify="left" if col == "variant" else "right",
                         overflow="fold" if col == "variant" else "ellipsis")
    for r in rows:
        err = None if r.error_exact is None or not r.update_norm else \
            r.error_exact / r.update_norm
        share = r.planned_bytes / r.total_expert_bytes if r.total_expert_bytes else 0
        rr = r.ranges()
        on_share = "bound_relative_to_update" in r.estimated
        on_err = r.error_estimated()
        table.add_row(r.variant, r.budget, f"{human_bytes(r.planned_bytes)} ({pct(share)})",
                      "≈" * on_share + pct(r.bound_share) + rng(on_share, *rr["share"])
                      if r.bound_share is not None else
                      ("no bound" if r.bound_tight is None else "-"),
                      "≈" * (on_err and err is not None) + pct(err)
                      + rng(on_err, *rr["error"]),
                      "≈" * (on_err and r.energy_kept is not None) + pct(r.energy_kept)
                      + rng(on_err, *rr["kept"]))
    return table


def merge_summary(outdir: str, totals: dict[str, Any], manifest: Any) -> str:
    """The line ``mergefs merge`` ends with: where, how long, what was read."""
    read = totals["physical_bytes_read"]
    vocab = totals.get("expert_bytes_vocabulary", 0)
    whole = f", plus {human_bytes(vocab)} of vocabulary tensors read whole for the tokenizer " \
        "merge" if vocab else ""
    return (f"merged into {outdir} in {totals['wall_seconds']:.2f}s: read "
            f"{human_bytes(totals['expert_bytes_read'])} expert bytes ("
            f"{human_bytes(totals['expert_bytes_planned'])} planned of "
            f"{human_bytes(totals['total_expert_bytes'])} in blocks{whole}) and "
            f"{human_bytes(read['base'])} base; manifest {manifest}")


GC_WORDS = {"unreached": "pieces no recent spec reaches",
            "temporary": "temporary files of dead builds",
            "over the size cap": "least recently used pieces over the size cap",
            "record": "records of sources and uses left pointing at nothing"}


def gc_summary(got: Collected) -> list[str]:
    """What ``mergefs index gc`` prints: one line per kind of removal, then the total."""
    verb = "would remove" if got.dry_run else "removed"
    lines = []
    for kind, words in GC_WORDS.items():
        mine = [r for r in got.removed if r.kind == kind]
        lines.append(f"{verb} {len(mine)} {words} ({human_bytes(got.freed_bytes(kind))})")
    live = f", {got.live_pieces} used by running mounts" if got.live_pieces else ""
    lines.append(f"{'would free' if got.dry_run else 'freed'} {human_bytes(got.freed_bytes())} "
                 f"in {got.folder}; kept {got.kept_pieces} pieces "
                 f"({human_bytes(got.kept_bytes)}){live}")
    return lines
