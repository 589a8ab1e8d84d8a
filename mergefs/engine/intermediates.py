"""Multi-document specs (mergekit-multi): materialise the named merges a final merge reads.

``ensure_intermediates(spec)`` merges each of ``spec.intermediates`` in dependency order into its
output directory, as ``mergefs merge`` would (its own manifest beside the spec), and skips one
whose directory already holds a mergefs merge of the same plan (plan hash in its marker), as
mergekit-multi skips existing outputs. Blocking I/O: call from the CLI or API, never trio.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mergefs.engine.manifest import ManifestWriter
from mergefs.engine.output import MARKER
from mergefs.spec.model import Spec

log = logging.getLogger(__name__)


def _done(outdir: Path, plan_hash: str) -> bool:
    try:
        marker = json.loads((outdir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("plan_hash") == plan_hash


def _sources_of(spec: Spec, outdir: str) -> list[str]:
    """Every model the spec's merges read, but the intermediate ``outdir`` itself (a later
    merge reads it)."""
    return [p for p in spec.model_paths if p != outdir]


def ensure_intermediates(spec: Spec) -> None:
    from mergefs.engine.merger import Session

    from mergefs.engine.output import check_writes

    for name, sub, outdir in spec.intermediates:
        # an intermediate is an output: never inside a source of any merge of the spec
        check_writes(_sources_of(spec, outdir), outdir=outdir,
                     manifest=sub.manifest, index_dir=sub.index_dir)
        probe = Session(sub)  # the index is built (or reused) here; the plan hash is cheap
        try:
            done = _done(Path(outdir), probe.plan.plan_hash)
        finally:
            probe.close()
        if done:
            log.info("intermediate merge %s is up to date in %s", name, outdir)
            continue
        log.info("merging intermediate %s into %s", name, outdir)
        writer = ManifestWriter.for_run(sub.manifest)
        try:
            session = Session(sub, manifest=writer)
            try:
                session.engine.materialise(outdir, overwrite=True)
                session.finish()
            finally:
                session.close()
        finally:
            writer.close()
