"""Helpers of the Hub tests: a local Hugging Face cache with models at known commits."""

from __future__ import annotations
import hashlib
import os
from pathlib import Path


COMMIT_A = "a" * 8 + "1" * 32


COMMIT_B = "b" * 8 + "2" * 32


COMMIT_C = "c" * 8 + "3" * 32


def cache_model(cache: Path, repo_id: str, model_dir: Path, commit: str,
                refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``model_dir``'s files into ``cache`` as huggingface_hub does: content-named blobs,
    a snapshot of relative symlinks into them, and ``refs/<name>`` files holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return snapshot
