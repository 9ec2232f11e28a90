"""Params fitted to a model directory where params.yaml is silent, before any work: the
context the model was made for, capped by what this machine's memory holds for the running
batch's KV cache; the name it registers under; and a refusal, naming both sizes, of a model
whose build this machine's memory cannot hold.

The defaults in params.yaml suit the small model kiln trains from scratch (256 positions);
a pretrained Llama or Qwen is made for 8k-128k, and its engine should take what it can.
Read from config.json and the weight files' sizes: no torch, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from components.config import Params, ShapeRange, model_name_for, scratch_model_problems, shape_problems
from components.errors import ConfigError
from components.families import shape_of
from components.model_dir import check_fits_model_directory, check_model_directory, pretrained_directory, read_config, stored_dtype
from components.resources import GIB, machine_memory

KV_BYTES = 4  # ONNX Runtime's engines keep the cache in fp32, whatever the weights' precision
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ROUND_TO = 256  # a derived context is a multiple of this many tokens (below it: as computed)


@dataclass(frozen=True)
class ContextFit:
    """How long a context the slots of one engine get on this machine, and why."""

    model_positions: int  # the model's own context (its sliding window where that is shorter)
    slots: int  # build.profiles.batch.max: sequences whose KV is held at once
    kv_bytes_per_token: int  # one sequence's KV cache per token
    weight_bytes: int  # the widest engine asked for, in memory
    memory_bytes: int  # this machine's (or its cgroup's) memory

    @property
    def kv_budget(self) -> int:
        """Half of what the weights leave: the other half for activations, the server, the OS."""
        return max(0, (self.memory_bytes - self.weight_bytes) // 2)

    @property
    def memory_tokens(self) -> int:
        """Tokens of context every slot can hold at once within the budget."""
        return self.kv_budget // (self.slots * self.kv_bytes_per_token)

    @property
    def context(self) -> int:
        fits = self.memory_tokens
        return min(self.model_positions, fits - fits % ROUND_TO if fits >= ROUND_TO else fits)

    @property
    def capped(self) -> bool:
        return self.context < self.model_positions

    def note(self) -> str:
        """The line a run prints: the context it chose, and the cap where memory set it."""
        chosen = f"build.profiles.context.max {self.context} from the model's {self.model_positions} positions"
        if not self.capped:
            return chosen
        kv = self.slots * self.context * self.kv_bytes_per_token
        return (
            f"{chosen}, capped by memory: {self.slots} slots × {self.context} tokens × {self.kv_bytes_per_token / 1024:.0f} KiB of KV "
            f"= {kv / GIB:.1f} GiB, half of what {self.memory_bytes / GIB:.1f} GiB leave after {self.weight_bytes / GIB:.1f} GiB of weights "
            f"(build.profiles.context or a smaller batch.max sets it)"
        )


def fit_for_run(params: Params, params_file: Path, root: Path, model_dir: Path | None = None) -> tuple[Params, list[str]]:
    """The params a run builds with, before any work: fitted to the model directory it builds
    (`model_dir`, else model.pretrained), or checked against the context of the model it
    trains from scratch. The lines saying what was derived."""
    if model_dir is None and params.model.pretrained:
        model_dir = pretrained_directory(params.model.pretrained, root)
    if model_dir is not None:
        return fit_to_model(params, model_dir)
    problems = scratch_model_problems(params)
    if problems:
        raise ConfigError(f"{params_file}: " + "; ".join(problems))
    return params, []


def fit_to_model(params: Params, model_dir: Path) -> tuple[Params, list[str]]:
    """A model directory of a family kiln builds, and `params` fitted to it (its context, and
    its name where neither params.yaml nor model.pretrained gives one) and checked against
    it: in seconds, before any work. The lines saying what was derived."""
    check_model_directory(model_dir)
    check_build_memory(model_dir, machine_memory(), _widest(params))
    params, note = with_model_context(params, model_dir)
    params, named = named_after(params, model_dir)
    check_fits_model_directory(model_dir, params.build.profiles, params.sample)
    return params, [line for line in (note, named) if line]


# What the stages hold at their peak, per byte of the model's weights, measured on a
# Llama-3.2-1B shape (docs/performance.md, "A model's size and the build's memory"): the
# export's parity check loads the model in fp32 and then ONNX Runtime's session of the fp32
# graph (the stage at 1.7x its fp32 bytes; where that does not fit, it checks the first
# layers alone); the gates hold the model, with its checkpoint's pages mapped while it loads
# (1.3x), beside the engine they run where both fit, else one after the other. The export,
# precision and engine stages write weights one at a time; none holds the model twice.
EXPORT_PEAK_PER_FP32_BYTE = 1.7
REFERENCE_PEAK_PER_BYTE = 1.3  # the model as loaded, its checkpoint's pages mapped beside it
BUILD_PEAK_OVERHEAD = 2 * GIB  # Python, torch, ONNX Runtime and Prefect, and the gates' activations (3B int8: 12.6 GiB measured)
# The gates' PyTorch model is fp32 where that takes at most this share of the machine's
# memory, else the dtype it was saved in: a Llama-3.2-3B shape's int8 build was killed on a
# 24 GB machine loading its 12 GiB fp32 model beside the engine, with the stages' gigabytes
# of files still being written out.
REFERENCE_FP32_SHARE = 0.4


def reference_dtype(model_dir: Path, memory: int) -> str:
    """The dtype the gates compute the model in: float32, or where its fp32 weights would take
    more than REFERENCE_FP32_SHARE of `memory`, the dtype they were saved in (say bfloat16)."""
    return "float32" if parameter_count(model_dir) * 4 <= REFERENCE_FP32_SHARE * memory else stored_dtype(model_dir)


def export_parity_fits(parameters: int, memory: int) -> bool:
    """Whether the export's parity check can hold the whole model in fp32 and its graph's
    session in `memory`; else it checks the model's first layers (components.export)."""
    return parameters * 4 * EXPORT_PEAK_PER_FP32_BYTE + BUILD_PEAK_OVERHEAD <= memory


def build_memory(parameters: int, widest: str = "fp32", reference: str = "float32") -> int:
    """Bytes the stages need at their peak to build a model of `parameters` on this CPU, its
    widest engine in `widest`: the gates', which hold the model in `reference` and the
    engine, one after the other where both do not fit at once (components.reference). The
    export's parity check takes the whole model in fp32 only where it fits."""
    return int(max(reference_bytes(parameters, reference), parameters * BYTES_PER_WEIGHT[widest]) + BUILD_PEAK_OVERHEAD)


def reference_bytes(parameters: int, dtype: str) -> int:
    """The gates' PyTorch model of `parameters` in `dtype` at its peak, as it loads."""
    return int(parameters * STORED_BYTES[dtype] * REFERENCE_PEAK_PER_BYTE)


def reference_beside_engine(model_dir: Path, dtype: str, engine_dir: Path, memory: int) -> bool:
    """Whether the gates can hold the model in `dtype` and the engine at once in `memory`;
    else they compute the model first and free it before the engine loads."""
    engine_bytes = sum(f.stat().st_size for f in engine_dir.rglob("*") if f.is_file())
    return reference_bytes(parameter_count(model_dir), dtype) + engine_bytes + BUILD_PEAK_OVERHEAD <= memory


def check_build_memory(model_dir: Path, memory: int, widest: str = "fp32") -> None:
    """ConfigError, before any work, where the stages would need more memory than `memory`."""
    check_parameters_fit(parameter_count(model_dir), memory, str(model_dir), widest, reference_dtype(model_dir, memory))


def side_by_side_memory(parameters: int, widest: str = "fp32", reference: str = "float32") -> int:
    """Bytes to hold the model in `reference` and its `widest` engine at once, as `kiln bench`
    times them, interleaved."""
    return reference_bytes(parameters, reference) + int(parameters * BYTES_PER_WEIGHT[widest]) + BUILD_PEAK_OVERHEAD


def check_parameters_fit(
    parameters: int, memory: int, what: str, widest: str = "fp32", reference: str = "float32", side_by_side: bool = False
) -> None:
    """ConfigError naming both sizes where the build (or, `side_by_side`, the model beside its
    engine) needs more than `memory`."""
    needed = (side_by_side_memory if side_by_side else build_memory)(parameters, widest, reference)
    how = f"it runs in {reference} beside its {widest} engine" if side_by_side else f"the gates compute it in {reference}, and run its {widest} engine"
    if needed > memory:
        raise ConfigError(
            f"{what} is too big to build here: {parameters / 1e9:.2f}B parameters need about {needed / GIB:.1f} GiB "
            f"at the stages' peak ({how}), and this machine has {memory / GIB:.1f} GiB; build it on a machine with more memory"
        )


def named_after(params: Params, model_dir: Path) -> tuple[Params, str | None]:
    """`kiln build --model DIR` with no name in params.yaml registers DIR under DIR's name,
    and says how the other verbs, which read only params.yaml, find it."""
    if params.model.pretrained or "model_name" in params.registry.model_fields_set:
        return params, None
    name = model_name_for(params.model.model_copy(update={"pretrained": str(model_dir)}))
    named = params.model_copy(update={"registry": params.registry.model_copy(update={"model_name": name})})
    return named, f"registered as {name}, the model directory's name: registry.model_name: {name} in params.yaml names it for kiln serve and kiln promote too"


def with_model_context(params: Params, model_dir: Path) -> tuple[Params, str | None]:
    """`params` with the context derived from `model_dir` where params.yaml sets none, and the
    line that says so (None where params.yaml set it). ConfigError where what the gates and
    the sample ask no longer fits, or the weights leave no memory for any context."""
    profiles = params.build.profiles
    if "context" in profiles.model_fields_set:
        return params, None
    fit = context_fit(params, model_dir)
    if fit.context < 2:
        raise ConfigError(
            f"{model_dir} does not fit this machine: {fit.weight_bytes / GIB:.1f} GiB of weights at "
            f"{_widest(params)} leave no room for the KV cache of {fit.slots} slots in {fit.memory_bytes / GIB:.1f} GiB "
            f"(build a smaller precision, lower build.profiles.batch.max, or use a machine with more memory)"
        )
    context = profiles.context
    fitted_context = ShapeRange(min=min(context.min, fit.context), opt=min(context.opt, fit.context), max=fit.context)
    build = params.build.model_copy(update={"profiles": profiles.model_copy(update={"context": fitted_context})})
    fitted = params.model_copy(update={"build": build})
    problems = shape_problems(fitted)
    if problems:
        raise ConfigError(f"{fit.note()}; then " + "; ".join(problems))
    return fitted, fit.note()


def context_fit(params: Params, model_dir: Path) -> ContextFit:
    shape = shape_of(read_config(model_dir), f"model directory {model_dir}")
    positions = min(shape.max_positions, shape.sliding_window or shape.max_positions)
    return ContextFit(
        model_positions=positions,
        slots=params.build.profiles.batch.max,
        kv_bytes_per_token=2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * KV_BYTES,
        weight_bytes=int(parameter_count(model_dir) * BYTES_PER_WEIGHT[_widest(params)]),
        memory_bytes=machine_memory(),
    )


def _widest(params: Params) -> str:
    return max(params.precision.build, key=BYTES_PER_WEIGHT.__getitem__, default="fp32")


def parameter_count(model_dir: Path) -> int:
    """The model's parameters, from its weight files' sizes and stored dtype (headers are a
    few KB of gigabytes: close enough for a memory budget)."""
    files = [*model_dir.glob("*.safetensors")] or [*model_dir.glob("*.bin")]
    return sum(f.stat().st_size for f in files) // STORED_BYTES[stored_dtype(model_dir)]
