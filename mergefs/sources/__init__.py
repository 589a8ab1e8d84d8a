"""Where bytes come from: one source interface over local files, object stores and LoRA adapters.

Every source is a :class:`~mergefs.sources.local.Checkpoint` (tensor map, non-weight files, file
identities, ``read_ranges`` with counters); :func:`open_source` is the one place that decides, from
the reference, which kind opens it:

- ``model+adapter`` or a bare PEFT adapter directory: :mod:`mergefs.sources.lora`;
- a URL (``s3://``, ``https://``, ``file://``...): :mod:`mergefs.sources.remote` (fsspec);
- anything else: a local directory or ``.safetensors`` file (:mod:`mergefs.sources.local`).

Hub ids are resolved to local snapshot paths before they get here (:mod:`mergefs.spec.refs`).
"""

from __future__ import annotations

import os

from mergefs.sources.local import Checkpoint, open_local
from mergefs.sources.lora import open_lora_ref
from mergefs.sources.remote import open_remote
from mergefs.spec.options import RemoteOptions


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
