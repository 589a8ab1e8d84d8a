"""The merge spec: a mergekit YAML config plus mergefs's own keys, validated once, at the edge.

``load_spec(path)`` returns a frozen :class:`Spec` with every path resolved relative to the spec
file and every parameter checked; errors name the file and the key. ``check_coordinates`` checks
that the experts share the base's coordinate system (tensor names, shapes, dtypes).
Pure validation; no tensor bytes are read here.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mergefs.spec import refs as hub, settings
from mergefs import methods as registry
from mergefs.core.errors import BudgetError, SpecError
from mergefs.methods.base import BasePolicy
from mergefs.spec.options import RemoteOptions
from mergefs.spec.tokenizer import to_json as tokenizer_json
from mergefs.core.sizes import parse_size
from mergefs.spec.budget import parse_budget
from mergefs.spec.model import DTYPE_NAMES, ModelEntry, OUT_DTYPE_NAMES, REFERENCE, Spec
from mergefs.spec.options import options_for, remote_settings, storage_options, redact_options
from mergefs.spec.model import DEFAULT_DECODE_LIMIT
from mergefs.spec.slices import (
    Lenient, check_module_roles, lead_slice, models_slice, modules_raw, own_settings, parse_models,
    parse_modules, parse_slices, resolve_method, resolve_path, make_slice_defs, slice_raw,
    spec_error,
)
from mergefs.spec.slices import resolve_model_path
from mergefs.spec.tokenizer import TokenRule, TokenizerSpec

log = logging.getLogger(__name__)

_MERGEKIT_KEYS = ("merge_method", "base_model", "models", "slices", "modules", "parameters",
                  "dtype", "out_dtype", "tokenizer_source", "tokenizer", "chat_template")
_MERGEFS_KEYS = ("budget", "block_size", "index_dir", "cache", "manifest", "name",
                 "storage_options", "remote", "strict", "sweep", "variants", "decode_limit",
                 "index_max_size", "memory")
_UNSUPPORTED_KEYS = (
    "architecture",
)
#: every top-level key a spec may give
KNOWN_KEYS = _MERGEKIT_KEYS + _MERGEFS_KEYS
#: how alike (difflib's ratio) an unknown top-level key must be to a known one to be taken for a
#: typo of it, an error whether or not strict: budgt, bugdet, merge_methd, base_modle, model,
#: blocksize are (0.8 and above); index, method, license, notes are not (mergekit ignores them,
#: and so does a lenient spec, with one warning)
TYPO_CUTOFF = 0.8
#: a file that holds a NUL byte in its first 64 KiB is binary (a weights file), never a spec
_SNIFF_BYTES = 1 << 16


def typo_of(key: str, known: tuple[str, ...] = KNOWN_KEYS) -> str | None:
    """The known key that ``key`` is a typo of, or None."""
    got = difflib.get_close_matches(key, known, n=1, cutoff=TYPO_CUTOFF)
    return got[0] if got else None


def read_spec_docs(path: str | Path) -> list[Any]:
    """The YAML documents of spec file ``path``. One-line errors for a file that cannot be read,
    is not UTF-8 text (a weights file given by mistake: found from its first bytes, without
    reading the whole file) or is not YAML."""
    p = Path(path)
    not_text = SpecError(f"{p}: not a YAML spec (not UTF-8 text; is it a weights file?)")
    try:
        with open(p, "rb") as f:
            head = f.read(_SNIFF_BYTES)
            if b"\0" in head:
                raise not_text
            text = (head + f.read()).decode("utf-8")
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise not_text from None
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}".replace("\n", " ")) from None


def load_spec(path: str | Path, strict: bool = False, *,
              intermediate_dir: str | os.PathLike[str] | None = None) -> Spec:
    """Read and validate a spec file. ``strict``: ignored keys are errors, not warnings.
    ``intermediate_dir``: of a multi-document spec, overrides its ``intermediate_dir`` (a
    relative path is relative to the working directory, as mergekit-multi's ``-I``)."""
    p = Path(path)
    docs = read_spec_docs(p)
    if len(docs) > 1:
        return _load_multi(docs, p, strict, None if intermediate_dir is None
                           else os.path.abspath(intermediate_dir))
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


def _load_multi(docs: list[Any], p: Path, strict: bool, intermediate_dir: str | None = None
                ) -> Spec:
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
    if intermediate_dir is not None:
        inter = intermediate_dir
    inter_dir = Path(resolve_path(base_dir, inter, str(p), "intermediate_dir"))
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
               **({"index_max_size": final["index_max_size"]} if "index_max_size" in final
                  else {}),
               "manifest": f"{stem}.{n}.manifest.jsonl", **patched[n]}
        intermediates.append((n, parse_spec(doc, base_dir, source=f"{p}#{n}", strict=strict),
                              paths[n]))
    spec = parse_spec(final, base_dir=base_dir, source=str(p), strict=strict)
    return Spec(**{**spec.__dict__, "intermediates": tuple(intermediates)})


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
    lenient = Lenient(source, strict)
    for key in data:
        if key in _UNSUPPORTED_KEYS:
            raise spec_error(source, key, "this mergekit feature is not supported by mergefs yet")
        if key not in KNOWN_KEYS:
            meant = typo_of(str(key))
            if meant is not None:  # an error even when lenient: the key meant is not set
                raise spec_error(source, key, f"unknown key; did you mean `{meant}`?")
            lenient.unknown_keys.append(str(key))
            lenient.ignore(key, "not a mergekit or mergefs key")
    method = data.get("merge_method")
    if method is None:
        raise lenient.required("merge_method", "required",
                               f"; choose one of {', '.join(registry.METHODS)}")
    mdef = registry.get(method) if isinstance(method, str) else None
    if mdef is None:
        raise spec_error(source, "merge_method", f"{method!r} is not supported; choose one of "
                   f"{', '.join(registry.METHODS)}")
    base_given = None
    if data.get("base_model") is not None:
        base_given = resolve_model_path(base_dir, data["base_model"], source, "base_model",
                                    hub_config, hub_records)
    top_options = storage_options(data.get("storage_options"), source, "storage_options")
    given = [k for k in ("models", "slices", "modules") if data.get(k) is not None]
    if len(given) > 1:
        raise spec_error(source, given[1], f"give only one of models, slices or modules, not both "
                   f"{given[0]} and {given[1]} (mergekit refuses it)")
    sliced = bool(given) and given[0] != "models"
    if given == ["modules"]:
        slices = parse_modules(data, base_given, base_dir, source, hub_config, hub_records)
    elif sliced:
        slices = parse_slices(data.get("slices"), "slices", base_dir, source, hub_config,
                         hub_records)
    else:
        slices = []
        if data.get("models") is None:
            raise lenient.required("models", "required", ": a non-empty list of {model: PATH, "
                                   "parameters: {...}} (or slices or modules)")
    lead = lead_slice(mdef, slices, base_given) if sliced else None
    models = [m for m, _ in lead.sources] if lead is not None else parse_models(
        data, base_dir, source, hub_config, hub_records)
    model_options = {x.path: x.options for x in models if x.options is not None}
    for sl in slices:  # a model's options given in any slice (module) of the spec
        for x, _ in sl.sources:
            if x.options is not None and model_options.setdefault(x.path, x.options) \
                    != x.options:
                raise spec_error(source, f"{x.key}.storage_options", f"{x.path} is given "
                           "different storage_options elsewhere in the spec")
    if slices and slices[0].module is not None:
        check_module_roles(mdef, slices, base_given, source)
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
    glob, inputs, per_input, has_base = resolve_method(mdef, method_data, models, method_base,
                                                        source, lenient)
    base = method_base if method_base is not None else models[0].path
    if sliced and has_base and base not in {x.path for x in models}:
        raise spec_error(source, f"{lead.key if lead else 'slices'}.sources", f"the base model {base} must be one of the "
                   "slice's sources (mergekit refuses a slice without its base)")
    glob_settings = own_settings(mdef, data.get("parameters") or {}, "parameters", source,
                                  lenient, scopes=None)
    tok = parse_tokenizer(data, base_dir, source, hub_config, hub_records)
    slice_defs = (make_slice_defs(mdef, slices, base_given, has_base, source, lenient) if sliced
                  else (models_slice(mdef, inputs, base, has_base, source, lenient),))
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
                raise spec_error(source, key, f"{name!r} is not one of {', '.join(DTYPE_NAMES)}")
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
        raise spec_error(source, "block_size", f"must be between 64 bytes and 16GiB, got {block_size}")

    stem = Path(source).stem if source != "<inline>" else "merge"
    index_dir = resolve_path(base_dir, data.get("index_dir", ".mergefs/index"), source,
                              "index_dir")
    manifest = resolve_path(base_dir, data.get("manifest", f"{stem}.manifest.jsonl"), source,
                             "manifest", follow=False)  # the pointer itself, not its target
    decode_limit = _decode_limit(data.get("decode_limit", DEFAULT_DECODE_LIMIT), source)
    index_max_size = None
    if data.get("index_max_size") not in (None, "none"):
        try:
            index_max_size = parse_size(data["index_max_size"], "index_max_size")
        except ValueError as exc:
            raise spec_error(source, "index_max_size", str(exc)) from None
    cache = data.get("cache") or {}
    if not isinstance(cache, dict) or set(cache) - {"memory", "dir"}:
        raise spec_error(source, "cache", "expected a mapping with 'memory' (a size) and/or 'dir'")
    try:
        cache_memory = parse_size(cache["memory"], "cache.memory") if "memory" in cache else None
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    cache_dir = resolve_path(base_dir, cache["dir"], source, "cache.dir") if "dir" in cache else None
    memory_bytes = None
    if data.get("memory") is not None:
        try:
            memory_bytes = parse_size(data["memory"], "memory")
        except ValueError as exc:
            raise spec_error(source, "memory", str(exc).removeprefix("memory: ")) from None
        if memory_bytes <= 0:
            raise spec_error(source, "memory", "must be more than 0")

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
            raw["modules"] = modules_raw(mdef, slices, hub_records)
        else:
            raw["slices"] = [slice_raw(mdef, sl, hub_records) for sl in slices]
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
                settings=glob_settings, tokenizer=tok, decode_limit=decode_limit,
                index_max_size_bytes=index_max_size, memory_bytes=memory_bytes)


def _decode_limit(value: Any, source: str) -> float | None:
    """The ``decode_limit`` key: a positive number, or ``none`` (no limit)."""
    if value is None or isinstance(value, str) and value.strip().lower() in ("none", "off"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise spec_error(source, "decode_limit", "expected a positive number (a plan decodes for at "
                   "most this many times the read time of the exact bytes it replaces) or "
                   f"'none', got {value!r}")
    return float(value)


def parse_tokenizer(data: dict[str, Any], base_dir: Path, source: str, hub_config: hub.HubConfig,
               hub_records: dict[str, Any]) -> TokenizerSpec | None:
    """tokenizer_source, the tokenizer: block and chat_template, as mergekit reads them."""
    ts, block, chat = data.get("tokenizer_source"), data.get("tokenizer"), data.get("chat_template")
    if ts is not None and block is not None:
        raise spec_error(source, "tokenizer", "give tokenizer_source or tokenizer, not both "
                   "(mergekit refuses both)")
    if chat is not None and not isinstance(chat, str):
        raise spec_error(source, "chat_template", "expected auto, a built-in name or Jinja text")

    def model_ref(value: Any, key: str) -> str:
        if isinstance(value, str) and value.startswith("model:"):
            value = value[len("model:"):]
        return resolve_model_path(base_dir, value, source, key, hub_config, hub_records)

    def src(value: Any, key: str) -> str:
        if value in ("base", "union"):
            return str(value)
        return model_ref(value, key)

    if block is not None:
        if not isinstance(block, dict) or set(block) - {"source", "tokens", "pad_to_multiple_of"}:
            raise spec_error(source, "tokenizer", "expected a mapping with source, tokens and/or "
                       "pad_to_multiple_of")
        pad = block.get("pad_to_multiple_of")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise spec_error(source, "tokenizer.pad_to_multiple_of", f"expected a positive integer, "
                       f"got {pad!r}")
        tokens: dict[str, TokenRule] = {}
        raw_tokens = block.get("tokens") or {}
        if not isinstance(raw_tokens, dict):
            raise spec_error(source, "tokenizer.tokens", "expected a mapping of token -> {source, force}")
        for t, cfg in raw_tokens.items():
            key = f"tokenizer.tokens.{t}"
            cfg = cfg or {}
            if not isinstance(cfg, dict) or set(cfg) - {"source", "force"}:
                raise spec_error(source, key, "expected a mapping with source and/or force")
            force = cfg.get("force", False)
            if not isinstance(force, bool):
                raise spec_error(source, f"{key}.force", "expected true or false")
            s = cfg.get("source")
            if s is None:
                tokens[str(t)] = TokenRule("auto", force=force)
            elif isinstance(s, dict) and s.get("kind") == "zero":
                tokens[str(t)] = TokenRule("zero", force=force)
            elif isinstance(s, dict) and s.get("kind") == "model_token":
                tid, tname = s.get("token_id"), s.get("token")
                if (tid is None) == (tname is None):
                    raise spec_error(source, f"{key}.source", "give one of token_id and token")
                tokens[str(t)] = TokenRule("model_token", model_ref(s.get("model"),
                                                                    f"{key}.source.model"),
                                           tid, tname, force)
            elif isinstance(s, dict):
                raise spec_error(source, f"{key}.source", "expected a model, {kind: zero} or "
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
