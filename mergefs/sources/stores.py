"""Talking to object stores through fsspec: info, listing, ranged GET, PUT, retries, errors.

One :class:`Store` wraps one fsspec filesystem: :class:`S3Store` sends ranged ``GetObject``
with ``If-Match`` (so a replaced object answers 412), :class:`HttpStore` sends its own ranged
GETs on fsspec's aiohttp session (so a server that ignores ``Range`` is refused before the whole
object is downloaded, and each response's ETag is checked), and the base class serves any other
fsspec filesystem (``file://``, ``memory://``, ...). :func:`classify` maps driver exceptions to
transient failures (5xx, 429, connection resets, timeouts) or to ``SourceError``s naming the
URL; :func:`retrying` retries the transient ones with jittered exponential backoff.

The coroutines run on fsspec's event loop thread (:func:`run` bridges from worker threads; never
call it from the trio thread). fsspec and the store drivers are imported only when used.
Storage options are passed to fsspec and never logged or echoed in an error.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, TypeVar

from mergefs.sources.base import Counters
from mergefs.core.errors import SourceChanged, SourceError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RemoteCounters(Counters):
    """Counters of a remote source.

    ``bytes_read``/``reads``: bytes received and successful ranged GETs of tensor data (as for
    local sources); ``gap_bytes``: the part of ``bytes_read`` no requested range asked for;
    ``requests``: every request sent for this source (HEAD, LIST, GET; retries included);
    ``retries``: requests re-sent after a transient error.
    """

    FIELDS = ("bytes_read", "reads", "gap_bytes", "requests", "retries")

    def __init__(self) -> None:
        super().__init__()
        self.gap_bytes = 0
        self.requests = 0
        self.retries = 0

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = self.reads = self.gap_bytes = self.requests = self.retries = 0

    def bump(self, requests: int = 0, retries: int = 0, gap_bytes: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.retries += retries
            self.gap_bytes += gap_bytes


@dataclass(frozen=True)
class ObjectInfo:
    size_bytes: int
    etag: str | None
    mtime_ns: int


class Transient(Exception):
    """A failure worth retrying (internal: never escapes the remote layer)."""


class RemoteNotFound(SourceError):
    """The store says the object does not exist (404, 410)."""


class RemoteDenied(SourceError):
    """The store refuses access (401, 403)."""


def _denied(url: str, status: int | str) -> SourceError:
    return RemoteDenied(f"{url}: access denied ({status}); check credentials or "
                        "storage_options")


def _not_found(url: str, status: int | str = 404) -> SourceError:
    return RemoteNotFound(f"{url}: not found ({status})")


def _status_error(url: str, status: int, reason: str = "") -> Exception:
    if status in (401, 403):
        return _denied(url, status)
    if status in (404, 410):
        return _not_found(url, status)
    if status == 412:
        return SourceChanged(f"{url}: object replaced since it was opened (412 on If-Match)")
    if status in _TRANSIENT_STATUS or status >= 500:
        return Transient(f"{url}: HTTP {status} {reason}".rstrip())
    return SourceError(f"{url}: HTTP {status} {reason}".rstrip())


def classify(exc: BaseException, url: str) -> Exception:
    """Map a driver exception to Transient or a MergefsError naming the URL."""
    if isinstance(exc, (SourceError, Transient)):
        return exc
    if isinstance(exc, FileNotFoundError):
        return _not_found(url)
    if isinstance(exc, PermissionError):
        return _denied(url, 403)
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and "ResponseMetadata" in resp:  # botocore ClientError
            status = int(resp["ResponseMetadata"].get("HTTPStatusCode") or 0)
            code = str(resp.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412") or status == 412:
                return _status_error(url, 412)
            if status:
                return _status_error(url, status, code)
        http_status = getattr(e, "status", None)  # aiohttp ClientResponseError
        if isinstance(http_status, int) and http_status >= 400:
            return _status_error(url, http_status, str(getattr(e, "message", "")))
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)) or names & {
        "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
        "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
        "ConnectTimeoutError", "IncompleteReadError",
    }:
        return Transient(f"{url}: {type(exc).__name__}: {exc}")
    return SourceError(f"{url}: {type(exc).__name__}: {exc}")


# -- stores: one fsspec filesystem and how to talk to it ----------------------------------------
class Store:
    """Info, listing, ranged GET and PUT against one fsspec filesystem (coroutines)."""

    writable = True

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    async def info(self, url: str) -> ObjectInfo:
        self.fs.invalidate_cache(url)  # listings are cached by fsspec: always ask the store
        if getattr(self.fs, "async_impl", False):
            d = await self.fs._info(url)
        else:
            d = await asyncio.to_thread(self.fs.info, url)
        if d.get("type") == "directory":
            raise SourceError(f"{url}: is a directory, expected a file")
        return object_info(d)

    async def listing(self, url: str) -> dict[str, ObjectInfo] | None:
        """Every file under ``url`` (relative name -> info); None if the store cannot list."""
        self.fs.invalidate_cache(url)
        if getattr(self.fs, "async_impl", False):
            found = await self.fs._find(url, detail=True)
        else:
            found = await asyncio.to_thread(self.fs.find, url, detail=True)
        prefix = self.fs._strip_protocol(url).rstrip("/") + "/"
        return {name[len(prefix):]: object_info(d) for name, d in found.items()
                if name.startswith(prefix) and d.get("type", "file") == "file"}

    async def get(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        if getattr(self.fs, "async_impl", False):
            return bytes(await self.fs._cat_file(url, start=start, end=end))
        return bytes(await asyncio.to_thread(self.fs.cat_file, url, start, end))

    async def put(self, url: str, data: bytes) -> None:
        if getattr(self.fs, "async_impl", False):
            await self.fs._pipe_file(url, data)
        else:
            await asyncio.to_thread(self.fs.pipe_file, url, data)


class S3Store(Store):
    async def get(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        bucket, key, _ = self.fs.split_path(url)
        kw = {"IfMatch": etag} if etag else {}
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                      Range=f"bytes={start}-{end - 1}", **kw)
        try:
            return bytes(await resp["Body"].read())
        finally:
            resp["Body"].close()


class HttpStore(Store):
    """Plain HTTP(S) with Range requests over fsspec's aiohttp session; cannot list or write."""

    writable = False

    def _kwargs(self, extra_headers: Mapping[str, str]) -> dict[str, Any]:
        kw = dict(self.fs.kwargs)
        kw["headers"] = {**kw.get("headers", {}), **extra_headers}
        return kw

    async def info(self, url: str) -> ObjectInfo:
        session = await self.fs.set_session()
        kw = self._kwargs({"Accept-Encoding": "identity"})
        async with session.head(self.fs.encode_url(url), allow_redirects=True, **kw) as r:
            if r.status == 200 and "Content-Length" in r.headers:
                return ObjectInfo(int(r.headers["Content-Length"]), r.headers.get("ETag"),
                                  _http_mtime(r.headers.get("Last-Modified")))
            if r.status not in (200, 405, 501):
                raise _status_error(url, r.status, r.reason or "")
        # No usable HEAD: ask for one byte and read the size from Content-Range.
        kw = self._kwargs({"Range": "bytes=0-0", "Accept-Encoding": "identity"})
        async with session.get(self.fs.encode_url(url), **kw) as r:
            if r.status != 206 or "/" not in r.headers.get("Content-Range", ""):
                raise _status_error(url, r.status, r.reason or "") if r.status >= 400 else \
                    SourceError(f"{url}: server reports no size (no Content-Length on HEAD, "
                                "no Content-Range on a ranged GET)")
            return ObjectInfo(int(r.headers["Content-Range"].rsplit("/", 1)[1]),
                              r.headers.get("ETag"), _http_mtime(r.headers.get("Last-Modified")))

    async def listing(self, url: str) -> dict[str, ObjectInfo] | None:
        return None

    async def get(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        session = await self.fs.set_session()
        kw = self._kwargs({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        async with session.get(self.fs.encode_url(url), **kw) as r:
            if r.status == 200 and start != 0:
                # Reading on would download the whole object: refuse instead.
                raise SourceError(f"{url}: server ignored the Range request (HTTP 200); "
                                  "mergefs needs Range support to read planned blocks")
            if r.status not in (200, 206):
                raise _status_error(url, r.status, r.reason or "")
            got = r.headers.get("ETag")
            if etag and got and _strong(got) != _strong(etag):
                raise SourceChanged(f"{url}: object replaced since it was opened "
                                    f"(ETag {etag} -> {got})")
            if r.status == 200:
                return bytes(await r.content.readexactly(end)) if end else b""
            return bytes(await r.read())

    async def put(self, url: str, data: bytes) -> None:
        raise SourceError(f"{url}: HTTP sources are read-only; publish index sidecars where the "
                          "expert can be written (a local copy, file:// or s3://)")


def _strong(etag: str) -> str:
    return etag.removeprefix("W/")


def _http_mtime(value: str | None) -> int:
    if not value:
        return 0
    try:
        return int(parsedate_to_datetime(value).timestamp()) * 1_000_000_000
    except (TypeError, ValueError):
        return 0


def object_info(d: Mapping[str, Any]) -> ObjectInfo:
    etag = d.get("ETag") or d.get("etag")
    mtime = d.get("LastModified") or d.get("last_modified") or d.get("mtime") or d.get("updated")
    mtime_ns = 0
    timestamp = getattr(mtime, "timestamp", None)  # a datetime
    if callable(timestamp):
        mtime_ns = int(timestamp() * 1e9)
    elif isinstance(mtime, (int, float)):
        mtime_ns = int(mtime * 1e9)
    return ObjectInfo(int(d.get("size") or 0), str(etag) if etag else None, mtime_ns)


def make_store(url: str, storage_options: Mapping[str, Any]) -> Store:
    """The store for ``url``'s protocol, with fsspec's filesystem built from the options."""
    try:
        import fsspec
    except ImportError:
        raise SourceError(f"{url}: remote sources need fsspec: pip install 'mergefs[remote]'"
                          ) from None
    protocol = url.split("://", 1)[0].lower()
    try:
        fs = fsspec.filesystem(protocol, **dict(storage_options))
    except ImportError as exc:
        raise SourceError(f"{url}: {exc} (pip install 'mergefs[remote]')") from None
    except (TypeError, ValueError) as exc:
        # Never echo the options themselves: they may hold credentials.
        raise SourceError(f"{url}: invalid storage_options for {protocol}: "
                          f"{type(exc).__name__}") from None
    if protocol in ("http", "https"):
        return HttpStore(fs)
    if protocol in ("s3", "s3a"):
        return S3Store(fs)
    return Store(fs)


def event_loop(store: Store) -> asyncio.AbstractEventLoop:
    from fsspec.asyn import get_loop

    return store.fs.loop if getattr(store.fs, "async_impl", False) else get_loop()


def run(store: Store, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    from fsspec.asyn import sync

    return sync(event_loop(store), fn, *args)


class RetryPolicy(Protocol):
    @property
    def retries(self) -> int: ...  # attempts after the first one

    @property
    def backoff_seconds(self) -> float: ...  # first wait; doubled each time, jittered, <= 10 s


async def retrying(what: str, options: RetryPolicy, counters: RemoteCounters,
                    op: Callable[[], Awaitable[T]]) -> T:
    """Run ``op`` (one request), retrying transient failures with jittered exponential backoff."""
    for attempt in range(options.retries + 1):
        counters.bump(requests=1)
        try:
            return await op()
        except BaseException as exc:
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                raise
            err = classify(exc, what)
            if not isinstance(err, Transient):
                raise err from None
            if attempt == options.retries:
                raise SourceError(f"{err} (gave up after {attempt + 1} attempts)") from None
            delay = min(10.0, options.backoff_seconds * 2**attempt) * random.uniform(0.5, 1.5)
            log.warning("%s; retrying in %.2fs (attempt %d of %d)", err, delay, attempt + 2,
                        options.retries + 1)
            counters.bump(retries=1)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
