"""The client side of a mount: ``mergefs stats MNT`` and ``mergefs reload MNT`` (a sweep's).

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


# -- stats ---------------------------------------------------------------------------------
def _pct(a: float, b: float) -> str:
    return f"  ({100 * a / b:.1f}%)" if b else ""


def run_stats(args: argparse.Namespace) -> int:
    data = read_stats(args.mountpoint)
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    if data.get("kind") == "sweep":
        Console().print(sweep_stats_table(args, data))
        return 0

    c = data["cache"]
    read = data["physical_bytes_read"]
    table = Table(title=f"mergefs {args.mountpoint}  ({data['method']}, plan "
                        f"{data['plan_hash'][:16]})", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    full = data["base_tensor_bytes"] + data["total_expert_bytes"]
    served = data["served_bytes"]
    table.add_row("weight bytes served", f"{human_bytes(served['weights'])} (weight files: "
                  f"{human_bytes(data['weight_file_bytes'])})")
    table.add_row("  by FUSE reads",
                  human_bytes(served.get("weights_fuse_reads", served["weights"])))
    table.add_row("  by pages pushed into the page cache",
                  human_bytes(served.get("weights_pushed", 0)))
    table.add_row("source bytes read / full merge", f"{human_bytes(sum(read.values()))} of "
                  f"{human_bytes(full)}{_pct(sum(read.values()), full)}")
    table.add_row("base bytes read", f"{human_bytes(read.get('base', 0))}")
    table.add_row("expert bytes read", f"{human_bytes(data['expert_bytes_read'])} of "
                  f"{human_bytes(data['total_expert_bytes'])}"
                  f"{_pct(data['expert_bytes_read'], data['total_expert_bytes'])}")
    for label, n in sorted(read.items()):
        if label != "base":
            table.add_row(f"  {label}", human_bytes(n))
    table.add_row("expert bytes planned (budget)", f"{human_bytes(data['planned_expert_bytes'])} "
                  f"({human_bytes(data['budget_bytes'])})")
    table.add_row("units / blocks merged", f"{data['units_merged']} / {data['blocks_merged']}")
    table.add_row("cache", f"{human_bytes(c['bytes_cached'])} of {human_bytes(c['capacity_bytes'])}, "
                  f"{c['entries']} units")
    table.add_row("cache hits / misses / waits", f"{c['hits']} / {c['misses']} / {c['waits']}")
    table.add_row("cache evictions", str(c["evictions"]))
    table.add_row("merges in flight", str(c["merges_in_flight"]))
    if c["disk_hits"] or c["disk_writes"] or c["disk_corrupt"]:
        table.add_row("disk cache hits / writes / corrupt",
                      f"{c['disk_hits']} / {c['disk_writes']} / {c['disk_corrupt']}")
    table.add_row("readahead units", str(data["readahead"]["units_scheduled"]))
    table.add_row("read errors", str(data["read_errors"]))
    for e in data.get("last_errors", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(e["unix_time"]))
        table.add_row(f"  {when} {e['path']} @{e['offset']}", e["error"])
    if data.get("read_errors"):
        table.add_row("", "a reader of a mapped file gets SIGBUS on such an error: see the log "
                      "and the README")
    table.add_row("uptime", f"{data['uptime_seconds']:.1f} s")
    Console().print(table)
    return 0


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
                "served from another variant's merge"), f"read errors: {data['read_errors']}",
               "served: FUSE reads + pages pushed into the kernel page cache"]
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
