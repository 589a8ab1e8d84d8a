"""The models and slices of a spec: which models each output layer merges, in which roles, with which parameters (mergekit's ``models``, ``slices`` and ``modules``). Pure validation; errors name the file and the key."""

from __future__ import annotations
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from mergefs.spec import refs as hub, settings
from mergefs.core.errors import SpecError
from mergefs.methods.base import BasePolicy, Method, ParamDef, Scope
from mergefs.spec.model import SliceDef, SliceSource
from mergefs.spec.options import check_url, storage_options


def spec_error(source: str, key: str, message: str) -> SpecError:
    return SpecError(f"{source}: {key}: {message}")


def resolve_path(base_dir: Path, value: Any, source: str, key: str,
                  allow_url: bool = False, follow: bool = True) -> str:
    if not isinstance(value, str) or not value:
        raise spec_error(source, key, f"expected a path, got {value!r}")
    if "://" in value:
        if not allow_url:
            raise spec_error(source, key, f"must be a local path, got the URL {value}")
        return check_url(value, source, key)
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base_dir / p
    return str(p.resolve() if follow else p.parent.resolve() / p.name)


def resolve_model_path(base_dir: Path, value: Any, source: str, key: str, hub_config: hub.HubConfig,
                   records: dict[str, Any]) -> str:
    """base_model or models[].model as mergekit reads it: a path, a URL or a Hub id (mergefs.spec.refs);
    a Hub model's pinned record (id, commit, snapshot) goes to ``records`` for Spec.raw."""
    found = hub.resolve_model(value, base_dir, hub_config, f"{source}: {key}")
    if found.plain:  # a local path or a URL, resolved as before
        return resolve_path(base_dir, found.path, source, key, allow_url=True)
    if found.lora is not None and key == "base_model":
        raise spec_error(source, key, "model+lora as the base model is not supported yet")
    records[found.path] = found.record()
    return found.path


class Lenient:
    """Collects what mergekit would silently ignore: one warning each, or an error if strict."""

    def __init__(self, source: str, strict: bool) -> None:
        self.source, self.strict = source, strict
        self.warnings: list[str] = []
        #: the unknown top-level keys ignored so far (a missing key's error names one like it)
        self.unknown_keys: list[str] = []

    def ignore(self, key: str, why: str, mergekit: str = "mergekit ignores it too") -> None:
        message = f"{self.source}: {key}: ignored ({why}; {mergekit})"
        if self.strict:
            raise spec_error(self.source, key, f"{why} (strict: ignored keys are errors)")
        self.warnings.append(message)

    def required(self, key: str, message: str, otherwise: str = "") -> SpecError:
        """The error for a missing required top-level ``key``: ``message``, then the unknown key
        given that may have been meant for it (``method`` for merge_method, ``base`` for
        base_model), or else ``otherwise``."""
        near = [k for k in self.unknown_keys if len(k) >= 4 and k in key] or \
            difflib.get_close_matches(key, self.unknown_keys, n=1, cutoff=0.6)
        hint = f"; did you mean `{key}` instead of `{near[0]}`?" if near else otherwise
        return spec_error(self.source, key, message + hint)


def _method_value(source: str, key: str, pdef: ParamDef, value: Any) -> Any:
    """A checked setting (mergefs.spec.settings): a scalar, a gradient or filtered values."""
    checked, problem = settings.check(pdef, value)
    if problem:
        raise spec_error(source, key, problem)
    return checked


@dataclass
class _Model:
    path: str
    key: str
    params_raw: dict[str, Any]
    options: dict[str, Any] | None


def parse_models(data: dict[str, Any], base_dir: Path, source: str, hub_config: hub.HubConfig,
            hub_records: dict[str, Any], where: str = "models") -> list[_Model]:
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise spec_error(source, where, "expected a non-empty list of {model: PATH, parameters: {...}}")
    out: list[_Model] = []
    for k, entry in enumerate(models):
        key = f"{where}[{k}]"
        if not isinstance(entry, dict) or "model" not in entry:
            raise spec_error(source, key, "expected a mapping with a 'model' path")
        extra = set(entry) - {"model", "parameters", "storage_options"}
        if extra:
            raise spec_error(source, f"{key}.{sorted(extra)[0]}", "not supported")
        mpath = resolve_model_path(base_dir, entry["model"], source, f"{key}.model", hub_config,
                               hub_records)
        options = None
        if "storage_options" in entry:
            options = storage_options(entry["storage_options"], source, f"{key}.storage_options")
        params_raw = entry.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise spec_error(source, f"{key}.parameters", "expected a mapping")
        _refuse_repeat(source, f"{key}.model", mpath, out)
        out.append(_Model(mpath, key, dict(params_raw), options))
    return out


def _refuse_repeat(source: str, key: str, path: str, earlier: list[_Model]) -> None:
    """mergekit 0.1.5 refuses a merge whose inputs name a model twice ("Duplicate merge
    inputs"), whatever the parameters or layer ranges; so does mergefs, naming both places."""
    first = next((x.key for x in earlier if x.path == path), None)
    if first is not None:
        raise spec_error(source, key, f"{path} is listed again (first at {first}); mergekit "
                         "refuses a model twice in one merge too (\"Duplicate merge inputs\")")


@dataclass
class _Slice:
    key: str
    #: per source: the model and its layers (None: all the module's layers, ``models:`` form)
    sources: list[tuple[_Model, tuple[int, int] | None]]
    base: str | None
    params_raw: dict[str, Any]
    module: str | None = None
    module_params_raw: dict[str, Any] = field(default_factory=dict)


def parse_slices(raw: Any, where: str, base_dir: Path, source: str, hub_config: hub.HubConfig,
            hub_records: dict[str, Any]) -> list[_Slice]:
    """``slices`` as mergekit reads them: sources with a layer range each, an optional slice
    ``base_model`` and ``parameters``. ``where``: the key of the list (``slices``,
    ``modules.NAME.slices``)."""
    if not isinstance(raw, list) or not raw:
        raise spec_error(source, where, "expected a non-empty list of {sources: [...]}")
    out: list[_Slice] = []
    for k, sl in enumerate(raw):
        key = f"{where}[{k}]"
        if not isinstance(sl, dict) or not isinstance(sl.get("sources"), list) \
                or not sl["sources"]:
            raise spec_error(source, key, "expected a mapping with a non-empty 'sources' list")
        extra = set(sl) - {"sources", "base_model", "parameters", "residual_weight"}
        if extra:
            raise spec_error(source, f"{key}.{sorted(extra)[0]}", "not a slice key")
        if sl.get("residual_weight") is not None:
            raise spec_error(source, f"{key}.residual_weight", "not supported (mergekit 0.1.5 "
                       "accepts it but never applies it)")
        sources: list[tuple[_Model, tuple[int, int] | None]] = []
        for j, src in enumerate(sl["sources"]):
            skey = f"{key}.sources[{j}]"
            if not isinstance(src, dict) or "model" not in src or "layer_range" not in src:
                raise spec_error(source, skey, "expected a mapping with 'model' and 'layer_range'")
            if set(src) - {"model", "layer_range", "parameters"}:
                raise spec_error(source, f"{skey}.{sorted(set(src) - {'model', 'layer_range', 'parameters'})[0]}",
                           "not supported")
            lr = src["layer_range"]
            if (not isinstance(lr, list) or len(lr) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in lr)
                    or not 0 <= lr[0] < lr[1]):
                raise spec_error(source, f"{skey}.layer_range", f"expected [first, end) with "
                           f"0 <= first < end, got {lr!r}")
            mpath = resolve_model_path(base_dir, src["model"], source, f"{skey}.model", hub_config,
                                   hub_records)
            params_raw = src.get("parameters") or {}
            if not isinstance(params_raw, dict):
                raise spec_error(source, f"{skey}.parameters", "expected a mapping")
            _refuse_repeat(source, f"{skey}.model", mpath, [x for x, _ in sources])
            sources.append((_Model(mpath, skey, dict(params_raw), None), (lr[0], lr[1])))
        lengths = {lr[1] - lr[0] for _, lr in sources if lr is not None}
        if len(lengths) != 1:
            raise spec_error(source, f"{key}.sources", "all sources of a slice must have the same "
                       "number of layers (mergekit refuses it too)")
        sbase = None
        if sl.get("base_model") is not None:
            sbase = resolve_model_path(base_dir, sl["base_model"], source, f"{key}.base_model",
                                   hub_config, hub_records)
        params_raw = sl.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise spec_error(source, f"{key}.parameters", "expected a mapping")
        out.append(_Slice(key, sources, sbase, dict(params_raw)))
    return out


def parse_modules(data: dict[str, Any], base_given: str | None, base_dir: Path, source: str,
             hub_config: hub.HubConfig, hub_records: dict[str, Any]) -> list[_Slice]:
    """``modules:`` as mergekit reads it: per architecture module, ``slices`` or ``models``
    (normalised as mergekit does to one slice over all of the module's layers, the base
    appended when not listed) and the module's ``parameters``; the slices of every module in
    the order given."""
    raw = data.get("modules")
    if not isinstance(raw, dict) or not raw:
        raise spec_error(source, "modules", "expected a mapping of module name -> {slices: [...]} "
                   "or {models: [...]}")
    out: list[_Slice] = []
    for name, mod in raw.items():
        key = f"modules.{name}"
        if not isinstance(mod, dict):
            raise spec_error(source, key, "expected a mapping with 'slices' or 'models'")
        extra = set(mod) - {"slices", "models", "parameters"}
        if extra:
            raise spec_error(source, f"{key}.{min(extra)}", "not a module key")
        if (mod.get("slices") is None) == (mod.get("models") is None):
            raise spec_error(source, key, "give slices or models, not both (mergekit refuses both "
                       "and neither)")
        params_raw = mod.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise spec_error(source, f"{key}.parameters", "expected a mapping")
        if mod.get("slices") is not None:
            part = parse_slices(mod["slices"], f"{key}.slices", base_dir, source, hub_config,
                           hub_records)
        else:
            models = parse_models(mod, base_dir, source, hub_config, hub_records, f"{key}.models")
            srcs: list[tuple[_Model, tuple[int, int] | None]] = [(m, None) for m in models]
            if base_given is not None and base_given not in {m.path for m in models}:
                srcs.append((_Model(base_given, "base_model", {}, None), None))
            part = [_Slice(f"{key}.models", srcs, None, {})]
        for sl in part:
            sl.module, sl.module_params_raw = str(name), dict(params_raw)
        out += part
    return out


def own_settings(m: Method, raw: dict[str, Any], key: str, source: str, lenient: Lenient,
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


def models_slice(m: Method, inputs: list[_Model], base: str, has_base: bool, source: str,
                  lenient: Lenient) -> SliceDef:
    """A ``models:`` spec as mergekit normalises it: one slice over every layer."""
    own = {x.path: own_settings(m, x.params_raw, f"{x.key}.parameters", source, lenient,
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


def lead_slice(m: Method, slices: list[_Slice], base_given: str | None) -> _Slice:
    """The slice whose models are the spec's roles: the first that is not the base alone."""
    return next((sl for sl in slices if not _is_ref_only(m, sl, base_given)), slices[0])


def make_slice_defs(m: Method, slices: list[_Slice], base_given: str | None, has_base: bool,
                source: str, lenient: Lenient) -> tuple[SliceDef, ...]:
    """Each slice by role; every slice must have the lead slice's roles (count and reference
    place), but for a base-only module slice (:func:`_is_ref_only`)."""
    out: list[SliceDef] = []
    lead = lead_slice(m, slices, base_given)
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
            raise spec_error(source, f"{sl.key}.sources", f"the base model {sbase} must be one of "
                       "the slice's sources (mergekit refuses a slice without its base)")
        if has_base or m.caps.base != BasePolicy.IGNORED:
            place = paths.index(sbase) if sbase in paths else 0
        else:
            place = paths.index(sbase) if sbase in paths else 0
        if place != ref_place or len(paths) != len(lead.sources):
            raise spec_error(source, sl.key, "every slice must have the same number of sources "
                       f"with the base in the same place as {lead.key} (not supported "
                       "otherwise)")
        for name in sl.params_raw:
            if m.param(name) is None:
                lenient.ignore(f"{sl.key}.parameters.{name}", f"{m.name} has no parameter "
                               f"{name!r}")
        roles = [SliceSource(x.path, lr, own_settings(
            m, x.params_raw, f"{x.key}.parameters", source, lenient, _PER_MODEL))
            for x, lr in sl.sources]
        module_settings: dict[str, Any] = {}
        if sl.module is not None:
            for name in sl.module_params_raw:
                if m.param(name) is None:
                    lenient.ignore(f"modules.{sl.module}.parameters.{name}",
                                   f"{m.name} has no parameter {name!r}")
            module_settings = own_settings(m, sl.module_params_raw,
                                            f"modules.{sl.module}.parameters", source, lenient,
                                            None)
        out.append(SliceDef(roles[place], tuple(r for k, r in enumerate(roles) if k != place),
                            own_settings(m, sl.params_raw, f"{sl.key}.parameters", source,
                                          lenient, None), sl.module, module_settings))
    return tuple(out)


def normal_raw(m: Method, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters as given at one level, each of ``m``'s in its checked normal form (what a
    manifest records); a value that level ignores stays as given."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        pdef = m.param(name)
        checked, problem = (None, "ignored") if pdef is None else settings.check(pdef, value)
        out[name] = value if problem else settings.to_json(checked)
    return out


def slice_raw(m: Method, sl: _Slice, hub_records: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sources": [
        {"model": hub_records.get(x.path, x.path), "layer_range": list(lr),
         **({"parameters": normal_raw(m, x.params_raw)} if x.params_raw else {})}
        for x, lr in sl.sources if lr is not None]}
    if sl.base is not None:
        out["base_model"] = hub_records.get(sl.base, sl.base)
    if sl.params_raw:
        out["parameters"] = normal_raw(m, sl.params_raw)
    return out


def check_module_roles(m: Method, slices: list[_Slice], base_given: str | None,
                        source: str) -> None:
    """mergefs merges every slice of every module with the same roles: as many models, the
    base in the same place; a slice of the base alone is the base (task-arithmetic family).
    Refused otherwise, naming the first slice that differs."""
    def shape(sl: _Slice) -> str:
        paths = [x.path for x, _ in sl.sources]
        b = sl.base if sl.base is not None else base_given
        where = f"the base at {paths.index(b)}" if b in paths else "no base"
        return f"{len(paths)} model(s), {where}"

    lead = lead_slice(m, slices, base_given)
    first = shape(lead)
    for sl in slices:
        if sl is not lead and not _is_ref_only(m, sl, base_given) and shape(sl) != first:
            raise spec_error(source, sl.key, f"{shape(sl)}, where {lead.key} has {first}: "
                       "mergefs merges every module with the same models in the same order "
                       "(or, for the task-arithmetic family, the base alone)")


def modules_raw(m: Method, slices: list[_Slice], hub_records: dict[str, Any]
                ) -> dict[str, Any]:
    """``modules:`` again as mergekit reads it (a ``models:`` module stays one)."""
    out: dict[str, Any] = {}
    for sl in slices:
        assert sl.module is not None
        mod = out.setdefault(sl.module, {})
        if sl.module_params_raw:
            mod["parameters"] = normal_raw(m, sl.module_params_raw)
        if sl.sources[0][1] is None:
            mod["models"] = [{"model": hub_records.get(x.path, x.path),
                              **({"parameters": normal_raw(m, x.params_raw)}
                                 if x.params_raw else {})}
                             for x, _ in sl.sources if x.key != "base_model"]
        else:
            mod.setdefault("slices", []).append(slice_raw(m, sl, hub_records))
    return out


def resolve_method(m: Method, data: dict[str, Any], models: list[_Model], base: str | None,
                    source: str, lenient: Lenient) -> tuple[
                        dict[str, Any], list[_Model], list[dict[str, Any]], bool]:
    """Global parameters, the inputs in mergekit's order with their per-model parameters, and
    whether the base plays the base role."""
    global_raw = data.get("parameters") or {}
    if not isinstance(global_raw, dict):
        raise spec_error(source, "parameters", "expected a mapping")
    for name in global_raw:
        if m.param(name) is None:
            lenient.ignore(f"parameters.{name}", f"{m.name} has no parameter {name!r}")
    glob: dict[str, Any] = {}
    for p in m.global_params:
        key = f"parameters.{p.name}"
        if p.name in global_raw:
            glob[p.name] = _method_value(source, key, p, global_raw[p.name])
        elif p.required:
            raise spec_error(source, key, f"required by {m.name}")
        else:
            glob[p.name] = p.default
    for p in m.model_params:  # a global value of a per-model name: every model's default
        if p.name in global_raw:
            _method_value(source, f"parameters.{p.name}", p, global_raw[p.name])
    if m.caps.base == BasePolicy.REQUIRED and base is None:
        raise lenient.required("base_model", f"required by {m.name}")
    has_base = base is not None and m.caps.base != BasePolicy.IGNORED
    inputs = _inputs(m, models, base, has_base, global_raw, lenient)
    if len({x.path for x in inputs}) != len(inputs):
        raise spec_error(source, "models", "the same model is listed twice")
    per_input = [_input_params(m, x, global_raw, source, lenient) for x in inputs]
    c = m.caps
    n = len(inputs)
    if n < c.min_inputs or (c.max_inputs is not None and n > c.max_inputs):
        what = "model(s) besides the base" if has_base else "input model(s)"
        want = (f"exactly {c.min_inputs}" if c.min_inputs == c.max_inputs
                else f"at least {c.min_inputs}" if c.max_inputs is None
                else f"{c.min_inputs} to {c.max_inputs}")
        raise spec_error(source, "models", f"{m.name} merges {want} {what}, got {n}")
    scalar = all(settings.is_scalar(v) for p in [glob, *per_input] for v in p.values())
    if m.check is not None and scalar:  # otherwise checked per tensor by the recipe
        problem = m.check(glob, per_input)
        if problem:
            raise spec_error(source, "models", problem)
    return glob, inputs, per_input, has_base


def _inputs(m: Method, models: list[_Model], base: str | None, has_base: bool,
            global_raw: Mapping[str, Any], lenient: Lenient) -> list[_Model]:
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
                  lenient: Lenient) -> dict[str, Any]:
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
            raise spec_error(source, key, f"{pdef.name} is required by {m.name}")
    return params
