"""The TensorRT backend (TensorRT 11 API through Polygraphy's loaders).

Build: a strongly typed network parsed from the precision ONNX file (precision lives in
the graph: TensorRT 11 has no FP16/INT8 builder flags), two optimization profiles
(context phase: past 0; generation phase: one new token, growing past), a workspace
memory-pool limit, a timing cache reused across builds, and a builder optimization level.

Run: KV-cache generation through `execute_async_v3` on CUDA buffers held as torch tensors.
An engine is tied to the TensorRT version and GPU architecture it was built for; loading
refuses a mismatch and says both.

Everything that needs TensorRT itself happens inside functions, so the build plan and the
Polygraphy loaders can be constructed (and tested) on machines without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.components.engine_dir import EngineDir, EngineManifest, Lineage, ShapeProfile
from kiln.components.engines.base import Engine
from kiln.components.engines.packaging import BackendBuild, package_engine, profiles_from_params
from kiln.components.precision import PrecisionOnnx
from kiln.config import BuildParams, section_digest
from kiln.errors import BackendUnavailable, BuildError

BACKEND = "tensorrt"
ENGINE_FILE = "model.engine"
MIB = 1 << 20

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TrtBuildPlan:
    """Everything the TensorRT build is asked to do, as plain values."""

    onnx_path: Path
    strongly_typed: bool
    # One dict per optimization profile: input name → (min, opt, max) shapes.
    profiles: tuple[dict[str, tuple[Shape, Shape, Shape]], ...]
    workspace_bytes: int
    timing_cache: Path
    optimization_level: int


def trt_build_plan(graph: PrecisionOnnx, params: BuildParams, timing_cache: Path) -> TrtBuildPlan:
    return TrtBuildPlan(
        onnx_path=graph.onnx.path,
        strongly_typed=True,
        profiles=tuple(
            profile_shapes(graph.onnx.layout, phase) for phase in profiles_from_params(params.profiles).values()
        ),
        workspace_bytes=params.tensorrt.workspace_mib * MIB,
        timing_cache=timing_cache,
        optimization_level=params.tensorrt.optimization_level,
    )


def profile_shapes(layout, phase: ShapeProfile) -> dict[str, tuple[Shape, Shape, Shape]]:
    """min / opt / max shape of every input in one phase; ranges agree across inputs
    (the mask spans past + new tokens), or TensorRT refuses the profile."""

    def at(which: str) -> dict[str, Shape]:
        batch = getattr(phase.batch, which)
        new = getattr(phase.sequence, which)
        past = getattr(phase.past, which)
        kv = (batch, layout.num_heads, past, layout.head_dim)
        return {"input_ids": (batch, new), "attention_mask": (batch, past + new), "position_ids": (batch, new)} | {
            name: kv for name in layout.past_names
        }

    low, opt, high = at("min"), at("opt"), at("max")
    return {name: (low[name], opt[name], high[name]) for name in low}


class _WorkspaceLimit(Mapping):
    """{trt.MemoryPoolType.WORKSPACE: bytes}, resolved when Polygraphy builds: the key is an
    enum of the tensorrt module, which must not be needed to construct the loaders."""

    def __init__(self, workspace_bytes: int) -> None:
        self.workspace_bytes = workspace_bytes

    def _as_dict(self) -> dict:
        import tensorrt as trt

        return {trt.MemoryPoolType.WORKSPACE: self.workspace_bytes}

    def __getitem__(self, key):
        return self._as_dict()[key]

    def __iter__(self) -> Iterator:
        return iter(self._as_dict())

    def __len__(self) -> int:
        return 1


@dataclass(frozen=True)
class TrtLoaders:
    network: object
    config: object
    engine_bytes: object


def polygraphy_loaders(plan: TrtBuildPlan) -> TrtLoaders:
    """The Polygraphy loader chain; calling `engine_bytes()` builds (needs TensorRT)."""
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    profiles = []
    for shapes in plan.profiles:
        profile = Profile()
        for name, (low, opt, high) in shapes.items():
            profile.add(name, min=low, opt=opt, max=high)
        profiles.append(profile)
    # Parsed from the file, not bytes: the export may keep weights in a side file.
    network = NetworkFromOnnxPath(str(plan.onnx_path), strongly_typed=plan.strongly_typed)
    config = CreateConfig(
        profiles=profiles,
        memory_pool_limits=_WorkspaceLimit(plan.workspace_bytes),
        load_timing_cache=str(plan.timing_cache),
        builder_optimization_level=plan.optimization_level,
    )
    return TrtLoaders(network, config, EngineBytesFromNetwork(network, config, save_timing_cache=str(plan.timing_cache)))


def trt_engine_from_onnx(
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path
) -> EngineDir:
    """Build a TensorRT engine directory (needs TensorRT and an NVIDIA GPU)."""
    build = BackendBuild(BACKEND, tensorrt_version(), gpu_target(), ENGINE_FILE)
    target = out_root / f"{BACKEND}-{graph.precision}-{build.target}-{section_digest(params)[:8]}-{graph.onnx.sha256[:12]}"
    plan = trt_build_plan(graph, params, Path(params.tensorrt.timing_cache).resolve())

    def write_engine(path: Path) -> None:
        plan.timing_cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.write_bytes(bytes(polygraphy_loaders(plan).engine_bytes()))
        except Exception as err:  # TensorRT reports build failures as generic exceptions
            raise BuildError(f"TensorRT could not build {graph.onnx.path}: {err}") from err

    return package_engine(target, write_engine, build, graph, tokenizer_dir, lineage, params.profiles)


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
            raise BuildError(f"TensorRT could not deserialize {engine_dir.engine_file}")
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
            raise BuildError(f"TensorRT execution failed for {self.engine_dir.engine_file}")
        self._stream.synchronize()
        logits = outputs["logits"].float().cpu().numpy()
        return logits, [outputs[name] for name in self.manifest.outputs[1:]]


def _torch_dtype(torch, trt_dtype):
    import tensorrt as trt

    return {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64, trt.int32: torch.int32}[trt_dtype]
