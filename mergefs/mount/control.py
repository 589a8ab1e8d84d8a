"""The client side of a sweep mount: ``mergefs reload MNT`` and the ``mergefs stats`` table.

Runs in the CLI's main thread; talks to the mount's server only through the mount itself
(``.mergefs/stats.json``) and a signal (SIGHUP).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from mergefs.core.errors import MergefsError
from mergefs.core.sizes import human_bytes
from mergefs.mount.view import STATE_DIR, STATS_NAME


def sweep_stats_table(args: argparse.Namespace, data: dict[str, Any]) -> Any:
    from rich.table import Table

    shared = data["shared"]
    read = shared["physical_bytes_read"]
    methods = {v["method"] for v in data["variants"].values()}
    table = Table(title=f"mergefs sweep {args.mountpoint}: {len(data['variants'])} variants "
                        f"({', '.join(sorted(methods))}); source bytes read for all: "
                        f"{human_bytes(sum(read.values()))}")
    for col in ("variant", "served", "units merged", "units shared", "its merges read",
                "planned expert bytes"):
        table.add_column(col, justify="left" if col == "variant" else "right",
                         overflow="fold")
    for name, v in sorted(data["variants"].items()):
        label = name if len(methods) == 1 else f"{name} ({v['method']})"
        table.add_row(label + (" (removed)" if v["removed"] else ""),
                      human_bytes(v["served_bytes"]), str(v["units_merged"]),
                      str(v["units_shared"]),
                      human_bytes(sum(v["requested_bytes_read"].values())),
                      human_bytes(v["planned_expert_bytes"]))
    sc = shared["source_cache"]
    caption = [(f"merged units: {shared['units_merged']} merged, {shared['units_shared']} "
                "served from another variant's merge"), f"read errors: {data['read_errors']}"]
    if sc:
        caption.insert(0, f"shared source cache: {human_bytes(sc['hit_bytes'])} served from "
                          f"memory, {human_bytes(sc['miss_bytes'])} read from disk")
    table.caption = "; ".join(caption)
    return table


# -- reload --------------------------------------------------------------------------------
RELOAD_WAIT_SECONDS = 300.0


def run_reload(args: argparse.Namespace) -> int:
    """Ask a sweep mount's server to re-read its spec (SIGHUP) and wait for the outcome, which
    the server publishes in stats.json (``reload``)."""
    mnt = Path(os.path.realpath(args.mountpoint))
    data = read_stats(mnt)
    if data.get("kind") != "sweep":
        raise MergefsError(f"{mnt}: not a sweep mount (mount a spec with `sweep:` or `variants:` "
                           "to add variants while mounted)")
    pid = server_pid(mnt)
    if pid is None:
        raise MergefsError(f"{mnt}: cannot find the mount's server process")
    generation = int(data["reload"]["generation"])
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_WAIT_SECONDS
    while time.monotonic() < deadline:
        state = read_stats(mnt)["reload"]
        if int(state["generation"]) > generation and state["last"] is not None:
            last = state["last"]
            if not last["ok"]:
                raise MergefsError(f"reload failed; the mount is unchanged: {last['error']}")
            added = ", ".join(last["added"]) or "none"
            print(f"mergefs: reloaded {data['spec']}: added {added}")
            if last["removed"]:
                print(f"mergefs: no longer in the spec, still served until unmounted: "
                      f"{', '.join(last['removed'])}")
            return 0
        time.sleep(0.1)
    raise MergefsError(f"{mnt}: no answer to the reload after {RELOAD_WAIT_SECONDS:.0f}s (see "
                       "the mount's log)")


# -- umount --------------------------------------------------------------------------------
def server_pid(mountpoint: Path) -> int | None:
    try:
        pid = int(json.loads((mountpoint / STATE_DIR / STATS_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"mergefs" in cmdline and pid != os.getpid() else None


# -- stats ---------------------------------------------------------------------------------
def read_stats(mountpoint: str | Path) -> dict[str, Any]:
    p = Path(mountpoint) / STATE_DIR / STATS_NAME
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise MergefsError(f"{mountpoint}: not a mergefs mount (no {STATE_DIR}/{STATS_NAME})"
                           ) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MergefsError(f"{mountpoint}: the mount's process died; run `mergefs umount "
                               f"{mountpoint}`") from None
        raise MergefsError(f"{p}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise MergefsError(f"{p}: not valid JSON: {exc}") from None
