"""Byte progress bars on stderr for long work (indexing, merging); hidden when stderr is not a
terminal. Used by the CLI and the mount's start-up; never on the trio thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

err_console = Console(stderr=True)


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True
                  ) -> Iterator[Callable[[int], None]]:
    """Yield ``tick(nbytes)``, which advances a bar of ``total`` bytes."""
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=err_console,
                    disable=not (enabled and err_console.is_terminal), transient=False)
    with prog:
        task = prog.add_task(description, total=total)
        yield lambda n: prog.advance(task, n)
