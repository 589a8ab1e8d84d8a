"""The merge spec: a mergekit YAML config plus mergefs's own keys, validated once, at the edge.

``load_spec(path)`` returns a frozen :class:`Spec` with every path resolved relative to the spec
file and every parameter checked; errors name the file and the key. ``check_coordinates`` checks
that the experts share the base's coordinate system (tensor names, shapes, dtypes).
Pure validation; no tensor bytes are read here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from . import hub
from .errors import BudgetError, SpecError
from .format import FLOAT_DTYPES
from .remote import DEFAULT_CONCURRENCY, DEFAULT_GAP_BYTES, DEFAULT_RETRIES, RemoteOptions

ADDITIVE = ("linear", "task_arithmetic")
GTA = ("ties", "dare_linear", "dare_ties", "breadcrumbs")
METHODS = ADDITIVE + GTA + ("slerp",)

# method -> (per-model parameter names, global parameter names with defaults)
_MODEL_PARAMS: dict[str, tuple[str, ...]] = {
    "linear": ("weight",),
    "task_arithmetic": ("weight",),
    "ties": ("weight", "density"),
    "dare_linear": ("weight", "density"),
    "dare_ties": ("weight", "density"),
    "breadcrumbs": ("weight", "density", "gamma"),
    "slerp": (),
}
_GLOBAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "linear": {"normalize": True},
    "task_arithmetic": {"normalize": False, "lambda": 1.0},
    "ties": {"normalize": True, "lambda": 1.0},
    "dare_linear": {"normalize": False, "lambda": 1.0, "rescale": True, "seed": 0},
    "dare_ties": {"normalize": False, "lambda": 1.0, "rescale": True, "seed": 0},
    "breadcrumbs": {"normalize": False, "lambda": 1.0},
    "slerp": {"t": None},
}
_MODEL_DEFAULTS = {"density": 1.0, "gamma": 0.01}
_IGNORED_PARAMS = ("int8_mask",)  # mergekit memory knobs with no effect on the result here

_MERGEKIT_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype")
_MERGEFS_KEYS = ("budget", "block_size", "index_dir", "cache", "manifest", "name",
                 "storage_options", "remote")
_UNSUPPORTED_KEYS = (
    "slices",
    "tokenizer_source",
    "tokenizer",
    "chat_template",
    "modules",
    "architecture",
)

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

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units); ``None`` -> ``'-'``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return str(x)


def parse_size(value: object, what: str = "size") -> int:
    """Parse ``1048576``, ``'1MiB'``, ``'2GB'``, ``'512 KiB'`` into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like 1MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"{what}: expected a size like 1MiB or 2GB, got {value!r}")


@dataclass(frozen=True)
class Budget:
    """An expert-read budget: a fraction of all expert bytes, a byte count, or everything."""

    kind: str  # "full" | "fraction" | "bytes"
    value: float = 1.0

    def resolve(self, total_expert_bytes: int) -> int:
        if self.kind == "full":
            return total_expert_bytes
        if self.kind == "fraction":
            return min(total_expert_bytes, math.floor(self.value * total_expert_bytes))
        return min(total_expert_bytes, int(self.value))

    @property
    def is_full(self) -> bool:
        return self.kind == "full" or (self.kind == "fraction" and self.value >= 1.0)

    def describe(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "fraction":
            return f"{self.value * 100:g}%"
        return f"{int(self.value)} bytes"


def parse_budget(value: object) -> Budget:
    """``full``, ``0.1``, ``10%``, ``2GiB``, ``1500000`` (bytes, when an integer > 1)."""
    err = (
        f"budget: expected 'full', a fraction in [0, 1] like 0.1, a percentage like 10%, "
        f"or a size like 2GiB; got {value!r}"
    )
    if isinstance(value, bool) or value is None:
        raise BudgetError(err)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise BudgetError(err)
        if isinstance(value, float) or value <= 1:
            if value > 1:
                raise BudgetError(err)
            return Budget("full") if value == 1 else Budget("fraction", float(value))
        return Budget("bytes", float(value))
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("full", "all", "100%"):
            return Budget("full")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
        if m:
            pct = float(m.group(1))
            if pct > 100:
                raise BudgetError(err)
            return Budget("full") if pct == 100 else Budget("fraction", pct / 100)
        try:
            as_float = float(text)
        except ValueError:
            try:
                return Budget("bytes", float(parse_size(text, "budget")))
            except ValueError:
                raise BudgetError(err) from None
        if not math.isfinite(as_float):  # "nan", "inf": int() of them would raise ValueError
            raise BudgetError(err)
        try:
            return parse_budget(as_float if "." in text or "e" in text else int(as_float))
        except BudgetError:
            raise BudgetError(err) from None  # name the text as given, not the number
    raise BudgetError(err)


@dataclass(frozen=True)
class ModelEntry:
    """An expert: its resolved path and its validated parameters."""

    path: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class Spec:
    """A validated merge spec. ``raw`` is the resolved spec as plain JSON-able data."""

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

    @property
    def is_additive(self) -> bool:
        return self.method in ADDITIVE

    def with_budget(self, budget: Budget) -> Spec:
        raw = dict(self.raw)
        raw["budget"] = budget.describe()
        return Spec(**{**self.__dict__, "budget": budget, "raw": raw})

    def source_options(self, path: str) -> RemoteOptions | None:
        """Options to open the source at ``path``: None for a local path."""
        return self.remote_sources.get(path)


def _err(source: str, key: str, message: str) -> SpecError:
    return SpecError(f"{source}: {key}: {message}")


def _number(source: str, key: str, value: Any, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            raise _err(source, key, "per-tensor 'filter' values are not supported yet; "
                                    "give one number")
        if isinstance(value, list):
            raise _err(source, key, "gradient lists are not supported yet; give one number")
        if isinstance(value, dict):
            raise _err(source, key, "per-tensor 'filter' values are not supported yet; "
                                    "give one number")
        raise _err(source, key, f"expected a number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise _err(source, key, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise _err(source, key, f"must be <= {hi}, got {value}")
    return float(value)


def _check_param(source: str, key: str, name: str, value: Any) -> Any:
    if name in ("normalize", "rescale"):
        if not isinstance(value, bool):
            raise _err(source, key, f"expected true or false, got {value!r}")
        return value
    if name == "seed":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _err(source, key, f"expected an integer, got {value!r}")
        return value
    if name == "density":
        return _number(source, key, value, 0.0, 1.0, lo_open=True)
    if name in ("gamma", "t"):
        return _number(source, key, value, 0.0, 1.0)
    return _number(source, key, value)


def _resolve_path(base_dir: Path, value: Any, source: str, key: str,
                  allow_url: bool = False) -> str:
    if not isinstance(value, str) or not value:
        raise _err(source, key, f"expected a path, got {value!r}")
    if "://" in value:
        if not allow_url:
            raise _err(source, key, f"must be a local path, got the URL {value}")
        return _check_url(value, source, key)
    p = Path(value).expanduser()
    return str((p if p.is_absolute() else base_dir / p).resolve())


def _resolve_model(base_dir: Path, value: Any, source: str, key: str, hub_config: hub.HubConfig,
                   records: dict[str, Any]) -> str:
    """base_model or models[].model as mergekit reads it: a path, a URL or a Hub id (mergefs.hub);
    a Hub model's pinned record (id, commit, snapshot) goes to ``records`` for Spec.raw."""
    found = hub.resolve_model(value, base_dir, hub_config, f"{source}: {key}")
    if found.plain:  # a local path or a URL, resolved as before
        return _resolve_path(base_dir, found.path, source, key, allow_url=True)
    if found.lora is not None and key == "base_model":
        raise _err(source, key, "model+lora as the base model is not supported yet")
    records[found.path] = found.record()
    return found.path


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}".replace("\n", " ")) from None
    return parse_spec(data, base_dir=p.resolve().parent, source=str(p))


def parse_spec(data: Any, base_dir: Path, source: str = "<inline>",
               hub_config: hub.HubConfig | None = None) -> Spec:
    """Validate a spec already loaded from YAML. Paths resolve against ``base_dir``; Hub ids
    in ``hub_config``'s cache (default: from the environment, read here, at the edge)."""
    # The one read of the environment (HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE): spec loading is
    # the edge; library code below gets the cache directory and offline flag passed in.
    hub_config = hub_config or hub.HubConfig.from_environ(os.environ)
    hub_records: dict[str, Any] = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a spec is a YAML mapping with merge_method, base_model, models")
    for key in data:
        if key in _UNSUPPORTED_KEYS:
            raise _err(source, key, "this mergekit feature is not supported by mergefs yet")
        if key not in _MERGEKIT_KEYS + _MERGEFS_KEYS:
            raise _err(source, key, "unknown key (mergekit keys: "
                       f"{', '.join(_MERGEKIT_KEYS)}; mergefs keys: {', '.join(_MERGEFS_KEYS)})")
    method = data.get("merge_method")
    if method not in METHODS:
        raise _err(source, "merge_method", f"{method!r} is not supported; choose one of "
                   f"{', '.join(METHODS)}")
    if "base_model" not in data:
        raise _err(source, "base_model", "required: mergefs merges deltas against a base model")
    base = _resolve_model(base_dir, data["base_model"], source, "base_model", hub_config,
                          hub_records)
    top_options = _storage_options(data.get("storage_options"), source, "storage_options")
    model_options: dict[str, dict[str, Any]] = {}  # per-model storage_options, by source

    global_raw = data.get("parameters") or {}
    if not isinstance(global_raw, dict):
        raise _err(source, "parameters", "expected a mapping")
    allowed_model = _MODEL_PARAMS[method]
    defaults = _GLOBAL_DEFAULTS[method]
    glob: dict[str, Any] = {}
    model_defaults: dict[str, Any] = {}
    for name, value in global_raw.items():
        key = f"parameters.{name}"
        if name in _IGNORED_PARAMS:
            continue
        if name in defaults:
            glob[name] = _check_param(source, key, name, value)
        elif name in allowed_model:
            model_defaults[name] = _check_param(source, key, name, value)
        else:
            raise _err(source, key, f"unknown parameter for {method}")
    for name, default in defaults.items():
        if name not in glob:
            if default is None:
                raise _err(source, f"parameters.{name}", f"required by {method}")
            glob[name] = default

    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _err(source, "models", "expected a non-empty list of {model: PATH, parameters: {...}}")
    experts: list[ModelEntry] = []
    base_weight: float | None = None
    for k, entry in enumerate(models):
        key = f"models[{k}]"
        if not isinstance(entry, dict) or "model" not in entry:
            raise _err(source, key, "expected a mapping with a 'model' path")
        extra = set(entry) - {"model", "parameters", "storage_options"}
        if extra:
            raise _err(source, f"{key}.{sorted(extra)[0]}", "not supported")
        mpath = _resolve_model(base_dir, entry["model"], source, f"{key}.model", hub_config,
                               hub_records)
        if "storage_options" in entry:
            model_options[mpath] = _storage_options(entry["storage_options"], source,
                                                    f"{key}.storage_options")
        params_raw = entry.get("parameters") or {}
        if not isinstance(params_raw, dict):
            raise _err(source, f"{key}.parameters", "expected a mapping")
        if mpath == base:
            # The base listed among the models: for linear it joins the weighted sum (with its
            # own weight, else the global default weight, as mergekit does); for the
            # delta-based methods it is simply the base.
            if method == "linear":
                wb = params_raw.get("weight", model_defaults.get("weight"))
                if wb is not None:
                    base_weight = _check_param(source, f"{key}.parameters.weight", "weight", wb)
            continue
        params: dict[str, Any] = {}
        for name, value in params_raw.items():
            pkey = f"{key}.parameters.{name}"
            if name in _IGNORED_PARAMS:
                continue
            if name not in allowed_model:
                raise _err(source, pkey, f"unknown parameter for {method} (per-model parameters: "
                           f"{', '.join(allowed_model) or 'none'})")
            params[name] = _check_param(source, pkey, name, value)
        for name in allowed_model:
            if name not in params:
                if name in model_defaults:
                    params[name] = model_defaults[name]
                elif name in _MODEL_DEFAULTS:
                    params[name] = _MODEL_DEFAULTS[name]
                else:
                    raise _err(source, f"{key}.parameters.{name}", f"required by {method}")
        experts.append(ModelEntry(mpath, params))
    if not experts:
        raise _err(source, "models", "no expert besides the base model")
    if len({e.path for e in experts}) != len(experts):
        raise _err(source, "models", "the same model is listed twice")
    if method == "linear" and glob.get("normalize"):
        total = (base_weight or 0.0) + sum(e.parameters["weight"] for e in experts)
        if total == 0:
            raise _err(source, "models", "linear with normalize: the weights sum to zero")
    if method == "slerp" and len(experts) != 1:
        raise _err(source, "models", f"slerp merges the base with exactly one model, got "
                   f"{len(experts)}")

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
    if method == "slerp" and not budget.is_full:
        raise _err(source, "budget", "slerp has no base deltas to skip; it needs budget: full")
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
                             "manifest")
    cache = data.get("cache") or {}
    if not isinstance(cache, dict) or set(cache) - {"memory", "dir"}:
        raise _err(source, "cache", "expected a mapping with 'memory' (a size) and/or 'dir'")
    try:
        cache_memory = parse_size(cache["memory"], "cache.memory") if "memory" in cache else None
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    cache_dir = _resolve_path(base_dir, cache["dir"], source, "cache.dir") if "dir" in cache else None

    models_raw: list[dict[str, Any]] = [{"model": e.path, "parameters": dict(e.parameters)}
                                        for e in experts]
    if base_weight is not None:
        models_raw.insert(0, {"model": base, "parameters": {"weight": base_weight}})
    for entry_raw in models_raw:
        if entry_raw["model"] in model_options:
            entry_raw["storage_options"] = redact_options(model_options[entry_raw["model"]])
        entry_raw["model"] = hub_records.get(entry_raw["model"], entry_raw["model"])
    remote_settings = _remote_settings(data.get("remote"), source)
    remote_sources = {
        p: RemoteOptions(_options_for(p, top_options, model_options.get(p, {})),
                         **remote_settings)
        for p in [base, *(e.path for e in experts)] if "://" in p
    }
    raw = {  # a valid spec again (replay re-parses it), with every default filled in
        "merge_method": method,
        "base_model": hub_records.get(base, base),
        "models": models_raw,
        "parameters": glob,
        "out_dtype": OUT_DTYPE_NAMES.get(out_dtype) if out_dtype else None,
        "budget": budget.describe(),
        "block_size": block_size,
    }
    if "storage_options" in data:  # redacted: credentials never reach a manifest or a log
        raw["storage_options"] = redact_options(top_options)
    if "remote" in data:
        raw["remote"] = {"coalesce_gap": remote_settings["gap_bytes"],
                         "concurrency": remote_settings["concurrency"],
                         "retries": remote_settings["retries"]}
    return Spec(source, method, base, tuple(experts), base_weight, glob, out_dtype, budget,
                block_size, index_dir, cache_memory, cache_dir, manifest, raw, remote_sources)


# -- remote sources -----------------------------------------------------------------------------
REDACTED = "<redacted>"
#: storage_options keys whose values are kept in ``Spec.raw`` (everything else is redacted).
_PUBLIC_OPTIONS = frozenset({
    "endpoint_url", "region_name", "anon", "use_ssl", "requester_pays", "version_aware",
    "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions",
    "max_concurrency", "client_kwargs", "config_kwargs", "s3", "addressing_style",
    "signature_version", "block_size", "simple_links", "same_scheme", "size_policy", "encoded",
    "retries", "connect_timeout", "read_timeout", "auto_mkdir",
})
#: Top-level storage_options keys that scope a mapping to one protocol (http also covers https).
_PROTOCOL_KEYS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https",
                            "file", "hf", "memory"})


def _check_url(value: str, source: str, key: str) -> str:
    parts = urlsplit(value)
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme or "") or not (
            parts.netloc or parts.path.strip("/")):
        raise _err(source, key, f"not a valid URL: {value}")
    if "@" in parts.netloc:  # never echo the URL: it holds credentials
        raise _err(source, key, "credentials in a URL are refused (they would be recorded); "
                   "give them in storage_options or the environment")
    if parts.query or parts.fragment:
        raise _err(source, key, "a source URL may not have a query string or fragment "
                   "(signed URLs are not supported; give credentials in storage_options)")
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost")
                                   or not parts.path.startswith("/")):
        raise _err(source, key, f"a file:// URL needs an absolute path (file:///...): {value}")
    return value.rstrip("/")


def _storage_options(value: Any, source: str, key: str) -> dict[str, Any]:
    """Validate a storage_options mapping (values are not echoed: they may be secrets)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _err(source, key, "expected a mapping of fsspec storage options")
    return _drop_redacted(value)


def _drop_redacted(value: dict[str, Any]) -> dict[str, Any]:
    """A recorded (redacted) spec re-parsed: redacted values come from the environment again."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, dict):
            v = _drop_redacted(v)
        if v != REDACTED:
            out[k] = v
    return out


def redact_options(value: Mapping[str, Any]) -> dict[str, Any]:
    """A copy safe to record: only known non-secret keys keep their values (deny by default)."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, Mapping) and (k in _PUBLIC_OPTIONS or k in _PROTOCOL_KEYS):
            out[k] = redact_options(v)
        elif k in _PUBLIC_OPTIONS and not isinstance(v, Mapping):
            out[k] = _redact_userinfo(v) if isinstance(v, str) else v
        else:
            out[k] = REDACTED
    return out


def _redact_userinfo(text: str) -> str:
    parts = urlsplit(text) if "://" in text else None
    if parts is None or "@" not in parts.netloc:
        return text
    return parts._replace(netloc=f"{REDACTED}@{parts.netloc.rsplit('@', 1)[1]}").geturl()


def _options_for(url: str, top: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """Options of one source: top-level ones, then its protocol's, then the model's own."""
    protocol = url.split("://", 1)[0]
    scopes = {protocol, "http"} if protocol == "https" else {protocol}
    out = {k: v for k, v in top.items() if not (k in _PROTOCOL_KEYS and isinstance(v, dict))}
    for k in sorted(scopes):
        if isinstance(top.get(k), dict):
            out.update(top[k])
    out.update(model)
    return out


def _remote_settings(value: Any, source: str) -> dict[str, Any]:
    """The ``remote`` key: coalesce_gap (a size), concurrency (>= 1), retries (>= 0)."""
    if value is None:
        value = {}
    if not isinstance(value, dict) or set(value) - {"coalesce_gap", "concurrency", "retries"}:
        raise _err(source, "remote", "expected a mapping with coalesce_gap (a size like 1MiB), "
                   "concurrency and/or retries")
    try:
        gap = parse_size(value.get("coalesce_gap", DEFAULT_GAP_BYTES), "remote.coalesce_gap")
    except ValueError as exc:
        raise SpecError(f"{source}: {exc}") from None
    out = {"gap_bytes": gap}
    for name, default, lo in (("concurrency", DEFAULT_CONCURRENCY, 1),
                              ("retries", DEFAULT_RETRIES, 0)):
        v = value.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise _err(source, f"remote.{name}", f"expected an integer >= {lo}, got {v!r}")
        out[name] = v
    return out


def check_coordinates(base: Any, experts: Sequence[Any], limit: int = 5) -> None:
    """Every expert must have exactly the base's tensor names, shapes and dtypes; floating
    dtypes may differ (each source is decoded with its own and merged in float32, as mergekit
    promotes mixed inputs).

    ``base`` and ``experts`` are :class:`mergefs.checkpoint.Checkpoint`. Lists the first few
    differences per expert.
    """
    for ex in experts:
        diffs: list[str] = []
        for name, loc in base.tensors.items():
            other = ex.tensors.get(name)
            if other is None:
                diffs.append(f"{name}: missing")
            elif other.shape != loc.shape or (other.dtype != loc.dtype and not
                                               {other.dtype, loc.dtype} <= FLOAT_DTYPES):
                diffs.append(f"{name}: {other.dtype}{list(other.shape)} vs base "
                             f"{loc.dtype}{list(loc.shape)}")
        for name in ex.tensors:
            if name not in base.tensors:
                diffs.append(f"{name}: not in base")
        if diffs:
            more = f" (and {len(diffs) - limit} more)" if len(diffs) > limit else ""
            raise SpecError(
                f"{ex.root}: does not share the base's coordinate system ({base.root}): "
                + "; ".join(diffs[:limit]) + more
            )
