"""Running merges as Ray tasks (the optional ``mergefs[ray]`` extra), and what every Ray path
shares: connecting, placing tasks, checking the sources on the workers, unwrapping errors.
Index builds and delta sidecars on Ray: :mod:`mergefs.engine.ray_index`.

``mergefs merge SPEC OUT --ray [ADDRESS]`` plans on the driver as always, then runs one task per
output shard. A task opens the spec's sources itself (local paths that every node sees, or
``s3://``/``https://`` URLs read by ranges), refuses to start when any source's identity (sizes,
mtimes, ETags, header hashes) differs from what the driver opened (a source that changed
mid-run fails the run, naming it), merges exactly the units the local run merges with the same
:class:`~mergefs.engine.merger.Engine` (every block checked against the index hashes, as locally), and
writes the shard to a temporary name inside the output's staging directory
(:class:`~mergefs.engine.output.Staging`, which must lie on storage every node sees). The driver renames
each finished shard, writes the manifest records the task returns (each with an additive
``worker`` field: Ray node id and pid), adds the task's read counters to the session's, then
writes the shard index and non-weight files and commits the staging directory: so output files,
manifest records and totals are those of the local run, and nothing partial is ever left under a
final name. A task whose worker dies is retried by Ray (``max_retries``); any other failure fails
the run, its other tasks are cancelled and the staging directory is removed.

Only the driver functions here call Ray; the task bodies are plain functions of picklable
values. Blocking; never on the trio thread. The spec is sent to the tasks whole, storage options
(credentials) included: they travel inside the cluster's object store, never into a log.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mergefs.core.version import __version__
from mergefs.sources.local import Checkpoint
from mergefs.core.errors import MergefsError, SourceChanged
from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.merger import Engine
from mergefs.engine.output import Staging
from mergefs.engine.output import write_error
from mergefs.engine.session import find_deltas
from mergefs.engine.session import prepare_family
from mergefs.recipe.family import recipe_of
from mergefs.sources.base import GapAllowance

T = TypeVar("T")

log = logging.getLogger(__name__)

INSTALL_HINT = "--ray needs Ray: pip install 'mergefs[ray]'"
MAX_RETRIES = 3  # attempts after a worker process or node is lost (Ray's max_retries)
TASK_OPTIONS: dict[str, Any] = {"max_retries": MAX_RETRIES, "num_cpus": 1}
#: Fault injection for tests only: a worker that finds a file ``exit-once`` in this directory
#: (and claims it by removing it) exits mid-shard, as a lost worker would. Read on the workers,
#: never by the driver or the library's own configuration.
FAULT_DIR_ENV = "MERGEFS_RAY_FAULT_DIR"


class RayUnavailable(MergefsError):
    """Ray is not installed (the ``ray`` extra)."""


def require_ray() -> Any:
    """The ``ray`` module, or one clear error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable(INSTALL_HINT) from None
    return ray


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """An explicit ``HOST:PORT`` that nothing answers on fails here, in one line, before
    anything is opened or written (Ray itself retries for minutes)."""
    if not address or "://" in address or address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise MergefsError(f"--ray {address}: expected HOST:PORT (the head node's GCS address, "
                           "as `ray start --head` prints it)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise MergefsError(f"--ray {address}: no Ray cluster answers there ({why}); start one "
                           "with `ray start --head` or check the address") from None


def connect(address: str | None) -> Any:
    """Connect to the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else the cluster
    ``ray start`` runs on this machine, else a new local one); reuse an existing connection."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=False)
    return ray


#: how long a failed run waits for its other tasks to finish before it reports the failure
DRAIN_SECONDS = 120.0


def completed(ray: Any, tasks: dict[Any, T], what: Callable[[T], str]
              ) -> Iterator[tuple[T, Any]]:
    """``(item, result)`` of each task of ``tasks`` (object ref -> item) as it finishes; a
    failed task raises one error naming ``what(item)``, once the tasks still pending have
    finished (up to ``DRAIN_SECONDS``; their results are dropped, a merge's shard files with its
    staging directory). They are not cancelled: Ray 2.60's force-cancel of a task racing its
    own completion aborts the driver process ("Tried to complete task that was not pending",
    seen in our CI)."""
    pending = list(tasks)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        item = tasks[done[0]]
        try:
            res = ray.get(done[0])
        except (ray.exceptions.RayError, MergefsError, OSError) as exc:
            if pending:  # nothing of theirs may land after the caller cleans up
                ray.wait(pending, num_returns=len(pending), timeout=DRAIN_SECONDS)
            raise task_error(exc, what(item)) from None
        yield item, res


def refuse_unsupported(spec: Any) -> None:
    """Specs the Ray path does not run yet (their sources' counters are sums of several)."""
    if spec.sliced or spec.tokenizer is not None or spec.intermediates:
        raise MergefsError(f"{spec.source}: --ray does not run sliced, tokenizer or "
                           "multi-document merges yet; run them without --ray")


def placements(ray: Any) -> Callable[[int], Any]:
    """Task k's placement: the k-th alive node with CPUs, round robin, *soft* (a task whose
    node is gone, e.g. a retry after a node was lost, runs anywhere). Ray's own SPREAD is best
    effort: short tasks all land on the node whose workers are warm, and reads do not spread."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes()
                   if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)
    if not nodes:
        return lambda k: "DEFAULT"
    return lambda k: NodeAffinitySchedulingStrategy(nodes[k % len(nodes)], soft=True)


def worker_id() -> dict[str, Any]:
    """Who runs this task: the Ray node id and the worker's pid (the manifest's ``worker``)."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {"node": node, "pid": os.getpid()}


def identities(base: Checkpoint, experts: Sequence[Checkpoint]) -> list[dict[str, object]]:
    return [c.identity_json() for c in [base, *experts]]


def check_same_sources(expected: list[dict[str, object]], base: Checkpoint,
                       experts: Sequence[Checkpoint]) -> None:
    """Refuse sources that differ from what the driver opened, naming the first one."""
    for want, src in zip(expected, [base, *experts]):
        now = src.identity_json()
        if now != want:
            raise SourceChanged(f"{src.root}: changed since the run started (file sizes, "
                                "mtimes, ETags or headers differ on a worker); run again once "
                                "the sources are stable")


#: The family a worker process opened last, by (spec file, identities): the next task of the
#: same run reuses its parsed headers instead of re-reading every header (on S3: a LIST and a
#: GET per file and task). Tasks of one worker process run one at a time.
_OPENED: dict[str, tuple[Checkpoint, list[Checkpoint]]] = {}


def open_checked(spec: Any, expected: list[dict[str, object]]
                 ) -> tuple[Checkpoint, list[Checkpoint]]:
    """The spec's family on this worker, refused if it differs from what the driver opened.

    A family this process opened before for the same run is reused after a fresh check of what
    its reads would not notice (``check_unchanged_for_reuse``: local files' size and mtime;
    remote reads carry the opened ETag in every request).
    """

    key = json.dumps([spec.source, expected], sort_keys=True, default=str)
    got = _OPENED.get(key)
    if got is not None:
        for c in [got[0], *got[1]]:
            c.check_unchanged_for_reuse()
        return got
    base, experts = prepare_family(spec)
    try:
        check_same_sources(expected, base, experts)
    except BaseException:
        for c in [base, *experts]:
            c.close()
        raise
    _OPENED.clear()  # one family per worker process at a time
    _OPENED[key] = (base, experts)
    return base, experts


def same_version(driver: str) -> None:
    if driver != __version__:
        raise MergefsError(f"worker runs mergefs {__version__}, the driver {driver}: install "
                           "the same version on every node")


def _fault_point() -> None:
    where = os.environ.get(FAULT_DIR_ENV)
    if not where:
        return
    try:
        os.unlink(Path(where) / "exit-once")
    except FileNotFoundError:
        return
    log.warning("fault injection: worker %d exits", os.getpid())
    os._exit(17)


# -- merge: one task per output shard --------------------------------------------------------
@dataclass(frozen=True)
class MergeJob:
    """What every shard task of one merge shares (sent once through the object store)."""

    spec: Any
    index: Any
    plan: Any
    identities: list[dict[str, object]]
    staging: str
    version: str
    threads: int
    #: each task's share of the plan's gap allowance (an equal part; None: no limit), so the
    #: tasks together fetch no more gap bytes than one local merge may
    gap_share_bytes: int | None = None
    #: the output's layout (mergefs.engine.layout.OutputOptions): the tasks cut the same shards
    output: Any = None


@dataclass(frozen=True)
class ShardDone:
    """A finished shard: its temporary name in the staging directory and what it read."""

    file: str
    tmp_name: str
    hashes: dict[str, str]
    lines: list[str]  # manifest records (JSON), in the order the task made them
    counters: list[dict[str, int]]  # per source: base, then experts
    sidecar_counts: dict[int, tuple[int, int, int]]  # per expert: bytes_read, gap_bytes, reads
    gap_spent_bytes: int  # of the task's gap allowance share
    blocks_merged: int
    units_merged: int
    worker: dict[str, Any]


def merge_shard(job: MergeJob, file: str) -> ShardDone:
    """Task body: merge output file ``file`` into the staging directory (a temporary name)."""

    same_version(job.version)
    base, experts = open_checked(job.spec, job.identities)
    deltas: dict[int, Any] = {}
    try:
        if job.plan.levels is not None:
            deltas = find_deltas(base, experts, job.index, job.spec.index_dir)
        for c in [base, *experts]:  # count the merge's reads only, as the local session does
            c.counters.reset()  # (after looking for sidecars, as it does)
        records = ManifestWriter(None, keep_lines=True)
        engine = Engine(job.spec, base, experts, job.index, job.plan, records,
                        recipe=recipe_of(job.spec, base), deltas=deltas,
                        gap_allowance=GapAllowance(job.gap_share_bytes), output=job.output)
        f = next(o for o in engine.out_files if o.name == file)
        # unique across nodes and attempts (pids repeat across containers; a retry may run
        # while a node marked dead still writes)
        tmp_name = f".{f.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fired = False

        def on_bytes(_: int) -> None:
            nonlocal fired
            if not fired:  # after the first piece is written: a worker lost mid-shard
                fired = True
                _fault_point()

        with ThreadPoolExecutor(max_workers=job.threads,
                                thread_name_prefix="mergefs-merge") as pool:
            hashes = engine.write_shard(Path(job.staging) / tmp_name, f, pool, on_bytes)
        return ShardDone(file, tmp_name, hashes, list(records.lines),
                         [c.counters.snapshot() for c in [base, *experts]],
                         {i: (sc.bytes_read, sc.gap_bytes, sc.reads)
                          for i, sc in deltas.items()},
                         engine.gap_allowance.spent_bytes, engine.blocks_merged,
                         engine.units_merged, worker_id())
    finally:
        for c in [base, *experts]:
            c.close()  # its file descriptors; a reused family opens them again
        for sc in deltas.values():
            sc.close()


def task_error(exc: BaseException, what: str) -> BaseException:
    """A task's own error (a MergefsError, an OSError) rather than Ray's wrapper; any other
    failure (retries exhausted, a node lost for good) as one MergefsError naming the task."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, (MergefsError, OSError)):
        return cause
    if isinstance(exc, (MergefsError, OSError)):
        return exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return MergefsError(f"ray task for {what} failed: {first}")


def materialise(session: Any, outdir: str | Path, address: str | None = None,
                on_bytes: Callable[[int], None] | None = None, overwrite: bool = False,
                threads: int = 2) -> dict[str, str]:
    """``session.engine.materialise`` with one Ray task per output shard (module docstring).

    Returns {tensor: xxh3}; the session's counters, the engine's block counts and the manifest
    end up as the local run leaves them, so ``session.finish()`` writes the same totals.
    """

    refuse_unsupported(session.spec)
    if any(o.absent for o in session.recipe.outputs):
        raise MergefsError(f"{session.spec.source}: --ray does not run merges of optional "
                           "weights some models lack yet; run it without --ray")
    ray = connect(address)
    engine = session.engine
    hashes: dict[str, str] = {}
    staging = Staging(outdir, force=overwrite)
    try:
        with staging:
            allowed = session.plan.gap_allowance_bytes
            share = None if allowed is None else allowed // max(1, len(engine.out_files))
            job = ray.put(MergeJob(session.spec, session.index, session.plan,
                                   identities(session.base, session.experts), str(staging.tmp),
                                   __version__, threads, share, engine.output))
            task, place = ray.remote(merge_shard), placements(ray)
            files = {task.options(scheduling_strategy=place(k), **TASK_OPTIONS)
                     .remote(job, f.name): f for k, f in enumerate(engine.out_files)}
            res: ShardDone
            for f, res in completed(ray, files, lambda f: f.name):
                os.replace(staging.tmp / res.tmp_name, staging.tmp / f.name)
                _absorb(session, res)
                engine.record_tensors(f, res.hashes, hashes)
                if on_bytes is not None:
                    on_bytes(f.size_bytes - len(f.header))
            for p in staging.tmp.glob(".*.partial-*"):  # left by a worker that was lost
                p.unlink()
            engine.write_extras(staging.tmp, Path(outdir).name)
            staging.commit(engine.marker())
    except OSError as exc:
        raise write_error(exc, outdir) from None
    return hashes


def _absorb(session: Any, res: ShardDone) -> None:
    """Take a finished shard's records and counts into the driver's session."""
    engine = session.engine
    if engine.manifest is not None:
        for line in res.lines:
            engine.manifest.write({**json.loads(line), "worker": res.worker})
    for src, counts in zip([session.base, *session.experts], res.counters):
        src.counters.absorb(counts)
    for i, (n, gap, reads) in res.sidecar_counts.items():
        sc = session.deltas[i]
        sc.bytes_read += n
        sc.gap_bytes += gap
        sc.reads += reads
    engine.gap_allowance.absorb(res.gap_spent_bytes)
    engine.add_merged(res.blocks_merged, res.units_merged)
