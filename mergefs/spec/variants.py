"""Variants of one spec: a ``sweep:`` grid and/or a ``variants:`` list, expanded to named specs.

A spec file may carry, beside the ordinary mergekit/mergefs keys::

    sweep:                          # the product of every list, in the order given
      weight: [0.3, 0.5, 0.7]       # every model's parameters.weight (or a list per model)
      budget: [10%, 50%, full]
      merge_method: [task_arithmetic, ties]
      parameters.lambda: [0.5, 1.0] # any spec key by dotted path (models.0.parameters.weight)
    variants:                       # named variants, listed first
      - name: strong
        parameters.lambda: 1.5

Each variant is the spec without ``sweep``/``variants`` plus its settings; it must keep the
family (base, experts, block size, index): a sweep varies coefficients, methods and budgets over
one index. Names are stable (the same spec file gives the same names), readable and safe as
directory names: grid variants are named by the settings that vary across the grid
(``weight-0.3_budget-10pct``: ``_`` separates settings, so a value's own ``_`` reads ``-``,
``%`` reads ``pct``, a list ``0.2+0.8``), listed variants by their ``name``.

Pure: parsing and expanding; ``load_variants`` reads the spec file. Runs in the main thread (or a
worker thread for a reload), never on the trio thread.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergefs.core.errors import MergefsError, SpecError
from mergefs.spec.model import Spec
from mergefs.spec.load import KNOWN_KEYS, parse_spec, read_spec_docs, typo_of

SWEEP_KEY = "sweep"
VARIANTS_KEY = "variants"
#: keys a variant may not change: they define the family, the index or the mount itself
FIXED_KEYS = frozenset({"base_model", "models", "slices", "modules", "block_size", "index_dir",
                        "index_max_size",
                        "manifest", "cache", "storage_options", "remote", "tokenizer_source",
                        "tokenizer", "name", SWEEP_KEY, VARIANTS_KEY})
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
RESERVED_NAMES = frozenset({"variants.json"})


@dataclass(frozen=True)
class Variant:
    """One variant: its directory name, the settings it applies, the spec document it gives."""

    name: str
    settings: dict[str, Any]
    doc: dict[str, Any]


def is_sweep(doc: Any) -> bool:
    return isinstance(doc, dict) and (SWEEP_KEY in doc or VARIANTS_KEY in doc)


def read_doc(path: str | Path) -> Any:
    p = Path(path)
    docs = read_spec_docs(p)
    if len(docs) > 1 and any(is_sweep(d) for d in docs):
        raise SpecError(f"{p}: sweep and variants are not supported in a multi-document spec")
    return docs[0] if len(docs) == 1 else docs


def _value_name(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(_value_name(v) for v in value)
    text = str(value).replace("%", "pct")
    return re.sub(r"[^A-Za-z0-9.+-]", "-", text)


def _key_name(key: str) -> str:
    return "method" if key == "merge_method" else short_key(key)


def _apply(doc: dict[str, Any], key: str, value: Any, where: str) -> None:
    top, dot, rest = key.partition(".")
    if key != "weight" and top not in KNOWN_KEYS:
        meant = typo_of(top, (*KNOWN_KEYS, "weight"))
        if meant is not None:  # a variant of a typo would silently equal the others
            raise SpecError(f"{where}: {key}: unknown key; did you mean `{meant}{dot}{rest}`?")
    if top in FIXED_KEYS:
        raise SpecError(f"{where}: {key}: a variant cannot change {top!r} (a sweep mount "
                        "serves one family over one index; mount another spec for another)")
    if key == "weight":  # every model's weight: one value for all, or one per model
        models = doc.get("models")
        if not isinstance(models, list) or not models:
            raise SpecError(f"{where}: weight: the spec has no models list to weight")
        values = value if isinstance(value, list) else [value] * len(models)
        if len(values) != len(models):
            raise SpecError(f"{where}: weight: {len(values)} values for {len(models)} models")
        for m, v in zip(models, values):
            if not isinstance(m, dict):
                raise SpecError(f"{where}: weight: a models entry is not a mapping")
            params = m.setdefault("parameters", {})
            if not isinstance(params, dict):
                raise SpecError(f"{where}: weight: a model's parameters is not a mapping")
            params["weight"] = v
        return
    try:
        set_key(doc, key, value, where)
    except SpecError:
        raise
    except MergefsError as exc:  # set_key's own: name the file and key
        raise SpecError(f"{where}: {exc}") from None


def _settings(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping of spec keys to values")
    return {str(k): v for k, v in raw.items()}


def expand(doc: Any, where: str) -> list[Variant]:
    """Every variant of a spec document, listed variants first, then the grid in order."""
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: a spec is a YAML mapping with merge_method, base_model, models")
    common = {k: v for k, v in doc.items() if k not in (SWEEP_KEY, VARIANTS_KEY)}
    out: list[Variant] = []
    listed = doc.get(VARIANTS_KEY) or []
    if not isinstance(listed, list):
        raise SpecError(f"{where}: variants: expected a list of mappings, each with a name")
    for k, item in enumerate(listed):
        settings = _settings(item, f"{where}: variants[{k}]")
        name = settings.pop("name", None)
        if not isinstance(name, str):
            raise SpecError(f"{where}: variants[{k}]: needs a name (a directory name)")
        out.append(_variant(common, name, settings, f"{where}: variants[{k}]"))
    grid = _settings(doc.get(SWEEP_KEY) or {}, f"{where}: sweep")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{where}: sweep: {key}: expected a non-empty list of values")
    if grid or not out:
        varying = [k for k, vs in grid.items() if len(vs) > 1]
        for point in itertools.product(*grid.values()):
            settings = dict(zip(grid, point))
            name = "_".join(f"{_key_name(k)}-{_value_name(settings[k])}" for k in varying)
            out.append(_variant(common, name or "default", settings, f"{where}: sweep"))
    seen: dict[str, Variant] = {}
    for v in out:
        if v.name in seen:
            raise SpecError(f"{where}: two variants are named {v.name!r}; names must be unique")
        seen[v.name] = v
    return out


def _variant(common: dict[str, Any], name: str, settings: dict[str, Any], where: str
             ) -> Variant:
    if not NAME_RE.match(name) or name in RESERVED_NAMES:
        raise SpecError(f"{where}: variant name {name!r} is not a safe directory name (letters, "
                        "digits, '.', '_', '+', '-'; at most 128; not starting with '.' or '-')")
    doc = copy.deepcopy(common)
    for key, value in settings.items():
        _apply(doc, key, value, f"{where} ({name})")
    return Variant(name, settings, doc)


def parse_variants(doc: Any, base_dir: Path, source: str, strict: bool = False
                   ) -> list[tuple[Variant, Spec]]:
    """Expand and validate every variant; all must share the first one's family and index."""
    out: list[tuple[Variant, Spec]] = []
    for v in expand(doc, source):
        try:
            spec = parse_spec(copy.deepcopy(v.doc), base_dir, source, strict=strict)
        except SpecError as exc:
            raise SpecError(f"variant {v.name}: {exc}") from None
        if spec.sliced or spec.tokenizer is not None or spec.intermediates:
            raise SpecError(f"{source}: variant {v.name}: slices, tokenizer merges and "
                            "multi-document specs are not supported in a sweep yet")
        if out:
            first = out[0][1]
            if (spec.base, [e.path for e in spec.experts], spec.block_size, spec.index_dir) != \
                    (first.base, [e.path for e in first.experts], first.block_size,
                     first.index_dir):
                raise SpecError(f"{source}: variant {v.name} changes the base, experts or block "
                                "size; a sweep varies coefficients, methods and budgets over "
                                "one family")
        out.append((v, spec))
    return out


def load_variants(path: str | Path, strict: bool = False) -> list[tuple[Variant, Spec]]:
    p = Path(path)
    return parse_variants(read_doc(p), p.resolve().parent, str(p), strict)


def load_variant(path: str | Path, name: str, strict: bool = False) -> Spec:
    """One variant of a sweep spec, as ``mergefs merge --variant NAME`` merges it."""
    found = load_variants(path, strict)
    for v, spec in found:
        if v.name == name:
            return spec
    raise SpecError(f"{path}: no variant {name!r}; variants: "
                    f"{', '.join(v.name for v, _ in found)}")


def names_of(found: Sequence[tuple[Variant, Spec]]) -> list[str]:
    return [v.name for v, _ in found]


def set_key(doc: Any, key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    node = doc
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if isinstance(node, list):
            try:
                idx = int(part)
                node[idx]
            except (ValueError, IndexError):
                raise MergefsError(f"--grid {key}: {where} has no list item {part!r}") from None
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise MergefsError(f"--grid {key}: {'.'.join(parts[:k])} is not a mapping or list")


def short_key(key: str) -> str:
    """``models.0.parameters.weight`` -> ``models.0.weight``; ``parameters.lambda`` -> ``lambda``."""
    return ".".join(p for p in key.split(".") if p != "parameters")
