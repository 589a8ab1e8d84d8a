"""The frozen spec a merge runs from: models, slices, parameters, budget and mergefs' own keys. Plain data."""

from __future__ import annotations
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from mergefs import methods as registry
from mergefs.methods.base import Method
from mergefs.spec.options import RemoteOptions
from mergefs.spec.tokenizer import TokenizerSpec
from mergefs.spec.budget import Budget

#: ``decode_limit`` when a spec gives none: plans by bytes alone (docs/benchmarks.md, issue 14:
#: on a local disk, a limit that makes decoding cheaper than the reads costs most of the
#: layers' energy; remote sidecars are never limited)
DEFAULT_DECODE_LIMIT: float | None = None



DTYPE_NAMES = {
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float64": "F64",
}


OUT_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class ModelEntry:
    """An expert: its resolved path and its validated parameters (settings: scalars, or
    gradients and filtered values resolved per tensor by the recipe)."""

    path: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class SliceSource:
    """One input of an output slice: a model, its layers ``[lo, hi)`` (None: all of them) and
    the parameter settings given on it (only those given: the recipe resolves precedence)."""

    path: str
    layer_range: tuple[int, int] | None
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class SliceDef:
    """An output slice by role: ``ref`` plays the reference (``Spec.base``'s role), ``experts``
    the roles of ``Spec.experts`` in order; ``settings`` are the slice's own parameters."""

    ref: SliceSource
    experts: tuple[SliceSource, ...]
    settings: Mapping[str, Any]
    #: the architecture module of a ``modules:`` spec this slice belongs to (mergefs.recipe.modules)
    module: str | None = None
    #: the module's own parameters (precedence below the slice's, above the global ones)
    module_settings: Mapping[str, Any] = field(default_factory=dict)
    #: a module slice of the base alone, for a method whose output is the base when it has
    #: no other input (mergekit's task-arithmetic family returns the base tensor): its expert
    #: roles are the base itself (nothing to read), its output the base cast to the output
    #: dtype
    ref_only: bool = False


#: ``Spec.input_order`` value for the reference model (``Spec.base``) as an input.
REFERENCE = -1


@dataclass(frozen=True)
class Spec:
    """A validated merge spec. ``raw`` is the resolved spec as plain JSON-able data.

    ``base`` is the reference model: the coordinate system deltas are taken against and omitted
    blocks fall back to (``base_model``; for methods that may run without one and a spec that
    gives none, the first model). ``experts`` are the other models. ``input_order`` lists the
    method's inputs in mergekit's order (:data:`REFERENCE` or an expert index), the base
    excluded when ``has_base`` (it then plays mergekit's base role); ``base_parameters`` are the
    reference's own per-model parameters when it is an input.
    """

    source: str  # the spec file, or "<inline>"
    method: str
    base: str
    experts: tuple[ModelEntry, ...]
    base_weight: float | None
    parameters: Mapping[str, Any]
    out_dtype: str | None  # safetensors dtype name, or None for "each tensor's own"
    budget: Budget
    block_size: int
    index_dir: str
    cache_memory_bytes: int | None
    cache_dir: str | None
    manifest: str
    raw: Mapping[str, Any] = field(repr=False)
    # URL of each remote source -> how to reach it (holds credentials: never log or write it)
    remote_sources: Mapping[str, RemoteOptions] = field(default_factory=dict, repr=False)
    has_base: bool = True
    input_order: tuple[int, ...] = ()
    base_parameters: Mapping[str, Any] | None = None
    warnings: tuple[str, ...] = ()
    #: the output by slices (a ``models:`` spec is one slice over all layers, as in mergekit)
    slices: tuple[SliceDef, ...] = ()
    #: the spec was written with ``slices`` (output layers renumbered, config rewritten)
    sliced: bool = False
    #: the global ``parameters`` as given (settings), for per-tensor resolution
    settings: Mapping[str, Any] = field(default_factory=dict)
    #: tokenizer_source / tokenizer / chat_template (None: the base's tokenizer files as they are)
    tokenizer: TokenizerSpec | None = None
    #: a multi-document spec's named merges, in dependency order: (name, spec, output dir)
    intermediates: tuple[tuple[str, Spec, str], ...] = ()
    #: delta sidecars on local disks: a plan decodes for at most this many times the modelled
    #: read time of the exact bytes it replaces (:class:`mergefs.plan.levels.DecodeCost`);
    #: None: no limit
    decode_limit: float | None = DEFAULT_DECODE_LIMIT
    #: ``index_max_size``: after an index build, least recently used pieces of ``index_dir``
    #: are removed until it holds at most this many bytes (:mod:`mergefs.index.collect`);
    #: None (the default): no automatic collection
    index_max_size_bytes: int | None = None
    #: the cap on the merge's working set (``memory``; None: the default, half of RAM;
    #: mergefs.engine.working_set)
    memory_bytes: int | None = None
    #: ``memory_bytes`` came from ``--memory``, not the spec file
    memory_flag: bool = False

    @property
    def method_def(self) -> Method:
        m = registry.get(self.method)
        assert m is not None
        return m

    @property
    def is_additive(self) -> bool:
        return self.method_def.caps.additive

    def input_parameters(self) -> list[Mapping[str, Any]]:
        """Per-model parameters of the method's inputs, in ``input_order``."""
        return [self.base_parameters or {} if k == REFERENCE else self.experts[k].parameters
                for k in self.input_order]

    def expert_coefficients(self) -> list[float]:
        """Per expert, the method's coefficient ``c_i`` (ranking reads; the bound if additive)."""
        per_input = self.method_def.coefficients(self.parameters, self.input_parameters())
        out = [0.0] * len(self.experts)
        for k, c in zip(self.input_order, per_input):
            if k != REFERENCE:
                out[k] = float(c)
        return out

    def with_budget(self, budget: Budget) -> Spec:
        raw = dict(self.raw)
        raw["budget"] = budget.to_spec()
        return Spec(**{**self.__dict__, "budget": budget, "raw": raw})

    def with_memory(self, memory_bytes: int) -> Spec:
        """This spec with the memory cap ``memory_bytes`` (``--memory``; not recorded in
        ``raw``: the cap never changes the output)."""
        return Spec(**{**self.__dict__, "memory_bytes": memory_bytes, "memory_flag": True})

    @property
    def model_paths(self) -> list[str]:
        """Every model the spec reads: base, experts, every slice's models, tokenizer sources
        and the models its named merges read (outputs must never land in one)."""
        out = [self.base, *(e.path for e in self.experts)]
        for sl in self.slices:
            out += [r.path for r in (sl.ref, *sl.experts)]
        tok = self.tokenizer
        if tok is not None:
            out += [p for p in (tok.source, *(r.model for r in tok.tokens.values()))
                    if p is not None and p not in ("base", "union")]
        for _, sub, _ in self.intermediates:
            out += sub.model_paths
        return list(dict.fromkeys(out))

    def source_options(self, path: str) -> RemoteOptions | None:
        """Options to open the source at ``path``: None for a local path."""
        return self.remote_sources.get(path)

    def key_naming(self, path: str) -> tuple[str, str] | None:
        """The first key of the spec as written (``models[1].model``) whose local path value
        resolves to ``path``, and that value; None if no key names it (a Hub id, a URL)."""
        written: Any = self.raw
        base_dir = Path.cwd()
        if self.source != "<inline>":
            base_dir = Path(self.source).parent
            try:  # the file as written: raw holds the inputs resolved and reordered
                docs = [d for d in yaml.safe_load_all(Path(self.source).read_text()) if d]
                written = docs[0] if len(docs) == 1 else docs
            except (OSError, ValueError, yaml.YAMLError):
                pass
        for key, value in _model_values(written, ""):
            local = value.split("+")[0].partition("@")[0]
            if value == path or (local and str((base_dir / Path(local).expanduser()).resolve())
                                 == str(Path(path).expanduser().resolve())):
                return key, value
        return None


def _model_values(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """``(key, value)`` of every ``model``/``base_model``/``path`` string under ``node``."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            sub = f"{key}.{k}" if key else str(k)
            if k in ("model", "base_model", "path") and isinstance(v, str):
                yield sub, v
            else:
                yield from _model_values(v, sub)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _model_values(v, f"{key}[{i}]")
