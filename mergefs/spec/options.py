"""Remote source options (fsspec storage options, concurrency, retries) and their redaction in records. Pure."""

from __future__ import annotations

import re
from urllib.parse import urlsplit
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from mergefs.core.errors import SpecError
from mergefs.core.sizes import parse_size


DEFAULT_GAP_BYTES = 1 << 20


DEFAULT_CONCURRENCY = 16


DEFAULT_RETRIES = 5


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach and read one remote source. ``storage_options`` go to fsspec as they are.

    ``gap_bytes``: ranges of a file at most this far apart share one request (while the
    merge's gap allowance lasts).
    ``concurrency``: requests in flight per source. ``retries``: attempts after the first one
    on a transient error, waiting ``backoff_seconds * 2**attempt`` (jittered, at most 10 s).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    gap_bytes: int = DEFAULT_GAP_BYTES
    concurrency: int = DEFAULT_CONCURRENCY
    retries: int = DEFAULT_RETRIES
    backoff_seconds: float = 0.2


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


def check_url(value: str, source: str, key: str) -> str:
    parts = urlsplit(value)
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme or "") or not (
            parts.netloc or parts.path.strip("/")):
        raise _spec_error(source, key, f"not a valid URL: {value}")
    if "@" in parts.netloc:  # never echo the URL: it holds credentials
        raise _spec_error(source, key, "credentials in a URL are refused (they would be recorded); "
                   "give them in storage_options or the environment")
    if parts.query or parts.fragment:
        raise _spec_error(source, key, "a source URL may not have a query string or fragment "
                   "(signed URLs are not supported; give credentials in storage_options)")
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost")
                                   or not parts.path.startswith("/")):
        raise _spec_error(source, key, f"a file:// URL needs an absolute path (file:///...): {value}")
    return value.rstrip("/")


def storage_options(value: Any, source: str, key: str) -> dict[str, Any]:
    """Validate a storage_options mapping (values are not echoed: they may be secrets)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _spec_error(source, key, "expected a mapping of fsspec storage options")
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


def options_for(url: str, top: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """Options of one source: top-level ones, then its protocol's, then the model's own."""
    protocol = url.split("://", 1)[0]
    scopes = {protocol, "http"} if protocol == "https" else {protocol}
    out = {k: v for k, v in top.items() if not (k in _PROTOCOL_KEYS and isinstance(v, dict))}
    for k in sorted(scopes):
        if isinstance(top.get(k), dict):
            out.update(top[k])
    out.update(model)
    return out


def remote_settings(value: Any, source: str) -> dict[str, Any]:
    """The ``remote`` key: coalesce_gap (a size), concurrency (>= 1), retries (>= 0)."""
    if value is None:
        value = {}
    if not isinstance(value, dict) or set(value) - {"coalesce_gap", "concurrency", "retries"}:
        raise _spec_error(source, "remote", "expected a mapping with coalesce_gap (a size like 1MiB), "
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
            raise _spec_error(source, f"remote.{name}", f"expected an integer >= {lo}, got {v!r}")
        out[name] = v
    return out


def _spec_error(source: str, key: str, message: str) -> SpecError:
    return SpecError(f"{source}: {key}: {message}")
