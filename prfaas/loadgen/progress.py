"""A live progress bar (rich) for long runs."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from prfaas.loadgen.records import RequestRecord


class RichProgress:
    """Completed requests (of the total, when known) and failures, refreshed 4 times/s."""

    def __init__(self, console: Console | None = None) -> None:
        self._bar = Progress(
            TextColumn("[bold]bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=4,
            transient=True,
        )
        self._task: TaskID | None = None
        self._failed = 0

    def start(self, total: int | None, duration_s: float | None) -> None:
        self._bar.start()
        self._task = self._bar.add_task("requests", total=total, failed=0)

    def done(self, record: RequestRecord) -> None:
        if self._task is None:
            return
        self._failed += not record.ok
        self._bar.update(self._task, advance=1, failed=self._failed)

    def stop(self) -> None:
        self._bar.stop()
