"""Index builds and delta sidecars as Ray tasks (the ``mergefs[ray]`` extra).

``mergefs index SPEC --ray [ADDRESS]`` (also with ``--publish``, whose index sidecars are cut
from the index built so) hands each build pass's chunks (:class:`mergefs.index.build.Pass`) to :class:`RayChunkRunner`:
each task takes a run of consecutive chunks (every expert the pass reads there: the Gram pair
terms need them together), opens the family itself, refuses sources that differ from the
driver's, and computes the same pass over its chunks with the local build's code; the driver's
pass takes the columns (``Pass.put``) and stores the pieces as the local build does, so the
index is the local one.

``mergefs compress SPEC --ray`` runs one task per expert: it reads its expert and the base and
encodes the delta sidecar (:func:`mergefs.deltas.publish.encode_sidecar`); the driver writes each file
beside its expert.

Only the driver functions here call Ray; task bodies are plain functions of picklable values.
Blocking; never on the trio thread.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mergefs.core.version import __version__
from mergefs.sources.local import Checkpoint
from mergefs.core.errors import MergefsError
from mergefs.engine.ray_merge import (
    TASK_OPTIONS, completed, connect, identities, open_checked, placements, refuse_unsupported,
    same_version, worker_id,
)
from mergefs.deltas.publish import check_writable, write_sidecar
from mergefs.deltas.publish import encode_sidecar
from mergefs.deltas.reconstruct import one_blas_thread
from mergefs.index.build import BuildReport, Pass
from mergefs.sources.lora import LoraCheckpoint

log = logging.getLogger(__name__)

# -- index: one task per run of chunks ---------------------------------------------------------
RANGE_BYTES = 1 << 30  # a task reads at most about this many source bytes
TASKS_PER_CPU = 4  # enough tasks to even out unequal ones, few enough to keep overheads small


@dataclass(frozen=True)
class IndexJob:
    """One build pass to run as tasks: what to compute (the pass's own experts, pairs, known
    zero flags, whether the base is read in full) over which family."""

    spec: Any
    identities: list[dict[str, object]]  # of the spec's base and every expert
    layout: Any
    own: list[int]
    pairs: list[tuple[int, int]]
    zero_known: dict[int, Any]
    full: bool
    version: str


@dataclass(frozen=True)
class RangeDone:
    part: Any  # mergefs.index.build.PassPart
    worker: dict[str, Any]


def index_range(job: IndexJob, chunks: list[tuple[int, int]]) -> RangeDone:
    """Task body: the pass's columns over a run of consecutive chunks, computed by the local
    build's code (:meth:`mergefs.index.build.Pass.run_chunks`)."""

    same_version(job.version)
    base, experts = open_checked(job.spec, job.identities)
    try:
        p = Pass(base, experts, job.layout, job.own, job.pairs, job.zero_known, job.full, None,
                 BuildReport())
        return RangeDone(p.run_chunks(chunks), worker_id())
    finally:
        for c in [base, *experts]:
            c.close()


def chunk_groups(chunks: Sequence[tuple[int, int]], block_bytes: Any, n_tasks: int
                 ) -> list[list[tuple[int, int]]]:
    """Split chunks (in order) into ``min(n_tasks, len(chunks))`` non-empty runs of about
    equal bytes (``block_bytes``: what each block costs to read)."""
    cum = list(itertools.accumulate(int(block_bytes[b0:b1].sum()) for b0, b1 in chunks))
    n = max(1, min(n_tasks, len(chunks)))
    cuts = [0]
    for k in range(1, n):
        want = cum[-1] * k / n
        j = next((i + 1 for i in range(cuts[-1], len(chunks)) if cum[i] >= want), len(chunks))
        cuts.append(min(max(j, cuts[-1] + 1), len(chunks) - (n - k)))
    cuts.append(len(chunks))
    return [list(chunks[a:b]) for a, b in itertools.pairwise(cuts)]


class RayChunkRunner:
    """A :data:`mergefs.index.blocks.ChunkRunner` over Ray tasks for one opened spec.

    ``parts`` records, per task, which worker read which blocks and how many bytes.
    """

    def __init__(self, spec: Any, base: Checkpoint, experts: Sequence[Checkpoint],
                 address: str | None = None) -> None:
        refuse_unsupported(spec)
        self.spec, self.base, self.experts = spec, base, list(experts)
        self.address = address
        self.parts: list[dict[str, Any]] = []

    def __call__(self, p: Any, chunks: list[tuple[int, int]]) -> Iterator[Any]:
        """Run pass ``p``'s chunks as tasks (a :data:`mergefs.index.build.ChunkRunner`)."""
        if p.base is not self.base or len(p.experts) != len(self.experts) or \
                any(a is not b for a, b in zip(p.experts, self.experts)):
            raise MergefsError("--ray: the index pass is not over the spec's family")
        ray = connect(self.address)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        per_block = p.layout.block_bytes() * (int(p.full) + len(p.own) + len(p.others))
        n_tasks = max(cpus * TASKS_PER_CPU, math.ceil(int(per_block.sum()) / RANGE_BYTES))
        job = ray.put(IndexJob(self.spec, identities(self.base, self.experts), p.layout,
                               list(p.own), list(p.pairs), dict(p.zero_known), p.full,
                               __version__))
        task, place = ray.remote(index_range), placements(ray)
        groups = {task.options(scheduling_strategy=place(k), **TASK_OPTIONS).remote(job, g): g
                  for k, g in enumerate(chunk_groups(chunks, per_block, n_tasks))}
        res: RangeDone
        for g, res in completed(ray, groups, lambda g: f"index blocks [{g[0][0]}, {g[-1][1]})"):
            self.parts.append({"worker": res.worker, "blocks": [g[0][0], g[-1][1]],
                               "bytes_read": sum(res.part.bytes_read.values())})
            yield res.part


# -- compress: one task per expert ------------------------------------------------------------
@dataclass(frozen=True)
class CompressJob:
    spec: Any
    index: Any
    identities: list[dict[str, object]]
    version: str


def compress_expert(job: CompressJob, i: int) -> tuple[bytes, dict[str, Any]]:
    """Task body: the delta sidecar of expert ``i`` (bytes; the driver writes it)."""

    same_version(job.version)
    base, experts = open_checked(job.spec, job.identities)
    try:
        with one_blas_thread():
            return encode_sidecar(base, experts[i], job.index, i), worker_id()
    finally:
        for c in [base, *experts]:
            c.close()


def publish_deltas(spec: Any, base: Checkpoint, experts: Sequence[Checkpoint], index: Any,
                   address: str | None = None, publish: bool = False) -> list[str]:
    """``compress.publish`` with one Ray task per expert: each task reads its expert and the
    base and encodes the sidecar; the driver writes each file into mergefs's store under the
    spec's ``index_dir`` (``publish``: beside its expert)."""

    refuse_unsupported(spec)
    store = None if publish else spec.index_dir
    if publish:
        check_writable(experts)  # as compress.publish: refused before anything is read
    ray = connect(address)
    job = ray.put(CompressJob(spec, index, identities(base, experts), __version__))
    task, place = ray.remote(compress_expert), placements(ray)
    todo = {task.options(scheduling_strategy=place(i), **TASK_OPTIONS).remote(job, i): i
            for i, e in enumerate(experts) if not isinstance(e, LoraCheckpoint)}
    written: dict[int, str] = {}
    for i, (data, who) in completed(ray, todo, lambda i: f"the delta sidecar of "
                                    f"{experts[i].root}"):
        where = write_sidecar(base, experts[i], index, i, data, store)
        log.info("delta sidecar %s: %d bytes (node %s, pid %s)", where, len(data),
                 who["node"], who["pid"])
        written[i] = where
    return [written[i] for i in sorted(written)]
