"""The merge spec: a mergekit YAML config plus mergefs's own keys, validated once, at the edge.

``load_spec(path)`` returns a frozen :class:`Spec` with every path resolved relative to the spec
file and every parameter checked; errors name the file and the key. ``check_coordinates`` checks
that the experts share the base's coordinate system (tensor names, shapes, dtypes).
Pure validation; no tensor bytes are read here.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mergefs.spec import refs as hub, settings
from mergefs import methods as registry
from mergefs.core.errors import BudgetError, SpecError
from mergefs.methods.base import BasePolicy, Method, ParamDef, Scope
from mergefs.spec.options import RemoteOptions
from mergefs.spec.tokenizer import TokenizerSpec, TokenRule
from mergefs.spec.tokenizer import to_json as tokenizer_json
from mergefs.core.sizes import parse_size
from mergefs.spec.budget import parse_budget
from mergefs.spec.model import (
    DTYPE_NAMES, ModelEntry, OUT_DTYPE_NAMES, REFERENCE, SliceDef, SliceSource, Spec,
)
from mergefs.spec.options import (
    check_url, options_for, remote_settings, storage_options, redact_options,
)
from mergefs.spec.model import DEFAULT_DECODE_LIMIT

log = logging.getLogger(__name__)

_MERGEKIT_KEYS = ("merge_method", "base_model", "models", "slices", "modules", "parameters",
                  "dtype", "out_dtype", "tokenizer_source", "tokenizer", "chat_template")
_MERGEFS_KEYS = ("budget", "block_size", "index_dir", "cache", "manifest", "name",
                 "storage_options", "remote", "strict", "sweep", "variants", "decode_limit")
_UNSUPPORTED_KEYS = (
    "architecture",
)


def _err(source: str, key: str, message: str) -> SpecError:
    return SpecError(f"{source}: {key}: {message}")


def _resolve_path(base_dir: Path, value: Any, source: str, key: str,
                  allow_url: bool = False, follow: bool = True) -> str:
    if not isinstance(value, str) or not value:
        raise _err(source, key, f"expected a path, got {value!r}")
    if "://" in value:
        if not allow_url:
            raise _err(source, key, f"must be a local path, got the URL {value}")
        return check_url(value, source, key)
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base_dir / p
    return str(p.resolve() if follow else p.parent.resolve() / p.name)


def _resolve_model(base_dir: Path, value: Any, source: str, key: str, hub_config: hub.HubConfig,
                   records: dict[str, Any]) -> str:
    """base_model or models[].model as mergekit reads it: a path, a URL or a Hub id (mergefs.spec.refs);
    a Hub model's pinned record (id, commit, snapshot) goes to ``records`` for Spec.raw."""
    found = hub.resolve_model(value, base_dir, hub_config, f"{source}: {key}")
    if found.plain:  # a local path or a URL, resolved as before
        return _resolve_path(base_dir, found.path, source, key, allow_url=True)
    if found.lora is not None and key == "base_model":
        raise _err(source, key, "model+lora as the base model is not supported yet")
    records[found.path] = found.record()
    return found.path


def load_spec(path: str | Path, strict: bool = False) -> Spec:
    """Read and validate a spec file. ``strict``: ignored keys are errors, not warnings."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}".replace("\n", " ")) from None
    if len(docs) > 1:
        return _load_multi(docs, p, strict)
    return parse_spec(docs[0] if docs else None, base_dir=p.resolve().parent, source=str(p),
                      strict=strict)


#: model-reference keys whose value may name an earlier merge of a multi-document spec
_REF_KEYS = frozenset({"model", "base_model", "tokenizer_source", "source"})


def _patch_refs(value: Any, paths: Mapping[str, str], used: set[str], key: str = "") -> Any:
    """``value`` with every model reference that names a merge replaced by its output path."""
    if isinstance(value, list):
        return [_patch_refs(v, paths, used, key) for v in value]
    if isinstance(value, dict):
        return {k: _patch_refs(v, paths, used, k) for k, v in value.items()}
    if isinstance(value, str) and key in _REF_KEYS:
        name, sep, rest = value.partition("+")  # name+lora
        name = name.partition("@")[0]
        if name in paths:
            used.add(name)
            return paths[name] + (sep + rest if sep else "")
    return value


def _load_multi(docs: list[Any], p: Path, strict: bool) -> Spec:
    """mergekit-multi: named merges that later documents use as models, and one unnamed final
    merge. Each named merge is materialised under ``intermediate_dir`` (a key of the final
    document; default ``.mergefs/intermediate`` beside the spec) as ``<dir>/<name>``, as
    mergekit-multi does; the final Spec lists them, in dependency order, in ``intermediates``."""
    base_dir = p.resolve().parent
    named: dict[str, dict[str, Any]] = {}
    final: dict[str, Any] | None = None
    for k, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise SpecError(f"{p}: document {k + 1}: a merge spec is a YAML mapping")
        if doc.get("name") is None:
            if final is not None:
                raise SpecError(f"{p}: only one document may be unnamed (the final merge)")
            final = dict(doc)
        else:
            name = doc["name"]
            if not isinstance(name, str) or not name or "/" in name or name in named:
                raise SpecError(f"{p}: document {k + 1}: name: expected a unique name "
                                f"without '/', got {name!r}")
            named[name] = {k2: v for k2, v in doc.items() if k2 != "name"}
    if final is None:
        raise SpecError(f"{p}: a multi-document spec needs one unnamed document: the merge "
                        "to write or mount")
    inter = final.pop("intermediate_dir", ".mergefs/intermediate")
    inter_dir = Path(_resolve_path(base_dir, inter, str(p), "intermediate_dir"))
    paths = {n: str(inter_dir / n) for n in named}
    deps: dict[str, set[str]] = {}
    patched: dict[str, dict[str, Any]] = {}
    for n, doc in named.items():
        used: set[str] = set()
        patched[n] = _patch_refs(doc, paths, used)
        deps[n] = used
    order: list[str] = []

    def visit(n: str, stack: tuple[str, ...]) -> None:
        if n in order:
            return
        if n in stack:
            raise SpecError(f"{p}: merges depend on each other in a cycle: "
                            f"{' -> '.join((*stack, n))}")
        for d in sorted(deps[n]):
            visit(d, (*stack, n))
        order.append(n)

    used_final: set[str] = set()
    final = _patch_refs(final, paths, used_final)
    for n in named:
        visit(n, ())
    stem = p.stem
    intermediates = []
    for n in order:
        doc = {"index_dir": final.get("index_dir", ".mergefs/index"),
               "manifest": f"{stem}.{n}.manifest.jsonl", **patched[n]}
        intermediates.append((n, parse_spec(doc, base_dir, source=f"{p}#{n}", strict=strict),
                              paths[n]))
    spec = parse_spec(final, base_dir=base_dir, source=str(p), strict=strict)
    return Spec(**{**spec.__dict__, "intermediates": tuple(intermediates)})


class _Lenient:
    """Collects what mergekit would silently ignore: one warning each, or an error if strict."""

    def __init__(self, source: str, strict: bool) -> None:
        self.source, self.strict = source, strict
        self.warnings: list[str] = []

    def ignore(self, key: str, why: str, mergekit: str = "mergekit ignores it too") -> None:
        message = f"{self.source}: {key}: ignored ({why}; {mergekit})"
        if self.strict:
            raise _err(self.source, key, f"{why} (strict: ignored keys are errors)")
        self.warnings.append(message)


def _method_value(source: str, key: str, pdef: ParamDef, value: Any) -> Any:
    """A checked setting (mergefs.spec.settings): a scalar, a gradient or filtered values."""
    checked, problem = settings.check(pdef, value)
    if problem:
        raise _err(source, key, problem)
    return checked


@dataclass
class _Model:
    path: str
    key: str
    params_raw: dict[str, Any]
    options: dict[str, Any] | None


def _models(data: dict[str, Any], base_dir: Path, source: str, hub_config: hub.HubConfig,
            hub_records: dict[str, Any], where: str = "models") -> list[_Model]:
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _err(source, where, "expected a non-empty list of {model: PATH, parameters: {...}}")
    out: list[_Model] = []
    for k, entry in enumerate(models):
        key = f"{where}[{k}]"
        if not isinstance(entry, dict) or "model" not in entry:
            raise _err(source, key, "expected a mapping with a 'model' path")
        extra = set(entry) - {"model", "parameters", "storage_options"}
        if extra:
            raise _err(source, f"{key}.{sorted(extra)[0]}", "not supported")
        mpath = _resolve_model(base_dir, entry["model"], source, f"{key}.model", hub_config,
                               hub_records)
        options = None
        if "storage_options" in entry:
            options = storage_options(entry["storage_options"], source, f"{key}.storage_options")
        params_raw = entry.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise _err(source, f"{key}.parameters", "expected a mapping")
        out.append(_Model(mpath, key, dict(params_raw), options))
    return out


@dataclass
class _Slice:
    key: str
    #: per source: the model and its layers (None: all the module's layers, ``models:`` form)
    sources: list[tuple[_Model, tuple[int, int] | None]]
    base: str | None
    params_raw: dict[str, Any]
    module: str | None = None
    module_params_raw: dict[str, Any] = field(default_factory=dict)


def _slices(raw: Any, where: str, base_dir: Path, source: str, hub_config: hub.HubConfig,
            hub_records: dict[str, Any]) -> list[_Slice]:
    """``slices`` as mergekit reads them: sources with a layer range each, an optional slice
    ``base_model`` and ``parameters``. ``where``: the key of the list (``slices``,
    ``modules.NAME.slices``)."""
    if not isinstance(raw, list) or not raw:
        raise _err(source, where, "expected a non-empty list of {sources: [...]}")
    out: list[_Slice] = []
    for k, sl in enumerate(raw):
        key = f"{where}[{k}]"
        if not isinstance(sl, dict) or not isinstance(sl.get("sources"), list) \
                or not sl["sources"]:
            raise _err(source, key, "expected a mapping with a non-empty 'sources' list")
        extra = set(sl) - {"sources", "base_model", "parameters", "residual_weight"}
        if extra:
            raise _err(source, f"{key}.{sorted(extra)[0]}", "not a slice key")
        if sl.get("residual_weight") is not None:
            raise _err(source, f"{key}.residual_weight", "not supported (mergekit 0.1.5 "
                       "accepts it but never applies it)")
        sources: list[tuple[_Model, tuple[int, int] | None]] = []
        for j, src in enumerate(sl["sources"]):
            skey = f"{key}.sources[{j}]"
            if not isinstance(src, dict) or "model" not in src or "layer_range" not in src:
                raise _err(source, skey, "expected a mapping with 'model' and 'layer_range'")
            if set(src) - {"model", "layer_range", "parameters"}:
                raise _err(source, f"{skey}.{sorted(set(src) - {'model', 'layer_range', 'parameters'})[0]}",
                           "not supported")
            lr = src["layer_range"]
            if (not isinstance(lr, list) or len(lr) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in lr)
                    or not 0 <= lr[0] < lr[1]):
                raise _err(source, f"{skey}.layer_range", f"expected [first, end) with "
                           f"0 <= first < end, got {lr!r}")
            mpath = _resolve_model(base_dir, src["model"], source, f"{skey}.model", hub_config,
                                   hub_records)
            params_raw = src.get("parameters") or {}
            if not isinstance(params_raw, dict):
                raise _err(source, f"{skey}.parameters", "expected a mapping")
            sources.append((_Model(mpath, skey, dict(params_raw), None), (lr[0], lr[1])))
        lengths = {lr[1] - lr[0] for _, lr in sources if lr is not None}
        if len(lengths) != 1:
            raise _err(source, f"{key}.sources", "all sources of a slice must have the same "
                       "number of layers (mergekit refuses it too)")
        if len({m.path for m, _ in sources}) != len(sources):
            raise _err(source, f"{key}.sources", "the same model is listed twice")
        sbase = None
        if sl.get("base_model") is not None:
            sbase = _resolve_model(base_dir, sl["base_model"], source, f"{key}.base_model",
                                   hub_config, hub_records)
        params_raw = sl.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise _err(source, f"{key}.parameters", "expected a mapping")
        out.append(_Slice(key, sources, sbase, dict(params_raw)))
    return out


def _modules(data: dict[str, Any], base_given: str | None, base_dir: Path, source: str,
             hub_config: hub.HubConfig, hub_records: dict[str, Any]) -> list[_Slice]:
    """``modules:`` as mergekit reads it: per architecture module, ``slices`` or ``models``
    (normalised as mergekit does to one slice over all of the module's layers, the base
    appended when not listed) and the module's ``parameters``; the slices of every module in
    the order given."""
    raw = data.get("modules")
    if not isinstance(raw, dict) or not raw:
        raise _err(source, "modules", "expected a mapping of module name -> {slices: [...]} "
                   "or {models: [...]}")
    out: list[_Slice] = []
    for name, mod in raw.items():
        key = f"modules.{name}"
        if not isinstance(mod, dict):
            raise _err(source, key, "expected a mapping with 'slices' or 'models'")
        extra = set(mod) - {"slices", "models", "parameters"}
        if extra:
            raise _err(source, f"{key}.{min(extra)}", "not a module key")
        if (mod.get("slices") is None) == (mod.get("models") is None):
            raise _err(source, key, "give slices or models, not both (mergekit refuses both "
                       "and neither)")
        params_raw = mod.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise _err(source, f"{key}.parameters", "expected a mapping")
        if mod.get("slices") is not None:
            part = _slices(mod["slices"], f"{key}.slices", base_dir, source, hub_config,
                           hub_records)
        else:
            models = _models(mod, base_dir, source, hub_config, hub_records, f"{key}.models")
            srcs: list[tuple[_Model, tuple[int, int] | None]] = [(m, None) for m in models]
            if base_given is not None and base_given not in {m.path for m in models}:
                srcs.append((_Model(base_given, "base_model", {}, None), None))
            part = [_Slice(f"{key}.models", srcs, None, {})]
        for sl in part:
            sl.module, sl.module_params_raw = str(name), dict(params_raw)
        out += part
    return out


def _own_settings(m: Method, raw: dict[str, Any], key: str, source: str, lenient: _Lenient,
                  scopes: tuple[Scope, ...] | None) -> dict[str, Any]:
    """The settings given at one level (checked), keyed by parameter name; ``scopes``: which
    parameters this level may set (None: all)."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        pdef = m.param(name)
        if pdef is None or (scopes is not None and pdef.scope not in scopes):
            continue  # reported (ignored) where the level is first read
        out[name] = _method_value(source, f"{key}.{name}", pdef, value)
    return out


_PER_MODEL = (Scope.MODEL, Scope.NON_BASE)


def _models_slice(m: Method, inputs: list[_Model], base: str, has_base: bool, source: str,
                  lenient: _Lenient) -> SliceDef:
    """A ``models:`` spec as mergekit normalises it: one slice over every layer."""
    own = {x.path: _own_settings(m, x.params_raw, f"{x.key}.parameters", source, lenient,
                                 _PER_MODEL) for x in inputs}
    ref = SliceSource(base, None, own.get(base, {}) if not has_base else {})
    experts = tuple(SliceSource(x.path, None, own[x.path]) for x in inputs if x.path != base)
    return SliceDef(ref, experts, {})


def _is_ref_only(m: Method, sl: _Slice, base_given: str | None) -> bool:
    """A ``modules:`` slice whose only source is the base, for the task-arithmetic family
    (mergekit returns the base tensor when a group has no other model)."""
    b = sl.base if sl.base is not None else base_given
    return (sl.module is not None and m.family == "gta" and b is not None
            and len(sl.sources) == 1 and sl.sources[0][0].path == b)


def _lead(m: Method, slices: list[_Slice], base_given: str | None) -> _Slice:
    """The slice whose models are the spec's roles: the first that is not the base alone."""
    return next((sl for sl in slices if not _is_ref_only(m, sl, base_given)), slices[0])


def _slice_defs(m: Method, slices: list[_Slice], base_given: str | None, has_base: bool,
                source: str, lenient: _Lenient) -> tuple[SliceDef, ...]:
    """Each slice by role; every slice must have the lead slice's roles (count and reference
    place), but for a base-only module slice (:func:`_is_ref_only`)."""
    out: list[SliceDef] = []
    lead = _lead(m, slices, base_given)
    lead_paths = [x.path for x, _ in lead.sources]
    lead_base = lead.base if lead.base is not None else base_given
    ref_place = lead_paths.index(lead_base) if lead_base in lead_paths else 0
    for sl in slices:
        if _is_ref_only(m, sl, base_given) and sl is not lead:
            (x, lr), = sl.sources
            ref = SliceSource(x.path, lr, {})
            out.append(SliceDef(ref, tuple(SliceSource(x.path, lr, {})
                                           for _ in range(len(lead.sources) - 1)),
                                {}, sl.module, {}, ref_only=True))
            continue
        paths = [x.path for x, _ in sl.sources]
        sbase = sl.base if sl.base is not None else base_given
        if has_base and sbase not in paths:
            raise _err(source, f"{sl.key}.sources", f"the base model {sbase} must be one of "
                       "the slice's sources (mergekit refuses a slice without its base)")
        if has_base or m.caps.base != BasePolicy.IGNORED:
            place = paths.index(sbase) if sbase in paths else 0
        else:
            place = paths.index(sbase) if sbase in paths else 0
        if place != ref_place or len(paths) != len(lead.sources):
            raise _err(source, sl.key, "every slice must have the same number of sources "
                       f"with the base in the same place as {lead.key} (not supported "
                       "otherwise)")
        for name in sl.params_raw:
            if m.param(name) is None:
                lenient.ignore(f"{sl.key}.parameters.{name}", f"{m.name} has no parameter "
                               f"{name!r}")
        roles = [SliceSource(x.path, lr, _own_settings(
            m, x.params_raw, f"{x.key}.parameters", source, lenient, _PER_MODEL))
            for x, lr in sl.sources]
        module_settings: dict[str, Any] = {}
        if sl.module is not None:
            for name in sl.module_params_raw:
                if m.param(name) is None:
                    lenient.ignore(f"modules.{sl.module}.parameters.{name}",
                                   f"{m.name} has no parameter {name!r}")
            module_settings = _own_settings(m, sl.module_params_raw,
                                            f"modules.{sl.module}.parameters", source, lenient,
                                            None)
        out.append(SliceDef(roles[place], tuple(r for k, r in enumerate(roles) if k != place),
                            _own_settings(m, sl.params_raw, f"{sl.key}.parameters", source,
                                          lenient, None), sl.module, module_settings))
    return tuple(out)


def _slice_raw(sl: _Slice, hub_records: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sources": [
        {"model": hub_records.get(x.path, x.path), "layer_range": list(lr),
         **({"parameters": x.params_raw} if x.params_raw else {})}
        for x, lr in sl.sources if lr is not None]}
    if sl.base is not None:
        out["base_model"] = hub_records.get(sl.base, sl.base)
    if sl.params_raw:
        out["parameters"] = sl.params_raw
    return out


def _check_module_roles(m: Method, slices: list[_Slice], base_given: str | None,
                        source: str) -> None:
    """mergefs merges every slice of every module with the same roles: as many models, the
    base in the same place; a slice of the base alone is the base (task-arithmetic family).
    Refused otherwise, naming the first slice that differs."""
    def shape(sl: _Slice) -> str:
        paths = [x.path for x, _ in sl.sources]
        b = sl.base if sl.base is not None else base_given
        where = f"the base at {paths.index(b)}" if b in paths else "no base"
        return f"{len(paths)} model(s), {where}"

    lead = _lead(m, slices, base_given)
    first = shape(lead)
    for sl in slices:
        if sl is not lead and not _is_ref_only(m, sl, base_given) and shape(sl) != first:
            raise _err(source, sl.key, f"{shape(sl)}, where {lead.key} has {first}: "
                       "mergefs merges every module with the same models in the same order "
                       "(or, for the task-arithmetic family, the base alone)")


def _modules_raw(slices: list[_Slice], hub_records: dict[str, Any]) -> dict[str, Any]:
    """``modules:`` again as mergekit reads it (a ``models:`` module stays one)."""
    out: dict[str, Any] = {}
    for sl in slices:
        assert sl.module is not None
        mod = out.setdefault(sl.module, {})
        if sl.module_params_raw:
            mod["parameters"] = sl.module_params_raw
        if sl.sources[0][1] is None:
            mod["models"] = [{"model": hub_records.get(x.path, x.path),
                              **({"parameters": x.params_raw} if x.params_raw else {})}
                             for x, _ in sl.sources if x.key != "base_model"]
        else:
            mod.setdefault("slices", []).append(_slice_raw(sl, hub_records))
    return out


def _tokenizer(data: dict[str, Any], base_dir: Path, source: str, hub_config: hub.HubConfig,
               hub_records: dict[str, Any]) -> TokenizerSpec | None:
    """tokenizer_source, the tokenizer: block and chat_template, as mergekit reads them."""
    ts, block, chat = data.get("tokenizer_source"), data.get("tokenizer"), data.get("chat_template")
    if ts is not None and block is not None:
        raise _err(source, "tokenizer", "give tokenizer_source or tokenizer, not both "
                   "(mergekit refuses both)")
    if chat is not None and not isinstance(chat, str):
        raise _err(source, "chat_template", "expected auto, a built-in name or Jinja text")

    def model_ref(value: Any, key: str) -> str:
        if isinstance(value, str) and value.startswith("model:"):
            value = value[len("model:"):]
        return _resolve_model(base_dir, value, source, key, hub_config, hub_records)

    def src(value: Any, key: str) -> str:
        if value in ("base", "union"):
            return str(value)
        return model_ref(value, key)

    if block is not None:
        if not isinstance(block, dict) or set(block) - {"source", "tokens", "pad_to_multiple_of"}:
            raise _err(source, "tokenizer", "expected a mapping with source, tokens and/or "
                       "pad_to_multiple_of")
        pad = block.get("pad_to_multiple_of")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise _err(source, "tokenizer.pad_to_multiple_of", f"expected a positive integer, "
                       f"got {pad!r}")
        tokens: dict[str, TokenRule] = {}
        raw_tokens = block.get("tokens") or {}
        if not isinstance(raw_tokens, dict):
            raise _err(source, "tokenizer.tokens", "expected a mapping of token -> {source, force}")
        for t, cfg in raw_tokens.items():
            key = f"tokenizer.tokens.{t}"
            cfg = cfg or {}
            if not isinstance(cfg, dict) or set(cfg) - {"source", "force"}:
                raise _err(source, key, "expected a mapping with source and/or force")
            force = cfg.get("force", False)
            if not isinstance(force, bool):
                raise _err(source, f"{key}.force", "expected true or false")
            s = cfg.get("source")
            if s is None:
                tokens[str(t)] = TokenRule("auto", force=force)
            elif isinstance(s, dict) and s.get("kind") == "zero":
                tokens[str(t)] = TokenRule("zero", force=force)
            elif isinstance(s, dict) and s.get("kind") == "model_token":
                tid, tname = s.get("token_id"), s.get("token")
                if (tid is None) == (tname is None):
                    raise _err(source, f"{key}.source", "give one of token_id and token")
                tokens[str(t)] = TokenRule("model_token", model_ref(s.get("model"),
                                                                    f"{key}.source.model"),
                                           tid, tname, force)
            elif isinstance(s, dict):
                raise _err(source, f"{key}.source", "expected a model, {kind: zero} or "
                           "{kind: model_token, model: ..., token_id|token: ...}")
            else:
                tokens[str(t)] = TokenRule("model", model_ref(s, f"{key}.source"), force=force)
        return TokenizerSpec(src(block.get("source", "union"), "tokenizer.source"), tokens,
                             pad, chat)
    if ts is not None:
        return TokenizerSpec(src(ts, "tokenizer_source"), chat_template=chat)
    if chat is not None:
        return TokenizerSpec(None, chat_template=chat)
    return None


def _resolve_method(m: Method, data: dict[str, Any], models: list[_Model], base: str | None,
                    source: str, lenient: _Lenient) -> tuple[
                        dict[str, Any], list[_Model], list[dict[str, Any]], bool]:
    """Global parameters, the inputs in mergekit's order with their per-model parameters, and
    whether the base plays the base role."""
    global_raw = data.get("parameters") or {}
    if not isinstance(global_raw, dict):
        raise _err(source, "parameters", "expected a mapping")
    for name in global_raw:
        if m.param(name) is None:
            lenient.ignore(f"parameters.{name}", f"{m.name} has no parameter {name!r}")
    glob: dict[str, Any] = {}
    for p in m.global_params:
        key = f"parameters.{p.name}"
        if p.name in global_raw:
            glob[p.name] = _method_value(source, key, p, global_raw[p.name])
        elif p.required:
            raise _err(source, key, f"required by {m.name}")
        else:
            glob[p.name] = p.default
    for p in m.model_params:  # a global value of a per-model name: every model's default
        if p.name in global_raw:
            _method_value(source, f"parameters.{p.name}", p, global_raw[p.name])
    if m.caps.base == BasePolicy.REQUIRED and base is None:
        raise _err(source, "base_model", f"required by {m.name}")
    has_base = base is not None and m.caps.base != BasePolicy.IGNORED
    inputs = _inputs(m, models, base, has_base, global_raw, lenient)
    if len({x.path for x in inputs}) != len(inputs):
        raise _err(source, "models", "the same model is listed twice")
    per_input = [_input_params(m, x, global_raw, source, lenient) for x in inputs]
    c = m.caps
    n = len(inputs)
    if n < c.min_inputs or (c.max_inputs is not None and n > c.max_inputs):
        what = "model(s) besides the base" if has_base else "input model(s)"
        want = (f"exactly {c.min_inputs}" if c.min_inputs == c.max_inputs
                else f"at least {c.min_inputs}" if c.max_inputs is None
                else f"{c.min_inputs} to {c.max_inputs}")
        raise _err(source, "models", f"{m.name} merges {want} {what}, got {n}")
    scalar = all(settings.is_scalar(v) for p in [glob, *per_input] for v in p.values())
    if m.check is not None and scalar:  # otherwise checked per tensor by the recipe
        problem = m.check(glob, per_input)
        if problem:
            raise _err(source, "models", problem)
    return glob, inputs, per_input, has_base


def _inputs(m: Method, models: list[_Model], base: str | None, has_base: bool,
            global_raw: Mapping[str, Any], lenient: _Lenient) -> list[_Model]:
    """The method's inputs in mergekit's order: the models as listed, the base excluded when it
    has the base role; otherwise the base is an input too (appended when not listed)."""
    inputs = [x for x in models if x.path != base]
    listed_base = [x for x in models if x.path == base]
    if has_base:
        for x in listed_base:
            for name in x.params_raw:
                lenient.ignore(f"{x.key}.parameters.{name}", "parameters of the base model")
        return inputs
    if base is None:
        return inputs
    # mergekit makes the base one more input, appended when not listed; it refuses the config
    # when the base then has no weight. mergefs keeps it as the reference only.
    candidate = listed_base[0] if listed_base else _Model(base, "base_model", {}, None)
    missing = [p.name for p in m.model_params if p.required
               and p.name not in candidate.params_raw and p.name not in global_raw]
    if missing:
        lenient.ignore(candidate.key, f"the base model has no {missing[0]}, so it is only the "
                       "reference, not an input", mergekit="mergekit refuses such a config")
    elif listed_base:
        inputs.insert(models.index(candidate), candidate)
    else:
        inputs.append(candidate)
    return inputs


def _input_params(m: Method, x: _Model, global_raw: Mapping[str, Any], source: str,
                  lenient: _Lenient) -> dict[str, Any]:
    """One input's per-model parameters: its own value, else the global one, else the default."""
    for name in x.params_raw:
        pdef = m.param(name)
        if pdef is None:
            lenient.ignore(f"{x.key}.parameters.{name}", f"{m.name} has no parameter {name!r}")
        elif pdef.scope == Scope.GLOBAL:
            lenient.ignore(f"{x.key}.parameters.{name}", f"{name} is a global parameter of "
                           f"{m.name}")
    params: dict[str, Any] = {}
    for pdef in m.model_params:
        key = f"{x.key}.parameters.{pdef.name}"
        if pdef.name in x.params_raw:
            params[pdef.name] = _method_value(source, key, pdef, x.params_raw[pdef.name])
        elif pdef.name in global_raw:
            params[pdef.name] = _method_value(source, f"parameters.{pdef.name}", pdef,
                                              global_raw[pdef.name])
        elif not pdef.required:
            params[pdef.name] = pdef.default
        else:
            raise _err(source, key, f"{pdef.name} is required by {m.name}")
    return params


def parse_spec(data: Any, base_dir: Path, source: str = "<inline>",
               hub_config: hub.HubConfig | None = None, *, strict: bool = False) -> Spec:
    """Validate a spec already loaded from YAML. Paths resolve against ``base_dir``; Hub ids
    in ``hub_config``'s cache (default: from the environment, read here, at the edge)."""
    # The one read of the environment (HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE): spec loading is
    # the edge; library code below gets the cache directory and offline flag passed in.
    hub_config = hub_config or hub.HubConfig.from_environ(os.environ)
    hub_records: dict[str, Any] = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec is a YAML mapping with merge_method, base_model, models")
    strict = strict or data.get("strict") is True
    lenient = _Lenient(source, strict)
    for key in data:
        if key in _UNSUPPORTED_KEYS:
            raise _err(source, key, "this mergekit feature is not supported by mergefs yet")
        if key not in _MERGEKIT_KEYS + _MERGEFS_KEYS:
            lenient.ignore(key, "not a mergekit or mergefs key")
    method = data.get("merge_method")
    mdef = registry.get(method) if isinstance(method, str) else None
    if mdef is None:
        raise _err(source, "merge_method", f"{method!r} is not supported; choose one of "
                   f"{', '.join(registry.METHODS)}")
    base_given = None
    if data.get("base_model") is not None:
        base_given = _resolve_model(base_dir, data["base_model"], source, "base_model",
                                    hub_config, hub_records)
    top_options = storage_options(data.get("storage_options"), source, "storage_options")
    given = [k for k in ("models", "slices", "modules") if data.get(k) is not None]
    if len(given) > 1:
        raise _err(source, given[1], f"give only one of models, slices or modules, not both "
                   f"{given[0]} and {given[1]} (mergekit refuses it)")
    sliced = bool(given) and given[0] != "models"
    if given == ["modules"]:
        slices = _modules(data, base_given, base_dir, source, hub_config, hub_records)
    elif sliced:
        slices = _slices(data.get("slices"), "slices", base_dir, source, hub_config,
                         hub_records)
    else:
        slices = []
    lead = _lead(mdef, slices, base_given) if sliced else None
    models = [m for m, _ in lead.sources] if lead is not None else _models(
        data, base_dir, source, hub_config, hub_records)
    model_options = {x.path: x.options for x in models if x.options is not None}
    for sl in slices:  # a model's options given in any slice (module) of the spec
        for x, _ in sl.sources:
            if x.options is not None and model_options.setdefault(x.path, x.options) \
                    != x.options:
                raise _err(source, f"{x.key}.storage_options", f"{x.path} is given "
                           "different storage_options elsewhere in the spec")
    if slices and slices[0].module is not None:
        _check_module_roles(mdef, slices, base_given, source)
    method_base = base_given
    if sliced and mdef.caps.base == BasePolicy.IGNORED and base_given not in {
            x.path for x in models}:
        method_base = None  # the inputs of a slice are its sources, exactly
    method_data = data
    if sliced:  # parameters a slice sets count as given (resolved per tensor by the recipe)
        assert lead is not None
        method_data = {**data, "parameters": {**lead.params_raw,
                                              **lead.module_params_raw,
                                              **(data.get("parameters") or {})}}
    glob, inputs, per_input, has_base = _resolve_method(mdef, method_data, models, method_base,
                                                        source, lenient)
    base = method_base if method_base is not None else models[0].path
    if sliced and has_base and base not in {x.path for x in models}:
        raise _err(source, f"{lead.key if lead else 'slices'}.sources", f"the base model {base} must be one of the "
                   "slice's sources (mergekit refuses a slice without its base)")
    glob_settings = _own_settings(mdef, data.get("parameters") or {}, "parameters", source,
                                  lenient, scopes=None)
    tok = _tokenizer(data, base_dir, source, hub_config, hub_records)
    if tok is not None and tok.source is not None and slices and slices[0].module is not None:
        raise _err(source, "tokenizer" if data.get("tokenizer") is not None
                   else "tokenizer_source", "a tokenizer merge of a modules: spec is not "
                   "supported yet (its vocabulary tensors and size live in the text module's "
                   "config); chat_template alone is")
    slice_defs = (_slice_defs(mdef, slices, base_given, has_base, source, lenient) if sliced
                  else (_models_slice(mdef, inputs, base, has_base, source, lenient),))
    experts = [ModelEntry(x.path, p) for x, p in zip(inputs, per_input) if x.path != base]
    expert_index = {e.path: k for k, e in enumerate(experts)}
    input_order = tuple(REFERENCE if x.path == base else expert_index[x.path] for x in inputs)
    base_parameters = next((p for x, p in zip(inputs, per_input) if x.path == base), None)
    base_weight = None
    if base_parameters is not None and "weight" in base_parameters:
        base_weight = base_parameters["weight"]
    for w in lenient.warnings:
        log.warning("%s", w)

    out_dtype = None
    for key in ("dtype", "out_dtype"):  # out_dtype wins when both are given
        if data.get(key) is not None:
            name = data[key]
            if name not in DTYPE_NAMES:
                raise _err(source, key, f"{name!r} is not one of {', '.join(DTYPE_NAMES)}")
            out_dtype = DTYPE_NAMES[name]

    try:
        budget = parse_budget(data.get("budget", "full"))
    except BudgetError as exc:
        raise SpecError(f"{source}: {exc}") from None
    try:
        block_size = parse_size(data.get("block_size", "1MiB"), "block_size")
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    if not 64 <= block_size <= 1 << 34:
        raise _err(source, "block_size", f"must be between 64 bytes and 16GiB, got {block_size}")

    stem = Path(source).stem if source != "<inline>" else "merge"
    index_dir = _resolve_path(base_dir, data.get("index_dir", ".mergefs/index"), source,
                              "index_dir")
    manifest = _resolve_path(base_dir, data.get("manifest", f"{stem}.manifest.jsonl"), source,
                             "manifest", follow=False)  # the pointer itself, not its target
    decode_limit = _decode_limit(data.get("decode_limit", DEFAULT_DECODE_LIMIT), source)
    cache = data.get("cache") or {}
    if not isinstance(cache, dict) or set(cache) - {"memory", "dir"}:
        raise _err(source, "cache", "expected a mapping with 'memory' (a size) and/or 'dir'")
    try:
        cache_memory = parse_size(cache["memory"], "cache.memory") if "memory" in cache else None
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    cache_dir = _resolve_path(base_dir, cache["dir"], source, "cache.dir") if "dir" in cache else None

    # the inputs in mergekit's order (an appended base listed last), so that replay re-parses
    # the same inputs in the same order
    models_raw: list[dict[str, Any]] = [
        {"model": x.path, "parameters": {k: settings.to_json(v) for k, v in p.items()}}
        for x, p in zip(inputs, per_input)]
    for entry_raw in models_raw:
        if entry_raw["model"] in model_options:
            entry_raw["storage_options"] = redact_options(model_options[entry_raw["model"]])
        entry_raw["model"] = hub_records.get(entry_raw["model"], entry_raw["model"])
    remote_config = remote_settings(data.get("remote"), source)
    remote_sources = {
        p: RemoteOptions(options_for(p, top_options, model_options.get(p, {})),
                         **remote_config)
        for p in dict.fromkeys([base, *(e.path for e in experts),
                                *(r.path for sl in slice_defs for r in (sl.ref, *sl.experts))])
        if "://" in p
    }
    raw = {  # a valid spec again (replay re-parses it), with every default filled in
        "merge_method": method,
        "base_model": (hub_records.get(base_given, base_given) if base_given is not None
                       else None),
        "models": models_raw,
        "parameters": {k: settings.to_json(v) for k, v in glob.items()},
        "out_dtype": OUT_DTYPE_NAMES.get(out_dtype) if out_dtype else None,
        "budget": budget.to_spec(),
        "block_size": block_size,
    }
    if tok is not None:
        if tok.source is not None or tok.tokens or tok.pad_to_multiple_of:
            raw["tokenizer"] = {**tokenizer_json(tok), "source": hub_records.get(
                tok.source, tok.source) if tok.source is not None else "base"}
        if tok.chat_template is not None:
            raw["chat_template"] = tok.chat_template
    if sliced:
        del raw["models"]
        if slices[0].module is not None:
            raw["modules"] = _modules_raw(slices, hub_records)
        else:
            raw["slices"] = [_slice_raw(sl, hub_records) for sl in slices]
        # only what the global level gave: a slice's own values stay on the slice
        raw["parameters"] = {k: settings.to_json(v) for k, v in glob_settings.items()}
    if "storage_options" in data:  # redacted: credentials never reach a manifest or a log
        raw["storage_options"] = redact_options(top_options)
    if "decode_limit" in data:
        raw["decode_limit"] = decode_limit if decode_limit is not None else "none"
    if "remote" in data:
        raw["remote"] = {"coalesce_gap": remote_config["gap_bytes"],
                         "concurrency": remote_config["concurrency"],
                         "retries": remote_config["retries"]}
    return Spec(source, mdef.name, base, tuple(experts), base_weight, glob, out_dtype, budget,
                block_size, index_dir, cache_memory, cache_dir, manifest, raw, remote_sources,
                has_base=has_base, input_order=input_order, base_parameters=base_parameters,
                warnings=tuple(lenient.warnings), slices=slice_defs, sliced=sliced,
                settings=glob_settings, tokenizer=tok, decode_limit=decode_limit)


def _decode_limit(value: Any, source: str) -> float | None:
    """The ``decode_limit`` key: a positive number, or ``none`` (no limit)."""
    if value is None or isinstance(value, str) and value.strip().lower() in ("none", "off"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise _err(source, "decode_limit", "expected a positive number (a plan decodes for at "
                   "most this many times the read time of the exact bytes it replaces) or "
                   f"'none', got {value!r}")
    return float(value)


