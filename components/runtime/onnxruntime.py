"""The ONNX Runtime runner: generation on a CPU session over the engine's ONNX file."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import numpy as np

from components.engine_dir import LOGITS_POSITIONS, EngineDir
from components.errors import EngineError
from components.runtime.engine import Engine

# Both rewrites turn int8 MatMuls back into float ones over weights dequantized every step:
# MatMulAddFusion makes a float Gemm of a quantized MatMul + Add, and common-subexpression
# elimination merges the Q/DQ pairs components.precision gives each reader of an activation
# (measured: docs/performance.md, "Measured choices in the code").
QDQ_DISABLED_OPTIMIZERS = ["MatMulAddFusion", "CommonSubexpressionElimination"]

# A cache buffer's first room, in positions: it doubles when full, so a sequence copies its
# cache a few times in all rather than on every step.
FIRST_ROOM = 64


class OrtEngine(Engine):
    """Generation on an ONNX Runtime CPU session."""

    def __init__(self, engine_dir: EngineDir, threads: int | None = None) -> None:
        import onnxruntime as ort

        super().__init__(engine_dir)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        disabled = QDQ_DISABLED_OPTIMIZERS if self.manifest.precision == "int8" else []
        try:
            self.session = ort.InferenceSession(
                str(engine_dir.engine_file), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
            )
        except Exception as err:  # ORT raises its own Fail/InvalidGraph types
            raise EngineError(f"ONNX Runtime cannot load {engine_dir.engine_file}: {err}") from err
        # In-place calls (kv_in_place): the cache views the last call returned, the IO
        # binding and the buffers it binds.
        self._views: list[np.ndarray] = []
        self._binding, self._bound = None, []

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= self._logits_positions_feed(input_ids, logits_positions)
        # A prefill (no past) runs unbound: its cache is copied into a running batch's
        # buffers (DecodeState.put) or into its own at its first decode step, and the
        # running batch keeps its binding. So does a prefill after a cached prefix
        # (several new tokens: `extend`); only decode steps are bound.
        if self.manifest.kv_in_place and cache[0].shape[2] and input_ids.shape[1] == 1:
            return self._forward_in_place(feeds, cache, input_ids.shape[1])
        feeds |= dict(zip(self.manifest.past_names, cache))
        logits, *present = self.session.run(None, feeds)
        return logits, present

    def _forward_in_place(self, feeds: dict, cache: list[np.ndarray], new: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """One call with each past and present bound to one buffer: the graph writes the new
        positions after the past, and the returned cache is a view of those buffers."""
        total = cache[0].shape[2] + new
        buffers = self._buffers_for(cache, total)
        binding = self._binding_for(buffers)
        kept = len(feeds[LOGITS_POSITIONS]) if LOGITS_POSITIONS in feeds else new
        logits = np.empty((len(cache[0]), kept, self.manifest.vocab_size), np.float32)
        binding.bind_output(self.manifest.outputs[0], "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        self.session.run_with_iobinding(binding)
        self._views = [buffer[:, :, :total] for buffer in buffers]
        return logits, list(self._views)

    def _buffers_for(self, cache: list[np.ndarray], total: int) -> list[np.ndarray]:
        """Buffers that start with `cache` and have room for `total` positions: those of the
        last call where `cache` is what it returned (a decode step after the last one), else
        new ones with twice the room (a first decode; rows joined or dropped; a state decoded
        twice, which so keeps what its first decode wrote)."""
        if len(cache) == len(self._views) and all(a is b for a, b in zip(cache, self._views, strict=True)):
            if self._views[0].base.shape[2] >= total:
                return [view.base for view in self._views]
        limit = max(total, self.manifest.profiles["generation"].past.max + 1)
        room = min(limit, max(total, 2 * cache[0].shape[2], FIRST_ROOM))
        buffers = [np.empty((*part.shape[:2], room, part.shape[3]), np.float32) for part in cache]
        for buffer, part in zip(buffers, cache, strict=True):
            buffer[:, :, : part.shape[2]] = part
        return buffers

    def _binding_for(self, buffers: list[np.ndarray]):
        """The session's IO binding with `buffers` as past and present: the last call's while
        the buffers are the same (binding 50 tensors costs ~0.2 ms, a twentieth of a step)."""
        if len(buffers) != len(self._bound) or any(a is not b for a, b in zip(buffers, self._bound, strict=True)):
            self._binding = binding = self.session.io_binding()
            for past, present, buffer in zip(self.manifest.past_names, self.manifest.outputs[1:], buffers, strict=True):
                binding.bind_input(past, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
                binding.bind_output(present, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            self._bound = buffers  # held: the binding points into them
        return self._binding

    def runtime_settings(self) -> dict[str, str]:
        threads = self.session.get_session_options().intra_op_num_threads  # 0: ONNX Runtime's default, one per core
        return super().runtime_settings() | {"threads": str(threads) if threads else f"all cores ({os.cpu_count()})"}

    def close(self) -> None:
        self.session = None


@functools.cache
def keep_freed_memory() -> None:
    """glibc gives freed memory at the heap's top back to the OS, and large blocks are mmapped
    and unmapped, so the next multi-MB cache buffer (a batch's rows changed) is faulted in
    page by page: 0.5-0.6 ms instead of 0.06 for four 0.5 MB buffers. Keep freed memory in
    the process, as ONNX Runtime's arena keeps its own. Once per process; not glibc: nothing.
    Only in a process that serves (kiln serve's engine process, the latency gate's): where a
    build loads gigabytes of weights, the memory it freed would stay held (a 1B model's
    build was killed for memory)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return
    trim_threshold, mmap_threshold = -1, -3  # glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    libc.mallopt(mmap_threshold, 256 << 20)
    libc.mallopt(trim_threshold, 1 << 30)
