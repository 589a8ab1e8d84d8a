"""Where bytes come from: one source interface over local files, object stores and LoRA adapters.

Every source is a :class:`~mergefs.sources.local.Checkpoint` (tensor map, non-weight files, file
identities, ``read_ranges`` with counters) and answers, each kind in its own way, what code outside
``sources/`` needs: prefetch advice (``will_need``), files derived beside it (``read_aux``,
``aux_reader``, ``check_writable_aux``, ``write_aux``), its files on this machine
(``local_files``, ``file_ctimes``, ``extra_dir``), the check before reuse
(``check_unchanged_for_reuse``), ``reads_gap_bytes`` and ``prefers_published_index``.
:func:`open_source` is the one place that decides, from the reference, which kind opens it:

- ``model+adapter`` or a bare PEFT adapter directory: :mod:`mergefs.sources.lora`;
- a URL (``s3://``, ``https://``, ``file://``...): :mod:`mergefs.sources.remote` (fsspec);
- anything else: a local directory or ``.safetensors`` file (:mod:`mergefs.sources.local`).

Hub ids are resolved to local snapshot paths before they get here (:mod:`mergefs.spec.refs`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mergefs.sources.local import Checkpoint, open_local
from mergefs.sources.lora import open_lora_ref
from mergefs.sources.remote import open_remote
from mergefs.spec.options import RemoteOptions
from mergefs.sources.base import GapAllowance, ReadRange
from mergefs.sources.remote import read_concurrently


def open_source(path: str | os.PathLike[str], options: RemoteOptions | None = None,
                base: Checkpoint | None = None) -> Checkpoint:
    """Open any source reference; ``base`` is the merge's base, which a bare adapter applies to."""
    ref = os.fspath(path)
    lora = open_lora_ref(ref, options, base)
    if lora is not None:
        return lora
    if "://" in ref:
        return open_remote(ref, options or RemoteOptions())
    return open_local(path)


def read_many(requests: Sequence[tuple[Checkpoint, Sequence[ReadRange]]],
              allowances: Sequence[GapAllowance | None] | None = None
              ) -> list[list[memoryview]]:
    """``read_ranges`` of several sources; remote sources are fetched together, concurrently.

    Local sources are read in the calling thread, in request order, exactly as
    ``src.read_ranges(ranges)`` would. ``allowances``: per request, the
    :class:`GapAllowance` its coalesced gaps are taken from (None: no limit).
    """
    gaps = list(allowances) if allowances is not None else [None] * len(requests)
    out: list[list[memoryview] | None] = [None] * len(requests)
    # sources with an async reader of their own (a recipe's role over remote models reads
    # through its members, one after another)
    remote = [k for k, (src, _) in enumerate(requests) if src.is_remote
              and hasattr(src, "read_ranges_async")]
    if len(remote) > 1:

        for k, views in zip(remote, read_concurrently([requests[k] for k in remote],
                                                      [gaps[k] for k in remote])):
            out[k] = views
    for k, (src, ranges) in enumerate(requests):
        if out[k] is None:
            out[k] = src.read_ranges(ranges, gap_allowance=gaps[k])
    return [v for v in out if v is not None]
