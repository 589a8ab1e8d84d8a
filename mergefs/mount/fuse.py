"""The FUSE adapter: pyfuse3 ``Operations`` over a :class:`~mergefs.mount.view.View`, nothing more.

Read-only: anything that would modify the tree answers EROFS. Weight files open with
``keep_cache=True`` and without direct I/O (direct I/O breaks mmap, which safetensors uses), so a
second read is served by the kernel's page cache; the dynamic files under ``.mergefs/`` open with
direct I/O (their size is unknown until read). Errors are logged with their cause and mapped to
an errno here, the only module that raises ``FUSEError``: a failed merge or a changed source
(any :class:`MergefsError`) is EIO, never wrong bytes.

Thread use: the handlers run on the trio thread. ``lookup``, ``getattr``, ``readdir`` and
``statfs`` only read the view's in-memory tables; ``read`` answers from memory on the trio thread
when every byte is cached (``View.read_cached``: no lock, no copy for a range in one unit);
otherwise ``open`` and ``read`` call the view in a worker thread (``trio.to_thread.run_sync``)
under a ``trio.CapacityLimiter``. :func:`notify_store` is for worker threads only.

Importing this module needs the mount extra (pyfuse3, trio): only the serving path imports it
(``mergefs.mount.lifecycle``, after ``require_mount_extra``), never ``import mergefs``.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from mergefs.core.errors import MergefsError
from mergefs.mount.view import Attr, View

log = logging.getLogger(__name__)

T = TypeVar("T")

BLOCK = 4096
STATIC_TIMEOUT = 3600.0  # seconds the kernel may cache names and attributes of static nodes


def _fail(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)


class Operations(pyfuse3.Operations):
    """pyfuse3 handlers; each one translates to a view call and back."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, view: View, limiter: trio.CapacityLimiter) -> None:
        super().__init__()
        self.view = view
        self.limiter = limiter
        self.uid = os.getuid()
        self.gid = os.getgid()

    # -- helpers ----------------------------------------------------------------------------
    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.inode
        e.generation = 0
        timeout = 0.0 if a.dynamic else STATIC_TIMEOUT
        e.entry_timeout = timeout
        e.attr_timeout = timeout
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = self.uid
        e.st_gid = self.gid
        e.st_rdev = 0
        e.st_size = a.size_bytes
        e.st_blksize = BLOCK
        e.st_blocks = (a.size_bytes + 511) // 512
        e.st_atime_ns = a.mtime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.mtime_ns
        return e

    def _attr(self, inode: int) -> Attr:
        try:
            return self.view.attr(inode)
        except KeyError:
            raise _fail(errno.ENOENT) from None

    async def _blocking(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run view work in a worker thread; map its errors to errno (logged first)."""
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        except pyfuse3.FUSEError:
            raise
        except MergefsError as exc:
            log.error("%s: %s", what, exc)
            raise _fail(errno.EIO) from None
        except KeyError:
            raise _fail(errno.EBADF) from None
        except IsADirectoryError:
            raise _fail(errno.EISDIR) from None
        except OSError as exc:
            log.error("%s: %s", what, exc)
            raise _fail(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s: unexpected error", what)
            raise _fail(errno.EIO) from None

    # -- namespace --------------------------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None
                     ) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        if text == ".":
            return self._entry(self._attr(parent_inode))
        if text == "..":
            try:
                return self._entry(self._attr(self.view.parent_of(parent_inode)))
            except KeyError:
                raise _fail(errno.ENOENT) from None
        a = self.view.lookup(parent_inode, text)
        if a is None:
            raise _fail(errno.ENOENT)
        return self._entry(a)

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._entry(self._attr(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None  # inodes live as long as the mount

    async def opendir(self, inode: int, ctx: Any) -> int:
        if not self._attr(inode).is_dir:
            raise _fail(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self.view.readdir(fh)
        for k in range(start_id, len(entries)):
            name, a = entries[k]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(a), k + 1):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        n_nodes, size = self.view.totals()
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLOCK
        s.f_frsize = BLOCK
        s.f_blocks = (size + BLOCK - 1) // BLOCK
        s.f_bfree = 0
        s.f_bavail = 0
        s.f_files = n_nodes
        s.f_ffree = 0
        s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        self._attr(inode)
        if mode & os.W_OK:
            raise _fail(errno.EROFS)
        return True

    # -- files ------------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        a = self._attr(inode)
        if a.is_dir:
            raise _fail(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT):
            raise _fail(errno.EROFS)
        fh = await self._blocking(f"open inode {inode}", self.view.open, inode)
        if a.dynamic:
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    # pyfuse3 takes any contiguous buffer from read (PyObject_GetBuffer), its stub says bytes
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        try:  # in-memory hits are served here, without a thread hop or a copy
            data = self.view.read_cached(fh, off, size)
        except Exception:  # anything odd: take the full path, which maps errors properly
            log.debug("fast read path failed for fh %d", fh, exc_info=True)
            data = None
        if data is not None:
            return data
        return await self._blocking(f"read fh {fh} [{off}, {off + size})", self.view.read, fh,
                                    off, size)

    async def release(self, fh: int) -> None:
        self.view.release(fh)

    async def flush(self, fh: int) -> None:
        return None

    # -- everything that would write --------------------------------------------------------
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        raise _fail(errno.EROFS)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise _fail(errno.EROFS)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EROFS)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
                    ) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EROFS)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any
                      ) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EROFS)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
                   ) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EROFS)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise _fail(errno.EROFS)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        raise _fail(errno.EROFS)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        raise _fail(errno.EROFS)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None, ctx: Any
                      ) -> pyfuse3.EntryAttributes:
        raise _fail(errno.EROFS)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise _fail(errno.EROFS)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise _fail(errno.EROFS)


def notify_store(inode: int, offset: int, data: bytes | memoryview) -> None:
    """Put ``data`` into the kernel page cache of ``inode`` at ``offset`` (no reply needed).

    Worker threads only, never the trio thread: the kernel waits for locked pages, which a read
    in flight holds until the trio thread answers it (see :mod:`mergefs.mount.pages`). Raises
    ``OSError`` (ENOSYS: the kernel cannot; ENOENT: it does not know the inode now)."""
    pyfuse3.notify_store(inode, offset, data)  # type: ignore[arg-type]  # any buffer


def mount_options(allow_other: bool = False) -> set[str]:
    """Options for ``pyfuse3.init`` (never ``max_read``: libfuse 3.14 rejects it)."""
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=mergefs", "subtype=mergefs", "default_permissions", "ro"}
    if allow_other:
        opts.add("allow_other")
    return opts
