"""Building for the torch-cuda backend: the trained model as a static-KV program.

The engine file is a `torch.export` ExportedProgram of the static-KV model's forward
(`StaticKVGPT2` for GPT-2, `StaticKVLlama` for Llama, Qwen2 and Mistral; one function for
prefill, decode and scoring; the caches are mutated inputs), with the batch,
token count, attended length and picked positions dynamic and the cache's shape fixed by
the profile (slots = the batch profile's max, context = the context profile's max). It is
built from the Hugging Face model directory, not from the precision ONNX: the dtype (fp32,
fp16, bf16) is the program's weights; fp8 keeps each layer's projections in e4m3 with a
scale per output row and computes in bf16 (Ada and Hopper GPUs, the Llama family); int8
has no torch-cuda form. The model is loaded
in the dtype it was saved in (an 8B bf16 model takes 16 GB of host memory, not fp32's 32)
and cast on the device, layer by layer.

`engine.json` records torch's and CUDA's versions and the GPU architecture the program
was built on (`sm_90`), or `cpu` for a program built without CUDA (kiln's CPU tests);
components.runtime.torch_cuda refuses to load one elsewhere, naming both.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from components.build.packaging import BackendBuild, engine_folder, eos_id, profiles_from_params, write_chat_template
from components.config import ProfileParams, section_digest
from components.engine_dir import MANIFEST, TOKENIZER_FILES, EngineDir, EngineManifest, Lineage, ParityRecord, load_engine_dir, write_manifest
from components.errors import BuildError
from components.families import shape_of
from components.files import file_sha256, stage_output
from components.model_dir import eos_token_ids, stored_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BACKEND = "torch-cuda"
ENGINE_FILE = "model.pt2"
PROGRAM_INPUTS = ["input_ids", "positions", "attn_bias", "picked", "k_cache", "v_cache"]
# bf16 measured no faster than fp16 and less exact (docs/performance.md#on-the-gpu), but
# it is the dtype Llama 3 and Qwen2.5 are published in: their own rounding, and fp16's range.
# The dtype each precision computes in; fp8 and int4 keep their projections' weights in e4m3
# or 4-bit codes and compute the rest in bf16 (what the FP8 GEMM and the int4 kernel write).
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "bfloat16", "int4": "bfloat16"}
WEIGHT_FORMAT = {"fp8": "fp8", "int4": "int4"}  # the rest: dense weights in the precision's dtype
SOURCE_PRECISION = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # a model's saved dtype, as a precision
# Largest logit difference from the PyTorch model that a build accepts: fp32 differs by
# summation order only, fp16 by its rounding (3.3e-3 measured on the H200 for GPT-2 small),
# bf16 by 8x fp16's (8 significant bits to 11), so 8x its tolerance; fp8 (e4m3: 4
# significant bits, weights and activations) 16x bf16's: a bound that catches a wrong scale
# or layout, while the quality gate holds fp8 to int8's limits; int4 (16 levels across each
# group of 128 weights) twice fp8's, the gate holding it to int4's limits. A model saved in
# bf16 computes in bf16 itself, and its tolerance is added (parity_tolerance).
PARITY_TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 0.4, "fp8": 6.4, "int4": 12.8}
FP8_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores; torch._scaled_mm needs them


def torch_target(device: str) -> str:
    """`sm_XY` of the CUDA device the program is built and run on, or `cpu`."""
    import torch

    if device == "cpu":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def torch_versions() -> dict[str, str]:
    """What a program depends on: torch, the CUDA it was built with, the GPU by name."""
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def torch_engine_from_model(
    model_dir: Path, precision: str, lineage: Lineage, profiles: ProfileParams, out_root: Path, device: str = "cuda", memory_utilization: float = 0.9
) -> EngineDir:
    """A torch-cuda engine directory for `model_dir` in `precision`, built on `device`; on a
    GPU its cache holds as many of `profiles.batch.max` sequences as `memory_utilization` of
    the card leaves room for (components.runtime.gpu_memory)."""
    import torch

    if precision not in DTYPES:
        raise BuildError(f"the torch-cuda backend builds {', '.join(DTYPES)}; precision {precision} has no torch-cuda form (use onnxruntime or tensorrt)")
    if device != "cpu" and not torch.cuda.is_available():
        raise BuildError(f"the torch-cuda backend needs a CUDA GPU; torch {torch.__version__} sees none")
    if precision == "fp8" and device != "cpu":
        _check_fp8_gpu(torch.cuda.get_device_capability(torch.device(device)), torch.cuda.get_device_name(torch.device(device)))
    build = BackendBuild(BACKEND, torch.__version__, torch_target(device), ENGINE_FILE)
    identity = (section_digest(profiles)[:8], lineage.source_model_sha256[:12])
    target = engine_folder(out_root, build, precision, *identity)

    def fill(staging: Path) -> None:
        hf = hf_model(model_dir)
        _check_full_attention(hf.config, profiles)
        if precision in WEIGHT_FORMAT:
            _check_quantizable(hf.config, precision)
        program, parity, sized = _export_checked(hf, precision, profiles, device, memory_utilization)
        _drop_stack_traces(program)
        torch.export.save(program, staging / ENGINE_FILE)
        for name in TOKENIZER_FILES:
            shutil.copyfile(model_dir / name, staging / name)
        template_sha256 = write_chat_template(staging, model_dir)
        write_manifest(staging, _manifest(staging, build, hf, precision, model_dir, lineage, sized, parity).model_copy(update={"chat_template_sha256": template_sha256}))

    return load_engine_dir(stage_output(target, MANIFEST, fill))


def _check_fp8_gpu(capability: tuple[int, int], name: str) -> None:
    """FP8 engines need FP8 tensor cores (sm_89 and newer); say which GPU lacks them."""
    if tuple(capability) < FP8_CAPABILITY:
        major, minor = capability
        raise BuildError(
            f"fp8 engines need a GPU with FP8 tensor cores (compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer: Ada, Hopper, Blackwell); "
            f"this {name} is sm_{major}{minor} (build bf16 or fp16 on it)"
        )


def _check_quantizable(config, precision: str) -> None:
    """fp8 and int4 programs are the Llama family's; int4's kernel takes inputs in groups of
    128 (INT4_GROUP) and outputs in multiples of 8."""
    from components.runtime.static_kv import INT4_GROUP, LlamaShape

    if config.model_type == "gpt2":
        raise BuildError(f"{precision} engines are built for the Llama family (Llama, Qwen2, Mistral); GPT-2 builds fp32, fp16 or bf16")
    if precision != "int4":
        return
    shape = LlamaShape.from_hf_config(config)
    widths = {"hidden_size": shape.hidden_size, "num_attention_heads × head_dim": shape.num_heads * shape.head_dim, "intermediate_size": shape.intermediate_size}
    odd = [f"{name} {width}" for name, width in widths.items() if width % INT4_GROUP]
    if odd:
        verb = "is not a multiple" if len(odd) == 1 else "are not multiples"
        raise BuildError(f"int4 engines quantize each projection's inputs in groups of {INT4_GROUP}; this model's {' and '.join(odd)} {verb} of {INT4_GROUP} (build bf16 or fp8)")


def _drop_stack_traces(program: torch.export.ExportedProgram) -> None:
    """torch.export keeps each node's stack trace (absolute file paths, line numbers) in the
    saved program: the same model built from another checkout or virtualenv was another
    file, so another engine to the registry. The module stack, which names no file, stays."""
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)


def _check_full_attention(config, profiles: ProfileParams) -> None:
    """The static program attends to the whole context: a sliding window (Mistral) must
    reach past the longest context the profiles allow, where it changes nothing."""
    window = shape_of(config.to_dict()).sliding_window
    if window is not None and profiles.context.max > window:
        raise BuildError(f"the model attends within a sliding window of {window} tokens, shorter than build.profiles.context.max ({profiles.context.max}); the torch-cuda program attends to the whole context")


def hf_model(model_dir: Path):
    """The Hugging Face model on the host in the dtype it was saved in: a bf16 model is never
    copied to fp32, and an fp32 model stays the exact reference the parity check needs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=stored_dtype(model_dir)).eval()


def parity_tolerance(precision: str, source_dtype: str) -> float:
    """The program's rounding, plus the model's own where it computes in less than fp32: the
    reference is the model as saved, and a bf16 model's logits carry bf16's rounding too."""
    source = SOURCE_PRECISION[source_dtype]
    return PARITY_TOLERANCE[precision] + (PARITY_TOLERANCE[source] if source != "fp32" else 0.0)


def _export_checked(hf, precision: str, profiles: ProfileParams, device: str, memory_utilization: float):
    """The exported program, its parity with the model (checked against the tolerance), and
    the profiles it was exported for (on a GPU: as many slots as the card holds)."""
    import torch

    from components.runtime.static_kv import static_model_from_hf

    formats = {"weights": WEIGHT_FORMAT[precision]} if precision in WEIGHT_FORMAT else {}
    dtype = getattr(torch, DTYPES[precision])
    static = static_model_from_hf(hf, dtype=dtype, device=device, **formats)
    if device != "cpu":
        profiles = sized_to_the_card(static.shape, profiles, dtype.itemsize, device, memory_utilization)
    program = export_program(static, profiles.batch.max, profiles.context.max)
    tolerance = parity_tolerance(precision, str(hf.dtype).removeprefix("torch."))
    parity = program_parity(program.module(), hf, profiles.batch.max, profiles.context.max, device, tolerance)
    if max(parity.prefill_max_abs_diff, parity.decode_max_abs_diff) > parity.tolerance:
        raise BuildError(
            f"the {precision} torch-cuda program differs from the PyTorch model by {max(parity.prefill_max_abs_diff, parity.decode_max_abs_diff):.3g} "
            f"in its logits (tolerance {parity.tolerance:g})"
        )
    return program, parity, profiles


def sized_to_the_card(shape, profiles: ProfileParams, dtype_bytes: int, device: str, memory_utilization: float) -> ProfileParams:
    """`profiles` with batch.max the slots that fit on the card now that the weights are on it."""
    from components.config import ShapeRange
    from components.runtime.gpu_memory import CardMemory, activations_of, plan_slots, slot_bytes_of

    card, context, batch = CardMemory.of(device), profiles.context.max, profiles.batch
    activations = activations_of(shape, batch.max, profiles.prompt.max, dtype_bytes)
    plan = plan_slots(card, memory_utilization, activations, slot_bytes_of(shape, context, dtype_bytes), context, batch.min, batch.max)
    log.info(plan.text(card))
    return profiles.model_copy(update={"batch": ShapeRange(min=batch.min, opt=min(batch.opt, plan.slots), max=plan.slots)})


def export_program(model, num_slots: int, max_context: int):
    """`model.forward` exported with the cache shape baked in (slots × context) and every
    other size dynamic. The example inputs are dropped before saving: they hold the two
    full-size caches (1.2 GB at 16 slots × 1024 in fp32)."""
    import torch
    from torch.export import Dim

    from components.runtime.static_kv import causal_bias

    k_cache, v_cache = model.new_cache(num_slots, max_context)
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    # Example sizes of at least 2 everywhere: export specialises a size-1 dimension to 1.
    batch, tokens, attended = min(2, num_slots), 3, 16
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).expand(batch, tokens).contiguous()
    bias = causal_bias(positions, torch.arange(attended, device=device), dtype)
    picked = torch.arange(2, device=device).expand(batch, 2).contiguous()
    width = Dim("tokens", min=1, max=max_context)
    rows = {0: Dim("rows", min=1, max=num_slots)} if num_slots > 1 else {}  # one slot: one row, a static size
    dynamic = {
        "input_ids": rows | {1: width},
        "positions": rows | {1: width},
        "attn_bias": rows | {2: width, 3: Dim("attended", min=1, max=max_context)},
        "picked": rows | {1: Dim("picked", min=1, max=max_context)},
        "k_cache": None,
        "v_cache": None,
    }
    with torch.no_grad():
        program = torch.export.export(model, (ids, positions, bias, picked, k_cache, v_cache), dynamic_shapes=dynamic, strict=False)
    program.example_inputs = None
    return program


def program_parity(program, hf, num_slots: int, max_context: int, device: str, tolerance: float, decode_steps: int = 3) -> ParityRecord:
    """Largest logit difference between the program and the Hugging Face model (in the dtype
    it was saved in): every position of a two-row prompt batch (one row for a one-slot
    program), then `decode_steps` greedy steps on the cache."""
    import torch

    from components.runtime.static_kv import causal_bias, new_cache, static_shape

    generator = torch.Generator().manual_seed(0)
    rows = min(2, num_slots)
    prompt = torch.randint(0, hf.config.vocab_size, (rows, 7), generator=generator)
    steps = torch.randint(0, hf.config.vocab_size, (rows, decode_steps), generator=generator)
    weight = next(program.parameters())
    k_cache, v_cache = new_cache(static_shape(hf.config), num_slots, max_context, weight.dtype, weight.device)  # the program's own cache shape
    keys = torch.arange(max_context, device=device)
    with torch.no_grad():
        reference = hf(torch.cat([prompt, steps], dim=1)).logits.float()
        P = prompt.shape[1]
        positions = torch.arange(P, device=device).expand(rows, P)
        ours = program(prompt.to(device), positions, causal_bias(positions, keys, weight.dtype), positions, k_cache, v_cache)
        prefill = float((ours.float().cpu() - reference[:, :P]).abs().max())
        decode = 0.0
        for step in range(decode_steps):
            at = torch.full((rows, 1), P + step, device=device)
            logits = program(steps[:, step : step + 1].to(device), at, causal_bias(at, keys, weight.dtype), torch.zeros_like(at), k_cache, v_cache)
            decode = max(decode, float((logits[:, 0].float().cpu() - reference[:, P + step]).abs().max()))
    return ParityRecord(prefill_max_abs_diff=prefill, decode_max_abs_diff=decode, tolerance=tolerance)


def _manifest(staging: Path, build: BackendBuild, hf, precision: str, model_dir: Path, lineage: Lineage, profiles: ProfileParams, parity: ParityRecord) -> EngineManifest:
    from components.runtime.static_kv import static_shape

    shape = shape_of(hf.config.to_dict())
    return EngineManifest(
        backend=build.backend,
        backend_version=build.version,
        precision=precision,
        target=build.target,
        opset=None,
        engine_file=build.engine_file,
        engine_sha256=file_sha256(staging / build.engine_file),
        inputs=PROGRAM_INPUTS,
        outputs=["logits"],
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_positions=shape.max_positions,
        eos_token_id=eos_id(model_dir),
        profiles=profiles_from_params(profiles),
        lineage=lineage,
        parity=parity,
        # The static model's own shape, which the runtime reads back (static_shape_from_json).
        runtime=torch_versions() | {"shape": json.dumps(asdict(static_shape(hf.config)))},
        model_family=shape.family,
        num_kv_heads=shape.num_kv_heads,
        eos_token_ids=eos_token_ids(model_dir),
        # parameters() yields a tied embedding once.
        parameter_count=sum(p.numel() for p in hf.parameters()),
    )
