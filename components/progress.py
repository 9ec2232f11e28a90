"""Progress of long stages (training, gates, benchmarks): rich bars in a terminal, and lines
with an estimate of the time left where stderr is a log file or a pipe (rich draws a bar
there only once it is finished, so a log showed nothing of an hour-long gate until its end)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Advance = Callable[[int, str], None]
LOG_EVERY_S = 30.0  # a line at least this often in a log, besides one every tenth of the work


@contextmanager
def stage_progress(stage: str, total: int) -> Iterator[Advance]:
    """A bar for `total` steps of a stage; yields advance(steps, status_text)."""
    # stderr, like every progress display: stdout stays for results (and can be redirected).
    console = Console(stderr=True)
    if not console.is_terminal:
        with _logged_progress(stage, total, sys.stderr) as advance:
            yield advance
        return
    columns = (
        TextColumn(f"[bold]{stage}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(stage, total=total, status="")

        def advance(steps: int, status: str = "") -> None:
            progress.update(task, advance=steps, status=status)

        yield advance


@contextmanager
def _logged_progress(stage: str, total: int, stream: TextIO) -> Iterator[Advance]:
    """Lines `stage: done/total (pct), elapsed, about T left` at each tenth of the work and at
    least every LOG_EVERY_S seconds, and one at the end."""
    start = last = time.monotonic()
    done, tenth, status_seen = 0, 0, ""

    def line(now: float) -> None:
        elapsed = now - start
        left = f", about {_clock(elapsed * (total - done) / done)} left" if 0 < done < total else ""
        stream.write(f"{stage}: {done}/{total} ({100 * done / max(total, 1):.0f} %), {_clock(elapsed)} elapsed{left}{status_seen}\n")
        stream.flush()

    def advance(steps: int, status: str = "") -> None:
        nonlocal done, tenth, last, status_seen
        done += steps
        status_seen = f", {status}" if status else ""
        now = time.monotonic()
        reached = 10 * done // max(total, 1)
        if done < total and (reached > tenth or now - last >= LOG_EVERY_S):
            tenth, last = reached, now
            line(now)

    yield advance
    line(time.monotonic())


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
