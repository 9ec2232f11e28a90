"""The TensorRT runner (TensorRT 11 API): KV-cache generation through `execute_async_v3`,
profile 0 for the prompt and profile 1 for decode steps.

Device memory and the stream come from Polygraphy's CUDA wrappers (ctypes over the CUDA
runtime), not torch: the project's environment pins a CPU build of torch, and the runner
must work beside it. An engine is tied to the TensorRT version and GPU architecture it was
built for; loading refuses a mismatch and says both. tensorrt, polygraphy.cuda and the CUDA
runtime are loaded inside functions.
"""

from __future__ import annotations

import ctypes

import numpy as np

from components.engine_dir import EngineDir, EngineManifest
from components.errors import BackendUnavailable, EngineError
from components.runtime.engine import Engine

# cudaDeviceAttr values of the CUDA runtime API (stable since CUDA 2.x).
_COMPUTE_CAPABILITY_MAJOR, _COMPUTE_CAPABILITY_MINOR = 75, 76


def tensorrt_version() -> str:
    try:
        import tensorrt as trt
    except ImportError as err:
        raise BackendUnavailable("the tensorrt backend needs the tensorrt package, which is not installed") from err
    return trt.__version__


def cuda_runtime():
    """The CUDA runtime library as Polygraphy loads it; BackendUnavailable when it cannot."""
    from polygraphy import cuda

    try:
        return cuda.wrapper()
    except Exception as err:  # OSError from ctypes, or Polygraphy's own exception type
        raise BackendUnavailable(f"the CUDA runtime library (libcudart) cannot be loaded: {err}") from err


def gpu_target() -> str:
    """`sm_XX` of CUDA device 0, asked of the CUDA runtime itself (what TensorRT will use)."""
    handle = cuda_runtime().handle
    count = ctypes.c_int(0)
    if handle.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value == 0:
        raise BackendUnavailable("the tensorrt backend needs an NVIDIA GPU; the CUDA runtime reports none")
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    handle.cudaDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, 0)
    handle.cudaDeviceGetAttribute(ctypes.byref(minor), _COMPUTE_CAPABILITY_MINOR, 0)
    return f"sm_{major.value}{minor.value}"


def check_compatible(manifest: EngineManifest, version: str, target: str) -> None:
    """Refuse an engine built for another TensorRT version or GPU architecture."""
    if manifest.backend_version != version or manifest.target != target:
        raise BackendUnavailable(
            f"engine built with TensorRT {manifest.backend_version} for {manifest.target}; "
            f"this machine has TensorRT {version} on {target}: rebuild it here"
        )


class TrtEngine(Engine):
    """Generation with a TensorRT engine: profile 0 for the prompt, 1 for decode steps.

    The KV cache stays on the device between steps: `forward` returns the present tensors
    as device arrays and takes them back as the next step's past, freeing the past it was
    given once the step has run (a decode state is used once, as `Engine.generate` does).
    """

    continues_prefills = False  # not shown to take several new tokens after a past

    CONTEXT, GENERATION = 0, 1

    def __init__(self, engine_dir: EngineDir) -> None:
        super().__init__(engine_dir)
        # First what this machine has (BackendUnavailable naming it), then the imports.
        check_compatible(self.manifest, tensorrt_version(), gpu_target())
        import tensorrt as trt
        from polygraphy import cuda

        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(engine_dir.engine_file.read_bytes())
        if self._engine is None:
            raise EngineError(f"TensorRT could not deserialize {engine_dir.engine_file}")
        self._context = self._engine.create_execution_context()
        self._cuda = cuda
        self._stream = cuda.Stream()
        self._dtypes = {name: self._engine.get_tensor_dtype(name) for name in self.manifest.inputs + self.manifest.outputs}

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        from polygraphy.datatype import DataType

        cuda = self._cuda
        profile = self.CONTEXT if cache[0].shape[2] == 0 else self.GENERATION
        self._context.set_optimization_profile_async(profile, self._stream.ptr)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= self._logits_positions_feed(input_ids, logits_positions)
        feeds |= dict(zip(self.manifest.past_names, cache))
        staged, hosts = [], []  # host inputs copied to the device for this step only
        for name, value in feeds.items():
            if not isinstance(value, cuda.DeviceView):
                hosts.append(np.ascontiguousarray(value))  # alive until the stream has synchronised
                value = cuda.DeviceArray(shape=value.shape, dtype=DataType.from_dtype(value.dtype)).copy_from(hosts[-1], self._stream)
                staged.append(value)
            self._context.set_input_shape(name, tuple(value.shape))
            self._context.set_tensor_address(name, value.ptr)
        outputs = {}
        for name in self.manifest.outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            outputs[name] = cuda.DeviceArray(shape=shape, dtype=DataType.from_dtype(self._dtypes[name], "tensorrt"))
            self._context.set_tensor_address(name, outputs[name].ptr)
        if not self._context.execute_async_v3(self._stream.ptr):
            raise EngineError(f"TensorRT execution failed for {self.engine_dir.engine_file}")
        self._stream.synchronize()
        logits = outputs.pop("logits")
        host = logits.numpy().astype(np.float32)
        for array in [logits, *staged, *(v for v in cache if isinstance(v, cuda.DeviceArray))]:
            array.free()
        return host, [outputs[name] for name in self.manifest.outputs[1:]]

    def close(self) -> None:
        """Drop the execution context and engine before the stream, as TensorRT requires."""
        if self._stream is not None:
            self._stream.synchronize()
            self._context = self._engine = None
            self._stream.free()
            self._stream = None
