"""Where outputs go: never into a source, and a merge output appears whole or not at all.

``check_writes(spec, ...)`` refuses an output directory that is, contains or lies inside a local
source of the spec (base, experts), and an index, cache or manifest path that would write into
one, naming both paths. ``--force`` never overrides it.

``Staging`` is the output directory's lifecycle: everything is written into a temporary sibling
(``.<name>.mergefs-partial-<pid>``, same filesystem) which is renamed into place only when
complete, so the output directory is always absent, the old one, or the complete new one. With
``force`` an existing merge output is replaced as a whole (exchanged atomically with
``renameat2(RENAME_EXCHANGE)``, then the old tree removed), so no stale file survives. Only a
directory mergefs wrote (it holds ``.mergefs/merge.json``) is ever replaced; anything else must be
removed by its owner. Runs in the main thread (CLI, ``materialise``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mergefs.core.version import __version__
from mergefs.core.errors import MergefsError
from mergefs.core.process import pid_alive

log = logging.getLogger(__name__)

MARKER = ".mergefs/merge.json"  # inside a merge output: what wrote it (and lets --force replace)
_PARTIAL = ".mergefs-partial-"
_OLD = ".mergefs-old-"


class UnsafePath(MergefsError):
    """An output would overwrite or write into a source of the merge."""


def _real(p: str | Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(p)))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def local_sources(paths: Iterable[str]) -> list[Path]:
    """The local source paths (URLs and Hub ids read remotely are skipped)."""
    return [_real(p) for p in paths if "://" not in p]


def check_writes(sources: Iterable[str], outdir: str | Path | None = None,
                 **writes: str | Path | None) -> None:
    """Refuse writes that would land in a source.

    ``outdir`` may be neither a source, inside one, nor contain one (it may be replaced as a
    whole); each of ``writes`` (label -> path: index_dir, cache dir, manifest) may not be a
    source or lie inside one. Both the path as given and its real path are checked.
    """
    srcs = local_sources(sources)
    if outdir is not None:
        out = _real(outdir)
        for src in srcs:
            if _inside(out, src) or _inside(src, out):
                how = "is" if out == src else ("lies inside" if _inside(out, src)
                                               else "contains")
                raise UnsafePath(f"{outdir}: output directory {how} the source {src}; "
                                 "choose another output directory (--force never overrides this)")
    for label, path in writes.items():
        if path is None:
            continue
        target = _real(path)
        for src in srcs:
            if _inside(target, src):
                raise UnsafePath(f"{path}: the {label.replace('_', ' ')} would write into the "
                                 f"source {src}; put it elsewhere")


def check_outside(outdir: str | Path, **paths: str | Path | None) -> None:
    """Refuse inputs and records of the run that lie inside ``outdir`` (the spec, its manifest,
    index or cache): ``--force`` replaces the directory as a whole and would delete them, and
    a new output directory would not be empty when the merge ends."""
    out = _real(outdir)
    for label, path in paths.items():
        if path is None or "://" in str(path):
            continue
        if _inside(_real(path), out):
            raise UnsafePath(f"{path}: the {label.replace('_', ' ')} lies inside the output "
                             f"directory {outdir}, which the merge replaces as a whole; put it "
                             "elsewhere")


def check_source_files(outdir: str | Path, sources: Iterable[Any]) -> None:
    """Refuse an output directory that holds any file on this machine of an opened source
    (``local_files``: a recipe's role, each of its models'), e.g. a Hub snapshot whose weight
    files are symlinks into it."""
    out = _real(outdir)
    for src in sources:
        for owner, p in src.local_files():
            if _inside(_real(p), out):
                raise UnsafePath(f"{outdir}: output directory holds {_real(p)}, a file of the "
                                 f"source {owner}; choose another output directory (--force "
                                 "never overrides this)")


def _is_mountpoint(p: Path) -> bool:
    try:
        return os.path.ismount(p)
    except OSError:
        return False


def check_outdir(out: Path, force: bool) -> None:
    """Validate an output directory before any work is done (nothing is written here)."""
    if out.is_symlink():
        raise MergefsError(f"{out}: is a symlink; give the directory it points to, or a new one")
    if out.exists() and not out.is_dir():
        raise MergefsError(f"{out}: exists and is not a directory")
    if out.is_dir() and _is_mountpoint(out):
        raise MergefsError(f"{out}: is a mountpoint; mergefs writes the output beside the "
                           "directory and renames it into place, which a mountpoint cannot take: "
                           f"give a directory inside it (e.g. {out / 'merged'})")
    if out.exists() and _inside(_real(Path.cwd()), _real(out)):
        raise MergefsError(f"{out}: holds the current directory; the output is renamed into "
                           "place, so give a path outside the current directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise MergefsError(f"{out}: directory is not empty (use --force to replace it)"
                           if (out / MARKER).is_file() else
                           f"{out}: directory is not empty and not written by mergefs (no "
                           f"{MARKER}): empty it yourself or choose a new or empty directory")
    if not (out / MARKER).is_file():
        raise MergefsError(f"{out}: not empty and not written by mergefs (no {MARKER}); --force "
                           "replaces only earlier merge outputs: remove it yourself or choose "
                           "another directory")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False when unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _clean_stale(out: Path) -> None:
    """Remove temporary siblings left by merges that were killed (their pid is gone)."""
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for p in entries:
        for kind in (_PARTIAL, _OLD):
            prefix = f".{out.name}{kind}"
            if not p.name.startswith(prefix) or p.is_symlink() or not p.is_dir():
                continue
            try:
                pid = int(p.name[len(prefix):].split(".")[0])
            except ValueError:
                continue
            if pid == os.getpid() or pid_alive(pid):
                continue
            if kind == _OLD and not out.exists():  # killed between the two fallback renames
                log.warning("restoring %s from %s (an interrupted --force)", out, p)
                os.rename(p, out)
            else:
                log.info("removing %s, left by an interrupted merge (pid %d)", p, pid)
                shutil.rmtree(p, ignore_errors=True)


class Staging:
    """Write a directory's new contents beside it, then put them in place at once."""

    def __init__(self, out: str | Path, force: bool = False) -> None:
        self.out = Path(os.path.abspath(out))
        self.force = force
        self.tmp = self.out.with_name(f".{self.out.name}{_PARTIAL}{os.getpid()}")
        self.committed = False

    def __enter__(self) -> Staging:
        check_outdir(self.out, self.force)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(self.out)
        if self.tmp.exists() or self.tmp.is_symlink():
            shutil.rmtree(self.tmp) if self.tmp.is_dir() and not self.tmp.is_symlink() \
                else self.tmp.unlink()
        self.tmp.mkdir()
        return self

    def commit(self, marker: dict[str, Any]) -> None:
        """Write the marker, then rename the finished tree into place."""
        m = self.tmp / MARKER
        m.parent.mkdir(exist_ok=True)
        m.write_text(json.dumps({"mergefs_version": __version__, "created_unix": time.time(),
                                 **marker}, indent=1, sort_keys=True) + "\n")
        _fsync_dir(self.tmp)
        check_outdir(self.out, self.force)  # again: it may have changed while we merged
        if self.out.is_dir() and any(self.out.iterdir()):
            if _exchange(self.tmp, self.out):
                self.committed = True  # the new tree is in place; what follows is cleanup
                shutil.rmtree(self.tmp, ignore_errors=True)  # now the old tree
            else:  # no RENAME_EXCHANGE here (NFS, ...): two renames, undone on any failure
                old = self.out.with_name(f".{self.out.name}{_OLD}{os.getpid()}")
                os.rename(self.out, old)
                try:
                    os.rename(self.tmp, self.out)
                except BaseException:
                    os.rename(old, self.out)
                    raise
                self.committed = True
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.out)  # replaces an empty directory atomically
        _fsync_dir(self.out.parent)
        self.committed = True

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(exc: OSError, outdir: str | Path) -> MergefsError:
    """The error of a failed write of the merged model (e.g. ENOSPC), naming the output directory
    the user gave (never the hidden staging name beside it), and the file when it is another."""
    out = Path(outdir)
    where = str(out)
    name = exc.filename
    if name and _PARTIAL not in str(name) and not str(name).startswith(f"{out}/"):
        where = f"{out} ({name})"
    elif name and str(name).startswith(f"{out}/"):
        where = str(name)  # a file inside the output directory
    return MergefsError(f"{where}: cannot write the merged model: {exc.strerror}")


def _clear_temp(tmp: Path) -> None:
    """Remove whatever sits at a temporary name (a crash's leftover, or a symlink planted
    there) without following it. Weight files and the shard index are then created with
    O_EXCL ("xb"), which never writes through a symlink made in between."""
    tmp.unlink(missing_ok=True)


def _atomic_write(path: Path, chunks: list[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    try:
        _clear_temp(tmp)
        with open(tmp, "xb") as fh:
            fh.writelines(chunks)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
