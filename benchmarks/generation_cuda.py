"""`kiln bench --device cuda`: kiln's torch-cuda engines beside the GPU peer a user would
assemble, on a benchmark model of the chosen shape with random weights drawn on the GPU in
the dtype the shape is published in (bf16 for Llama 3 and Qwen2.5; GPT-2-small and
SmolLM2-135M in fp16), 32 + 128 tokens, at batch 1, 16 and 64, interleaved in one process
(each row's median, and its ratio to the peer, from the same run).

Rows:
* `hf-static-compile-<dtype>`: HF's StaticCache with the forward compiled by torch.compile
  (`reduce-overhead`: CUDA graphs) from a Python loop. `generate(cache_implementation=
  "static")` plus a compiled forward — the documented recipe — fails in transformers 5.17
  (generate compiles the forward itself, and the two collide), so this is the working form
  of that recipe. If it fails on this model, its row says so, with the error, and HF eager
  `generate` is the baseline instead.
* `hf-eager-<dtype>`: Hugging Face `generate`, eager — what most people run first (batch 1).
* `kiln-torch-cuda-<precision>`: the engine `kiln build` makes with build.backend torch-cuda,
  one per --precisions.
* each precision's weight-read floor: the bytes a step must read (the engine's weights, and
  each row's KV cache at the mean attended length) at the card's bandwidth, measured by a
  copy on the card in the same run — a row computed, not timed; its name gives kiln's ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.generation import PUBLISHED_DTYPE, SHAPES, BenchRow, BenchSetup, random_prompts, read_floor_row, rows_from_samples, saved_with_tokenizer, time_interleaved
from components.read_floor import ReadFloor, card_bandwidth, program_read_bytes

BATCHES = (1, 16, 64)
MAX_CONTEXT = 1024  # the engines' cache: enough for 32 + 128, and GPT-2's whole context
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class CudaRows:
    batch: int
    rows: list[BenchRow]


def shape_dtype(shape: str) -> str:
    """The dtype the GPU bench builds `shape` in: as published, else fp16."""
    return PUBLISHED_DTYPE.get(shape, "float16")


def cuda_rows(
    work: Path, setup: BenchSetup, shape: str = "gpt2-small", batches: tuple[int, ...] = BATCHES, precisions: tuple[str, ...] | None = None
) -> Iterator[CudaRows]:
    """Build (or reuse) the benchmark model and its torch-cuda engines; time the peers and
    them, batch by batch (each batch's rows as soon as they are measured), with each
    precision's weight-read floor beside them."""
    import torch

    from components.errors import BackendUnavailable
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling

    if not torch.cuda.is_available():
        raise BackendUnavailable(f"kiln bench --device cuda needs a CUDA GPU; torch {torch.__version__} sees none")
    dtype = shape_dtype(shape)
    precisions = precisions or (DTYPE_NAMES[dtype],)
    model_dir = gpu_model_dir(work / shape / f"model-{dtype}", SHAPES[shape], dtype, setup.seed)
    paths = {p: torch_cuda_engine(model_dir, work / shape / "engines", max(batches), setup, p) for p in precisions}
    bandwidth = card_bandwidth()
    prompts = random_prompts(max(batches), setup.prompt_tokens, SHAPES[shape]["vocab_size"], setup.seed)
    hf = _hf_on_gpu(model_dir, dtype)
    peer = StaticCacheLoop(hf)
    tag = DTYPE_NAMES[dtype]
    sampling = Sampling(max_new_tokens=setup.new_tokens, stop_at_eos=False)
    with ExitStack() as stack:
        engines = {p: stack.enter_context(load_engine(path)) for p, path in paths.items()}
        for batch in batches:
            ids = torch.tensor(prompts[:batch], device="cuda")
            eager = _synced(lambda ids=ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=setup.new_tokens,
                                                        min_new_tokens=setup.new_tokens, do_sample=False))  # fmt: skip
            candidates: dict[str, Callable[[], None]] = {f"hf-static-compile-{tag}": _synced(lambda ids=ids: peer.generate(ids, setup.new_tokens))}
            failed = _failing(candidates, f"hf-static-compile-{tag}")
            if batch == 1 or failed is not None:
                candidates[f"hf-eager-{tag}"] = eager
            candidates |= {f"kiln-torch-cuda-{p}": (lambda engine=engine, batch=batch: engine.generate(prompts[:batch], sampling)) for p, engine in engines.items()}
            samples = time_interleaved(candidates, replace(setup, warmup=max(setup.warmup, 2)))  # two: compile, then capture
            baseline = f"hf-eager-{tag}" if failed else f"hf-static-compile-{tag}"
            rows = rows_from_samples(samples, setup.new_tokens, baseline)
            rows += [floor_row(rows, baseline, p, engine, batch, bandwidth, setup) for p, engine in engines.items()]
            if failed is not None:
                rows.insert(0, failed)
            yield CudaRows(batch, rows)


def gpu_model_dir(directory: Path, shape: dict, dtype: str, seed: int) -> Path:
    """A model directory of `shape` whose random weights were drawn on the GPU in `dtype`
    (an 8B model never passes through fp32 or the host's memory as a whole)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from components.errors import BuildError

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    config = AutoConfig.for_model(shape["family"], **{k: v for k, v in shape.items() if k != "family"})
    with torch.device("meta"):
        parameters = AutoModelForCausalLM.from_config(config).num_parameters()
    need, free = parameters * torch.finfo(getattr(torch, dtype)).bits // 8, torch.cuda.mem_get_info()[0]
    if need > free:
        raise BuildError(f"the bench model needs {need / 2**30:.1f} GiB of GPU memory in {dtype}; {free / 2**30:.1f} GiB are free")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    saved_with_tokenizer(model, directory)
    del model
    torch.cuda.empty_cache()
    return directory


def floor_row(rows: list[BenchRow], baseline: str, precision: str, engine, batch: int, bandwidth: float, setup: BenchSetup) -> BenchRow:
    """The generation's floor for `precision` at `batch`: each step reads the weights once and
    every row's cache up to its mean length, at `bandwidth`; named with kiln's ratio to it."""
    kv_token = engine.manifest.kv_bytes_per_token or 0
    step = program_read_bytes(engine.runner.model) + batch * kv_token * (setup.prompt_tokens + setup.new_tokens / 2)
    return read_floor_row(rows, baseline, precision, f"kiln-torch-cuda-{precision}", ReadFloor(step, bandwidth), setup)


def _failing(candidates: dict[str, Callable[[], None]], name: str) -> BenchRow | None:
    """Run `name` once; if it raises, take it out of the timing and give the row that says so."""
    try:
        candidates[name]()
    except Exception as err:  # a peer's failure is a result of the bench, whatever its type
        del candidates[name]
        message = " ".join(str(err).split())[:160]
        return BenchRow(f"{name} FAILED: {type(err).__name__}: {message}", math.nan, math.nan, math.nan, ())
    return None


def torch_cuda_engine(model_dir: Path, out_root: Path, slots: int, setup: BenchSetup, precision: str = "fp16") -> Path:
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams, ShapeRange
    from components.engine_dir import Lineage
    from components.families import shape_of
    from components.model_dir import model_from_directory

    # At least two slots: the build exports the row dimension as dynamic (torch's Dim refuses
    # min=1, max=1) and checks parity on a two-row batch; --batches 1 still times one row.
    slots = max(2, slots)
    model = model_from_directory(model_dir)
    context = min(MAX_CONTEXT, shape_of(json.loads((model_dir / "config.json").read_text())).max_positions)
    profiles = ProfileParams(batch=ShapeRange(min=1, opt=1, max=slots), prompt=ShapeRange(min=1, opt=setup.prompt_tokens, max=128),
                             context=ShapeRange(min=2, opt=setup.prompt_tokens + setup.new_tokens, max=context))  # fmt: skip
    lineage = Lineage(source_model_path=str(model.path), source_model_sha256=model.sha256, onnx_sha256="-", data_md5="benchmark")
    return torch_engine_from_model(model.path, precision, lineage, profiles, out_root).path


def _hf_on_gpu(model_dir: Path, dtype: str):
    """The model as Hugging Face runs it on the GPU, in the dtype it was built in."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    model.generation_config.eos_token_id = None  # exactly new_tokens, as the engine is asked
    model.generation_config.pad_token_id = 0
    return model


def _synced(run: Callable[[], object]) -> Callable[[], None]:
    """A GPU call timed to its end, not to its launch."""
    import torch

    def timed() -> None:
        run()
        torch.cuda.synchronize()

    return timed


class StaticCacheLoop:
    """HF's StaticCache under a `reduce-overhead` compiled forward, driven token by token
    (eager prefill, argmax on the device): the peer a GPU user assembles from HF's docs."""

    def __init__(self, model) -> None:
        import torch

        self.model = model
        # Static shapes: each batch size compiles its own graph. A second batch size under
        # automatic dynamic shapes aborted the process in torch 2.11 ("trying to set the
        # current FakeTensorMode, but one already exists") on an H200.
        self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
        self.caches: dict[int, object] = {}

    def generate(self, ids, new_tokens: int):
        import torch
        from transformers import StaticCache

        batch, length = ids.shape
        cache = self.caches.get(batch)
        if cache is None:  # one per batch size, reset per call: new addresses would re-record the graphs
            cache = self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=length + new_tokens)
        else:
            cache.reset()
        with torch.no_grad():
            logits = self.model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(length, device="cuda")).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            out = [token]
            for step in range(new_tokens - 1):
                position = torch.full((1,), length + step, device="cuda")
                logits = self.forward(token, past_key_values=cache, use_cache=True, cache_position=position, position_ids=position.expand(batch, 1)).logits
                token = logits[:, -1].argmax(-1, keepdim=True).clone()
                out.append(token)
        return torch.cat(out, 1)
