"""What every benchmark section shares, written once: the page cache (``evict``), running a
command and measuring it (``run``: wall time, peak RSS, CPU; the block device's read counter),
the machine's facts and load, the mergefs and mergekit command lines, reads of files and
mounts, timing ``from_pretrained``, and the results table (``Row``, ``Results``: text, JSON, CSV
and Markdown).

Nothing here imports mergefs: the sections measure it through its command line or import it
themselves.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import mmap
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: the repository (``bench/``'s parent): default places for results and families
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
FAMILIES = RESULTS / "families"
PY = sys.executable
#: ``-P``: never the current directory's mergefs (``python -m`` puts the cwd first on
#: sys.path); ``PYTHONPATH`` says which tree runs (:func:`children_run_this_mergefs`, or a
#: baseline's tree passed in ``env``)
MERGEFS: list[str | Path] = [PY, "-P", "-m", "mergefs.cli"]
#: spec keys mergekit does not know (stripped from the copy mergekit runs)
MERGEFS_ONLY_KEYS = ("budget", "block_size", "index_dir", "cache", "manifest", "name", "remote",
                     "sidecar", "sidecars", "decode_limit", "sweep", "variants")
#: where mergekit is installed when neither this interpreter's environment nor PATH has it
MERGEKIT_VENV = RESULTS / ".mergekit-venv"
TORCH_PIN = "torch==2.13.0"
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def children_run_this_mergefs() -> None:
    """Put the tree of the mergefs this process imports first on ``PYTHONPATH``, so that every
    command started from here (``MERGEFS``, snippets) runs the same code."""
    spec = importlib.util.find_spec("mergefs")
    if spec is None or spec.origin is None:
        return
    tree = str(Path(spec.origin).resolve().parent.parent)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != tree]
    os.environ["PYTHONPATH"] = os.pathsep.join([tree, *rest])


# --------------------------------------------------------------------------------------------
# formatting


def q(cmd: Sequence[str | Path]) -> str:
    """A shell command line, with this interpreter shown as ``python``, paths relative to the
    repository where possible, and the mergefs command line as ``mergefs``."""
    parts = []
    for c in cmd:
        s = str(c)
        if s == PY:
            s = "python"
        elif s.startswith(str(ROOT) + "/"):
            s = s[len(str(ROOT)) + 1:]
        parts.append(shlex.quote(s))
    line = " ".join(parts)
    return line.replace("python -P -m mergefs.cli", "mergefs")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# --------------------------------------------------------------------------------------------
# files, page cache, block device


def weight_files(*dirs: Path) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        out += sorted(Path(d).glob("*.safetensors"))
    return out


def evict(*paths: Path | str) -> None:
    """Drop every file under ``paths`` (files or directories) from the page cache: ``os.sync()``
    first (dirty pages cannot be dropped), then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each."""
    os.sync()
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def device_of(path: Path) -> str | None:
    """The block device (``/proc/diskstats`` name) holding ``path``."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open("/proc/diskstats") as fh:
            for line in fh:
                f = line.split()
                if int(f[0]) == major and int(f[1]) == minor:
                    return f[2]
    except OSError:
        return None
    return None


def device_read_bytes(dev: str | None) -> int | None:
    """Bytes read from block device ``dev`` so far (all processes: /proc/diskstats)."""
    if dev is None:
        return None
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if f[2] == dev:
                return int(f[5]) * 512
    return None


def read_files(files: Sequence[Path], block: int = 1 << 20, order: str = "seq",
               count: int | None = None, seed: int = 0) -> tuple[int, float]:
    """``preadv`` loops over ``files`` in ``block``-byte reads: ``seq`` reads each file to its
    end; ``random`` makes ``count`` (default 256) page-aligned reads at seeded offsets.
    Returns (bytes, seconds)."""
    buf = bytearray(block)
    fds = [(os.open(f, os.O_RDONLY), Path(f).stat().st_size) for f in files]
    n = 0
    t = time.perf_counter()
    try:
        if order == "seq":
            for fd, _ in fds:
                off = 0
                while k := os.preadv(fd, [buf], off):
                    off += k
                    n += k
        else:
            rng = random.Random(seed)
            for _ in range(count or 256):
                fd, size = rng.choice(fds)
                off = rng.randrange(0, max(1, size - block)) // 4096 * 4096
                n += os.preadv(fd, [buf], off)
    finally:
        for fd, _ in fds:
            os.close(fd)
    return n, time.perf_counter() - t


def read_mmap(files: Sequence[Path]) -> tuple[int, float]:
    """safetensors-style: map each file and copy every byte out of the map, 16 MiB at a time."""
    n = 0
    t = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
            for off in range(0, len(m), 16 << 20):
                n += len(bytes(m[off:off + (16 << 20)]))
    return n, time.perf_counter() - t


def tree_sha256(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path, read in 1 MiB reads; hidden
    entries (``.mergefs/``: which run wrote it), manifests (``*.jsonl``) and a sweep mount's
    ``variants.json`` are left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if f.startswith(".") or f.endswith(".jsonl") or \
                    (Path(dirpath) == Path(root) and f == "variants.json"):
                continue
            h = hashlib.sha256()
            with open(Path(dirpath) / f, "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
            out[(Path(dirpath) / f).relative_to(root).as_posix()] = h.hexdigest()
    return out


# --------------------------------------------------------------------------------------------
# processes


@dataclass
class Proc:
    wall: float
    rc: int
    out: str
    err: str
    maxrss_bytes: int
    cpu_seconds: float


def run(cmd: Sequence[str | Path], *, env: dict[str, str] | None = None, check: bool = True,
        timeout: float = 3600, cwd: Path | None = None) -> Proc:
    """Run a command (``env`` added to this environment); its wall time, exit code, output,
    and its own peak RSS and CPU seconds (``wait4``)."""
    full_env = {**os.environ, **(env or {})}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        p = subprocess.Popen([str(c) for c in cmd], stdout=fo, stderr=fe, env=full_env, cwd=cwd)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    res = Proc(wall, p.returncode, out, err, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime)
    if check and res.rc != 0:
        raise RuntimeError(f"command failed ({res.rc}): {q(cmd)}\n{err[-3000:]}")
    return res


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object ({} if none)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def run_py(code: str, *, check: bool = True, timeout: float = 3600,
           env: dict[str, str] | None = None) -> tuple[dict[str, Any], Proc]:
    """Run a Python snippet in a fresh interpreter (Hugging Face offline); it prints one JSON
    object last."""
    res = run([PY, "-c", textwrap.dedent(code)], check=check, timeout=timeout,
              env={**HF_OFFLINE, **(env or {})})
    return last_json(res.out), res


# --------------------------------------------------------------------------------------------
# the machine


def proc_field(path: str, key: str, conv: Callable[[str], Any]) -> Any:
    """``conv`` of the value of the first ``key: value`` line of a /proc file (None if none)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return conv(line.split(":", 1)[1].strip())
    except OSError:
        return None
    return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "kernel": platform.release(),
                            "cpus": os.cpu_count()}
    info["cpu"] = proc_field("/proc/cpuinfo", "model name", lambda v: v)
    info["ram_gib"] = proc_field("/proc/meminfo", "MemTotal",
                                 lambda v: round(int(v.split()[0]) / 2**20, 1))
    for mod in ("numpy", "torch", "transformers", "safetensors", "mergefs"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001, S112 - informative only
            continue
    return info


def load_now() -> dict[str, Any]:
    """The load average and the CPU pressure line (``/proc/pressure/cpu``) now."""
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    try:
        with open("/proc/pressure/cpu") as fh:
            out["cpu_pressure"] = fh.readline().strip()
    except OSError:
        out["cpu_pressure"] = None
    return out


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` shows them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------------------------
# mounts and loading


def mount_available() -> bool:
    """Whether ``mergefs mount`` can run here (its command, /dev/fuse, fusermount3)."""
    p = run([*MERGEFS, "mount", "--help"], check=False)
    return p.rc == 0 and os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def umount(mnt: Path, env: dict[str, str] | None = None) -> None:
    """Unmount ``mnt`` if mounted (``mergefs umount``, else a lazy ``fusermount3 -u -z``)."""
    if not os.path.ismount(mnt):
        return
    p = run([*MERGEFS, "umount", mnt], check=False, env=env)
    if p.rc != 0:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


#: times the commands (argv[1], JSON), then ``from_pretrained(argv[2])`` in bf16, and a
#: checksum of every parameter (the same weights load the same checksum)
LOAD_CODE = """
    import json, os, subprocess, sys, time
    import torch
    from transformers import AutoModelForCausalLM
    cmds = json.loads(sys.argv[1]); target = sys.argv[2]
    t0 = time.perf_counter()
    for c in cmds:
        subprocess.run(c, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    t2 = time.perf_counter()
    with torch.no_grad():
        check = float(sum(p.double().sum() for p in model.parameters()))
    print(json.dumps({"prepare": t1 - t0, "load": t2 - t1, "total": t2 - t0, "checksum": check}))
"""


def timed_load(cmds: list[list[str]], target: Path, env: dict[str, str] | None = None
               ) -> dict[str, Any]:
    """In a fresh interpreter that has imported torch and transformers: run ``cmds``, then
    ``AutoModelForCausalLM.from_pretrained(target)``; seconds of each ("prepare", "load",
    "total") and the parameters' checksum."""
    res = run([PY, "-c", textwrap.dedent(LOAD_CODE), json.dumps(cmds), str(target)],
              env={**HF_OFFLINE, **(env or {})})
    return last_json(res.out)


# --------------------------------------------------------------------------------------------
# mergekit


def mergekit_doc(doc: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A mergefs spec document as mergekit runs it: mergefs-only keys stripped, model paths
    made absolute (mergekit resolves them against its working directory, not the spec's)."""
    out = {k: v for k, v in doc.items() if k not in MERGEFS_ONLY_KEYS}
    out["base_model"] = str((folder / out["base_model"]).resolve())
    out["models"] = [{**m, "model": str((folder / m["model"]).resolve())} for m in out["models"]]
    return out


def mergekit_spec(spec: Path, suffix: str = "", **overrides: Any) -> Path:
    """Write ``<spec stem>.mergekit<suffix>.yaml`` beside ``spec`` (:func:`mergekit_doc`, then
    the keys ``overrides`` gives) and return its path."""
    doc = mergekit_doc(yaml.safe_load(spec.read_text()), spec.parent)
    doc.update(overrides)
    out = spec.with_name(f"{spec.stem}.mergekit{suffix}.yaml")
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def mergekit_cmd(exe: str | Path, mk_spec: Path, out: Path) -> list[str]:
    """``mergekit-yaml`` on a spec written by :func:`mergekit_spec`."""
    return [str(exe), str(mk_spec), str(out), "--lazy-unpickle", "--no-copy-tokenizer", "--quiet"]


def find_mergekit(install: bool = False, log: Callable[[str], None] = print) -> Path | None:
    """``mergekit-yaml`` beside this interpreter, on PATH, or in :data:`MERGEKIT_VENV`; with
    ``install``, installed into that venv (``pip install mergekit torch==2.13.0``) if none."""
    for cand in (Path(PY).parent / "mergekit-yaml", shutil.which("mergekit-yaml"),
                 MERGEKIT_VENV / "bin" / "mergekit-yaml"):
        if cand and Path(cand).exists():
            return Path(cand)
    if not install:
        return None
    log(f"installing mergekit into {MERGEKIT_VENV} (pip install mergekit {TORCH_PIN})")
    try:
        subprocess.run([PY, "-m", "venv", str(MERGEKIT_VENV)], check=True)
        subprocess.run([str(MERGEKIT_VENV / "bin" / "pip"), "install", "-q", "mergekit",
                        TORCH_PIN], check=True)
    except subprocess.CalledProcessError as exc:
        log(f"mergekit install failed: {exc}")
        return None
    exe = MERGEKIT_VENV / "bin" / "mergekit-yaml"
    return exe if exe.exists() else None


# --------------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    """One figure: what was measured, on which family, cold or warm, the result (formatted),
    the raw metrics, a comparison, a target and whether it was met, and the command."""

    section: str
    case: str
    family: str
    cache: str  # cold | warm | -
    result: str
    metrics: dict[str, Any] = field(default_factory=dict)
    versus: str = ""
    target: str = ""
    met: bool | None = None
    command: str = ""
    note: str = ""


def not_run(section: str, case: str, family: str, why: str, target: str = "") -> Row:
    return Row(section, case, family, "-", f"not run: {why}", target=target, met=None, note=why)


def markdown(headers: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def text_table(title: str, headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """The table as text (rich, when installed, else aligned columns); printed too."""
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, show_lines=False)
        for h in headers:
            t.add_column(h, overflow="fold")
        for row in body:
            t.add_row(*row)
        console = Console(width=220, record=True)
        console.print(t)
        return console.export_text()
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
        lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
        text = "\n".join(lines)
        print(text)
        return text


class Results:
    """The rows of one run, under ``<out>/<timestamp>/`` (``work/`` for scratch files), with
    the machine, the arguments and the load at the start and the end in ``raw``."""

    def __init__(self, out: str | Path, args: dict[str, Any] | None = None) -> None:
        self.out = Path(out).resolve() / time.strftime("%Y%m%d-%H%M%S")
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = self.out / "work"
        self.work.mkdir(exist_ok=True)
        self.rows: list[Row] = []
        self.raw: dict[str, Any] = {"machine": machine_info(), "args": dict(args or {}),
                                    "load_start": load_now()}

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})",
              file=sys.stderr, flush=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.log(f"{row.section} | {row.case} | {row.cache} | {row.result}"
                 + (f" | target {row.target}: {'met' if row.met else 'MISSED'}"
                    if row.met is not None else ""))

    def commands(self) -> str:
        return "\n".join(f"[{k}] {r.command}" for k, r in enumerate(self.rows, 1) if r.command)

    def write_json(self, path: Path) -> None:
        self.raw["load_end"] = load_now()
        doc = {**self.raw, "rows": [asdict(r) for r in self.rows]}
        path.write_text(json.dumps(doc, indent=1, default=str))

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["section", "case", "family", "cache", "result", "versus", "target",
                        "met", "command", "metrics"])
            for r in self.rows:
                w.writerow([r.section, r.case, r.family, r.cache, r.result, r.versus, r.target,
                            "" if r.met is None else r.met, r.command,
                            json.dumps(r.metrics, default=str)])

    def markdown(self) -> str:
        """Section, case, cold/warm, result, target (met or missed), load, command."""
        body = []
        for r in self.rows:
            status = "" if r.met is None else (" **met**" if r.met else " **missed**")
            load = r.metrics.get("load")
            body.append([r.section, r.case, r.cache, r.result + (f"; {r.versus}" if r.versus
                                                                  else ""),
                         r.target + status, "" if load is None else f"{load:.1f}",
                         f"`{r.command}`" if r.command else ""])
        return markdown(["section", "figure", "cold/warm", "result", "target", "load",
                         "command"], body)

    def write(self, title: str = "mergefs benchmarks") -> None:
        """``table.txt`` (the table, then each row's command), ``results.json``,
        ``results.csv`` and ``table.md``; prints the table and the commands."""
        headers = ["#", "section", "case", "family", "cache", "result", "versus", "target",
                   "met"]
        body = [[str(k), r.section, r.case, r.family, r.cache, r.result, r.versus, r.target,
                 "" if r.met is None else ("yes" if r.met else "MISSED")]
                for k, r in enumerate(self.rows, 1)]
        text = text_table(title, headers, body)
        cmds = self.commands()
        (self.out / "table.txt").write_text(text + "\n\ncommands:\n" + cmds + "\n")
        print("\ncommands (cold rows: sync + posix_fadvise DONTNEED on sources first):")
        print(cmds)
        self.write_json(self.out / "results.json")
        self.write_csv(self.out / "results.csv")
        (self.out / "table.md").write_text(self.markdown())
        print(f"\nresults: {self.out}")
