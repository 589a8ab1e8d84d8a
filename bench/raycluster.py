"""A real Ray cluster on 127.0.0.1 for tests and benchmarks: a head node and worker nodes, each a
``ray start --block`` process of its own, started here and stopped here.

Every node runs in a session (process group) of its own, and :meth:`LocalRayCluster.stop` ends
exactly those groups (SIGTERM, then SIGKILL): never ``ray stop``, which ends every Ray process of
the machine, other users' included. Each node gets explicit free ports and ``--num-cpus`` (1 by
default): the test machines have 2 cores shared between several users. This module does not
import mergefs or ray (the ``ray`` command of the running interpreter's environment is used).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _die_with_parent() -> None:
    """In the node's process (before exec): SIGTERM when the test process dies, however it
    dies (SIGKILL, a CI timeout), so `ray start --block` stops its node instead of leaking it."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (each socket held until all are chosen: two separate
    ``free_port()`` calls can return the same port, and Ray refuses a node whose components
    share one)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_command() -> str | None:
    near = Path(sys.executable).with_name("ray")
    return str(near) if near.is_file() else shutil.which("ray")


class LocalRayCluster:
    """``nodes`` Ray nodes (the first is the head) with ``cpus`` CPUs each. ``env`` is added to
    the nodes' environment (their workers inherit it). ``address`` is ``127.0.0.1:<port>``."""

    def __init__(self, nodes: int = 2, cpus: int = 1, env: dict[str, str] | None = None,
                 object_store_bytes: int = 80 << 20) -> None:
        self.nodes, self.cpus = nodes, cpus
        # token auth off whatever ~/.ray holds (a local `ray.init` writes ~/.ray/auth_token,
        # and every later `ray start` would then demand it): the driver sets the same
        self.env = {**os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "disabled"}
        self.object_store_bytes = object_store_bytes
        # Short: Ray puts Unix sockets under it (at most 107 bytes per path).
        self.temp_dir = tempfile.mkdtemp(prefix="mfray", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def _start_node(self, head: bool) -> None:
        ray = ray_command()
        assert ray is not None
        k = len(self.procs)
        ports = free_ports(7)
        while self.port in ports:  # the head's port, chosen before: not again
            ports = free_ports(7)
        cmd = [ray, "start", "--block", f"--num-cpus={self.cpus}", "--num-gpus=0",
               f"--object-store-memory={self.object_store_bytes}", "--disable-usage-stats",
               "--node-ip-address=127.0.0.1",
               f"--dashboard-agent-listen-port={ports[0]}",
               f"--dashboard-agent-grpc-port={ports[1]}",
               f"--metrics-export-port={ports[2]}",
               f"--runtime-env-agent-port={ports[3]}",
               f"--node-manager-port={ports[4]}", f"--object-manager-port={ports[5]}"]
        if head:
            cmd += ["--head", f"--port={self.port}", "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}"]
        else:
            cmd += [f"--address={self.address}"]
        with open(Path(self.temp_dir) / f"node{k}.log", "wb") as log:
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True,
                                               preexec_fn=_die_with_parent))

    def start(self, timeout_s: float = 60.0, attempts: int = 3) -> LocalRayCluster:
        """Start the nodes and wait until every one has joined (raises, after stopping, if not).
        A node that exits because a port it was given is taken (by a port Ray picked itself, or
        another program) is started again on new ports, up to ``attempts`` times in all."""
        for attempt in range(attempts):
            try:
                self._start_node(head=True)
                self._wait_nodes(1, timeout_s)
                for _ in range(self.nodes - 1):
                    self._start_node(head=False)
                self._wait_nodes(self.nodes, timeout_s)
                return self
            except RuntimeError as exc:
                self.stop()
                if "port number" not in str(exc) or attempt == attempts - 1:
                    raise
                self.procs = []
                self.temp_dir = tempfile.mkdtemp(prefix="mfray", dir="/tmp")
                self.port = free_port()
                self.address = f"127.0.0.1:{self.port}"
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        """Wait until the first ``n`` nodes say they started (``ray start`` logs it once the
        node has joined the cluster)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a ray node exited ({p.returncode}): {self.logs()}")
            up = 0
            for k in range(n):
                log = Path(self.temp_dir) / f"node{k}.log"
                up += log.is_file() and "Ray runtime started" in log.read_text(errors="replace")
            if up >= n:
                return
            time.sleep(0.25)
        raise RuntimeError(f"ray cluster: {n} nodes not up in {timeout_s:.0f}s: {self.logs()}")

    def logs(self) -> str:
        out = []
        for k in range(len(self.procs)):
            p = Path(self.temp_dir) / f"node{k}.log"
            if p.is_file():
                out.append(p.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    def session_pids(self) -> list[int]:
        """Processes still running in the nodes' sessions (what :meth:`stop` ends)."""
        sids = {p.pid for p in self.procs}
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.getsid(int(d.name)) not in sids:
                    continue
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":  # a zombie has ended (reaping it is its new parent's job)
                pids.append(int(d.name))
        return pids

    def stop(self, grace_s: float = 3.0) -> None:
        """End every process of the nodes' sessions (their process groups, and any process of
        the sessions in another group): SIGTERM, then SIGKILL after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid in self.session_pids():  # Ray workers may sit in process groups of their own
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and self.session_pids():
                time.sleep(0.2)
            if not self.session_pids():
                break
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

