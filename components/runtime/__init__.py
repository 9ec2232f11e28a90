"""Running engines: the `Engine` interface, sampling, the engine tokenizer and one runner
per backend. What the gates and the server both drive, so what was gated is what is served.

Imports nothing of kiln's but the engine-directory contract and errors: no stage module.
"""

from __future__ import annotations

from pathlib import Path

from components.engine_dir import EngineDir, load_engine_dir
from components.errors import BackendUnavailable
from components.runtime.engine import Engine


def load_engine(path: Path, threads: int | None = None) -> Engine:
    """Verify an engine directory and open it with the runtime of its backend."""
    return open_engine(load_engine_dir(path), threads)


def open_engine(engine_dir: EngineDir, threads: int | None = None) -> Engine:
    """Open an engine directory already verified (`load_engine_dir`) with its backend's runtime."""
    backend = engine_dir.manifest.backend
    if backend == "onnxruntime":
        from components.runtime.onnxruntime import OrtEngine

        return OrtEngine(engine_dir, threads=threads)
    if backend == "tensorrt":
        from components.runtime.tensorrt import TrtEngine

        return TrtEngine(engine_dir)
    if backend == "torch-cuda":
        from components.runtime.torch_cuda import TorchCudaEngine

        return TorchCudaEngine(engine_dir)
    raise BackendUnavailable(f"engine {engine_dir.path} needs backend {backend!r}, which this kiln cannot run")
