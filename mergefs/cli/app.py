"""The ``mergefs`` argument parser and ``main``: index, plan, sweep, merge, replay, mount, reload,
umount, stats, methods.

Maps domain errors (:class:`MergefsError`) to one clear line on stderr and exit code 1 (2 for
usage errors); ``--debug`` shows tracebacks and debug logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from typing import Any


from mergefs.core.version import __version__
from mergefs.core.errors import MergefsError
from mergefs.cli.commands import (
    cmd_compress, cmd_index, cmd_index_gc, cmd_merge, cmd_methods, cmd_mount, cmd_plan,
    cmd_reload, cmd_replay, cmd_stats, cmd_sweep, cmd_umount,
)

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


def _paragraphs(*texts: str) -> str:
    """Descriptions for the raw formatter (kept for the examples in epilogs): wrapped here."""
    return "\n\n".join(textwrap.fill(t, 79) for t in texts)


def _add_ray(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"run on a Ray cluster ({what}): ADDRESS like 10.0.0.1:6379; without "
                   "it, RAY_ADDRESS or the cluster `ray start` runs here (else a local one). "
                   "Sources must be URLs or paths every node sees. Needs mergefs[ray]")


def _add_mergekit_options(s: argparse.ArgumentParser) -> None:
    """Every flag of mergekit-yaml 0.1.5 (and mergekit-multi's), with mergekit's meaning or,
    where mergefs has nothing to change, a help line saying so: `mergefs merge CONFIG OUT
    [flags]` is a drop-in for `mergekit-yaml CONFIG OUT [flags]`."""
    flag = argparse.BooleanOptionalAction
    g = s.add_argument_group(
        "mergekit-yaml options",
        "every flag of mergekit-yaml 0.1.5, with mergekit's meaning (docs/cli.md, \"Coming from "
        "mergekit-yaml\")")
    g.add_argument("--out-shard-size", metavar="SIZE", default="5B",
                   help="at most SIZE bytes of tensor data per weight file, tensors in "
                   "mergekit's order (mergekit's K/M/B suffixes: thousands, millions, billions; "
                   "default 5B); `base`: mirror the base's weight files instead")
    g.add_argument("--copy-tokenizer", action=flag, default=True,
                   help="copy the base's tokenizer files (mergekit's list, with "
                   "generation_config.json) to the output (default: on)")
    g.add_argument("--write-model-card", action=flag, default=True,
                   help="write README.md (mergekit's model card plus the budget, bytes read and "
                   "error bound) and mergekit_config.yml (the spec's text) (default: on); the "
                   "base's README.md is never copied")
    g.add_argument("--random-seed", type=int, metavar="N",
                   help="seed of the random masks of dare_* and della* (sets the spec's "
                   "parameters.seed; mergefs's masks are reproducible even without it: seed 0)")
    g.add_argument("--allow-crimes", action=flag, default=False,
                   help="changes nothing: mergefs never compares architectures, only tensor "
                   "names and shapes (models that differ there are refused)")
    g.add_argument("--trust-remote-code", action=flag, default=False,
                   help="changes nothing: mergefs runs no code from a model repository "
                   "(config.json is read as JSON, tokenizers load without remote code)")
    g.add_argument("--lora-merge-cache", metavar="DIR",
                   help="changes nothing: mergefs applies model+lora adapters while reading "
                   "and stores no merged copy")
    g.add_argument("--lora-merge-dtype", metavar="DTYPE",
                   help="not applied (one log line): mergefs applies a LoRA adapter in each "
                   "weight's own dtype (W + delta in float32, rounded once)")
    g.add_argument("-j", "--num-threads", type=int, metavar="N",
                   help="threads that merge (default 2)")
    g.add_argument("--safe-serialization", action=flag, default=True,
                   help="always on: mergefs writes safetensors only (--no-safe-serialization "
                   "is refused)")
    g.add_argument("--quiet", action=flag, default=False,
                   help="no progress bars, and only warnings and errors in the log")
    g.add_argument("-v", dest="verbosity", action="count", default=0,
                   help="more logging: -v info (the default, also with --quiet), -vv debug "
                   "(without --debug's tracebacks)")
    g.add_argument("--lazy-unpickle", action=flag, default=False,
                   help="changes nothing: mergefs never unpickles (it reads safetensors)")
    g.add_argument("--low-cpu-memory", action=flag, default=False,
                   help="a GPU option: mergefs computes on the CPU (one log line); it holds "
                   "a few merge units in memory, never a model")
    g.add_argument("--clone-tensors", action=flag, default=False,
                   help="changes nothing: repeated layers are written as copies anyway")
    g.add_argument("--async-write", action=flag, default=False,
                   help="changes nothing: mergefs always writes a file while the next units "
                   "merge")
    g.add_argument("--write-threads", type=int, metavar="N",
                   help="changes nothing: one writer per output file (merging uses -j threads)")
    g.add_argument("--unsafe-truncate-embeddings", action=flag, default=False,
                   help="changes nothing: models must share their tensor shapes, so "
                   "embeddings are never truncated; merge different vocabularies with a "
                   "tokenizer: block (differing vocabularies are refused naming the tensor)")
    g.add_argument("--transformers-cache", metavar="DIR",
                   help="where Hub models are found and downloaded (the Hugging Face hub "
                   "cache; default HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    g.add_argument("--cuda", action=flag, default=False,
                   help="a GPU option: mergefs computes on the CPU (one log line)")
    g.add_argument("--device", metavar="DEVICE",
                   help="a GPU option: mergefs computes on the CPU (one log line unless cpu)")
    g.add_argument("--read-to-gpu", action=flag, default=False,
                   help="a GPU option: mergefs reads into host memory (one log line)")
    g.add_argument("--multi-gpu", action=flag, default=False,
                   help="a GPU option: mergefs computes on the CPU (one log line)")
    g.add_argument("--gpu-rich", action="store_true",
                   help="a GPU option (--cuda --low-cpu-memory --read-to-gpu --multi-gpu): "
                   "mergefs computes on the CPU (one log line)")
    m = s.add_argument_group("mergekit-multi options",
                             "for a multi-document spec (named merges, then the final one)")
    m.add_argument("-I", "--intermediate-dir", metavar="DIR",
                   help="where the named merges go (overrides the spec's intermediate_dir; "
                   "relative to the working directory)")
    m.add_argument("--lazy", action=flag, default=None,
                   help="--lazy: skip a named merge whose directory holds a model, as "
                   "mergekit-multi; --no-lazy: merge every one again; default: skip one that "
                   "holds a mergefs merge of the same plan")
    m.add_argument("--out-path", metavar="OUTDIR",
                   help="the output directory, instead of the positional OUTDIR")


GC_COMMAND = "index gc"  # `mergefs index gc`: main() joins the two words into this one
SPEC_HELP = "the merge spec: a mergekit YAML config, plus optional mergefs keys"
#: the commands that read a spec (and so take --strict)
SPEC_COMMANDS = ("index", "compress", "plan", "sweep", "merge", "mount")
NO_SIDECARS_HELP = ("plan with exact blocks only: ignore the delta sidecars (`mergefs compress`, "
                    "in index_dir or beside the experts) that the plan would otherwise use")
MEMORY_HELP = ("cap on the merge's working set (e.g. 4GiB; default: the spec's memory:, else half "
               "of RAM): units wait for room under it, and a tensor that needs more is refused "
               "before any work (`mergefs methods` gives each method's need)")
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
                   help="spec keys and parameters that mergekit ignores are errors, not warnings "
                   f"({', '.join(SPEC_COMMANDS)})")
    # --strict only where a spec is read (SUPPRESS: it does not reset the global one)
    reads_spec = argparse.ArgumentParser(add_help=False)
    reads_spec.add_argument("--strict", action="store_true", default=argparse.SUPPRESS,
                            help="spec keys and parameters that mergekit ignores are errors, not "
                            "warnings")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    budget_help = ("override the spec's budget: full, 10%%, 0.1 (a fraction) or a size with a "
                   "unit like 2GiB or 500MB; a bare number above 1 is refused as ambiguous")

    manifest_help = ("write the manifest exactly here (must not exist); default: a new "
                     "timestamped file beside the spec's `manifest` path, which then points to it")

    def add(name: str, **kw: Any) -> argparse.ArgumentParser:
        parents = [common, reads_spec] if name in SPEC_COMMANDS else [common]
        return sub.add_parser(name, parents=parents, **kw)

    s = add("index", help="build (or reuse) the block index of a spec's family; "
            "`index gc`: collect an index directory",
            description="Read base and experts once; store per-block delta norms, "
            "hashes, zero flags and delta sketches under index_dir. Reused while sources hold "
            "the same bytes (a touched or copied source is hashed once to check; a renamed one "
            "is not read); adding an expert reads only it and the base. "
            "`mergefs index gc --help`: removing pieces no spec uses.")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("--rebuild", action="store_true", help="rebuild even if a valid index exists")
    s.add_argument("--exact", action="store_true",
                   help="also compute the exact cross terms <D_i, D_j> of every pair of experts "
                   "that has none stored (reads both experts where both deltas are non-zero); "
                   "without, plan and sweep estimate them from the pieces' sketches")
    s.add_argument("--tensors", type=int, default=0, metavar="N",
                   help="also list the N tensors with the largest deltas (per-expert norms)")
    s.add_argument("--publish", action="store_true",
                   help="also publish each expert's block index beside it, into the source "
                   "(mergefs-index.<base-key>.<block_size>.safetensors; only when asked: "
                   "without it nothing is written beside a source), so later plans over "
                   "remote experts need not read them")
    _add_ray(s, "tasks per run of blocks, every expert of them; the driver assembles the index")
    s.set_defaults(func=cmd_index)

    # `mergefs index gc ...` (main() joins "index" "gc" into this one argument)
    s = sub.add_parser(
        GC_COMMAND, parents=[common, reads_spec], prog="mergefs index gc",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs(
            "Remove what an index directory no longer needs, from its pieces/ folder: pieces "
            "no recent spec reaches (each index, plan, merge or mount records which pieces its "
            "family assembled, and when), pieces of an earlier index format, temporary files "
            "of builds whose process died, and records left pointing at nothing; with "
            "--max-size, then the least recently used pieces until the folder fits.",
            "With SPEC files, the pieces their families assemble now are kept and every other "
            "piece goes (a touched or copied source is hashed to find its pieces; nothing is "
            "built). Without, pieces used in the last --keep-days are kept. Pieces written in "
            "the last 10 minutes (a build in progress) and pieces a running mount uses are "
            "never removed. Prints one line per kind of removal and the total freed."),
        epilog="examples:\n"
        "  mergefs index gc --index-dir .mergefs/index --dry-run   # what would go\n"
        "  mergefs index gc spec.yaml other.yaml     # keep only what these two use\n"
        "  mergefs index gc --index-dir idx --max-size 20GiB   # and cap its size, LRU first")
    s.add_argument("specs", nargs="*", metavar="SPEC",
                   help="specs whose pieces to keep (all must use one index_dir)")
    s.add_argument("--index-dir", metavar="DIR",
                   help="the index directory to collect (default: the specs' index_dir)")
    s.add_argument("--max-size", metavar="SIZE",
                   help="then remove least recently used pieces until pieces/ holds at most "
                   "SIZE (e.g. 20GiB)")
    s.add_argument("--keep-days", type=float, default=30.0, metavar="DAYS",
                   help="without SPEC: keep pieces some spec used in the last DAYS days "
                   "(default 30)")
    s.add_argument("--dry-run", action="store_true",
                   help="say what would be removed; remove nothing")
    s.set_defaults(func=cmd_index_gc)

    s = add("compress", help="write compressed delta sidecars of each expert (into index_dir; "
            "--publish: beside each expert)",
            description=_paragraphs(
                "Write per expert mergefs-delta.<base-key>.<block_size>.safetensors: "
                "refinement levels of its delta (low rank at mixed precision, quantised "
                "residual, sparse exact values) per row block, with exact residual norms, so "
                "that budgeted merges read a few bits per element instead of skipping blocks.",
                "They go into mergefs's own store, index_dir/sidecars/ (nothing is written "
                "into a source); --publish writes them beside the experts instead, for others "
                "to use.",
                "Plans, merges and mounts then use the sidecars by themselves when they match "
                "the indexed base and expert bytes (the store's first, then those beside the "
                "experts; `mergefs plan` says so, --no-sidecars plans without them); a full "
                "budget still reads exact blocks."),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="example (on three full fine-tunes of MiniLM, 10% of the bytes kept 99.7% "
            "of the\nmerge update: docs/benchmarks.md, issue 14):\n"
            "  mergefs compress spec.yaml\n"
            "  mergefs plan spec.yaml --budget 10%      # the sidecar bytes and the bound\n"
            "  mergefs merge spec.yaml out/ --budget 10%")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("--publish", action="store_true",
                   help="write each sidecar beside its expert, into the source (local, file:// "
                   "or s3://), instead of into index_dir")
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
    s.add_argument("--no-sidecars", dest="sidecars", action="store_false",
                   help=NO_SIDECARS_HELP)
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
            description="Read base + planned expert blocks, merge, write OUTDIR as "
            "mergekit-yaml does (safetensors shards of at most --out-shard-size, config.json "
            "with the output dtype, the tokenizer files, README.md and mergekit_config.yml; "
            "the base's other non-weight files are copied too) and a manifest of every byte "
            "read. OUTDIR appears only when complete; an interrupted merge leaves no partial "
            "output. Takes every flag of mergekit-yaml: `mergefs merge CONFIG OUT [flags]` "
            "replaces `mergekit-yaml CONFIG OUT [flags]`.")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("outdir", nargs="?",
                   help="output directory (new or empty; never a source); or --out-path")
    s.add_argument("--budget", help=budget_help)
    s.add_argument("--manifest", metavar="PATH", help=manifest_help)
    s.add_argument("--force", action="store_true",
                   help="replace an earlier merge output in OUTDIR as a whole")
    s.add_argument("--variant", metavar="NAME", help=VARIANT_HELP)
    s.add_argument("--no-sidecars", dest="sidecars", action="store_false",
                   help=NO_SIDECARS_HELP)
    s.add_argument("--memory", metavar="SIZE", help=MEMORY_HELP)
    _add_ray(s, "one task per output shard, and the index if it must be built; OUTDIR must "
             "lie on storage every node sees")
    _add_mergekit_options(s)
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
    s.add_argument("--memory", metavar="SIZE", help=MEMORY_HELP + " (beside --cache-size)")
    s.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C unmounts")
    s.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    s.add_argument("--warm", nargs="?", const="on", default=None, choices=("auto", "on", "off"),
                   help="merge the whole model ahead, in file order, up to the cache size, and "
                   "push it into the kernel page cache, so that from_pretrained reads pages "
                   "already there. auto (the default): a variant once its config.json is opened "
                   "(from_pretrained and vLLM read it first) or 8 of its tensors are read; a "
                   "reader of a few tensors starts nothing; on (--warm alone): at mount time; "
                   "off: merge only what is read (and the readahead of sequential readers)")
    s.add_argument("--source-cache-size", metavar="SIZE",
                   help="sweep mounts: memory for source blocks shared by the variants "
                   "(default: the --cache-size; 0 turns sharing of reads off)")
    s.add_argument("--out-shard-size", metavar="SIZE", default="5B",
                   help="the weight files, as `mergefs merge --out-shard-size` writes them "
                   "(default 5B; `base`: the base's files)")
    s.add_argument("--copy-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the base's tokenizer files, as `mergefs merge` (default: on)")
    s.add_argument("--write-model-card", action=argparse.BooleanOptionalAction, default=True,
                   help="serve README.md and mergekit_config.yml, as `mergefs merge` (default: "
                   "on; named after the mountpoint, or the variant's directory)")
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

    s = add("stats", help="print a mount's live counters (and its last read errors)",
            description="Print what a running mount has done, from "
            "MOUNTPOINT/.mergefs/stats.json: weight bytes served, source bytes read (per source, "
            "against a full merge), the planned expert bytes and the budget, units merged, the "
            "cache (hits, misses, evictions) and the last read errors; per variant for a sweep "
            "mount. --json prints the file as is.")
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
        if a in ("--budget", "--cache-size", "--random-seed", "--out-shard-size") and k + 1 < len(argv) \
                and argv[k + 1].startswith("-") and argv[k + 1][1:2] not in ("-", ""):
            out.append(f"{a}={argv[k + 1]}")
            k += 2
            continue
        out.append(a)
        k += 1
    return out


def _index_gc(argv: list[str]) -> list[str]:
    """``index gc ...`` -> ``"index gc" ...`` (one argument, the name the subparser has, so
    that errors name it as typed): a subcommand of ``index``, whose own positional is a spec
    (a spec file named ``gc`` is ``./gc``)."""
    k = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if k is not None and argv[k:k + 2] == ["index", "gc"]:
        return [*argv[:k], GC_COMMAND, *argv[k + 2:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_index_gc(_join_option_values(
        list(sys.argv[1:] if argv is None else argv))))
    if args.command == "merge" and (args.outdir is None) == (args.out_path is None):
        parser.error("merge: give the output directory once: OUTDIR or --out-path OUTDIR")
    if args.strict and args.command not in (*SPEC_COMMANDS, GC_COMMAND):
        parser.error(f"--strict: `{args.command}` reads no spec (--strict applies to "
                     f"{', '.join(SPEC_COMMANDS)})")
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



def entry() -> None:
    """The ``mergefs`` command (console script, ``python -m mergefs``): :func:`main`, and after an
    interrupt, whose cleanup (staging, manifest, session) has run by then, an exit that does not
    wait for the interpreter's shutdown (with torch loaded it takes 0.3-2 s)."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(130)
    sys.exit(code)
