"""The TensorRT runner (TensorRT 11 API): KV-cache generation through `execute_async_v3`,
profile 0 for the prompt and profile 1 for decode steps, on CUDA buffers held as torch
tensors.

An engine is tied to the TensorRT version and GPU architecture it was built for; loading
refuses a mismatch and says both. tensorrt and torch are imported inside functions.
"""

from __future__ import annotations

import numpy as np

from components.engine_dir import EngineDir, EngineManifest
from components.errors import BackendUnavailable, EngineError
from components.runtime.engine import Engine


def tensorrt_version() -> str:
    try:
        import tensorrt as trt
    except ImportError as err:
        raise BackendUnavailable("the tensorrt backend needs the tensorrt package, which is not installed") from err
    return trt.__version__


def gpu_target() -> str:
    """`sm_XX` of the current CUDA device."""
    try:
        import torch
    except ImportError as err:
        raise BackendUnavailable("the tensorrt backend needs torch with CUDA for its buffers") from err
    if not torch.cuda.is_available():
        raise BackendUnavailable("the tensorrt backend needs an NVIDIA GPU; CUDA reports none")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def check_compatible(manifest: EngineManifest, version: str, target: str) -> None:
    """Refuse an engine built for another TensorRT version or GPU architecture."""
    if manifest.backend_version != version or manifest.target != target:
        raise BackendUnavailable(
            f"engine built with TensorRT {manifest.backend_version} for {manifest.target}; "
            f"this machine has TensorRT {version} on {target}: rebuild it here"
        )


class TrtEngine(Engine):
    """Generation with a TensorRT engine: profile 0 for the prompt, 1 for decode steps."""

    CONTEXT, GENERATION = 0, 1

    def __init__(self, engine_dir: EngineDir) -> None:
        import tensorrt as trt
        import torch

        super().__init__(engine_dir)
        check_compatible(self.manifest, tensorrt_version(), gpu_target())
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(engine_dir.engine_file.read_bytes())
        if self._engine is None:
            raise EngineError(f"TensorRT could not deserialize {engine_dir.engine_file}")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()
        self._torch = torch
        self._dtypes = {name: self._engine.get_tensor_dtype(name) for name in self.manifest.inputs + self.manifest.outputs}

    def forward(self, input_ids, attention_mask, position_ids, cache):
        torch = self._torch
        past_length = cache[0].shape[2]
        profile = self.CONTEXT if past_length == 0 else self.GENERATION
        self._context.set_optimization_profile_async(profile, self._stream.cuda_stream)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feeds |= dict(zip(self.manifest.past_names, cache))
        keep = []  # device tensors must outlive the launch
        for name, value in feeds.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value)).cuda()
            tensor = tensor.contiguous()
            keep.append(tensor)
            self._context.set_input_shape(name, tuple(tensor.shape))
            self._context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self.manifest.outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=_torch_dtype(torch, self._dtypes[name]), device="cuda")
            self._context.set_tensor_address(name, outputs[name].data_ptr())
        if not self._context.execute_async_v3(self._stream.cuda_stream):
            raise EngineError(f"TensorRT execution failed for {self.engine_dir.engine_file}")
        self._stream.synchronize()
        logits = outputs["logits"].float().cpu().numpy()
        return logits, [outputs[name] for name in self.manifest.outputs[1:]]

    def close(self) -> None:
        """Drop the execution context and engine before the stream, as TensorRT requires."""
        if self._stream is not None:
            self._stream.synchronize()
        self._context = self._engine = None
        self._stream = None


def _torch_dtype(torch, trt_dtype):
    import tensorrt as trt

    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64, trt.int32: torch.int32}[trt_dtype]
