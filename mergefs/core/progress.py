"""Byte progress bars on stderr for long work (indexing, merging); hidden when stderr is not a
terminal. Used by the CLI and the mount's start-up; never on the trio thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

err_console = Console(stderr=True)


class Ticker:
    """``tick(nbytes)`` advances the bar; ``tick.set_total(nbytes)`` says how many bytes the
    work will take, once known (before that the bar has no end)."""

    def __init__(self, prog: Progress, task: TaskID) -> None:
        self.prog, self.task = prog, task

    def __call__(self, n: int) -> None:
        self.prog.advance(self.task, n)

    def set_total(self, n: int) -> None:
        self.prog.update(self.task, total=n)


@contextmanager
def byte_progress(description: str, total: int | None = None, enabled: bool = True
                  ) -> Iterator[Ticker]:
    """Yield a :class:`Ticker` over a bar of ``total`` bytes (None: set later)."""
    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=err_console,
                    disable=not (enabled and err_console.is_terminal), transient=False)
    with prog:
        yield Ticker(prog, prog.add_task(description, total=total))
