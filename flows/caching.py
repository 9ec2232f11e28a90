"""Prefect cache keys from content, not names.

Prefect's INPUTS policy hashes a Path by its name, so a retrained model in the same folder
would hit a stale cache. Stage outputs here carry a `content_digest` (data md5, file or
directory sha256), settings are pydantic sections hashed by value, and only output
locations are plain Paths (keyed by where they point, which is what they mean).

A key also carries the `STAGE_VERSION` of the module that defines the stage, the same
constant that names the stage's output folder: one bump re-runs the stage and rebuilds
its output. A cached result is a record of files, not the files: it is reused only while
its output is still there and unchanged (`CachedStage`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from prefect import get_run_logger, task
from pydantic import BaseModel

from components.resources import measured, release_freed_memory


def stage_version(fn: Callable) -> str:
    """The `STAGE_VERSION` of the module defining `fn`; every cached stage must declare one."""
    module = inspect.getmodule(fn)
    version = getattr(module, "STAGE_VERSION", None)
    if version is None:
        raise TypeError(f"{fn.__module__}.{fn.__qualname__} is cached but its module declares no STAGE_VERSION")
    return str(version)


def content_key(task_name: str, version: str, parameters: dict[str, Any]) -> str:
    canonical = json.dumps({name: _identity(value) for name, value in sorted(parameters.items())}, sort_keys=True)
    return hashlib.sha256(f"{task_name}:v{version}:{canonical}".encode()).hexdigest()


def _identity(value: Any) -> Any:
    if hasattr(value, "content_digest"):
        return {"digest": value.content_digest}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Path):
        return {"location": str(value.resolve())}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_identity(v) for v in value]
    raise TypeError(f"cannot derive a content cache key from {type(value).__name__}")


def task_cache_key(context, parameters: dict[str, Any]) -> str:
    """A Prefect `cache_key_fn`."""
    return content_key(context.task.name, stage_version(context.task.fn), parameters)


class StageOutput(Protocol):
    """What a cached stage returns (TrainedModel, ExportedOnnx, CalibrationSet, PrecisionOnnx,
    EngineDir, GatedEngine): where its files are, and whether they still are what was made."""

    @property
    def output_dir(self) -> Path: ...

    def is_intact(self) -> bool: ...


class CachedStage:
    """A stage as a Prefect task cached on content, whose cached output is reused only if it
    is intact (`is_intact()`: its folder is there and its recorded digest still matches).
    Otherwise the leftover folder is removed and the stage runs again."""

    def __init__(self, fn: Callable, name: str) -> None:
        self.name = name
        self.task = task(name=name, cache_key_fn=task_cache_key, persist_result=True)(_measured(fn, name))
        self._rerun = self.task.with_options(refresh_cache=True)

    def __call__(self, *args: Any) -> StageOutput:
        state = self.task(*args, return_state=True)
        value: StageOutput = state.result()
        if state.name != "Cached" or value.is_intact():
            return value
        get_run_logger().warning("%s: the cached output %s is gone or changed; running the stage again", self.name, value.output_dir)
        shutil.rmtree(value.output_dir, ignore_errors=True)
        return self._rerun(*args)


def _measured(fn: Callable, name: str) -> Callable:
    """`fn` logging, when it runs (not when its result is reused), its time and the process's
    peak memory while it ran: what a model's size costs each stage."""

    @functools.wraps(fn)  # the task's name, parameters and STAGE_VERSION stay fn's
    def run(*args: Any) -> Any:
        with measured() as usage:
            result = fn(*args)
        release_freed_memory()  # so the next stage starts from what is still in use
        get_run_logger().info("%s: %s", name, usage.text())
        return result

    return run
