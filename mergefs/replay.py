"""Replay: re-execute exactly the plan a manifest recorded and verify every byte.

No re-planning and no index: the block layout comes from the base's headers and the recorded block
size, the plan from the recorded selection. Every source range is re-read and its xxh3 compared
with the recorded one (a changed source fails naming it, before anything is written under its
final name), and every output unit (and, with ``--out``, every tensor) must reproduce its hash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import Checkpoint
from .engine import Engine, open_family
from .errors import ManifestError, SourceChanged
from .index import BlockIndex, build_layout
from .manifest import read_manifest
from .plan import Plan, selected_from_runs
from .spec import parse_spec

log = logging.getLogger(__name__)


class _Checker:
    """Stands in for a ManifestWriter: compares each record the engine produces to the manifest."""

    def __init__(self, reads: list[dict[str, Any]], outputs: list[dict[str, Any]],
                 tensors: list[dict[str, Any]], sources: dict[str, Checkpoint]) -> None:
        self.reads = {(r["source"], r["file"], r["start"], r["end"]): r["xxh3"] for r in reads}
        self.outputs = {(o["tensor"], o["b0"], o["b1"]): o["xxh3"] for o in outputs}
        self.tensors = {t["name"]: t["xxh3"] for t in tensors}
        self.sources = sources
        self.checked_reads = 0
        self.checked_outputs = 0
        self.checked_tensors = 0

    def write(self, rec: dict[str, Any]) -> None:
        kind = rec["type"]
        if kind == "read":
            key = (rec["source"], rec["file"], rec["start"], rec["end"])
            want = self.reads.get(key)
            if want is None:
                raise ManifestError(f"replay read {key} that the manifest does not record")
            if want != rec["xxh3"]:
                src = self.sources.get(rec["source"])
                path = src.path_of(rec["file"]) if src is not None else rec["source"]
                raise SourceChanged(
                    f"{path}: changed since the manifest was written: bytes [{rec['start']}, "
                    f"{rec['end']}) ({rec['tensor']}) differ")
            self.checked_reads += 1
        elif kind == "output":
            want = self.outputs.get((rec["tensor"], rec["b0"], rec["b1"]))
            if want is not None:
                if want != rec["xxh3"]:
                    raise ManifestError(f"output of {rec['tensor']} blocks [{rec['b0']}, "
                                        f"{rec['b1']}) does not reproduce its recorded hash")
                self.checked_outputs += 1
        elif kind == "tensor":
            want = self.tensors.get(rec["name"])
            if want is not None:
                if want != rec["xxh3"]:
                    raise ManifestError(f"tensor {rec['name']} does not reproduce its hash")
                self.checked_tensors += 1


@dataclass(frozen=True)
class ReplayResult:
    reads_verified: int
    outputs_verified: int
    tensors_verified: int
    torn_lines: int
    plan_hash: str


def replay(manifest_path: str | Path, out: str | Path | None = None,
           overwrite: bool = False) -> ReplayResult:
    contents = read_manifest(manifest_path)
    h = contents.header
    spec = parse_spec(dict(h["spec"]), base_dir=Path(manifest_path).resolve().parent,
                      source=f"{manifest_path} (recorded spec)")
    base, experts = open_family(spec)
    try:
        recorded = h["sources"]
        labelled = {"base": base, **{f"expert:{i}": e for i, e in enumerate(experts)}}
        for label, c in labelled.items():
            now = c.identity_json()
            was = recorded.get(label, {})
            for f_now, f_was in zip(now["files"], was.get("files", [])):
                if (f_now["size_bytes"], f_now["header_xxh3"]) != (f_was["size_bytes"],
                                                                   f_was["header_xxh3"]):
                    raise SourceChanged(f"{f_now['path']}: changed since the manifest was "
                                        "written (size or header differ)")
        layout = build_layout(base, spec.block_size)
        n = len(experts)
        selected = selected_from_runs(h["selected"], layout.n_blocks)
        if selected.shape[0] != n:
            raise ManifestError(f"{manifest_path}: plan lists {selected.shape[0]} experts, "
                                f"spec has {n}")
        index = BlockIndex(h["index_key"], layout, np.zeros(layout.n_blocks, np.uint64),
                           np.zeros((n, layout.n_blocks), np.uint64),
                           np.zeros((n, layout.n_blocks)), np.zeros((n, layout.n_blocks), bool),
                           np.zeros((layout.n_blocks, n, n)))
        plan = Plan(selected, h["budget_bytes"], 0, 0, 0, int(selected.sum()), selected.size, 0,
                    None, None, None, None, h["plan_hash"])
        checker = _Checker(contents.reads, contents.outputs, contents.tensors, labelled)
        engine = Engine(spec, base, experts, index, plan, manifest=checker,  # type: ignore[arg-type]
                        verify_index=False)
        if out is not None:
            engine.materialise(out, overwrite=overwrite)
        else:
            for o in contents.outputs:
                engine.merge_unit(o["tensor"], o["b0"], o["b1"])
        if checker.checked_outputs < len(checker.outputs):
            raise ManifestError(f"{manifest_path}: only {checker.checked_outputs} of "
                                f"{len(checker.outputs)} recorded outputs were reproduced")
        if contents.torn_lines:
            log.warning("%s: ignored %d torn line(s) (an interrupted write)", manifest_path,
                        contents.torn_lines)
        return ReplayResult(checker.checked_reads, checker.checked_outputs,
                            checker.checked_tensors, contents.torn_lines, h["plan_hash"])
    finally:
        for c in [base, *experts]:
            c.close()

