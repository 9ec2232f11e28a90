"""Prefect cache keys from content, not names.

Prefect's INPUTS policy hashes a Path by its name, so a retrained model in the same folder
would hit a stale cache. Stage outputs here carry a `content_digest` (data md5, file or
directory sha256), settings are pydantic sections hashed by value, and only output
locations are plain Paths (keyed by where they point, which is what they mean).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# Bump when a stage's code changes what it makes (and that stage's own folder version, such
# as precision.GRAPH_VERSION): the keys miss, stages re-run, and only the changed stage,
# whose folder name changed, rebuilds; the others find their outputs in place.
CACHE_VERSION = "3"


def content_key(task_name: str, parameters: dict[str, Any]) -> str:
    canonical = json.dumps({name: _identity(value) for name, value in sorted(parameters.items())}, sort_keys=True)
    return hashlib.sha256(f"{CACHE_VERSION}:{task_name}:{canonical}".encode()).hexdigest()


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
    return content_key(context.task.name, parameters)
