"""``mergefs umount``, and the kernel's mount table it reads (also for ``mergefs mount``).

``run_umount`` detaches a mount with ``fusermount3 -u``; when the mount is busy it names the
processes holding files under it (:func:`holders`, as umount(8) would find them), or detaches it
lazily with ``--lazy``; then it waits for the server to write the manifest's totals and exit.
:func:`is_mounted` and :func:`mount_device` read ``/proc/self/mountinfo`` (no request through
the mount, which may not be answering).

Runs in the CLI's main thread (or the mount's, before and after serving); no FUSE here.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mergefs.core.errors import MergefsError
from mergefs.core.process import pid_alive
from mergefs.mount.control import server_pid
from mergefs.mount.view import STATE_DIR

log = logging.getLogger(__name__)

UMOUNT_WAIT_SECONDS = 60.0


# -- the mount table -----------------------------------------------------------------------
def _unescape(field: str) -> str:
    """/proc/self/mountinfo escapes space, tab, newline and backslash as octal."""
    out, k = [], 0
    while k < len(field):
        if field[k] == "\\" and k + 3 < len(field) and field[k + 1:k + 4].isdigit():
            out.append(chr(int(field[k + 1:k + 4], 8)))
            k += 4
        else:
            out.append(field[k])
            k += 1
    return "".join(out)


def is_mounted(path: str | Path) -> bool:
    """Whether something is mounted at ``path`` (also true for a dead FUSE mount)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            return any(_unescape(line.split()[4]) == target for line in f if line.strip())
    except OSError:
        return os.path.ismount(target)


def mount_device(mountpoint: Path) -> tuple[int, int] | None:
    """The (major, minor) device of the mount at ``mountpoint``, from /proc/self/mountinfo (no
    request through the mount, which may not be answering)."""
    target = os.path.realpath(mountpoint)
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape(fields[4]) == target:
                    major, minor = fields[2].split(":")
                    found = (int(major), int(minor))  # the last one is on top
    except (OSError, ValueError):
        return None
    return found


# -- umount ----------------------------------------------------------------------------------
def holders(mountpoint: Path) -> list[tuple[int, str]]:
    """Processes using files under ``mountpoint`` (open, mapped, or as cwd/root), as umount(8)
    would find them: ``(pid, command)`` from /proc, sorted by pid. Unreadable processes (not
    ours, without root) are skipped."""
    root = str(mountpoint).rstrip("/")
    inside = (lambda p: p == root or p.startswith(root + "/"))
    found: list[tuple[int, str]] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        base = f"/proc/{pid}"
        if _uses(base, inside):
            try:
                cmd = " ".join(Path(f"{base}/cmdline").read_bytes().decode(errors="replace")
                               .replace("\0", " ").split())
                name = cmd[:80] or Path(f"{base}/comm").read_text().strip()
            except OSError:
                name = "?"
            found.append((pid, name))
    return sorted(found)


def _uses(base: str, inside: Callable[[str], bool]) -> bool:
    try:
        for link in ("cwd", "root", "exe"):
            try:
                if inside(os.readlink(f"{base}/{link}")):
                    return True
            except OSError:
                pass
        try:
            for fd in os.scandir(f"{base}/fd"):
                try:
                    if inside(os.readlink(fd.path)):
                        return True
                except OSError:
                    pass
        except OSError:
            pass
        with open(f"{base}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and inside(fields[5].rstrip("\n").removesuffix(" (deleted)")):
                    return True
    except OSError:
        return False
    return False


def _is_dead(mnt: Path) -> bool:
    try:
        os.stat(mnt / STATE_DIR)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def run_umount(args: argparse.Namespace) -> int:
    mnt = Path(os.path.realpath(args.mountpoint))
    if not is_mounted(mnt):
        raise MergefsError(f"{mnt}: not mounted")
    pid = server_pid(mnt)
    lazy_wanted = bool(getattr(args, "lazy", False))
    first = _fusermount(["-u", str(mnt)])
    if first.returncode != 0:
        dead = _is_dead(mnt)
        users = [] if dead else holders(mnt)
        if not dead and not lazy_wanted:
            if users:
                who = ", ".join(f"pid {p} ({c})" for p, c in users[:5])
                more = f" and {len(users) - 5} more" if len(users) > 5 else ""
                raise MergefsError(f"{mnt}: busy: in use by {who}{more}; close them first (a "
                                   "model loaded from the mount keeps its files mapped while "
                                   "it lives), or `mergefs umount --lazy` to detach anyway")
            raise MergefsError(f"{mnt}: cannot unmount: "
                               f"{first.stderr.strip() or 'fusermount3 failed'}")
        lazy = _fusermount(["-u", "-z", str(mnt)])
        if lazy.returncode != 0:
            raise MergefsError(f"{mnt}: cannot unmount: "
                               f"{(lazy.stderr or first.stderr).strip() or 'fusermount3 failed'}")
        if not dead:
            who = ", ".join(f"pid {p}" for p, _ in users) or "its open files"
            print(f"mergefs: detached {mnt} lazily; the server"
                  f"{f' (pid {pid})' if pid else ''} keeps serving {who} until the last user "
                  "closes, then records the manifest's totals and exits")
            return 0
        log.info("%s: its process had died: detached", mnt)
    if pid is not None:  # wait for the server to write the manifest's totals and exit
        deadline = time.monotonic() + UMOUNT_WAIT_SECONDS
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            log.warning("mount process %d still running after %.0fs", pid, UMOUNT_WAIT_SECONDS)
    print(f"mergefs: unmounted {mnt}")
    return 0


def _fusermount(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["fusermount3", *argv], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise MergefsError("fusermount3 not found (install the fuse3 package)") from None
