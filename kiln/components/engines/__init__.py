"""Engine runtimes, one per backend, behind the `Engine` interface of `base`."""

from __future__ import annotations

from pathlib import Path

from kiln.components.engine_dir import load_engine_dir
from kiln.components.engines.base import Engine
from kiln.errors import BackendUnavailable


def load_engine(path: Path, threads: int | None = None) -> Engine:
    """Verify an engine directory and open it with the runtime of its backend."""
    engine_dir = load_engine_dir(path)
    backend = engine_dir.manifest.backend
    if backend == "onnxruntime":
        from kiln.components.engines.onnxruntime import OrtEngine

        return OrtEngine(engine_dir, threads=threads)
    if backend == "tensorrt":
        from kiln.components.engines.tensorrt import TrtEngine

        return TrtEngine(engine_dir)
    raise BackendUnavailable(f"engine {path} needs backend {backend!r}, which this kiln cannot run")
