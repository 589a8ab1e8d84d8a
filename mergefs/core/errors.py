"""The exception hierarchy. The CLI prints ``str(exc)`` of any MergefsError as one line."""

from __future__ import annotations


class MergefsError(Exception):
    """Base of every error mergefs raises on purpose."""


class SpecError(MergefsError):
    """The merge spec is invalid (names the file and key)."""


class SourceError(MergefsError):
    """A checkpoint source cannot be opened or read (names the file)."""


class SourceChanged(SourceError):
    """A source's bytes differ from what the index, plan or manifest recorded."""


class BudgetError(MergefsError):
    """The budget is invalid for this spec or operator."""


class MemoryCapError(MergefsError):
    """A tensor cannot be merged under the memory cap (names the tensor and its need)."""


class ManifestError(MergefsError):
    """A manifest is malformed or cannot be replayed."""


class DependencyMissing(MergefsError):
    """An optional dependency a command needs is not installed (names it and the extra)."""
