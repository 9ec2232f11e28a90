"""The generation benchmark behind `kiln bench`: Hugging Face `generate` (eager, fp32) vs
kiln engines, in one process, interleaved so that a busy machine slows all rows alike.

It wires the pipeline's own export, precision and build stages (without Prefect) on a
model of a known shape (GPT-2 small, 124M parameters; SmolLM2-135M, a Llama; random
weights: speed does not depend on them).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from components.config import TORCH_CUDA_ONLY_PRECISIONS, Precision
from components.errors import KilnError
from components.progress import stage_progress
from components.read_floor import ReadFloor, memory_bandwidth, onnx_read_bytes
from components.resources import Usage, measured, release_freed_memory

from benchmarks.footprint import CostLog, StageCost, serving_cost

COST_LOG = "stage-costs.json"
HF_ROW = "hf-eager-fp32"  # the baseline of the CPU bench's speed-up column

# Each shape is its family's transformers config, with the family named.
GPT2_SMALL = {"family": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "n_positions": 1024}
SMOLLM2_135M = {
    "family": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 100000.0,
}  # fmt: skip
# The sizes deployed on CPUs, as their config.json has them (random weights: speed does not depend on them).
QWEN25_05B = {
    "family": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0,
}  # fmt: skip
LLAMA32_1B = {
    "family": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 500000.0,
}  # fmt: skip
LLAMA32_3B = LLAMA32_1B | {"num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 24, "head_dim": 128, "intermediate_size": 8192}
# The sizes served on one GPU.
LLAMA31_8B = {
    "family": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
QWEN25_7B = {
    "family": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1000000.0,
}  # fmt: skip
# `kiln bench --shape tiny`: seconds instead of minutes, to check that the bench runs (not to measure).
TINY = {"family": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 300, "n_positions": 256}
SHAPES = {
    "gpt2-small": GPT2_SMALL, "smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_05B, "llama3.2-1b": LLAMA32_1B, "llama3.2-3b": LLAMA32_3B,
    "llama3.1-8b": LLAMA31_8B, "qwen2.5-7b": QWEN25_7B, "tiny": TINY,
}  # fmt: skip
# The dtype each shape's checkpoints are published in: both benches build their model so
# (an 8B model in fp32 would take 32 GB to build; the ONNX export reads it in fp32 anyway).
PUBLISHED_DTYPE = {name: "bfloat16" for name in ("qwen2.5-0.5b", "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "qwen2.5-7b")}
# `--precisions` names beside the precisions: int8 in TensorRT's Q/DQ form, run by ONNX
# Runtime, to time it against ONNX Runtime's own int8 (weight blocks) in one run.
VARIANTS = {"int8-qdq": ("int8", "qdq")}
# The CPU bench times ONNX Runtime engines: bf16 is the torch-cuda backend's alone.
ORT_PRECISIONS = [p for p in get_args(Precision) if p not in TORCH_CUDA_ONLY_PRECISIONS]


@dataclass(frozen=True)
class BenchRow:
    name: str
    median_ms: float
    ms_per_token: float
    speedup_vs_hf: float | None  # None where the bench had no Hugging Face row (hf_left_out)
    runs_ms: tuple[float, ...]


@dataclass(frozen=True)
class BenchSetup:
    prompt_tokens: int = 32
    new_tokens: int = 128
    runs: int = 5
    warmup: int = 1
    calibration_prompts: int = 16
    seed: int = 0


def benchmark_model_dir(directory: Path, shape: dict = GPT2_SMALL, seed: int = 0, widest: str = "fp32") -> Path:
    """A model directory of `shape` with random weights in the dtype its checkpoints are
    published in (and non-zero biases, as a trained model has) plus a small BPE tokenizer so
    it is a complete model directory; refused before any work where its build, `widest` its
    widest engine, cannot fit this machine."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from components.model_fit import check_parameters_fit
    from components.resources import machine_memory

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    family, config = shape["family"], {k: v for k, v in shape.items() if k != "family"}
    dtype = PUBLISHED_DTYPE.get(shape_name(shape), "float32")
    with torch.device("meta"):  # counted before gigabytes are drawn: refused here, named, not killed midway
        parameters = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config)).num_parameters()
    check_parameters_fit(parameters, machine_memory(), f"the {shape_name(shape)} bench model", widest, dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config), dtype=getattr(torch, dtype)).eval()
    return saved_with_tokenizer(model, directory)


def hf_left_out(model_dir: Path, widest: str, memory: int) -> str | None:
    """Why Hugging Face's fp32 model is not timed beside the engines, where the two do not
    fit this machine at once (timed interleaved, both are held); None where they do."""
    from components.model_fit import parameter_count, side_by_side_memory
    from components.resources import GIB

    needed = side_by_side_memory(parameter_count(model_dir), widest)
    if needed <= memory:
        return None
    return f"{HF_ROW} left out: Hugging Face's fp32 model beside the {widest} engine needs about {needed / GIB:.1f} GiB, and this machine has {memory / GIB:.1f} GiB"


def saved_with_tokenizer(model, directory: Path) -> Path:
    """`model` (biases drawn non-zero, as a trained model has them) saved to `directory` with a
    small BPE tokenizer, so that it is a complete model directory."""
    import torch

    from components.config import ModelParams, TokenizerParams
    from components.train import tokenizer_from_texts

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.02)
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "def function(argument): return value " * 20]
    tokenizer = tokenizer_from_texts(texts, ModelParams(tokenizer=TokenizerParams(vocab_size=300, min_frequency=1)))
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def shape_name(shape: dict) -> str:
    return next((name for name, known in SHAPES.items() if known is shape), "custom")


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(count)]


def hf_generate_fn(model_dir: Path, prompt: list[int], new_tokens: int) -> Callable[[], None]:
    import torch

    from components.model_dir import load_model

    model = load_model(model_dir)
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def run() -> None:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return run


def engine_generate_fn(engine_path: Path, prompt: list[int], new_tokens: int, threads: int | None = None) -> Callable[[], None]:
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling

    engine = load_engine(engine_path, threads=threads)  # lives as long as the closure
    sampling = Sampling(max_new_tokens=new_tokens, stop_at_eos=False)
    return lambda: engine.generate([prompt], sampling)


@dataclass(frozen=True)
class SelfTimed:
    """A candidate that another program times and warms up (llama-bench): `run` returns its ms."""

    run: Callable[[], float]


Candidate = Callable[[], object] | SelfTimed


def time_interleaved(candidates: dict[str, Candidate], setup: BenchSetup) -> dict[str, list[float]]:
    """Warm each up, then run them in turn `runs` times: ms per generation, per candidate."""
    for candidate in candidates.values():
        for _ in range(0 if isinstance(candidate, SelfTimed) else setup.warmup):
            _timed_ms(candidate)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    with stage_progress("bench", total=setup.runs * len(candidates)) as advance:
        for _ in range(setup.runs):
            for name, candidate in candidates.items():
                samples[name].append(_timed_ms(candidate))
                advance(1, name)
    return samples


def _timed_ms(candidate: Candidate) -> float:
    if isinstance(candidate, SelfTimed):
        return candidate.run()
    start = time.perf_counter()
    candidate()
    return (time.perf_counter() - start) * 1000.0


def rows_from_samples(samples: dict[str, list[float]], new_tokens: int, baseline: str | None) -> list[BenchRow]:
    """Each candidate's median, with its speed-up over `baseline`'s (None: no baseline timed)."""
    base = statistics.median(samples[baseline]) if baseline else None
    rows = []
    for name, runs in samples.items():
        median = statistics.median(runs)
        rows.append(BenchRow(name, median, median / new_tokens, base / median if base else None, tuple(runs)))
    return rows


def write_json(
    rows: list[BenchRow], setup: BenchSetup, path: Path, batches: list[int] | None = None, costs: list[StageCost] = (), left_out: tuple[str, ...] = ()
) -> None:
    """The rows (and the stages' `costs`, and what was `left_out` and why) as JSON; `batches`
    gives each row's batch (default: all batch 1)."""
    batches = batches or [1] * len(rows)
    payload = {
        "setup": asdict(setup) | ({"batch": 1} if set(batches) == {1} else {}),
        "rows": [{k: v for k, v in asdict(r).items() if k != "runs_ms"} | {"batch": b, "runs_ms": list(r.runs_ms)} for r, b in zip(rows, batches, strict=True)],
    } | ({"stages": [asdict(c) for c in costs]} if costs else {}) | ({"left_out": list(left_out)} if left_out else {})
    path.write_text(json.dumps(payload, indent=2) + "\n")


def benchmark_calibration(work: Path, vocab: int, setup: BenchSetup):
    """Random-token prompts: with random weights there is no distribution to match, and the
    bench measures speed; quality is the gates' job on the trained model."""
    import hashlib

    from components.calibrate import CalibrationSet

    prompts = random_prompts(setup.calibration_prompts, setup.prompt_tokens, vocab, setup.seed + 1)
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return CalibrationSet(path=work, digest=digest, prompts=tuple(map(tuple, prompts)), decode_steps=2)


def benchmark_engines(work: Path, precisions: list[str], setup: BenchSetup, shape: dict = GPT2_SMALL, context: int | None = None) -> tuple[Path, dict[str, Path]]:
    """The benchmark model and an ONNX Runtime engine per precision, built by the pipeline's
    own stages (cached in `work` across invocations, with what each stage cost: `CostLog`);
    `context`: prompts and contexts up to that many tokens (else the build's default profile)."""
    from components.config import ExportParams, Int8Params, PrecisionParams
    from components.data import DataVersion
    from components.export import onnx_from_model
    from components.model_dir import model_from_directory

    model = model_from_directory(benchmark_model_dir(work / "model", shape, setup.seed, widest_precision(precisions)))
    costs = CostLog(work / COST_LOG)
    with costs.measure("export", work / "onnx"):
        # Random 124M weights give logits in the tens; fp32 reassociation differs by ~1e-4 there.
        onnx = onnx_from_model(model, ExportParams(parity_tolerance=1e-3), work / "onnx")
    calibration = benchmark_calibration(work, shape["vocab_size"], setup)
    settings = PrecisionParams(int8=Int8Params(calibration_method="minmax"))
    data = DataVersion(path=work, md5="benchmark")
    engines = {}
    for name in precisions:
        precision, scheme = VARIANTS.get(name, (name, "auto"))
        if precision not in ORT_PRECISIONS:
            raise KilnError(f"--precisions: {name!r} is not one of {', '.join([*ORT_PRECISIONS, *VARIANTS])}")
        variant = settings.model_copy(update={"int8": settings.int8.model_copy(update={"scheme": scheme})})
        with costs.building(f"{name} precision", work / "precision") as graph_cost, costs.building(f"{name} engine", work / "engines") as engine_cost:
            engines[name], graph, usages = _in_own_process(_engine, onnx, precision, calibration, variant, model, data, work, _build_params(context))
            graph_cost(usages[0])
            engine_cost(usages[1])
        costs.chain(engines[name], [onnx.path, graph])
    return model.path, engines


def widest_precision(precisions: list[str]) -> str:
    """The precision (of `--precisions`' names) whose engine takes the most memory."""
    from components.model_fit import BYTES_PER_WEIGHT

    return max((VARIANTS.get(p, (p,))[0] for p in precisions), key=BYTES_PER_WEIGHT.__getitem__)


def _build_params(context: int | None):
    from components.config import BuildParams, ProfileParams, ShapeRange

    if context is None:
        return BuildParams(backend="onnxruntime")
    profiles = ProfileParams(prompt=ShapeRange(min=1, opt=32, max=context), context=ShapeRange(min=2, opt=64, max=context))
    return BuildParams(backend="onnxruntime", profiles=profiles)


def _engine(onnx, precision: str, calibration, settings, model, data, work: Path, build) -> tuple[Path, Path, tuple[Usage, Usage]]:
    from components.build import engine_from_onnx
    from components.precision import precision_onnx

    with measured() as graph_usage:
        graph = precision_onnx(onnx, precision, calibration, settings, work / "precision")
    release_freed_memory()
    with measured() as engine_usage:
        engine = engine_from_onnx(graph, model, data, build, work / "engines", work)
    return engine.path, graph.onnx.path, (graph_usage, engine_usage)


def stage_costs(work: Path, engines: dict[str, Path], setup: BenchSetup, prompt: list[int]) -> list[StageCost]:
    """What building the bench's engines cost (where measured when built), then each engine
    process as `kiln serve` runs it, measured now."""
    log = CostLog(work / COST_LOG)
    built = dict.fromkeys(cost for path in engines.values() for cost in log.costs_of(path))  # one export for all
    served = [dataclasses.replace(serving_cost(path, prompt, setup.new_tokens), stage=f"{name} serve") for name, path in engines.items()]
    return [*built, *served]


def _in_own_process(fn: Callable, *args):
    """`fn(*args)` in a fresh process: what one engine's build held goes back to the OS with
    it (in one process, a 1B model's int4 build after its int8 one was killed for memory)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(fn, *args).result()


@dataclass(frozen=True)
class CpuBench:
    """What `kiln bench` on the CPU measured, and what it left out and why."""

    rows: list[BenchRow]
    costs: list[StageCost]
    left_out: tuple[str, ...] = ()


def benchmark_rows(
    work: Path, precisions: list[str], setup: BenchSetup, shape: str = "gpt2-small", peer: Callable[[Path], dict[str, Candidate]] | None = None
) -> CpuBench:
    """`kiln bench`: build (or reuse) the engines, time HF (where it fits beside them) and
    each engine interleaved; `peer` gives more candidates from the model directory (`kiln
    bench --peer`). Also what each stage cost, and each engine process as `kiln serve` runs
    it (before the timing, so that nothing else is held)."""
    from components.resources import machine_memory

    model_dir, engines = benchmark_engines(work / shape, precisions, setup, SHAPES[shape])
    prompt = random_prompts(1, setup.prompt_tokens, SHAPES[shape]["vocab_size"], setup.seed)[0]
    costs = stage_costs(work / shape, engines, setup, prompt)
    bandwidth = memory_bandwidth()  # before the timing: once, on a machine nothing of the bench yet loads
    left_out = hf_left_out(model_dir, widest_precision(precisions), machine_memory())
    candidates: dict[str, Candidate] = {} if left_out else {HF_ROW: hf_generate_fn(model_dir, prompt, setup.new_tokens)}
    candidates |= {f"kiln-ort-{p}": engine_generate_fn(path, prompt, setup.new_tokens) for p, path in engines.items()}
    candidates |= peer(model_dir) if peer else {}
    rows = rows_from_samples(time_interleaved(candidates, setup), setup.new_tokens, baseline=None if left_out else HF_ROW)
    floors = [onnx_floor_row(rows, p, path, bandwidth, setup) for p, path in engines.items()]
    return CpuBench(rows + floors, costs, (left_out,) if left_out else ())


def read_floor_row(rows: list[BenchRow], baseline: str, precision: str, kiln: str, floor: ReadFloor, setup: BenchSetup) -> BenchRow:
    """The generation's floor (`setup.new_tokens` steps, a row computed, not timed), named with
    the `kiln` row's ratio to it (and its speed-up over `baseline`'s, where that was timed)."""
    floor_ms = floor.ms(setup.new_tokens)
    by_name = {row.name: row for row in rows}
    peer = by_name.get(baseline)
    speedup = peer.median_ms / floor_ms if peer else None
    return BenchRow(f"{precision} floor: {floor.text()}, kiln {by_name[kiln].median_ms / floor_ms:.2f}x", floor_ms, floor_ms / setup.new_tokens, speedup, ())


def onnx_floor_row(rows: list[BenchRow], precision: str, engine_path: Path, bandwidth: float, setup: BenchSetup) -> BenchRow:
    """An ONNX Runtime engine's floor at batch 1: its weights and its cache up to the mean length."""
    from components.engine_dir import load_engine_dir

    engine = load_engine_dir(engine_path)
    step = onnx_read_bytes(engine.engine_file) + engine.manifest.kv_bytes_per_token * (setup.prompt_tokens + setup.new_tokens / 2)
    return read_floor_row(rows, HF_ROW, precision, f"kiln-ort-{precision}", ReadFloor(step, bandwidth), setup)
