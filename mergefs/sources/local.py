"""Local sources: Hugging Face model directories or bare .safetensors files.

``open_local(path)`` parses every header once and yields the tensor map (name -> file,
absolute byte range, dtype, shape), the directory's non-weight files and each file's identity.
All reads of tensor bytes go through :meth:`Checkpoint.read_ranges`, which coalesces adjacent
ranges, uses ``os.pread`` and counts physical bytes per source. A source given as a URL
(``s3://``, ``https://``, ``file://``) opens as :class:`mergefs.sources.remote.RemoteCheckpoint`, the same
interface over fsspec. Thread-safe: reads may run on worker threads concurrently; nothing here may
run on the trio thread (it blocks on disk or network).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol
from pathlib import Path

import xxhash

from mergefs.core import format as fmt
from mergefs.core.errors import SourceChanged, SourceError
from mergefs.sources.base import (
    AuxFile, Counters, FileIdentity, GapAllowance, INDEX_NAME, PICKLE_SUFFIXES, ReadRange,
    SIDECAR_RE, SINGLE_NAME, TensorLoc, coalesce, slice_runs,
)

log = logging.getLogger(__name__)


def _read_header(path: Path) -> tuple[fmt.Header, FileIdentity]:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = fmt.header_length(prefix, st.st_size)
            prefix += f.read(n)
    except OSError as exc:
        raise SourceError(f"{path}: cannot read: {exc.strerror}") from None
    except fmt.FormatError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    try:
        header = fmt.parse_file_prefix(prefix, st.st_size)
    except fmt.FormatError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    ident = FileIdentity(
        str(path), st.st_size, st.st_mtime_ns, xxhash.xxh3_128_hexdigest(prefix)
    )
    return header, ident


def _refuse_pickle(path: Path) -> None:
    raise SourceError(
        f"{path}: pickle checkpoints are not read (mergefs reads safetensors only); convert it "
        "with transformers' save_pretrained(..., safe_serialization=True)"
    )


def write_beside(path: Path, data: bytes, what: str) -> None:
    """Write a file beside a source (or in the index) atomically and durably: a temporary
    name, fsync, then rename. ``what`` names the file in the error."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"{path}: cannot write the {what}: {exc.strerror}") from None


class RangeCache(Protocol):
    def read(self, src: Checkpoint, ranges: Sequence[ReadRange]) -> list[memoryview]: ...


class Checkpoint:
    """One source: tensor map, non-weight files, identities, and the only way to read bytes.

    Every source is one of these or a subclass (:mod:`mergefs.sources.remote`,
    :mod:`mergefs.sources.lora`; a recipe's role, :class:`mergefs.recipe.outputs.RoleSource`,
    has the same interface). Code outside ``sources/`` asks a source what it needs (the methods
    under "what callers ask of any source"), never which kind it is.
    """

    #: read over a network (``read_many`` batches such reads; code outside ``sources/`` asks
    #: the attributes and methods below instead)
    is_remote = False
    #: coalesced reads may fetch bytes between the requested ranges, taken from a
    #: :class:`GapAllowance` (local reads are exact preads: never)
    reads_gap_bytes = False
    #: index statistics published beside it (:meth:`read_aux`) are worth fetching instead of
    #: reading its bytes to index it (a local file is read at disk speed: no)
    prefers_published_index = False

    def __init__(
        self,
        root: Path,
        files: Sequence[str],
        tensors: dict[str, TensorLoc],
        headers: dict[str, fmt.Header],
        identities: dict[str, FileIdentity],
        extra_files: Sequence[str],
        index_json: dict | None,
    ) -> None:
        self.root = root
        self.files = tuple(files)  # weight file names, relative to root (or the bare file name)
        self.tensors = tensors
        self.headers = headers
        self.identities = identities
        self.extra_files = tuple(extra_files)
        self.index_json = index_json
        self.counters = Counters()
        #: a shared cache of source byte ranges (a sweep mount's variants read through it);
        #: None reads every range from the file
        self.range_cache: RangeCache | None = None
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()

    @property
    def name(self) -> str:
        return str(self.root)

    def path_of(self, file: str) -> Path:
        return self.root / file if self.root.is_dir() else self.root

    @property
    def is_dir(self) -> bool:
        """A model directory (True) or a bare .safetensors file (False)."""
        return self.root.is_dir()

    def read_extra(self, rel: str) -> bytes:
        """The bytes of a non-weight file (``extra_files``), e.g. config.json."""
        try:
            return (self.root / rel).read_bytes()
        except OSError as exc:
            raise SourceError(f"{self.root / rel}: cannot read: {exc.strerror}") from None

    def copy_extra(self, rel: str, dst: Path) -> None:
        """Copy a non-weight file to ``dst`` (OSError on failure, as shutil.copyfile)."""
        shutil.copyfile(self.root / rel, dst)

    def read_itemsize(self, name: str) -> int:
        """Bytes read from this source per element of tensor ``name`` (what a plan charges)."""
        return fmt.DTYPES[self.tensors[name].dtype][0]

    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def identity_json(self) -> dict[str, object]:
        return {"root": str(self.root), "files": [self.identities[f].to_json() for f in self.files]}

    def identity_key(self) -> str:
        """A short stable hash of all file identities."""
        blob = json.dumps(self.identity_json(), sort_keys=True).encode()
        return xxhash.xxh3_64_hexdigest(blob)

    def check_unchanged(self) -> None:
        """Raise SourceChanged if any weight file's size or mtime differs from when opened."""
        for f in self.files:
            ident = self.identities[f]
            try:
                st = os.stat(self.path_of(f))
            except OSError as exc:
                raise SourceChanged(f"{self.path_of(f)}: source vanished: {exc.strerror}") from None
            if st.st_size != ident.size_bytes or st.st_mtime_ns != ident.mtime_ns:
                raise SourceChanged(
                    f"{self.path_of(f)}: source changed since it was opened "
                    f"(size {ident.size_bytes} -> {st.st_size}, mtime changed: "
                    f"{st.st_mtime_ns != ident.mtime_ns})"
                )

    # -- what callers ask of any source ------------------------------------------------------
    def check_unchanged_for_reuse(self) -> None:
        """Before reusing this opened source (a worker's next task): raise SourceChanged if it
        changed in a way its reads would not notice. Local files: :meth:`check_unchanged`."""
        self.check_unchanged()

    def will_need(self, ranges: Iterable[ReadRange]) -> None:
        """Ask the kernel to start reading ``ranges`` (``POSIX_FADV_WILLNEED`` on the file:
        no wait, nothing read or counted here)."""
        fds = self.fds()
        for r in ranges:
            os.posix_fadvise(fds[r.file], r.start, r.end - r.start, os.POSIX_FADV_WILLNEED)

    def local_files(self) -> list[tuple[str, Path]]:
        """Every file on this machine this source reads or copies (weights, non-weight files),
        each with the source it belongs to as messages name it (an output directory must hold
        none of them)."""
        root = Path(self.root)
        return [(str(root), root / rel if root.is_dir() else root)
                for rel in (*self.files, *self.extra_files)]

    def file_ctimes(self) -> dict[str, int]:
        """Status-change time of every weight file on this machine, by path (``utime`` cannot
        set it back: a file rewritten in place with size, header and mtime kept shows)."""
        out: dict[str, int] = {}
        for f in self.files:
            try:
                out[str(self.path_of(f))] = os.stat(self.path_of(f)).st_ctime_ns
            except OSError:
                pass  # opening it will say what is wrong
        return out

    def extra_dir(self) -> Path | None:
        """The directory on this machine that ``extra_files`` are relative to (what a library
        that loads a model by directory reads), or None when they are not on this machine (read
        them with :meth:`read_extra`). A bare ``.safetensors`` file has none: its directory."""
        return self.root if self.is_dir else self.root.parent

    def _aux_path(self, name: str) -> Path:
        return Path(self.root) / name if self.is_dir else Path(self.root).parent / name

    def read_aux(self, name: str) -> bytes | None:
        """A small file beside the weights (an index sidecar), or None if there is none."""
        path = self._aux_path(name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceError(f"{path}: cannot read: {exc.strerror}") from None

    def aux_reader(self, name: str) -> AuxFile | None:
        """A large file beside the weights (a delta sidecar), to be read by ranges; None if
        there is none. Local: its path (read by pread)."""
        path = self._aux_path(name)
        return AuxFile(str(path), path=path) if path.is_file() else None

    def check_writable_aux(self, what: str, instead: str) -> None:
        """Raise SourceError, before any work, if ``what`` (a file, e.g. "a delta sidecar")
        cannot be written beside the weights (:meth:`write_aux`); ``instead`` says what to do.
        Local: nothing to check (a failed write says why)."""

    def write_aux(self, name: str, data: bytes, what: str) -> str:
        """Write a file named ``name`` beside the weights (atomically, :func:`write_beside`);
        returns where it went. ``what`` names it in an error."""
        path = self._aux_path(name)
        write_beside(path, data, what)
        return str(path)

    # -- reading ------------------------------------------------------------------------------
    def _fd(self, file: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(file)
            if fd is None:
                try:
                    fd = os.open(self.path_of(file), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    raise SourceError(f"{self.path_of(file)}: cannot open: {exc.strerror}") from None
                self._fds[file] = fd
            return fd

    def fds(self) -> dict[str, int]:
        return {f: self._fd(f) for f in self.files}

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _pread(self, file: str, start: int, end: int) -> bytes:
        fd = self._fd(file)
        want = end - start
        try:
            data = os.pread(fd, want, start)
            if len(data) < want:  # large or interrupted reads may come back short
                parts = [data]
                got = len(data)
                while got < want:
                    more = os.pread(fd, want - got, start + got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
        except OSError as exc:
            raise SourceError(f"{self.path_of(file)}: read failed: {exc.strerror}") from None
        self.counters.add(len(data))
        if len(data) != want:
            raise SourceChanged(
                f"{self.path_of(file)}: short read at [{start}, {end}): file was truncated"
            )
        return data

    def read_ranges(self, ranges: Iterable[ReadRange],
                    gap_allowance: GapAllowance | None = None) -> list[memoryview]:
        """Read each range, in order; adjacent or overlapping ranges of a file share one pread.

        Returns one zero-copy view per requested range, in the order given. With a
        ``range_cache``, ranges it holds are not read again (:class:`mergefs.sources.blockcache.SourceBlockCache`).
        ``gap_allowance`` is unused: local reads fetch no gap bytes (remote sources take
        theirs from it, :meth:`mergefs.sources.remote.RemoteCheckpoint.read_ranges`).
        """
        ranges = list(ranges)
        if self.range_cache is not None:
            return self.range_cache.read(self, ranges)
        return self.read_physical(ranges)

    def read_physical(self, ranges: Sequence[ReadRange]) -> list[memoryview]:
        """``read_ranges`` from the files, bypassing any range cache (counted)."""
        runs = coalesce(ranges)
        bufs = [memoryview(self._pread(run.file, run.start, run.end)) for run in runs]
        return slice_runs(ranges, runs, bufs)

    def read_tensor(self, name: str) -> memoryview:
        loc = self.tensors[name]
        return self.read_ranges([ReadRange(loc.file, loc.start, loc.end)])[0]


def _weights_of_dir(root: Path) -> tuple[list[str], dict | None]:
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as exc:
            raise SourceError(f"{index_path}: not a valid shard index: {exc}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise SourceError(f"{index_path}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for f in files:
            if Path(f).is_absolute() or ".." in Path(f).parts:
                raise SourceError(f"{index_path}: shard name {f!r} escapes the model directory")
            if not (root / f).is_file():
                raise SourceError(f"{index_path}: names shard {f!r}, which does not exist")
        return files, index
    if (root / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    found = sorted(p.name for p in root.glob("*.safetensors") if not SIDECAR_RE.match(p.name))
    if len(found) == 1:
        return found, None
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        _refuse_pickle(root / pickles[0])
    if found:
        raise SourceError(
            f"{root}: {len(found)} .safetensors files but no {INDEX_NAME} to say how they shard"
        )
    raise SourceError(f"{root}: no model.safetensors or {INDEX_NAME} found")


def open_local(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a local model directory or a bare .safetensors file and parse every header.

    Any source reference (URLs, Hub ids, LoRA adapters) opens through
    :func:`mergefs.sources.open_source`, which calls this for local paths.
    """
    root = Path(path).absolute()
    if root.suffix in PICKLE_SUFFIXES:
        _refuse_pickle(root)
    if root.is_dir():
        files, index = _weights_of_dir(root)
        extra = sorted(
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file()
            and p.name not in set(files) | {INDEX_NAME}
            and not p.name.endswith(".safetensors")
            and p.suffix not in PICKLE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
    elif root.is_file():
        if root.suffix != ".safetensors":
            raise SourceError(f"{root}: not a .safetensors file or a model directory")
        files, index, extra = [root.name], None, []
    else:
        raise SourceError(f"{root}: no such file or directory")

    tensors: dict[str, TensorLoc] = {}
    headers: dict[str, fmt.Header] = {}
    identities: dict[str, FileIdentity] = {}
    for f in files:
        p = root / f if root.is_dir() else root
        header, ident = _read_header(p)
        headers[f] = header
        identities[f] = ident
        for t in header.tensors:
            if t.name in tensors:
                raise SourceError(f"{p}: tensor {t.name!r} also appears in {tensors[t.name].file}")
            tensors[t.name] = TensorLoc(
                t.name, f, header.data_start + t.start, header.data_start + t.end, t.dtype, t.shape
            )
    if index is not None:
        weight_map = index["weight_map"]
        for name, f in weight_map.items():
            loc = tensors.get(name)
            if loc is None:
                raise SourceError(f"{root / INDEX_NAME}: names tensor {name!r}, missing from {f}")
            if loc.file != f:
                raise SourceError(
                    f"{root / INDEX_NAME}: maps {name!r} to {f}, but it is in {loc.file}"
                )
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise SourceError(
                f"{root / INDEX_NAME}: tensor {unlisted[0]!r} is in a shard but not in weight_map"
            )
    return Checkpoint(root, files, tensors, headers, identities, extra, index)


