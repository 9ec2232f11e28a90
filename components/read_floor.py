"""What a decode step cannot beat: the bytes it must read (the weights it multiplies by, and
its cache) at the bandwidth this machine's memory, or this GPU's, reaches. `kiln bench`
prints it beside each engine, and the latency gate's budget can be stated as a multiple of
it, which means the same for a 2-layer model and a 1B one."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache Linux reports for the first core (0 where it reports none;
    Python's sysconf has no cache sizes)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for size in cpu.glob("index*/size"):
        text = size.read_text().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text or 0))
    return max(sizes)


def copy_buffer_mib(cache: int, memory: int) -> int:
    """Each copy buffer four times the last-level `cache`, at least 256 MiB and at most a
    sixteenth of `memory`: a server Xeon's 300 MiB L3 held half of two 256 MiB buffers and
    made memory look 1.5 times as fast."""
    return min(max(256, 4 * cache >> 20), memory >> 24)


@functools.cache
def memory_bandwidth(mib: int | None = None, repeats: int = 8) -> float:
    """This machine's memory bandwidth in bytes/s, as a copy on every core reaches it (each
    byte read once and written once; the best of `repeats`, the buffers far larger than any
    cache: `copy_buffer_mib`): what a step that streams its weights can hope for. Measured
    once per process: each engine's latency and serving budgets ask for it."""
    from concurrent.futures import ThreadPoolExecutor

    from components.resources import machine_memory

    mib = mib or copy_buffer_mib(last_level_cache_bytes(), machine_memory())
    source = np.ones(mib << 20, np.uint8)
    target = np.empty_like(source)
    threads = os.cpu_count() or 1
    bounds = np.linspace(0, source.size, threads + 1, dtype=np.int64)

    def copy(i: int) -> None:  # numpy lets go of the GIL for a copy this large
        np.copyto(target[bounds[i] : bounds[i + 1]], source[bounds[i] : bounds[i + 1]])

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats + 1):  # the first touches every page
            start = time.perf_counter()
            list(pool.map(copy, range(threads)))
            best = min(best, time.perf_counter() - start)
    return 2 * source.size / best


def card_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """The GPU's memory bandwidth in bytes/s, as a device-to-device copy reaches it."""
    import torch

    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * repeats / (start.elapsed_time(end) / 1000.0)


def onnx_read_bytes(onnx_path: Path) -> int:
    """Bytes of weights a step reads from an ONNX graph: every initializer but the tables
    only looked up (consumed by Gather alone: token and position embeddings)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(onnx_path), load_external_data=False)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    return sum(
        int(np.prod(t.dims, dtype=np.int64)) * tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in model.graph.initializer
        if consumers.get(t.name, set()) != {"Gather"}
    )


def program_read_bytes(program) -> int:
    """Bytes of weights a step of a static-KV program reads: every parameter but the tables
    only looked up (GPT-2's positions; the token embeddings where a separate lm_head is the
    output layer)."""
    params = dict(program.named_parameters())
    lookups = {"wpe"} | ({"embed"} if params.get("lm_head") is not None else set())
    return sum(p.numel() * p.element_size() for name, p in params.items() if name not in lookups)


@dataclass(frozen=True)
class ReadFloor:
    """A generation's floor on one engine: `step_bytes` read per step at `bandwidth`."""

    step_bytes: float
    bandwidth: float

    def ms(self, new_tokens: int) -> float:
        return new_tokens * self.step_bytes / self.bandwidth * 1000.0

    def text(self) -> str:
        size = f"{self.step_bytes / 1e9:.2f} GB" if self.step_bytes >= 1e8 else f"{self.step_bytes / 1e6:.1f} MB"
        speed = f"{self.bandwidth / 1e12:.2f} TB/s" if self.bandwidth >= 1e12 else f"{self.bandwidth / 1e9:.0f} GB/s"
        return f"{size}/step @ {speed}"


def read_floor(engine, rows: int, mean_length: float) -> ReadFloor | None:
    """The floor of `engine` (loaded) for `rows` sequences of `mean_length` tokens on average:
    its weights and their caches, at its device's measured bandwidth; None for an engine whose
    weights kiln cannot count (TensorRT's plan)."""
    kv = engine.manifest.kv_bytes_per_token * rows * mean_length
    backend = engine.manifest.backend
    if backend == "onnxruntime":
        return ReadFloor(onnx_read_bytes(engine.engine_dir.engine_file) + kv, memory_bandwidth())
    if backend == "torch-cuda":
        weights = program_read_bytes(engine.runner.model)
        return ReadFloor(weights + kv, card_bandwidth() if engine.device == "cuda" else memory_bandwidth())
    return None
