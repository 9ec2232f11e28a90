"""Prefect's log handlers, told that a KilnError's message is the whole story.

Its console and API handlers print an exception's traceback for every task and flow it
passes through; a KilnError's message already says what was asked and what was found, so
its traceback is dropped (other exceptions, bugs, keep theirs). So is that of FailedRun,
which a deployment's flow-run process raises after any run that ended Failed: its message
is the run's final state message, logged on the line before.
"""

from __future__ import annotations

import logging

from prefect.exceptions import FailedRun

from components.errors import KilnError

# The loggers Prefect's logging.yml gives handlers of their own (the API handler that
# feeds the UI), besides the root's console.
_PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class NoKilnTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], KilnError | FailedRun):
            record.exc_info = None
            record.exc_text = None
        return True


def hide_kiln_tracebacks() -> None:
    """Add the filter to every handler that prints or ships a run's log (once each)."""
    handlers = [*logging.getLogger().handlers]
    for name in _PREFECT_RUN_LOGGERS:
        handlers += logging.getLogger(name).handlers
    for handler in handlers:
        if not any(isinstance(f, NoKilnTracebacks) for f in handler.filters):
            handler.addFilter(NoKilnTracebacks())


def show_stage_notes() -> None:
    """The stages' own INFO lines (what the data stage found on a fresh clone and did) in the
    run's log: Prefect's logging leaves loggers other than its own at WARNING."""
    logging.getLogger("components").setLevel(logging.INFO)
