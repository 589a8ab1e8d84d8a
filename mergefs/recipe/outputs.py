"""The recipe: the output model as output tensors, each with its sources and resolved parameters.

Between the spec and the index. An :class:`OutputTensor` names, per *role* (0: the reference,
``Spec.base``'s role; then the roles of ``Spec.experts``), the model and the source tensor it is
made of, its position ``t`` in its slice and the method's parameters resolved for it (gradients
and filters, precedence slice source > slice > global, as mergekit 0.1.5). Output tensors with the
same sources and parameters are one *unit* (``key``: the first of them): it is indexed, planned,
read and merged once, however often the output repeats it (a self-stack).

Layers are found as mergekit infers them: the first ``.N.`` in a tensor name is the layer index.
Non-layer tensors of a sliced spec are taken from the first slice's models when they are
embeddings (their name matches :data:`PRE_WEIGHT`), else from the last slice's (mergekit's pre and
post weights). :class:`RoleSource` presents one role's source tensors under the unit keys, so the
index, plan and engine work in the output's coordinates unchanged. Pure but for RoleSource's
reads; no trio.

Longer than ~500 lines on purpose: the resolver (which model and parameters each output tensor
takes) and :class:`RoleSource` (the same mapping, served as a source) read one table, which
splitting them would have to hand across a module boundary as a second public structure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mergefs.spec import settings
from mergefs.sources.local import Checkpoint
from mergefs.sources.base import Counters
from mergefs.sources.base import AuxFile, GapAllowance, ReadRange, TensorLoc, aux_read_only
from mergefs.core.errors import SpecError
from mergefs.spec.model import REFERENCE, SliceDef, SliceSource, Spec
from mergefs.recipe.modules import Module, Weight, read_modules, set_dotted

LAYER = re.compile(r"\.(\d+)\.")
#: Non-layer tensors that mergekit's architectures put before the layers (pre weights)
PRE_WEIGHT = re.compile(r"embed|wte|wpe|word_embeddings|position_embeddings|token_type")
#: config.json keys holding the number of layers, the first present is rewritten
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True)
class OutputTensor:
    name: str
    key: str
    models: tuple[str, ...]  # per role: model path
    sources: tuple[str, ...]  # per role: tensor name in that model
    t: float
    params: Mapping[str, Any]
    input_params: tuple[Mapping[str, Any], ...]  # per input, in ``Spec.input_order``
    #: a vocabulary tensor of a tokenizer merge: rows permuted per model (mergefs.spec.tokenizer),
    #: read whole, not indexed
    vocab: bool = False
    #: the reference's tensor cast to the output dtype (a base-alone module slice,
    #: :attr:`mergefs.spec.model.SliceDef.ref_only`): no expert is read, no method runs
    ref_only: bool = False
    #: roles whose model lacks this tensor (an optional weight of a ``modules:`` spec; their
    #: ``sources`` are ""): merged over the other roles as mergekit does, read whole, not
    #: indexed
    absent: tuple[int, ...] = ()
    #: the role whose tensor is the output as it is (cast to the output dtype): mergekit's
    #: passthrough of an optional weight that one input alone has (:func:`optional_outcome`)
    single: int | None = None

    @property
    def whole(self) -> bool:
        """Read whole from every role that has it and merged outside the index and plan."""
        return self.vocab or bool(self.absent)


@dataclass(frozen=True)
class Recipe:
    outputs: tuple[OutputTensor, ...]
    #: per output layer: (model path of the reference role, source layer); None: not sliced
    layers: tuple[tuple[str, int], ...] | None = None
    #: a ``modules:`` spec: per module with a layer-count key, (dotted config key, its
    #: output layer count), written into config.json as mergekit writes it; None: no modules
    layer_counts: tuple[tuple[str, int], ...] | None = None

    @property
    def units(self) -> dict[str, OutputTensor]:
        out: dict[str, OutputTensor] = {}
        for o in self.outputs:
            out.setdefault(o.key, o)
        return out

    @property
    def identity(self) -> bool:
        """Every output tensor is its own unit, read under its own name from one model per role."""
        return self.layers is None and all(o.key == o.name and set(o.sources) == {o.name}
                                           for o in self.outputs)

    def coefficients(self, spec: Spec, tensors: Sequence[str]) -> np.ndarray:
        """(N, T) the method's coefficient of each expert for each unit in ``tensors``."""
        units = self.units
        out = np.zeros((len(spec.experts), len(tensors)))
        for t, key in enumerate(tensors):
            u = units[key]
            if u.ref_only:
                continue  # no expert contributes
            per_input = spec.method_def.coefficients(u.params, u.input_params)
            for k, c in zip(spec.input_order, per_input):
                if k != REFERENCE:
                    out[k, t] = float(c)
        return out


def layer_of(name: str) -> tuple[str, int, str] | None:
    m = LAYER.search(name)
    return None if m is None else (name[:m.start()], int(m.group(1)), name[m.end():])


def _layer_counts(names: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in names:
        lay = layer_of(n)
        if lay is not None:
            counts[lay[0]] = max(counts.get(lay[0], 0), lay[1] + 1)
    return counts


def _position(index: int, count: int) -> float:
    return index / (count - 1) if count > 1 else 1.0


class _Resolver:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.m = spec.method_def
        self.check = self.m.check is not None and not all(
            settings.is_scalar(v) for p in [spec.parameters, *spec.input_parameters()]
            for v in p.values())

    def resolve(self, name: str, sl: SliceDef, roles: Sequence[SliceSource],
                sources: Sequence[str], t: float) -> tuple[dict[str, Any], tuple[dict, ...]]:
        spec, m = self.spec, self.m
        glob_levels = (sl.settings, sl.module_settings, spec.settings)
        params = {p.name: self._value(p, glob_levels, name, t, name) for p in m.global_params}
        if sl.ref_only:
            return params, tuple({} for _ in spec.input_order)
        per_input = []
        for k in spec.input_order:
            r = 0 if k == REFERENCE else k + 1
            levels = (roles[r].settings, sl.settings, sl.module_settings, spec.settings)
            per_input.append({p.name: self._value(p, levels, sources[r], t, name)
                              for p in m.model_params})
        if self.check:
            problem = m.check(params, per_input)  # type: ignore[misc]
            if problem:
                raise SpecError(f"{spec.source}: {name}: {problem}")
        return params, tuple(per_input)

    def _value(self, p: Any, levels: Any, tensor: str, t: float, out_name: str) -> Any:
        v = settings.resolve(p, levels, tensor, t)
        if v is settings.NO_VALUE:
            raise SpecError(f"{self.spec.source}: parameters.{p.name}: required by "
                            f"{self.m.name}, and no value applies to {out_name}")
        return v


_Row = tuple[str, tuple[str, ...], tuple[str, ...], float, SliceDef, tuple[SliceSource, ...]]

#: marks a row's source name of a role whose model lacks that (optional) weight
_ABSENT = "\0"
#: mergekit 0.1.5's handling of an optional weight that some inputs of a tensor lack
#: (``OptionalTensorPolicy``): the one input that has it passes through (any input / the base
#: only), or, below a number of inputs, the base passes through or the tensor is skipped
_SINGLETON = frozenset({"slerp", "nuslerp", "arcee_fusion"})
_BASE_SINGLETON = frozenset({"nearswap"})
_BASE_OR_SKIP = {"model_stock": 3}
#: mergekit's input contracts where they are not "one or more inputs": (min, max) inputs in
#: all, and (min, max) non-base inputs
_INPUTS = {"slerp": (2, 2), "nearswap": (2, 2), "arcee_fusion": (2, 2), "model_stock": (3, None),
           "passthrough": (1, 1)}
_NON_BASE = {"nuslerp": (2, 2), "multislerp": (1, None)}


def optional_outcome(spec: Spec, absent: Sequence[int], where: str) -> int | None:
    """What mergekit makes of an optional weight that the roles ``absent`` lack: the role
    whose tensor passes through as it is, -1 (merged over the roles that have it) or None
    (skipped: not in the output). Refused (SpecError) where mergekit refuses it: the base
    lacks it but the method takes a base, or too few inputs have it."""
    m = spec.method
    entries = [0 if k == REFERENCE else k + 1 for k in spec.input_order]
    if spec.has_base:
        entries.append(0)
    present = [r for r in entries if r not in absent]
    base_present = spec.has_base and 0 not in absent
    if len(present) == 1 and (m in _SINGLETON or (m in _BASE_SINGLETON and base_present)):
        return present[0]
    if m in _BASE_OR_SKIP and len(present) < _BASE_OR_SKIP[m]:
        return 0 if len(present) == 1 and base_present else None
    if spec.has_base and not base_present:
        raise SpecError(f"{where}: an optional weight the base lacks; {m} needs the base's "
                        "(mergekit refuses it too)")
    non_base = len(present) - int(base_present)
    for what, n, (lo, hi) in (("inputs", len(present), _INPUTS.get(m, (1, None))),
                              ("non-base inputs", non_base, _NON_BASE.get(m, (0, None)))):
        if n < lo or (hi is not None and n > hi):
            raise SpecError(f"{where}: an optional weight {n} {what} have, where {m} takes "
                            f"{lo if lo == hi else f'{lo} or more'} (mergekit refuses it too)")
    return 0 if base_present and non_base == 0 else -1  # the base alone: it is the result


def build_recipe(spec: Spec, names: Mapping[str, Sequence[str]],
                 vocab: frozenset[str] = frozenset(),
                 configs: Mapping[str, Mapping[str, Any]] | None = None,
                 vocab_weights: bool = False,
                 weights: Mapping[str, Mapping[str, Weight]] | None = None) -> Recipe:
    """The recipe of ``spec`` given each model's tensor names (``names[path]``, file order);
    ``vocab``: the reference model's vocabulary tensors when a tokenizer is merged;
    ``configs``: each model's config.json (a ``modules:`` spec needs them);
    ``vocab_weights``: a tokenizer merge of a ``modules:`` spec, whose vocabulary tensors are
    the weights mergekit's architecture gives a vocabulary axis;
    ``weights``: per model, its weights by mergekit's architecture
    (:func:`mergefs.recipe.modules.architecture_weights`), for a ``models:`` or ``slices:``
    spec whose models' tensors differ: the output has every tensor any model of a role
    has, and a model lacking one of its architecture's optional weights takes no part in
    it (:func:`stand_in`), as for a ``modules:`` spec. None: every model must have the
    reference's tensors."""
    res = _Resolver(spec)
    rows: list[_Row] = []
    layers: list[tuple[str, int]] | None = None
    layer_counts: tuple[tuple[str, int], ...] | None = None
    vocab_outputs: set[str] | None = None  # a modules: spec's vocabulary outputs
    if spec.slices and spec.slices[0].module is not None:
        rows, layers, layer_counts, vocab_outputs = _module_rows(spec, names, configs or {},
                                                                 vocab_weights)
    elif not spec.sliced:
        sl = spec.slices[0]
        roles = (sl.ref, *sl.experts)
        models = tuple(r.path for r in roles)
        base_names = names[spec.base] if weights is None else merged_order(
            [names[p] for p in dict.fromkeys(models)])
        have = {p: frozenset(names[p]) for p in models} if weights is not None else {}
        counts = _layer_counts(base_names)
        for n in base_names:
            lay = layer_of(n)
            t = 0.0 if lay is None else _position(lay[1], counts[lay[0]])
            srcs: tuple[str, ...] | None = (n,) * len(roles)
            if weights is not None:
                srcs = _sources((n,) * len(roles), models, have, weights, False,
                                lambda r: f"{spec.source}: {models[r]} has no tensor {n}")
            assert srcs is not None
            rows.append((n, models, srcs, t, sl, roles))
    else:
        layers = []
        first, last = spec.slices[0], spec.slices[-1]
        ref_names = names[first.ref.path]
        prefixes = set(_layer_counts(ref_names))
        if len(prefixes) != 1:
            raise SpecError(f"{spec.source}: slices: {first.ref.path} has "
                            f"{len(prefixes)} stacks of layers; slices need exactly one "
                            "(modules: are not supported yet)")
        prefix = prefixes.pop()
        have = {p: frozenset(ns) for p, ns in names.items()} if weights is not None else {}

        def loose_of(sl: SliceDef) -> list[str]:
            # the reference's (in its order), and with weights the other inputs' too
            others = [] if weights is None else [names[r.path] for r in (sl.ref, *sl.experts)]
            return [n for n in merged_order([ref_names, *others]) if layer_of(n) is None]

        pre = [n for n in loose_of(first) if PRE_WEIGHT.search(n)]
        post = [n for n in loose_of(last) if not PRE_WEIGHT.search(n)]
        for n in pre:
            row = _loose(spec, first, n, names, have, weights)
            if row is not None:
                rows.append(row)
        out_layer = 0
        for s, sl in enumerate(spec.slices):
            roles = (sl.ref, *sl.experts)
            assert all(r.layer_range is not None for r in roles)
            lo0, hi0 = roles[0].layer_range  # type: ignore[misc]
            for i in range(hi0 - lo0):
                t = _position(i, hi0 - lo0)
                src_layers = [r.layer_range[0] + i for r in roles]  # type: ignore[index]
                layers.append((roles[0].path, src_layers[0]))
                head = f"{prefix}.{src_layers[0]}."
                suffixes = [n[len(head):] for n in names[roles[0].path] if n.startswith(head)]
                if not suffixes:
                    raise SpecError(f"{spec.source}: slices[{s}]: {roles[0].path} has no "
                                    f"layer {src_layers[0]}")
                own = len(suffixes)
                if weights is not None:  # every weight any input's layer has
                    suffixes = merged_order([suffixes, *(
                        [n[len(f"{prefix}.{L}."):] for n in names[r.path]
                         if n.startswith(f"{prefix}.{L}.")]
                        for r, L in zip(roles[1:], src_layers[1:]))])
                for j, suf in enumerate(suffixes):
                    named = tuple(f"{prefix}.{L}.{suf}" for L in src_layers)
                    srcs = named
                    if weights is not None:
                        srcs = _sources(
                            named, [r.path for r in roles], have, weights, j >= own,
                            lambda r: f"{spec.source}: slices[{s}]: {roles[r].path} has no "
                                      f"tensor {named[r]}")
                        if srcs is None:
                            continue  # a weight the reference lacks: not output, as before
                    for r, src in zip(roles, srcs):
                        if weights is None and src not in names[r.path]:
                            raise SpecError(f"{spec.source}: slices[{s}]: {r.path} has no "
                                            f"tensor {src}")
                    rows.append((f"{prefix}.{out_layer}.{suf}", tuple(r.path for r in roles),
                                 srcs, t, sl, roles))
                out_layer += 1
        for n in post:
            row = _loose(spec, last, n, names, have, weights)
            if row is not None:
                rows.append(row)
    outputs: list[OutputTensor] = []
    keys: dict[str, str] = {}
    for name, models, named, t, sl, roles in rows:
        # a role without the tensor names it as _ABSENT + the name it would have (filters
        # match that name, as mergekit resolves parameters for every input)
        absent = tuple(r for r, src in enumerate(named) if src.startswith(_ABSENT))
        srcs = tuple("" if r in absent else src for r, src in enumerate(named))
        single = None
        if absent:
            outcome = optional_outcome(spec, absent, f"{spec.source}: {name}")
            if outcome is None:
                continue  # mergekit skips it (model_stock with too few inputs)
            single = outcome if outcome >= 0 else None
        params, per_input = res.resolve(name, sl, roles,
                                        tuple(src.lstrip(_ABSENT) for src in named), t)
        is_vocab = name in vocab_outputs if vocab_outputs is not None else srcs[0] in vocab
        sig = json.dumps([models, srcs, params, per_input, is_vocab, sl.ref_only, single],
                         sort_keys=True, default=str)
        key = keys.setdefault(sig, name)
        outputs.append(OutputTensor(name, key, models, srcs, t, params, per_input, is_vocab,
                                    sl.ref_only, absent, single))
    return Recipe(tuple(outputs), tuple(layers) if layers is not None else None, layer_counts)


def _module_rows(spec: Spec, names: Mapping[str, Sequence[str]],
                 configs: Mapping[str, Mapping[str, Any]], vocab_weights: bool = False
                 ) -> tuple[list[_Row], list[tuple[str, int]], tuple[tuple[str, int], ...],
                            set[str]]:
    """The rows of a ``modules:`` spec as mergekit 0.1.5 plans them: per module in the order
    given, its pre weights from the first slice's models, each slice's layers renumbered from
    0 within the module, its post weights from the last slice's models (both with the slice's
    parameters at t = 0); only the modules' weights are output (mergefs.recipe.modules).
    An optional weight some inputs lack names them with :data:`_ABSENT`. Also the outputs
    that are vocabulary tensors (a vocabulary axis) when ``vocab_weights``."""

    cache: dict[str, dict[str, Module]] = {}

    def modules_of(path: str) -> dict[str, Module]:
        if path not in cache:
            if path not in configs:
                raise SpecError(f"{spec.source}: modules: {path} has no config.json")
            cache[path] = read_modules(configs[path], path, used)
        return cache[path]

    groups: dict[str, list[SliceDef]] = {}
    for sl in spec.slices:
        assert sl.module is not None
        groups.setdefault(sl.module, []).append(sl)
    used = set(groups)
    ref_modules = modules_of(spec.base)
    for name in groups:
        if name not in ref_modules:
            raise SpecError(f"{spec.source}: modules.{name}: not a module of {spec.base} "
                            f"(its architecture has {', '.join(ref_modules)})")

    def ranges(name: str, key: str, sl: SliceDef) -> tuple[list[tuple[int, int]], int]:
        roles = (sl.ref, *sl.experts)
        rs = [r.layer_range if r.layer_range is not None
              else (0, modules_of(r.path)[name].n_layers) for r in roles]
        lengths = {hi - lo for lo, hi in rs}
        if len(lengths) != 1:
            raise SpecError(f"{spec.source}: {key}: all inputs of a slice must have the same "
                            f"number of layers, got {sorted(lengths)} (mergekit refuses it too)")
        return rs, lengths.pop()

    # the output's config: the reference's with each module's layer count (its templates may
    # use the count, as mergekit's do with the output's config)
    out_config: dict[str, Any] = dict(configs.get(spec.base, {}))
    counts: list[tuple[str, int]] = []
    for name, sls in groups.items():
        total = sum(ranges(name, f"modules.{name}", sl)[1] for sl in sls)
        count_key = ref_modules[name].layers_key
        if count_key is not None:
            counts.append((count_key, total))
            set_dotted(out_config, count_key, total)
    out_modules = read_modules(out_config, spec.base, used) if counts else ref_modules

    rows: list[_Row] = []
    layers: list[tuple[str, int]] = []
    vocab_outputs: set[str] = set()

    def source_names(ws: Sequence[Any], roles: Sequence[SliceSource], out: Any,
                     key: str) -> tuple[str, ...] | None:
        found = tuple(w.find(names[r.path]) for w, r in zip(ws, roles))
        if all(f is None for f in found) and out.optional:
            return None  # an optional weight no input has: skipped, as mergekit does
        # a tied weight (lm_head of a tied model) is loaded as the tensor it is tied to
        found = tuple(f if f is not None else w.find(names[r.path], tied=True)
                      for f, w, r in zip(found, ws, roles))
        for f, w, r in zip(found, ws, roles):
            if f is None and not w.optional:
                raise SpecError(f"{spec.source}: {key}: {r.path} has no tensor {w.name}")
        if vocab_weights and out.vocabulary_axis is not None:
            if out.vocabulary_axis != 0:
                raise SpecError(f"{spec.source}: {key}: {out.name} has its vocabulary on "
                                f"axis {out.vocabulary_axis}; a tokenizer merge of it is not "
                                "supported yet")
            vocab_outputs.add(out.name)
        # an optional weight some inputs lack: merged over the others (optional_outcome)
        return tuple(f if f is not None else _ABSENT + w.name for f, w in zip(found, ws))

    for name, sls in groups.items():
        first, last = sls[0], sls[-1]
        for w in out_modules[name].pre:
            roles = (first.ref, *first.experts)
            srcs = source_names([w] * len(roles), roles, w, f"modules.{name}")
            if srcs is not None:
                rows.append((w.name, tuple(r.path for r in roles), srcs, 0.0, first, roles))
        out_layer = 0
        for s, sl in enumerate(sls):
            roles = (sl.ref, *sl.experts)
            key = f"modules.{name}.slices[{s}]"
            rs, n = ranges(name, key, sl)
            for i in range(n):
                t = _position(i, n)
                outs = out_modules[name].layer(out_layer)
                ins = [modules_of(r.path)[name].layer(lo + i) for r, (lo, _) in zip(roles, rs)]
                if any(len(w) != len(outs) for w in ins):
                    raise SpecError(f"{spec.source}: {key}: the models' layer {i} differ in "
                                    "their weights")
                layers.append((roles[0].path, rs[0][0] + i))
                for j, w_out in enumerate(outs):
                    srcs = source_names([w[j] for w in ins], roles, w_out, key)
                    if srcs is not None:
                        rows.append((w_out.name, tuple(r.path for r in roles), srcs, t, sl,
                                     roles))
                out_layer += 1
        for w in out_modules[name].post:
            roles = (last.ref, *last.experts)
            srcs = source_names([w] * len(roles), roles, w, f"modules.{name}")
            if srcs is not None:
                rows.append((w.name, tuple(r.path for r in roles), srcs, 0.0, last, roles))
    return rows, layers, tuple(counts), vocab_outputs


def _loose(spec: Spec, sl: SliceDef, name: str, names: Mapping[str, Sequence[str]],
           have: Mapping[str, Collection[str]],
           weights: Mapping[str, Mapping[str, Weight]] | None) -> _Row | None:
    """The row of a non-layer tensor of a sliced spec; with ``weights``, None for a tensor
    the first slice's reference lacks and some input cannot stand in for (not output, as
    without them)."""
    roles = (sl.ref, *sl.experts)
    if weights is not None:
        paths = [r.path for r in roles]
        srcs = _sources((name,) * len(roles), paths, have, weights,
                        name not in have[spec.slices[0].ref.path],
                        lambda r: f"{spec.source}: slices: {paths[r]} has no tensor {name}")
        return None if srcs is None else (name, tuple(paths), srcs, 0.0, sl, roles)
    for r in roles:
        if name not in names[r.path]:
            raise SpecError(f"{spec.source}: slices: {r.path} has no tensor {name}")
    return (name, tuple(r.path for r in roles), (name,) * len(roles), 0.0, sl, roles)


def merged_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """Every name of ``lists`` once: the first list's order, each name only a later list has
    placed after the name it follows there (deterministic; the output's tensor order)."""
    out = list(lists[0])
    seen = set(out)
    for names in lists[1:]:
        after: dict[str | None, list[str]] = {}
        anchor: str | None = None
        for n in names:
            if n in seen:
                anchor = n
            else:
                after.setdefault(anchor, []).append(n)
                seen.add(n)
        if after:
            new = list(after.get(None, ()))
            for n in out:
                new.append(n)
                new.extend(after.get(n, ()))
            out = new
    return out


def stand_in(name: str, have: Collection[str], weights: Mapping[str, Weight] | None
             ) -> str | None:
    """The source of tensor ``name`` in a model that lacks it (its tensor names ``have``, its
    architecture's ``weights``): the tensor it is tied to (an LM head of a tied model, loaded
    as its embeddings, as mergekit's loader does), else :data:`_ABSENT` + ``name`` (an
    optional weight it lacks: merged over the models that have it, :func:`optional_outcome`);
    None when the architecture does not make ``name`` optional."""
    w = None if weights is None else weights.get(name)
    if w is None or not w.optional:
        return None
    return w.find(have, tied=True) or _ABSENT + name


def _sources(named: Sequence[str], paths: Sequence[str], have: Mapping[str, Collection[str]],
             weights: Mapping[str, Mapping[str, Weight]], extra: bool,
             refusal: Callable[[int], str]) -> tuple[str, ...] | None:
    """Per role (its tensor ``named[r]`` in model ``paths[r]``), the source name: the tensor,
    or its :func:`stand_in`; where a model lacks a weight its architecture does not make
    optional, SpecError ``refusal(r)`` (None when ``extra``: a tensor the reference lacks,
    left out as it is without ``weights``)."""
    out = []
    for r, (n, p) in enumerate(zip(named, paths)):
        found = n if n in have[p] else stand_in(n, have[p], weights.get(p))
        if found is None:
            if extra:
                return None
            raise SpecError(refusal(r) + " (and mergekit's architecture does not make it "
                            "optional)")
        out.append(found)
    return tuple(out)


def rewrite_config(config: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """``config.json`` of a sliced output: the layer count, and every per-layer list (a list as
    long as the reference model's layer count) rebuilt from the source layers."""
    if recipe.layers is None:
        return config
    out = dict(config)
    if recipe.layer_counts is not None:  # modules: each module's count, nothing else

        for dotted, n in recipe.layer_counts:
            set_dotted(out, dotted, n)
        return out
    n_out = len(recipe.layers)
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if key is not None:
        n_src = config[key]
        out[key] = n_out
        for k, v in config.items():
            if (isinstance(v, list) and len(v) == n_src and n_src != n_out
                    and all(L < len(v) for _, L in recipe.layers)):
                out[k] = [v[L] for _, L in recipe.layers]
    return out


class _SumCounters(Counters):
    """The counters of several sources, summed (``reset`` resets them all)."""

    def __init__(self, parts: Sequence[Counters]) -> None:
        super().__init__()
        self._parts = list(parts)

    @property  # type: ignore[override]
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self._parts)

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        pass

    @property  # type: ignore[override]
    def reads(self) -> int:
        return sum(p.reads for p in self._parts)

    @reads.setter
    def reads(self, value: int) -> None:
        pass

    @property
    def requests(self) -> int:
        """Requests sent (remote parts) or preads (local parts), as ``source_requests`` counts."""
        return sum(getattr(p, "requests", p.reads) for p in self._parts)

    def reset(self) -> None:
        for p in self._parts:
            p.reset()


class RoleSource:
    """One role's source tensors under the recipe's unit keys: reads go to the models the role
    takes each unit from. Files are the models' own (``k:name`` when the role spans several
    models); non-weight files are the first model's. Remote models (HTTP, S3, uncached Hub
    ids) are read by ranges as anywhere else; a role with any remote model is remote (no file
    descriptors). Derived files (sidecars) live beside the first model when every model is
    local; beside a role with any remote model none are read or written. No index statistics
    are published for a role (one sidecar per model)."""

    #: sidecars are published per model, and a role may span several: none to fetch
    prefers_published_index = False

    def __init__(self, recipe: Recipe, role: int, sources: Mapping[str, Checkpoint]) -> None:
        self.recipe = recipe
        self.tokenizer: Any = None  # mergefs.recipe.tokenizer.BuiltTokenizer of a tokenizer merge
        #: the recipe of another spec over the same models (a sweep's variant), for a family
        #: whose recipe is not the spec's own (mergefs.recipe.family.recipe_of); None: only
        #: ``recipe``
        self.recipe_for: Callable[[Spec], Recipe] | None = None
        members: list[str] = []
        for u in recipe.units.values():
            if u.models[role] not in members:
                members.append(u.models[role])
        self.members = [sources[p] for p in members]
        self.is_remote = any(c.is_remote for c in self.members)
        self.reads_gap_bytes = any(c.reads_gap_bytes for c in self.members)
        self._multi = len(self.members) > 1
        rank = {p: k for k, p in enumerate(members)}

        def q(k: int, f: str) -> str:
            return f"{k}:{f}" if self._multi else f

        self._where = {q(k, f): (c, f) for k, c in enumerate(self.members) for f in c.files}
        self.files = tuple(self._where)
        self.headers = {qf: c.headers[f] for qf, (c, f) in self._where.items()}
        self.identities = {qf: c.identities[f] for qf, (c, f) in self._where.items()}
        first = self.members[0]
        self.root: Path = first.root  # a remote model's root is its URL (a str)
        self.extra_files = first.extra_files
        self.index_json = None
        self.tensors: dict[str, TensorLoc] = {}
        file_rank = {f: i for i, f in enumerate(self.files)}
        items = []
        #: units read whole (vocabulary tensors, optional weights some roles lack; not
        #: indexed): where this role reads them (none when its model lacks the tensor)
        self.whole_locs: dict[str, tuple[Checkpoint, TensorLoc]] = {}
        for key, u in recipe.units.items():
            k = rank[u.models[role]]
            if role in u.absent:
                continue
            loc = self.members[k].tensors[u.sources[role]]
            if u.whole:
                self.whole_locs[key] = (self.members[k], loc)
                continue
            items.append(TensorLoc(key, q(k, loc.file), loc.start, loc.end, loc.dtype,
                                   loc.shape))
        for loc in sorted(items, key=lambda x: (file_rank[x.file], x.start, x.name)):
            self.tensors[loc.name] = loc
        self._map = xxhash.xxh3_64_hexdigest(json.dumps(
            [[u.key, u.models[role], u.sources[role]] for u in recipe.units.values()]).encode())
        self.counters = _SumCounters([c.counters for c in self.members])
        self._role_sources = {key: (rank[u.models[role]], u.sources[role])
                              for key, u in recipe.units.items()}

    @property
    def name(self) -> str:
        return str(self.root)

    @property
    def is_dir(self) -> bool:
        return self.members[0].is_dir

    def path_of(self, file: str) -> Path:
        c, f = self._where[file]
        return c.path_of(f)

    def read_extra(self, rel: str) -> bytes:
        return self.members[0].read_extra(rel)

    def copy_extra(self, rel: str, dst: Path) -> None:
        self.members[0].copy_extra(rel, dst)

    def extra_dir(self) -> Path | None:
        return self.members[0].extra_dir()  # the non-weight files are the first model's

    def local_files(self) -> list[tuple[str, Path]]:
        return [f for c in self.members for f in c.local_files()]

    def file_ctimes(self) -> dict[str, int]:
        return {p: t for c in self.members for p, t in c.file_ctimes().items()}

    def check_unchanged_for_reuse(self) -> None:
        for c in self.members:
            c.check_unchanged_for_reuse()

    def will_need(self, ranges: Iterable[ReadRange]) -> None:
        for r in ranges:
            c, f = self._where[r.file]
            c.will_need([ReadRange(f, r.start, r.end)])

    def read_aux(self, name: str) -> bytes | None:
        """No index sidecar: one is published per model, and a role may span several."""
        return None

    def _beside(self) -> Checkpoint | None:
        """The model whose directory holds the role's derived files: the first, if every model
        is local (beside a role over remote models nothing is read or written)."""
        return None if self.is_remote else self.members[0]

    def aux_reader(self, name: str) -> AuxFile | None:
        beside = self._beside()
        return beside.aux_reader(name) if beside is not None else None

    def check_writable_aux(self, what: str, instead: str) -> None:
        if self._beside() is None:
            raise aux_read_only(self.root, what, instead)

    def write_aux(self, name: str, data: bytes, what: str) -> str:
        beside = self._beside()
        if beside is None:  # callers ask check_writable_aux first, before any work
            raise aux_read_only(self.root, what, "publish from local copies of its models")
        return beside.write_aux(name, data, what)

    def read_itemsize(self, name: str) -> int:
        k, src = self._role_sources[name]
        return self.members[k].read_itemsize(src)

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def identity_json(self) -> dict[str, object]:
        return {"root": str(self.root), "files": [self.identities[f].to_json()
                                                  for f in self.files], "recipe": self._map}

    def identity_key(self) -> str:
        return xxhash.xxh3_64_hexdigest(json.dumps(self.identity_json(),
                                                   sort_keys=True).encode())

    def check_unchanged(self) -> None:
        for c in self.members:
            c.check_unchanged()

    def fds(self) -> dict[str, int]:
        out = {}
        for qf, (c, f) in self._where.items():
            out[qf] = c.fds()[f]
        return out

    def close(self) -> None:
        for c in self.members:
            c.close()

    def read_ranges(self, ranges: Iterable[ReadRange],
                    gap_allowance: GapAllowance | None = None) -> list[memoryview]:
        ranges = list(ranges)
        if not self._multi:
            return self.members[0].read_ranges(ranges, gap_allowance=gap_allowance)
        out: list[memoryview | None] = [None] * len(ranges)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(ranges):
            c, _ = self._where[r.file]
            groups.setdefault(id(c), []).append(i)
        for idxs in groups.values():
            c, _ = self._where[ranges[idxs[0]].file]
            got = c.read_ranges([ReadRange(self._where[ranges[i].file][1], ranges[i].start,
                                           ranges[i].end) for i in idxs],
                                gap_allowance=gap_allowance)
            for i, v in zip(idxs, got):
                out[i] = v
        return [v for v in out if v is not None]

    def read_tensor(self, name: str) -> memoryview:
        loc = self.tensors[name]
        return self.read_ranges([ReadRange(loc.file, loc.start, loc.end)])[0]
