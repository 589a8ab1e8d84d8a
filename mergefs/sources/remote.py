"""Remote sources: checkpoints behind fsspec URLs (``s3://``, ``https://``, ``file://``, ...).

:func:`open_remote` parses a remote model directory or ``.safetensors`` object into a
:class:`RemoteCheckpoint`, which has the interface of :class:`mergefs.sources.local.Checkpoint`:
``read_ranges`` coalesces the requested ranges of a file into runs (ranges at most
``gap_bytes`` apart share one request while the merge's gap allowance lasts,
:class:`mergefs.sources.base.GapAllowance`; the gap bytes are fetched, counted and dropped), and
fetches the runs concurrently with ranged GETs. Transient failures (5xx, 429, connection resets,
timeouts) are retried with exponential backoff; permanent ones (403, 404, ...) raise a
``SourceError`` naming the URL. A file's identity is its size, its ETag when the store sends one
and the xxh3 of its header; every ranged GET checks the ETag (``If-Match`` on S3, the response's
ETag over HTTP), so a replaced object raises ``SourceChanged`` instead of mixing versions.

Storage options (endpoint, credentials) live only in :class:`RemoteOptions` and the fsspec
filesystem; they are never logged, and never appear in an identity, a manifest or an index.

All network I/O runs on fsspec's event loop thread; the blocking entry points (``open_remote``,
``read_ranges``, :func:`read_concurrently`) may be called from any worker thread, never from the
trio thread. fsspec and the store's driver (s3fs, aiohttp) are imported only when a URL is used.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from mergefs.core import format as fmt
from mergefs.sources.base import (
    INDEX_NAME, PICKLE_SUFFIXES, SIDECAR_RE, SINGLE_NAME, AuxFile, FileIdentity, GapAllowance,
    ReadRange, TensorLoc, aux_read_only, coalesce, slice_runs,
)
from mergefs.sources.local import Checkpoint
from mergefs.core.errors import SourceChanged, SourceError
from mergefs.sources.stores import (
    ObjectInfo, RemoteCounters, RemoteDenied, RemoteNotFound, Store, make_store, retrying, run,
)
from mergefs.spec.options import RemoteOptions

__all__ = ["RemoteCheckpoint", "RemoteCounters", "RemoteDenied", "RemoteNotFound",
           "RemoteOptions", "open_remote", "read_concurrently"]

log = logging.getLogger(__name__)

PART_BYTES = 16 << 20  # a longer run is fetched as concurrent parts of at most this size
HEADER_PROBE_BYTES = 64 << 10  # first GET of a file: most safetensors headers fit
#: Non-weight files probed on stores that cannot list (HTTP), as Hugging Face repos name them.
HTTP_EXTRA_NAMES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.txt", "vocab.json", "merges.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json",
)


# -- the checkpoint ---------------------------------------------------------------------------
class RemoteCheckpoint(Checkpoint):
    """A checkpoint whose files are objects behind a URL. ``root`` is the URL (a str)."""

    is_remote = True
    reads_gap_bytes = True  # runs coalesce across gaps of up to ``options.gap_bytes``
    prefers_published_index = True  # reading it all to index it costs requests and transfer

    def __init__(self, url: str, is_dir: bool, store: Store, options: RemoteOptions,
                 files: Sequence[str], tensors: dict[str, TensorLoc],
                 headers: dict[str, fmt.Header], identities: dict[str, FileIdentity],
                 extra_files: Sequence[str], index_json: dict | None) -> None:
        super().__init__(url, files, tensors, headers, identities, extra_files,  # type: ignore[arg-type]
                         index_json)
        self.url = url
        self._is_dir = is_dir
        self.store = store
        self.options = options
        self.counters: RemoteCounters = RemoteCounters()
        self._sem: asyncio.Semaphore | None = None

    def path_of(self, file: str) -> str:  # type: ignore[override]
        return f"{self.url}/{file}" if self._is_dir else self.url

    @property
    def is_dir(self) -> bool:
        return self._is_dir

    def sibling_url(self, name: str) -> str:
        """URL of a file named ``name`` beside the weights (in the directory, or beside the file)."""
        return f"{self.url}/{name}" if self._is_dir else f"{self.url.rsplit('/', 1)[0]}/{name}"

    # -- metadata ---------------------------------------------------------------------------
    def check_unchanged(self) -> None:
        """Raise SourceChanged if any weight object's size or ETag differs from when opened."""
        async def infos() -> list[ObjectInfo]:
            return await asyncio.gather(*(self._info(self.path_of(f)) for f in self.files))

        for f, now in zip(self.files, run(self.store, infos)):
            was = self.identities[f]
            if now.size_bytes != was.size_bytes or (was.etag and now.etag != was.etag):
                raise SourceChanged(f"{self.path_of(f)}: object replaced since it was opened "
                                    f"(size {was.size_bytes} -> {now.size_bytes}, "
                                    f"ETag {was.etag} -> {now.etag})")

    def check_unchanged_for_reuse(self) -> None:
        """Nothing to check: every ranged read carries the ETag seen when it was opened
        (``If-Match``, or the response's ETag checked), so a replaced object fails the read."""

    async def _info(self, url: str) -> ObjectInfo:
        return await retrying(url, self.options, self.counters, lambda: self.store.info(url))

    async def _get(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        data = await retrying(url, self.options, self.counters,
                               lambda: self.store.get(url, start, end, etag))
        if len(data) != end - start:
            raise SourceChanged(f"{url}: short read at [{start}, {end}): got {len(data)} bytes; "
                                "the object was truncated or replaced")
        return data

    def read_extra(self, rel: str) -> bytes:
        url = f"{self.url}/{rel}"

        async def whole() -> bytes:
            info = await self._info(url)
            return await self._get(url, 0, info.size_bytes, info.etag) if info.size_bytes else b""

        return run(self.store, whole)

    def copy_extra(self, rel: str, dst: Any) -> None:
        with open(dst, "wb") as fh:
            fh.write(self.read_extra(rel))

    def read_aux(self, name: str) -> bytes | None:
        """A small file beside the weights (an index sidecar), or None if there is none."""
        url = self.sibling_url(name)

        async def whole() -> bytes | None:
            try:
                info = await self._info(url)
            except (RemoteNotFound, RemoteDenied) as exc:
                log.debug("no %s: %s", url, exc)
                return None
            return await self._get(url, 0, info.size_bytes, info.etag)

        return run(self.store, whole)

    def aux_reader(self, name: str) -> AuxFile | None:
        """A large file beside the weights (a delta sidecar) read by ranges: its URL and
        ``fetch(start, end)``, pinned to the ETag seen now (a replaced object fails the read),
        coalescing as this source's reads do; None if there is none. The sidecar counts its own
        bytes (``DeltaSidecar.bytes_read``), as for a local sidecar; the requests count in this
        source's ``requests``."""
        url = self.sibling_url(name)
        try:
            info = run(self.store, self._info, url)
        except (RemoteNotFound, RemoteDenied) as exc:
            log.debug("no %s: %s", url, exc)
            return None

        def fetch(start: int, end: int) -> bytes:
            end = min(end, info.size_bytes)
            if end <= start:
                return b""
            data: bytes = run(self.store, self._get, url, start, end, info.etag)
            return data

        return AuxFile(url, fetch=fetch, coalesce_gap_bytes=self.options.gap_bytes)

    def check_writable_aux(self, what: str, instead: str) -> None:
        """Refused on a store that cannot write (HTTP)."""
        if not self.store.writable:
            raise aux_read_only(self.root, what, instead)

    def write_aux(self, name: str, data: bytes, what: str) -> str:
        """PUT ``name`` beside the weights (one object: atomic on the store); its URL. The
        store's errors name the URL (``what`` is for local files' errors)."""
        url = self.sibling_url(name)
        run(self.store, retrying, url, self.options, self.counters,
             lambda: self.store.put(url, data))
        return url

    def local_files(self) -> list[tuple[str, Path]]:
        return []  # none on this machine

    def file_ctimes(self) -> dict[str, int]:
        return {}  # objects have no status-change time; the ETag pins them

    def extra_dir(self) -> Path | None:
        return None  # objects: read_extra fetches them

    # -- reading ----------------------------------------------------------------------------
    def will_need(self, ranges: Iterable[ReadRange]) -> None:
        """Nothing: no page cache to warm; reads are requests sent when the bytes are wanted."""

    def _fd(self, file: str) -> int:
        raise SourceError(f"{self.path_of(file)}: a remote object has no file descriptor")

    def fds(self) -> dict[str, int]:
        raise SourceError(f"{self.url}: a remote source has no file descriptors")

    def close(self) -> None:
        """Nothing to release: the fsspec filesystem (and its connections) is shared."""

    def _pread(self, file: str, start: int, end: int) -> bytes:
        return bytes(self.read_ranges([ReadRange(file, start, end)])[0])

    def read_ranges(self, ranges: Sequence[ReadRange],  # type: ignore[override]
                    gap_allowance: GapAllowance | None = None) -> list[memoryview]:
        """Read each range, in order: runs of ranges at most ``gap_bytes`` apart share one GET
        while their gaps can be taken from ``gap_allowance`` (None: no limit), and runs are
        fetched concurrently. Returns one view per requested range."""
        return run(self.store, self.read_ranges_async, list(ranges), gap_allowance)

    async def read_ranges_async(self, ranges: list[ReadRange],
                                gap_allowance: GapAllowance | None = None) -> list[memoryview]:
        runs = coalesce(ranges, self.options.gap_bytes, gap_allowance)
        bufs = await asyncio.gather(*(self._fetch_run(r.file, r.start, r.end) for r in runs))
        gap = sum((r.end - r.start) - r.covered_bytes for r in runs)
        if gap:
            self.counters.bump(gap_bytes=gap)
        return slice_runs(ranges, runs, [memoryview(b) for b in bufs])

    async def _fetch_run(self, file: str, start: int, end: int) -> bytes:
        if self._sem is None:
            self._sem = asyncio.Semaphore(max(1, self.options.concurrency))
        url = self.path_of(file)
        etag = self.identities[file].etag
        edges = list(range(start, end, PART_BYTES)) + [end]

        async def part(a: int, b: int) -> bytes:
            assert self._sem is not None
            async with self._sem:
                data = await self._get(url, a, b, etag)
            self.counters.add(len(data))
            return data

        parts = await asyncio.gather(*(part(a, b) for a, b in itertools.pairwise(edges)))
        return parts[0] if len(parts) == 1 else b"".join(parts)


def read_concurrently(requests: Sequence[tuple[Checkpoint, Sequence[ReadRange]]],
                      allowances: Sequence[GapAllowance | None] | None = None
                      ) -> list[list[memoryview]]:
    """``read_ranges`` of several remote sources at once, all requests in flight together;
    ``allowances``: per request, the allowance its gaps are taken from (None: no limit)."""
    srcs = [src for src, _ in requests]
    assert all(isinstance(s, RemoteCheckpoint) for s in srcs)
    gaps = list(allowances) if allowances is not None else [None] * len(requests)

    async def all_of() -> list[list[memoryview]]:
        return list(await asyncio.gather(*(
            src.read_ranges_async(list(ranges), gap)  # type: ignore[attr-defined]
            for (src, ranges), gap in zip(requests, gaps))))

    return run(srcs[0].store, all_of)  # type: ignore[attr-defined]


# -- opening ----------------------------------------------------------------------------------
def open_remote(url: str, options: RemoteOptions) -> RemoteCheckpoint:
    """Open a remote model directory (a prefix) or a ``.safetensors`` object; parse headers."""
    url = url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    if any(name.endswith(s) for s in PICKLE_SUFFIXES):
        raise SourceError(f"{url}: pickle checkpoints are not read (mergefs reads safetensors "
                          "only); convert it with save_pretrained(..., safe_serialization=True)")
    store = make_store(url, options.storage_options)
    t0 = time.monotonic()
    ckpt = run(store, _open_async, url, store, options)
    log.debug("opened %s: %d files, %d requests, %.2fs", url, len(ckpt.files),
              ckpt.counters.requests, time.monotonic() - t0)
    return ckpt


async def _open_async(url: str, store: Store, options: RemoteOptions) -> RemoteCheckpoint:
    counters = RemoteCounters()

    async def info(u: str) -> ObjectInfo:
        return await retrying(u, options, counters, lambda: store.info(u))

    denied: list[RemoteDenied] = []

    async def probe(u: str) -> ObjectInfo | None:
        try:
            return await info(u)
        except RemoteNotFound:
            return None
        except RemoteDenied as exc:  # a store without list rights says 403 for a missing key
            denied.append(exc)
            return None

    async def whole(u: str, inf: ObjectInfo) -> bytes:
        return await retrying(u, options, counters,
                               lambda: store.get(u, 0, inf.size_bytes, inf.etag))

    index_json: dict | None = None
    extra: list[str] = []
    if url.endswith(".safetensors"):
        is_dir, files = False, [url.rsplit("/", 1)[-1]]
        infos = {files[0]: await info(url)}
    else:
        is_dir = True
        listing = await retrying(url, options, counters, lambda: store.listing(url))
        if listing is None:  # HTTP: probe the names a model directory uses
            idx = await probe(f"{url}/{INDEX_NAME}")
            listing = {INDEX_NAME: idx} if idx is not None else {}
            if idx is None:
                single = await probe(f"{url}/{SINGLE_NAME}")
                if single is not None:
                    listing[SINGLE_NAME] = single
            if not listing and denied:
                raise denied[0]
            found = await asyncio.gather(*(probe(f"{url}/{n}") for n in HTTP_EXTRA_NAMES))
            listing.update({n: i for n, i in zip(HTTP_EXTRA_NAMES, found) if i is not None})
        elif not listing:
            raise SourceError(f"{url}: no such directory, or it is empty")
        if INDEX_NAME in listing:
            raw = await whole(f"{url}/{INDEX_NAME}", listing[INDEX_NAME])
            files, index_json = _shards_of(f"{url}/{INDEX_NAME}", raw)
            missing = [f for f in files if f not in listing]
            for f, inf in zip(missing, await asyncio.gather(*(probe(f"{url}/{f}")
                                                                for f in missing))):
                if inf is None:
                    raise SourceError(f"{url}/{INDEX_NAME}: names shard {f!r}, which does "
                                      "not exist")
                listing[f] = inf
        else:
            files = _single_weights(url, listing)
        infos = {f: listing[f] for f in files}
        extra = sorted(
            n for n in listing
            if n not in set(files) | {INDEX_NAME} and not n.endswith(".safetensors")
            and not any(n.endswith(s) for s in PICKLE_SUFFIXES)
            and not any(part.startswith(".") for part in n.split("/")))

    def file_url(f: str) -> str:
        return f"{url}/{f}" if is_dir else url

    parsed = await asyncio.gather(*(_read_header(file_url(f), infos[f], store, options, counters)
                                    for f in files))
    tensors: dict[str, TensorLoc] = {}
    headers: dict[str, fmt.Header] = {}
    identities: dict[str, FileIdentity] = {}
    for f, (header, ident) in zip(files, parsed):
        headers[f], identities[f] = header, ident
        for t in header.tensors:
            if t.name in tensors:
                raise SourceError(f"{file_url(f)}: tensor {t.name!r} also appears in "
                                  f"{tensors[t.name].file}")
            tensors[t.name] = TensorLoc(t.name, f, header.data_start + t.start,
                                        header.data_start + t.end, t.dtype, t.shape)
    if index_json is not None:
        _check_weight_map(f"{url}/{INDEX_NAME}", index_json["weight_map"], tensors)
    ckpt = RemoteCheckpoint(url, is_dir, store, options, files, tensors, headers, identities,
                            extra, index_json)
    ckpt.counters.bump(requests=counters.requests, retries=counters.retries)
    return ckpt


def _shards_of(where: str, raw: bytes) -> tuple[list[str], dict]:
    try:
        index = json.loads(raw)
    except ValueError as exc:
        raise SourceError(f"{where}: not a valid shard index: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise SourceError(f"{where}: 'weight_map' must map tensor names to file names")
    files = sorted(set(weight_map.values()))
    for f in files:
        if f.startswith("/") or ".." in f.split("/") or "://" in f:
            raise SourceError(f"{where}: shard name {f!r} escapes the model directory")
    return files, index


def _single_weights(url: str, listing: Mapping[str, ObjectInfo]) -> list[str]:
    if SINGLE_NAME in listing:
        return [SINGLE_NAME]
    top = [n for n in listing if "/" not in n]
    found = sorted(n for n in top if n.endswith(".safetensors") and not SIDECAR_RE.match(n))
    if len(found) == 1:
        return found
    pickles = sorted(n for n in top if any(n.endswith(s) for s in PICKLE_SUFFIXES))
    if pickles:
        raise SourceError(f"{url}/{pickles[0]}: pickle checkpoints are not read (mergefs reads "
                          "safetensors only); convert it with save_pretrained(..., "
                          "safe_serialization=True)")
    if found:
        raise SourceError(f"{url}: {len(found)} .safetensors files but no {INDEX_NAME} to say "
                          "how they shard")
    raise SourceError(f"{url}: no model.safetensors or {INDEX_NAME} found")


def _check_weight_map(where: str, weight_map: Mapping[str, str],
                      tensors: Mapping[str, TensorLoc]) -> None:
    for name, f in weight_map.items():
        loc = tensors.get(name)
        if loc is None:
            raise SourceError(f"{where}: names tensor {name!r}, missing from {f}")
        if loc.file != f:
            raise SourceError(f"{where}: maps {name!r} to {f}, but it is in {loc.file}")
    unlisted = sorted(set(tensors) - set(weight_map))
    if unlisted:
        raise SourceError(f"{where}: tensor {unlisted[0]!r} is in a shard but not in weight_map")


async def _read_header(url: str, info: ObjectInfo, store: Store, options: RemoteOptions,
                       counters: RemoteCounters) -> tuple[fmt.Header, FileIdentity]:
    """Parse a remote file's header with one GET (two when the header is longer than 64 KiB)."""
    size = info.size_bytes

    async def get(a: int, b: int) -> bytes:
        data = await retrying(url, options, counters, lambda: store.get(url, a, b, info.etag))
        if len(data) != b - a:
            raise SourceChanged(f"{url}: short read at [{a}, {b}): the object changed")
        return data

    try:
        prefix = await get(0, min(size, HEADER_PROBE_BYTES)) if size else b""
        n = fmt.header_length(prefix[:8], size)
        if len(prefix) < 8 + n:
            prefix += await get(len(prefix), 8 + n)
        prefix = prefix[: 8 + n]
        header = fmt.parse_file_prefix(prefix, size)
    except fmt.FormatError as exc:
        raise type(exc)(f"{url}: {exc}") from None
    ident = FileIdentity(url, size, info.mtime_ns, xxhash.xxh3_128_hexdigest(prefix), info.etag)
    return header, ident
