"""The seam between the HTTP side and the engine it serves through: what the routes, the
handlers and the alias follower may ask of a served engine, as a type.

`serving.engine_process.EngineProcess` (the engine and its scheduler in a child process)
is what `serving.follow.start_engine` makes; everything else names only `EngineClient`,
so where the engine runs (a child process today, in-process or remote another day) is
one module's business. The members are exactly those the HTTP side uses.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from serving.scheduler import Limits, SchedulerClosed, Sequence


class EngineLost(SchedulerClosed):
    """The engine exited without being asked to; the follower is loading it again."""


@runtime_checkable
class EngineClient(Protocol):
    # A request with more prompts than this can never be queued: answered 400, not 503.
    max_waiting: int
    limits: Limits  # what the engine holds: a chat's default max_tokens is what its context leaves

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue the sequences, all or none; each then reports through its own `emit`.
        Raises ShapeOutOfProfile (a sequence does not fit the engine), QueueFull (the
        waiting line cannot take them all), EngineLost, or SchedulerClosed (being swapped out)."""
        ...

    @property
    def alive(self) -> bool:
        """False once the engine has gone: the follower loads the version again."""
        ...

    @property
    def pid(self) -> int | None:
        """The engine's own process, whose memory and CPU the metrics report."""
        ...

    def close(self, timeout: float | None = None) -> bool:
        """Take no new sequences, finish those held, then free the engine; False if that
        has not happened within `timeout`."""
        ...
