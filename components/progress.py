"""Rich progress bars for long stages (training, gates, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[int, str], None]


@contextmanager
def stage_progress(stage: str, total: int) -> Iterator[Advance]:
    """A bar for `total` steps of a stage; yields advance(steps, status_text)."""
    columns = (
        TextColumn(f"[bold]{stage}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    # stderr, like every progress display: stdout stays for results (and can be redirected).
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(stage, total=total, status="")

        def advance(steps: int, status: str = "") -> None:
            progress.update(task, advance=steps, status=status)

        yield advance
