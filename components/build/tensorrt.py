"""Building for TensorRT (TensorRT 11 API through Polygraphy's loaders): a strongly typed network parsed from the precision ONNX file (precision lives in
the graph: TensorRT 11 has no FP16/INT8 builder flags), two optimization profiles
(context phase: past 0; generation phase: one new token, growing past), a workspace
memory-pool limit, a timing cache reused across builds, and a builder optimization level.

The engine records the TensorRT version and GPU architecture it was built for
(components.runtime.tensorrt refuses a mismatch at load).

Everything that needs TensorRT itself happens inside functions, so the build plan and the
Polygraphy loaders can be constructed (and tested) on machines without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from components.build.packaging import BackendBuild, engine_folder, package_engine, profiles_from_params
from components.config import BuildParams, section_digest
from components.engine_dir import LOGITS_POSITIONS, EngineDir, Lineage, ShapeProfile
from components.errors import BuildError
from components.precision import PrecisionOnnx
from components.runtime.tensorrt import gpu_target, tensorrt_version

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
        kv = (batch, layout.num_kv_heads, past, layout.head_dim)
        kept = new if which == "max" else 1  # whose logits are computed: a prefill's last position, up to scoring's every one
        return {"input_ids": (batch, new), "attention_mask": (batch, past + new), "position_ids": (batch, new), LOGITS_POSITIONS: (kept,)} | {
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
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path, timing_cache: Path
) -> EngineDir:
    """Build a TensorRT engine directory (needs TensorRT and an NVIDIA GPU); `timing_cache`
    is read before and written after the build, so the next build starts from it."""
    build = BackendBuild(BACKEND, tensorrt_version(), gpu_target(), ENGINE_FILE)
    target = engine_folder(out_root, build, graph.precision, section_digest(params)[:8], graph.onnx.sha256[:12])
    plan = trt_build_plan(graph, params, timing_cache)

    def write_engine(path: Path) -> None:
        plan.timing_cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.write_bytes(bytes(polygraphy_loaders(plan).engine_bytes()))
        except Exception as err:  # TensorRT reports build failures as generic exceptions
            raise BuildError(f"TensorRT could not build {graph.onnx.path}: {err}") from err

    return package_engine(target, write_engine, build, graph, tokenizer_dir, lineage, params.profiles)
