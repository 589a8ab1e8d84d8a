"""The mount lifecycle, in one place: ``mergefs mount``, from the checks to the last record.

``run_mount`` checks the mountpoint, makes sure the block index exists (with a progress bar),
then serves in the foreground or forks a daemon and returns once the mount answers. Serving
(:func:`serve`, a plain spec and a sweep alike: a plain spec is a sweep of one variant at the
root) opens the :class:`~mergefs.mount.session.MountSession` (its manifest is written live to
the spec's ``manifest`` path, one flushed line per record, so even a killed process leaves whole
lines), builds the cache and the :class:`~mergefs.mount.view.View`, then runs trio:
``pyfuse3.init``, a signal watcher (SIGINT/SIGTERM -> ``pyfuse3.terminate()``; SIGHUP -> a sweep
mount's reload, in a worker thread), a readiness probe, ``await pyfuse3.main()``, and
``pyfuse3.close()`` in a ``finally``. When the main loop ends (signal or external unmount) the
manifest gets its totals and is closed. ``mergefs umount`` is :mod:`mergefs.mount.umount`,
``mergefs stats`` and ``mergefs reload`` are :mod:`mergefs.mount.control` (the CLI and the API
call ``run_umount``, ``run_stats`` and ``is_mounted`` from here: ``__all__``).

The mount is an extra (``pip install 'mergefs[mount]'``: pyfuse3 and trio): this module imports
them, and the FUSE adapter (:mod:`mergefs.mount.fuse`, a subclass of ``pyfuse3.Operations``), only
in the functions that serve, so ``import mergefs``, ``mergefs umount`` and ``mergefs stats`` work
without them; :func:`run_mount` first checks that they import (:func:`require_mount_extra`: one
line saying how to install them).

Thread use: only ``_serve_fuse`` and its tasks run on the trio thread; everything else here runs
before or after trio, in the main thread. The readiness probe stats the mount from a worker thread.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mergefs.core.cache import UnitCache
from mergefs.core.errors import MergefsError
from mergefs.sources.local import Checkpoint
from mergefs.core.progress import byte_progress
from mergefs.core.sizes import human_bytes, parse_size
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.layout import OutputOptions, parse_shard_size
from mergefs.engine.merger import may_use_kernels
from mergefs.engine.output import check_writes
from mergefs.engine.session import prepare_family
from mergefs.index.blocks import BlockIndex, load_or_build
from mergefs.index.collect import register_live
from mergefs.methods import kernels
from mergefs.mount.control import run_stats
from mergefs.mount.pages import StoreFn
from mergefs.mount.session import ROOT, MountSession
from mergefs.mount.umount import is_mounted, mount_device, run_umount
from mergefs.mount.view import STATE_DIR, STATS_NAME, View
from mergefs.spec.model import Spec
from mergefs.spec.variants import Variant

__all__ = ["MOUNT_EXTRA", "MountConfig", "Opened", "check_mountpoint", "default_cache_bytes",
           "ensure_index", "forks_safely", "is_mounted", "make_config", "mount_device",
           "require_mount_extra", "run_mount", "run_stats", "run_umount", "serve",
           "set_read_ahead"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_CAP = 8 << 30
# The kernel's readahead window of the mount (its bdi) sets the size of cached-mode FUSE read
# requests: 128 KiB by default; 1-4 MiB gives 1 MiB requests (libfuse 3.14's max_pages 256) and
# a few of them in flight.
READ_AHEAD_KB = 4096
#: what ``mergefs mount`` says when pyfuse3 or trio cannot be imported (pyproject's ``mount``)
MOUNT_EXTRA = ("mergefs mount needs the mount extra: apt install fuse3 libfuse3-dev pkg-config, "
               "then pip install 'mergefs[mount]'")


def require_mount_extra() -> None:
    """Raise :class:`MergefsError` (:data:`MOUNT_EXTRA`, one line) unless pyfuse3 and trio
    import. pyfuse3 builds against libfuse3, so a missing system library fails here too."""
    try:
        import pyfuse3  # noqa: F401 - the mount extra: imported where it serves
        import trio  # noqa: F401
    except ImportError as exc:
        log.debug("cannot import the mount extra: %s", exc)
        raise MergefsError(MOUNT_EXTRA) from None


@dataclass(frozen=True)
class MountConfig:
    mountpoint: Path
    cache_bytes: int
    cache_dir: Path | None
    allow_other: bool
    threads: int
    log_file: Path
    #: merge the whole model ahead (up to the cache size) and push it into the kernel page
    #: cache: "auto" once a reader has read several tensors (View.arm_auto_warm), "on" at mount
    #: time, "off" never
    warm: str = "auto"
    read_ahead_kb: int = READ_AHEAD_KB  # the mount's bdi readahead window; 0 leaves it alone
    readahead_units: int = 8  # units merged ahead of a sequential reader
    source_cache_bytes: int = 0  # a sweep mount's shared source-block cache; 0 disables it
    strict: bool = False  # spec keys mergekit ignores are errors (reloads too)
    #: the files served beside the weights (as ``mergefs merge`` writes them by default; a
    #: sweep's variants each carry their own resolved spec in their card)
    output: OutputOptions = field(default_factory=OutputOptions)


def spec_text(path: str) -> str | None:
    """The spec file's text, for the card's configuration (None if it cannot be read or holds
    storage_options: the card then shows the resolved spec, credentials redacted)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "storage_options" in text else text  # credentials: the redacted spec


def default_cache_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        ram = 4 << 30
    return min(ram // 4, DEFAULT_CACHE_CAP)


WARM_MODES = ("auto", "on", "off")


def warm_mode(value: object) -> str:
    """``--warm``'s value: None (not given) is "auto", True (the old flag) is "on"."""
    if value is None:
        return "auto"
    if value is True:
        return "on"
    if value is False:
        return "off"
    if value not in WARM_MODES:
        raise MergefsError(f"--warm: expected one of {', '.join(WARM_MODES)}, got {value!r}")
    return str(value)


def make_config(args: argparse.Namespace, spec: Spec) -> MountConfig:
    if getattr(args, "cache_size", None):
        try:
            cache_bytes = parse_size(args.cache_size, "--cache-size")
        except ValueError as exc:
            raise MergefsError(str(exc)) from None
    elif spec.cache_memory_bytes is not None:
        cache_bytes = spec.cache_memory_bytes
    else:
        cache_bytes = default_cache_bytes()
    cache_dir = getattr(args, "cache_dir", None) or spec.cache_dir
    source_cache_bytes = cache_bytes
    if getattr(args, "source_cache_size", None):
        try:
            source_cache_bytes = parse_size(args.source_cache_size, "--source-cache-size")
        except ValueError as exc:
            raise MergefsError(str(exc)) from None
    return MountConfig(
        mountpoint=Path(os.path.abspath(args.mountpoint)),
        cache_bytes=cache_bytes,
        cache_dir=Path(os.path.abspath(cache_dir)) if cache_dir else None,
        allow_other=bool(getattr(args, "allow_other", False)),
        threads=max(4, 2 * (os.cpu_count() or 1)),
        log_file=Path(spec.manifest).with_suffix(".log"),
        warm=warm_mode(getattr(args, "warm", None)),
        source_cache_bytes=source_cache_bytes,
        strict=bool(getattr(args, "strict", False)),
        output=_output(args),
    )


def _output(args: argparse.Namespace) -> OutputOptions:
    """The files a mount serves beside the weights: ``mergefs merge``'s output flags
    (``--out-shard-size``, ``--copy-tokenizer``, ``--write-model-card``), default as it."""
    try:
        shard_bytes = parse_shard_size(str(getattr(args, "out_shard_size", None) or "5B"))
    except ValueError as exc:
        raise MergefsError(str(exc)) from None
    return OutputOptions(shard_bytes=shard_bytes,
                         copy_tokenizer=bool(getattr(args, "copy_tokenizer", True)),
                         model_card=bool(getattr(args, "write_model_card", True)))


# -- mountpoints ---------------------------------------------------------------------------
def check_mountpoint(path: str | Path) -> Path:
    """An absolute, existing, empty directory with nothing mounted on it, or MergefsError."""
    p = Path(os.path.abspath(path))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise MergefsError(f"{p}: mountpoint does not exist (create an empty directory)") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MergefsError(f"{p}: a dead mount is still attached (its process exited); "
                               f"run `mergefs umount {p}` first") from None
        raise MergefsError(f"{p}: cannot use as mountpoint: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MergefsError(f"{p}: mountpoint is not a directory")
    if is_mounted(p):
        try:
            os.listdir(p)
            state = "already mounted"
        except OSError as exc:
            state = "a dead mount is still attached (its process exited)" \
                if exc.errno == errno.ENOTCONN else "already mounted"
        raise MergefsError(f"{p}: {state}; run `mergefs umount {p}` first")
    with os.scandir(p) as it:
        if any(True for _ in it):
            raise MergefsError(f"{p}: mountpoint is not empty")
    return p


# -- mount ---------------------------------------------------------------------------------
@dataclass
class Opened:
    """A spec's family and block index, opened once before the mount starts serving and
    handed to its session (which then owns and closes them)."""

    base: Checkpoint
    experts: list[Checkpoint]
    index: BlockIndex

    def close(self) -> None:
        for c in [self.base, *self.experts]:
            c.close()


def ensure_index(spec: Spec, progress: bool = True) -> Opened:
    """Open the family and load its block index, building it now if needed (with a progress
    bar, before the mount returns), so the session opens fast and its counters only count the
    mount's own reads. The caller closes what it gets, or hands it to :func:`serve`."""
    base, experts = prepare_family(spec)
    try:
        with byte_progress("indexing", enabled=progress) as tick:  # total: what it will read
            index, built = load_or_build(base, experts, spec.block_size, spec.index_dir, tick,
                                         on_total=tick.set_total,
                                         max_size_bytes=spec.index_max_size_bytes)
        if built:
            log.info("index built in %s", spec.index_dir)
    except BaseException:
        for c in [base, *experts]:
            c.close()
        raise
    return Opened(base, experts, index)


def forks_safely(spec: Spec) -> bool:
    """Whether the family opened before the daemon forks can be used by it: local files
    are (descriptors and parsed headers carry over); remote sources are not (their I/O runs
    on fsspec's event loop thread, which does not exist in the forked child)."""
    return not spec.remote_sources


def run_mount(args: argparse.Namespace, spec: Spec,
              variants: Sequence[tuple[Variant, Spec]] | None = None) -> int:
    """Mount ``spec``; with ``variants`` (a sweep spec's, ``spec`` the first one's), mount
    every variant as a directory of one sweep mount (:func:`serve`)."""
    require_mount_extra()
    cfg = make_config(args, spec)
    explicit = getattr(args, "manifest", None)
    if explicit:
        explicit = os.path.abspath(explicit)  # the daemon runs in /
    check_writes(spec.model_paths,
                 manifest=explicit or spec.manifest, cache_dir=cfg.cache_dir, log=cfg.log_file)
    check_mountpoint(cfg.mountpoint)
    # Validated now, created by the server at its first record (never truncating anything).
    manifest = ManifestWriter(explicit) if explicit else ManifestWriter.for_run(spec.manifest)
    opened: Opened | None = ensure_index(spec)
    if opened is not None and not args.foreground and not forks_safely(spec):
        opened.close()  # the server opens its own
        opened = None

    def serve_it(ready: Callable[[], None]) -> dict[str, Any]:
        return serve(spec, cfg, ready, manifest, opened, variants)

    what = spec.source if variants is None else f"{spec.source} ({len(variants)} variants)"
    if args.foreground:
        def ready() -> None:
            print(f"mergefs: {what} mounted at {cfg.mountpoint} (Ctrl-C or `mergefs "
                  f"umount {cfg.mountpoint}` unmounts); manifest {manifest.path}", flush=True)

        totals = serve_it(ready)
        of = f" of {human_bytes(totals['total_expert_bytes'])}" \
            if "total_expert_bytes" in totals else ""  # (a sweep's totals have no one total)
        print(f"mergefs: unmounted {cfg.mountpoint}: read {human_bytes(totals['expert_bytes_read'])}"
              f"{of} expert bytes; manifest {manifest.path}", flush=True)
        return 0
    return _daemonize(what, cfg, manifest, serve_it)


def _daemonize(what: str, cfg: MountConfig, manifest: ManifestWriter,
               serve_it: Callable[[Callable[[], None]], Any]) -> int:
    """Fork a detached server; return 0 once the mount answers, or raise its startup error."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(r)
        code = 1
        try:
            os.setsid()
            os.chdir("/")
            _redirect_output(cfg.log_file)
            serve_it(lambda: _tell(w, b"ok " + str(manifest.path).encode() + b"\n"))
            code = 0
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiting parent
            msg = str(exc) if isinstance(exc, MergefsError) else f"{type(exc).__name__}: {exc}"
            log.error("mount failed: %s", msg)
            _tell(w, b"error " + msg.encode(errors="replace") + b"\n")
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        answer = pipe.readline()
    if answer.startswith(b"ok"):
        where = answer[3:].decode(errors="replace").strip()
        print(f"mergefs: {what} mounted at {cfg.mountpoint} (pid {pid}, log "
              f"{cfg.log_file}, manifest {where}); `mergefs umount {cfg.mountpoint}` unmounts")
        return 0
    os.waitpid(pid, 0)
    text = answer.decode(errors="replace").strip()
    raise MergefsError(text[len("error "):] if text.startswith("error ")
                       else f"the mount process exited before the mount was ready "
                            f"(see {cfg.log_file})")


def _tell(fd: int, msg: bytes) -> None:
    try:
        os.write(fd, msg)
        os.close(fd)
    except OSError:
        pass


def _redirect_output(log_file: Path) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler):
            h.setFormatter(logging.Formatter("%(asctime)s mergefs[%(process)d]: %(message)s"))


def serve(spec: Spec, cfg: MountConfig, ready: Callable[[], None],
          manifest: ManifestWriter | None = None, opened: Opened | None = None,
          variants: Sequence[tuple[Variant, Spec]] | None = None) -> dict[str, Any]:
    """Mount, serve until unmounted or signalled, then finalise the manifest; returns the
    totals. ``variants``: a sweep spec's (``spec`` the first one's), each served in its own
    directory, SIGHUP (``mergefs reload``) adding those the changed spec file lists; without,
    ``spec`` is served at the root. ``opened``: the family and index :func:`ensure_index`
    opened (owned from here on)."""
    import trio  # the mount extra (require_mount_extra)

    sweep = variants is not None
    found = list(variants) if variants is not None else [(Variant(ROOT, {}, dict(spec.raw)), spec)]
    # load the compiled kernels (numba import, disk cache) on a thread from now on: the mount
    # is ready before they are (listing, config.json and headers need no merge) and the first
    # unit merged waits for them (kernels.supports); only methods with a kernel form use them
    if any(may_use_kernels(s) for _, s in found):
        kernels.start_warm_up()
    if manifest is None:
        manifest = ManifestWriter.for_run(spec.manifest)
    try:
        mount = MountSession(
            spec.source, found, manifest, sweep=sweep, strict=cfg.strict,
            source_cache_bytes=cfg.source_cache_bytes,
            family=None if opened is None else (opened.base, opened.experts),
            index=None if opened is None else opened.index,
            output=cfg.output if sweep else replace(cfg.output,
                                                    config_text=spec_text(spec.source)))
        live = register_live(spec.index_dir, mount.index.pieces)  # index gc keeps them
        try:
            cache = UnitCache(cfg.cache_bytes, cfg.cache_dir, mount.cache_namespace)
            view = View(mount, cache, readahead_units=cfg.readahead_units,
                        name=cfg.mountpoint.name)
            try:
                trio.run(_serve_fuse, view, cfg, ready)
            finally:
                view.close()
            totals = mount.finish()
        finally:
            mount.close()
            if live is not None:
                live.close()
    finally:
        manifest.close()
    stats = view.stats()
    log.info("unmounted %s: %d variants; served %d weight bytes; read %d source bytes (%d "
             "expert bytes); cache %d hits, %d misses", cfg.mountpoint, len(mount.variants),
             stats["served_bytes"]["weights"], sum(stats["physical_bytes_read"].values()),
             stats["expert_bytes_read"], stats["cache"]["hits"], stats["cache"]["misses"])
    return totals


async def _serve_fuse(view: View, cfg: MountConfig, ready: Callable[[], None]) -> None:
    import pyfuse3  # the mount extra (require_mount_extra)
    import trio

    # the adapter subclasses pyfuse3.Operations: importing it needs the extra, so only serving
    # imports it (a deferred optional dependency; fuse imports nothing of lifecycle)
    from mergefs.mount.fuse import Operations, mount_options, notify_store

    ops = Operations(view, trio.CapacityLimiter(cfg.threads))
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        try:
            pyfuse3.init(ops, str(cfg.mountpoint), mount_options(cfg.allow_other))
        except RuntimeError as exc:
            raise MergefsError(f"{cfg.mountpoint}: cannot mount: {exc}") from None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, signals, view)
                nursery.start_soon(_announce_when_ready, view, cfg, ready, notify_store)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
        finally:
            # no store may run once the session is gone; one waiting for a read that will never
            # come is released by the unmount below, which we then wait for
            drained = await trio.to_thread.run_sync(view.disable_pages, 5.0)
            if not drained:
                log.warning("a page-cache store is still waiting; aborting the connection")
                _abort_connection(cfg.mountpoint)
                await trio.to_thread.run_sync(view.disable_pages, 5.0)
            pyfuse3.close(unmount=True)


async def _watch_signals(signals: Any, view: View) -> None:
    """SIGINT/SIGTERM unmount; SIGHUP reloads a sweep mount's spec (in a worker thread: it
    opens and plans the new variants) and is ignored, logged, by any other mount."""
    import pyfuse3  # the mount extra (require_mount_extra)
    import trio

    async for signum in signals:
        if signum == signal.SIGHUP:
            if not view.mount.sweep:
                log.warning("received SIGHUP: not a sweep mount, nothing to reload")
                continue
            log.info("received SIGHUP: reloading the spec")
            await trio.to_thread.run_sync(view.reload)
            continue
        log.info("received %s: unmounting", signal.Signals(signum).name)
        # the warm-up ends first, while requests are still answered (its lookups stat files
        # through the mount: one left pending would hold the unmount)
        if not await trio.to_thread.run_sync(view.pages.stop_warm, 10.0):
            log.warning("the warm-up did not stop within 10 s; unmounting anyway")
        pyfuse3.terminate()
        return


async def _announce_when_ready(view: View, cfg: MountConfig, ready: Callable[[], None],
                               store: StoreFn) -> None:
    """Once the kernel routes requests to us (a stat through the mount): widen the mount's
    readahead window, start pushing merged units into the page cache through ``store`` (the
    adapter's ``notify_store``; and the warm-up when asked for), then call ``ready``."""
    import trio  # the mount extra (require_mount_extra)

    mountpoint = cfg.mountpoint
    await trio.to_thread.run_sync(os.stat, mountpoint / STATE_DIR / STATS_NAME)
    log.info("mounted at %s", mountpoint)
    if cfg.read_ahead_kb > 0:
        set_read_ahead(mountpoint, cfg.read_ahead_kb)
    view.enable_page_store(store)
    def lookup(rel: str) -> None:
        os.stat(mountpoint / rel)

    if cfg.warm == "on":
        view.start_warm(lookup)
        log.info("warm-up started (up to %d bytes of merged units)", view.cache.capacity_bytes)
    elif cfg.warm == "auto":
        view.arm_auto_warm(lookup)
    ready()


def set_read_ahead(mountpoint: Path, kb: int) -> bool:
    """Set the mount's readahead window (``/sys/class/bdi/<major:minor>/read_ahead_kb``; root
    only); log a line and carry on when not permitted."""
    dev = mount_device(mountpoint)
    if dev is None:
        log.info("cannot find the device of %s: readahead window left alone", mountpoint)
        return False
    path = Path(f"/sys/class/bdi/{dev[0]}:{dev[1]}/read_ahead_kb")
    try:
        before = path.read_text().strip()
        path.write_text(f"{kb}\n")
    except OSError as exc:
        log.info("cannot set %s to %d (%s): reads stay at the kernel's default request size",
                 path, kb, exc.strerror or exc)
        return False
    log.info("readahead window %s: %s -> %d KiB", path, before, kb)
    return True


def _abort_connection(mountpoint: Path) -> None:
    """Abort the FUSE connection (root): releases any kernel wait on this mount."""
    dev = mount_device(mountpoint)
    try:
        if dev is None:
            raise OSError("mount not found")
        Path(f"/sys/fs/fuse/connections/{dev[1]}/abort").write_text("1\n")
    except OSError as exc:
        log.warning("cannot abort the FUSE connection of %s: %s", mountpoint, exc)
