"""The family a spec merges: its sources opened (base, experts; for a sliced spec the recipe's roles), checked to share one coordinate system, labelled; the output tokenizer built. Blocking I/O (headers); never on the trio thread."""

from __future__ import annotations
import json
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from mergefs.recipe import tokenizer as tokenizers
from mergefs.sources.local import Checkpoint
from mergefs.sources import open_source
from mergefs.core.errors import SourceError, SpecError
from mergefs.core.format import FLOAT_DTYPES
from mergefs.recipe.modules import Weight, architecture_weights, vocab_size_key
from mergefs.recipe.outputs import (PRE_WEIGHT, Recipe, RoleSource, build_recipe, layer_of,
                                    merged_order, stand_in)
from mergefs.spec.model import Spec
from mergefs.sources.base import CONFIG_NAME


def recipe_of(spec: Spec, base: Checkpoint) -> Recipe:
    """The spec's recipe: carried by the sources of a sliced spec (for a ``models:`` spec
    whose models differ in optional weights, rebuilt for ``spec``: a sweep's variants share
    its family), else built over the base."""
    if isinstance(base, RoleSource):
        if base.recipe_for is None:
            return base.recipe
        recipe = base.recipe_for(spec)
        if _served(recipe) != _served(base.recipe):
            raise SpecError(f"{spec.source}: this variant changes which tensors the models "
                            "that lack an optional weight take part in (a method that skips "
                            "or passes such weights through); sweep it separately")
        return recipe
    return build_recipe(spec, {spec.base: list(base.tensors)})


def _served(recipe: Recipe) -> list[tuple[Any, ...]]:
    """What a :class:`RoleSource` serves of a recipe: its units' sources and read modes."""
    return [(u.key, u.models, u.sources, u.whole) for u in recipe.units.values()]


_HUB_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def _label_parts(path: str) -> list[str]:
    """Path components a label is made of: a Hub snapshot or ``hf://`` URL as ``org/name``."""
    m = _HUB_SNAPSHOT.search(path)
    if m:
        return [f"{m.group(1)}/{m.group(2)}"]
    body = path.split("://", 1)[-1].rstrip("/")
    if path.startswith("hf://"):
        return [body.split("@", 1)[0]]
    return [q for q in body.split("/") if q] or [path]


def expert_labels(paths: Sequence[str]) -> list[str]:
    """Short unique names of experts for plans, stats and manifests: the shortest trailing
    path components that tell them apart (``math-7b``, ``a/ckpt`` vs ``b/ckpt``), never
    ``base``; a URL's scheme is dropped."""
    parts = [_label_parts(p) for p in paths]
    labels: list[str] = [""] * len(paths)
    for i, comps in enumerate(parts):
        for k in range(1, len(comps) + 1):
            cand = "/".join(comps[-k:])
            clash = any("/".join(o[-k:]) == cand for j, o in enumerate(parts) if j != i)
            if not clash and cand != "base":
                labels[i] = cand
                break
    for i, lab in enumerate(labels):
        if not lab:  # only "base" left, or the same path twice: name it by its position
            labels[i] = f"{parts[i][-1]}#{i}"
    for i, lab in enumerate(labels):
        if labels.count(lab) > 1:
            labels[i] = f"{lab}#{i}"
    return labels


def _configs(spec: Spec, opened: dict[str, Checkpoint]) -> dict[str, dict[str, Any]]:
    """Each model's config.json, for a ``modules:`` spec (its architecture says which tensors
    belong to which module); {} otherwise."""
    if not spec.slices or spec.slices[0].module is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for path, c in opened.items():
        if CONFIG_NAME in c.extra_files:
            try:
                cfg = json.loads(c.read_extra(CONFIG_NAME))
            except ValueError as exc:
                raise SpecError(f"{path}/{CONFIG_NAME}: not valid JSON ({exc})") from None
            if isinstance(cfg, dict):
                out[path] = cfg
    return out


def _open(spec: Spec, path: str, base: Checkpoint | None = None) -> Checkpoint:
    """``open_source``; a local path that does not exist is named by the spec key giving it."""
    try:
        return open_source(path, spec.source_options(path), base)
    except SourceError:
        named = None if "://" in path or Path(path).exists() else spec.key_naming(path)
        if named is None:
            raise
        key, value = named
        raise SpecError(f"{spec.source}: {key}: {value}: no such file or directory "
                        f"({path})") from None


def open_family(spec: Spec) -> tuple[Checkpoint, list[Checkpoint]]:
    """The base and experts; for a sliced spec, the recipe's roles (:class:`RoleSource`) over
    every model the slices name, keyed by the output's units. A multi-document spec's
    named merges must exist already: :func:`mergefs.engine.session.prepare_family` makes them."""
    base = _open(spec, spec.base)
    experts = [_open(spec, e.path, base) for e in spec.experts]  # model+lora too
    plain = not spec.slices or spec.slices[0].module is None  # models: or slices:
    weights: dict[str, dict[str, Weight]] | None = None
    if plain and not spec.sliced and any(set(e.tensors) != set(base.tensors)
                                         for e in experts):
        try:
            tables = _weight_tables({spec.base: base, **{e.path: c for e, c in
                                                         zip(spec.experts, experts)}})
            per_model = None if tables is None else [
                tables[spec.base], *(tables[e.path] for e in spec.experts)]
            if per_model is not None and _optional_gaps([base, *experts], per_model):
                weights = tables
            else:  # a difference in a weight that is not optional: refused
                check_coordinates(base, experts, optional=per_model)
        except BaseException:
            for c in (base, *experts):
                c.close()
            raise
    if spec.sliced or spec.tokenizer is not None or weights is not None:
        opened = {spec.base: base, **{e.path: c for e, c in zip(spec.experts, experts)}}
        try:
            for sl in spec.slices:
                for r in (sl.ref, *sl.experts):
                    if r.path not in opened:
                        opened[r.path] = _open(spec, r.path, base)
            if plain and spec.sliced and not _uniform(opened.values()):
                weights = _weight_tables(opened)
            configs = _configs(spec, opened)
            built, vocab = _tokenizer(spec, opened, configs)
            names = {p: list(c.tensors) for p, c in opened.items()}
            recipe = build_recipe(spec, names, vocab, configs,
                                  vocab_weights=bool(configs) and bool(
                                      spec.tokenizer and spec.tokenizer.source),
                                  weights=weights)
            # a base-alone module slice names the base in the expert roles too: those roles
            # get their own handle on it, so their counters count their own reads only
            aliased = {u.models[0] for u in recipe.units.values() if u.ref_only}
            roles = [RoleSource(recipe, 0, opened)]
            for k in range(1, 1 + len(experts)):
                own = dict(opened)
                for p in aliased:
                    own[p] = opened[f"\0{k}:{p}"] = open_source(p, spec.source_options(p),
                                                                 base)
                roles.append(RoleSource(recipe, k, own))
        except BaseException:
            for c in opened.values():
                c.close()
            raise
        for role in roles:
            role.tokenizer = built
            if weights is not None and not spec.sliced and spec.tokenizer is None:
                role.recipe_for = (lambda s, names=names, weights=weights:
                                   build_recipe(s, names, weights=weights))
        base, experts = roles[0], roles[1:]  # type: ignore[assignment]
    check_coordinates(base, experts)
    return base, experts


def _weight_tables(opened: dict[str, Checkpoint]) -> dict[str, dict[str, Weight]] | None:
    """Each model's weights by mergekit's architecture definition, or None unless every model
    has a config.json naming one architecture mergekit defines, the same for all (mergekit
    mixes architectures only with ``--allow-crimes``, and infers one for models it does not
    know; mergefs then knows of no optional weight)."""
    out: dict[str, dict[str, Weight]] = {}
    archs = set()
    for path, c in opened.items():
        cfg = _config_of(c)
        if cfg is None:
            return None
        try:
            out[path] = architecture_weights(cfg, path)
        except SpecError:
            return None
        archs.add(json.dumps(cfg.get("architectures")))
    return out if len(archs) == 1 else None


def _optional_gaps(models: Sequence[Checkpoint], tables: Sequence[Mapping[str, Weight]]
                   ) -> bool:
    """Whether every tensor some model of a ``models:`` spec lacks is an optional weight of
    its architecture (``tables``: each model's, :func:`_weight_tables`; mergekit merges such
    a weight over the models that have it)."""
    union = merged_order([list(c.tensors) for c in models])
    for c, table in zip(models, tables):
        have = c.tensors.keys()
        if any(n not in have and stand_in(n, have, table) is None for n in union):
            return False
    return True


def _uniform(models: Any) -> bool:
    """Whether the models of a sliced spec have the same tensors in every layer and the same
    other tensors (no weight some of them lack)."""
    shapes = set()
    for c in models:
        layers: dict[tuple[str, int], set[str]] = {}
        loose = set()
        for n in c.tensors:
            lay = layer_of(n)
            if lay is None:
                loose.add(n)
            else:
                layers.setdefault(lay[:2], set()).add(lay[2])
        kinds = {(p, frozenset(s)) for (p, _), s in layers.items()}
        if len(kinds) != len({p for p, _ in kinds}):
            return False
        shapes.add((frozenset(loose), frozenset(kinds)))
    return len(shapes) <= 1


#: Vocabulary tensors (rows are tokens) of a tokenizer merge: embeddings and LM heads whose
#: first dimension is the model's vocab_size
_VOCAB_NAME = re.compile(r"lm_head|embed_out|(^|\.)output\.weight$")


def _config_of(c: Checkpoint) -> dict[str, Any] | None:
    if CONFIG_NAME not in c.extra_files:
        return None
    try:
        doc = json.loads(c.read_extra(CONFIG_NAME))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _tokenizer(spec: Spec, opened: dict[str, Checkpoint],
               module_configs: dict[str, dict[str, Any]]
               ) -> tuple[tokenizers.BuiltTokenizer | None, frozenset[str]]:
    """The output tokenizer of a spec that merges one, and the vocabulary tensors of its
    reference model (empty when only a chat template is set: no rows change; and for a
    ``modules:`` spec, whose ``module_configs`` are given: there the architecture's
    vocabulary weights are, and its key of the vocabulary size)."""
    if spec.tokenizer is None:
        return None, frozenset()
    configs = {p: _config_of(c) for p, c in opened.items()}
    size_key = "vocab_size"
    if module_configs and spec.base in module_configs:
        size_key = vocab_size_key(module_configs[spec.base], spec.base)
    with tempfile.TemporaryDirectory(prefix="mergefs-tokenizer-") as tmp:
        dirs: dict[str, str] = {}
        for k, (path, c) in enumerate(opened.items()):
            if c.extra_dir() is None:  # its tokenizer files, fetched for transformers to load
                d = Path(tmp) / str(k)
                for rel in c.extra_files:  # top level only: what transformers reads
                    if "/" not in rel and rel in tokenizers.TOKENIZER_FILES | {CONFIG_NAME}:
                        (d / rel).parent.mkdir(parents=True, exist_ok=True)
                        (d / rel).write_bytes(c.read_extra(rel))
                dirs[path] = str(d)
        built = tokenizers.build(spec.tokenizer, spec.base, list(opened), configs, dirs,
                                 size_key)
    if spec.tokenizer.source is None or module_configs:
        return built, frozenset()
    ref = opened[spec.slices[0].ref.path]
    size = tokenizers.vocab_size_of(configs[spec.slices[0].ref.path], -1)
    vocab = frozenset(n for n, loc in ref.tensors.items()
                      if loc.shape and loc.shape[0] == size and loc.dtype in FLOAT_DTYPES
                      and (PRE_WEIGHT.search(n) or _VOCAB_NAME.search(n)))
    return built, vocab


def check_coordinates(base: Any, experts: Sequence[Any], limit: int = 5,
                      optional: Sequence[Mapping[str, Weight]] | None = None) -> None:
    """Every expert must have exactly the base's tensor names, shapes and dtypes; floating
    dtypes may differ (each source is decoded with its own and merged in float32, as mergekit
    promotes mixed inputs).

    ``base`` and ``experts`` are :class:`mergefs.sources.local.Checkpoint`. Lists the first few
    differences per expert; with ``optional`` (each model's architecture weights, in the
    order base, experts), not those in weights the model lacking them may lack.
    """
    tables = list(optional or ())

    def lacks(k: int, c: Any, name: str) -> bool:  # model k lacks tensor name, not optional
        return k >= len(tables) or stand_in(name, c.tensors.keys(), tables[k]) is None

    for k, ex in enumerate(experts, 1):
        diffs: list[str] = []
        for name, loc in base.tensors.items():
            other = ex.tensors.get(name)
            if other is None:
                if lacks(k, ex, name):
                    diffs.append(f"{name}: missing")
            elif other.shape != loc.shape or (other.dtype != loc.dtype and not
                                               {other.dtype, loc.dtype} <= FLOAT_DTYPES):
                diffs.append(f"{name}: {other.dtype}{list(other.shape)} vs base "
                             f"{loc.dtype}{list(loc.shape)}")
        for name in ex.tensors:
            if name not in base.tensors and lacks(0, base, name):
                diffs.append(f"{name}: not in base")
        if diffs:
            more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
            raise SpecError(
                f"{ex.root}: does not share the base's coordinate system ({base.root}): "
                + "; ".join(diffs[:limit]) + more
            )
