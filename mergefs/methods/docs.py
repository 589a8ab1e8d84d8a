"""docs/operators.md, rendered from the registry (a test keeps the file equal to this output).

Pure; no I/O. Regenerate with
``python -c "from mergefs.methods.docs import render; print(render(), end='')" > docs/operators.md``.
"""

from __future__ import annotations

from mergefs.methods.base import REQUIRED, Method, Scope
from mergefs.methods import _ALL, blockwise_note, needs
from mergefs.methods.base import ParamDef
from mergefs.methods.papers import reference_md

INTRO = """\
# Merge methods: exact arithmetic

<!-- Generated from mergefs/methods (mergefs.methods.docs.render); edit the registry, not this
file. -->

mergefs runs every merge method of mergekit 0.1.5 and produces the same bytes as mergekit
computing in float32 (`dtype: float32`) and writing the output dtype. This page is generated from
the method registry (`mergefs/methods/`), which spec validation, the planner, the engine and
`mergefs methods` read too.

Methods mergekit lacks follow their reference implementation the same way (bytes equal to it
run in float32 with the same torch); each names its reference in its section.

## Conventions

- Inputs are decoded to float32; the merge runs in float32; the result is cast once to the
  output dtype (`out_dtype`, else `dtype`, else each tensor's own) with round-to-nearest-even.
  mergekit's `dtype` is its compute dtype: a config that gives only `dtype: bfloat16` is computed
  in bfloat16 by mergekit and in float32 by mergefs (the output dtype is bfloat16 in both).
  Non-floating tensors pass through from the base unchanged.
- The arithmetic runs in torch CPU float32 kernels, in mergekit's order of operations, on
  zero-copy views of mergefs' buffers: mergekit's bytes are those kernels' (fused multiply-add in
  `addcmul_`, sums over the model axis that are sequential for up to 4 models and
  position-dependent beyond, Sleef transcendentals), which numpy does not reproduce in general.
  The elementwise methods (linear; task_arithmetic, DARE without rescale and ram up to 4 models;
  nearswap; passthrough) have numpy kernels equal to torch's bit for bit
  (linear's fused multiply-add by float64 round-to-odd), so they run without importing torch;
  so does task_arithmetic with 5-256 models on x86, whose position-dependent sum order (ATen's
  `multi_row_sum` cascade: a sum per block of 16 models) and weight sum mergefs models
  (`mergefs/methods/exact.py`, tested against torch).
  Python scalars (weights, lambda, t) enter as torch does: weights as a float32 tensor, other
  scalars converted to float32 by the kernel.
- torch is not a dependency of mergefs: the `torch` column below (and `mergefs methods`) says
  which methods need it, and when. Without torch those fail with one line naming the extra
  (`pip install 'mergefs[torch]'`; any torch>=2.0 already installed, CUDA builds included, is
  used as it is). The bytes equal mergekit's run on the same torch.
- Parameters use mergekit's names and defaults. Per-model parameters sit under
  `models[].parameters`; a global value of a per-model name is every model's default. Lists
  (gradients) and `{filter, value}` settings are not supported yet and are rejected.
- Inputs come in mergekit's order: the models as listed. For methods with a base, the base is
  the origin of the deltas and not an input. For linear, karcher and passthrough the base is one
  more input, appended last when it is not listed (mergekit does this; linear then needs a
  global `weight`, and without one mergekit refuses the config, while mergefs warns and keeps
  the base as the coordinate reference only).
- Leniency: like mergekit, mergefs runs configs with unknown top-level keys, parameters a
  method does not use and misspelt parameter names, printing one warning per ignored key;
  `--strict` (or `strict: true` in the spec) makes them errors.
- `D_i = W_i - W0` (float32). Under a budget every block the plan omits for model `i` holds the
  reference model's values (`W_i := W0` there, a zero delta); methods without a base use the
  first model as the reference.

## Budgets

Additive methods keep the error bound of design.md (their coefficients `c_i` are listed per
method). For the others the plan ranks reads by `|c_i| ||D_ib||` (the weights, or 1), omitted
blocks count as zero delta, there is no bound (`mergefs plan` says so), and the full budget is
bit-identical to the full read. Every method accepts a budget.

Block-wise methods are merged one block (or run of blocks) at a time, as the mount serves them;
whole-tensor methods read and merge the whole tensor for any byte of it (their statistics, such
as norms, ranks, variances or L1 rescales, span the whole tensor). model_stock's angles and
sce's model weights are functions of the index's per-block Gram matrices and could come from
the index instead, keeping those methods block-wise; that is not done, because the index sums
in float64 where mergekit reduces in float32, so the output would no longer equal mergekit's
bytes.

`inputs`: how many models besides the base (for linear, karcher and passthrough: all inputs).

| method | base | inputs | bound | block-wise | torch |
|---|---|---|---|---|---|
"""

RANDOM = """\
## The counter-based uniform `u(seed, tensor, i, j)`

DARE and DELLA masks in mergekit come from `torch.bernoulli` (not reproducible without
`--random-seed`, and dependent on merge order). mergefs keeps element `j` (flat index in the
tensor) of model `i` (its position among the non-base inputs) iff `u(seed, tensor, i, j) < p_j`,
compared in float64 with the float32 keep probability `p_j` (DARE: `density`; DELLA: its rank
probabilities). `seed` is a mergefs parameter (default 0).

    key  = xxh3_64(f"{seed}\\x00{tensor}\\x00{i}".encode())          # uint64
    x    = (key + j * 0x9E3779B97F4A7C15) mod 2**64                 # splitmix64 input
    x    = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 mod 2**64
    x    = (x ^ (x >> 27)) * 0x94D049BB133111EB mod 2**64
    x    =  x ^ (x >> 31)
    u    = (x >> 11) * 2**-53                                        # in [0, 1)

## Known differences from mergekit

- Magnitude selections (ties, breadcrumbs, della ranks) among equal `|delta|` at a cut (common
  in bfloat16/float16 families) follow torch's unstable CPU sort, as mergekit's do: the order of
  x86-simd-sort on AVX2/AVX-512 builds is deterministic for a torch build and CPU capability
  (`torch.backends.cpu.get_cpu_capability()`), so mergefs equals mergekit run with the same torch
  on the same kind of CPU; another build or capability may break such ties differently, in
  mergekit as in mergefs.
- Random masks are mergefs' own (above); with the same mask mergekit gives the same bytes.
- arcee_fusion sorts every element for its quantiles; mergekit samples 10^6 elements with
  replacement above 10^6 elements (not reproducible).
- task_arithmetic with 5-256 models follows torch's input-axis sum order as it is for fewer
  than 47 torch threads (mergefs/methods/exact.py: torch_sum_tail); a mergekit run with 47 or
  more threads can differ in the last elements of small tensors whose size is 4-7 past a
  multiple of 32.
- mergekit's full-tensor reductions (norms, L1 sums) split work across torch's threads; mergefs
  uses the same kernels and thread count, so a machine with a different SIMD width or thread
  count can round those sums differently, in mergekit as in mergefs.
- Refused where mergekit would not refuse: methods with a base and no other model (mergekit
  returns the base), slerp's `t` outside [0, 1], and linear weights summing to zero with
  normalize (mergekit divides by zero).
"""


MEMORY = """\
## Memory

What merging one tensor holds at its peak (`mergefs.methods.needs`), with `n` the tensor's
elements, `k` the models besides the base, `s` and `o` the source's and the output's bytes per
element. The memory cap (`--memory`, the spec's `memory:`, default half of RAM or of the
cgroup's memory limit, the lower) is checked against every tensor's need before anything is read, and units start only while the needs of
the units in flight fit under it. Whole-tensor units of the generalised task arithmetic rows run
in two phases: what each model keeps (its selection mask, bit-packed, and the L1 rescale factor)
from its whole delta, one model at a time, then the merge by blocks of 2^19 elements, each
model's blocks read again (from the page cache, usually), with the same bytes as whole tensors.
slerp, nuslerp, model_stock and sce keep whole tensors: their angles and norms are torch
reductions over the whole tensor. Not counted: the interpreter, numpy and torch (~0.1 GB,
~0.4 GB with torch), a mount's caches and the page cache. The two-phase path's peak is measured
against its formula in tests/engine/test_staged.py; the whole-tensor formulas of slerp and
model_stock were measured once (2M bf16 elements, 1 and 4/8 models), the others are estimates.

| method | bytes at the peak |
|---|---|
"""


def _param_line(p: object) -> str:

    assert isinstance(p, ParamDef)
    scope = {Scope.GLOBAL: "global", Scope.MODEL: "per model (base included)",
             Scope.NON_BASE: "per model"}[p.scope]
    default = "required" if p.default is REQUIRED else repr(p.default)
    notes = []
    if p.kind != "bool" and (p.lo is not None or p.hi is not None):
        notes.append(f"range {p.describe_range()}")
    if p.mergefs_only:
        notes.append("mergefs only")
    if p.no_op:
        notes.append(f"no effect: {p.no_op}")
    extra = "".join(f"; {n}" for n in notes)
    doc = f"{p.doc[0].upper()}{p.doc[1:]}." if p.doc else ""
    return f"- `{p.name}` ({scope}; default {default}{extra}): {doc}"


def _method_section(m: Method) -> str:
    c = m.caps
    lines = [f"### `{m.name}`", "", f"{m.summary[0].upper()}{m.summary[1:]}.", "",
             f"Paper: {reference_md(m.name)}.", ""]
    lines += [_param_line(p) for p in m.params] or ["- no parameters"]
    lines += ["", m.arithmetic.rstrip(), ""]
    if c.additive:
        lines += ["Additive: the bound of design.md holds with the coefficients above.", ""]
    return "\n".join(lines)


def render() -> str:

    rows = []
    for m in _ALL:
        c = m.caps
        inputs = f"{c.min_inputs}..{c.max_inputs if c.max_inputs is not None else 'n'}"
        block = blockwise_note(m)
        rows.append(f"| {m.name} | {c.base.value} | {inputs} | "
                    f"{'yes' if c.additive else 'no'} | {block} | {m.torch_use.note} |")
    families: dict[str, list[Method]] = {}
    for m in _ALL:
        families.setdefault(m.family, []).append(m)
    body = []
    for family, ms in families.items():
        title = {"linear": "Linear", "gta": "Generalised task arithmetic",
                 "slerp": "Spherical interpolation", "stock": "Model stock and SCE",
                 "spherical": "Means on the hypersphere", "simple": "Small methods",
                 "ram": "RAM",
                 "magmax": "MagMax (FusionBench)",
                 "consensus": "Consensus merging, TALL masks (mergekitty)",
                 "subspace": "Singular subspaces (FusionBench)"}[family]
        body.append(f"## {title}\n")
        if family in ("gta", "consensus"):
            body.append(ms[0].arithmetic.rstrip() + "\n")
            for m in ms:
                body.append(f"### `{m.name}`\n\n{m.summary[0].upper()}{m.summary[1:]}.\n\n"
                            f"Paper: {reference_md(m.name)}.\n\n"
                            + "\n".join(_param_line(p) for p in m.params) + "\n")
        else:
            body.extend(_method_section(m) for m in ms)
    memory = [f"| {m.name} | {needs.formula(m, blockwise_note(m) != 'no')} |" for m in _ALL]
    return INTRO + "\n".join(rows) + "\n\n" + "\n".join(body) + "\n" + MEMORY \
        + "\n".join(memory) + "\n\n" + RANDOM
