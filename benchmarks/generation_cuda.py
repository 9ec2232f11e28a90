"""`kiln bench --device cuda`: the GPU peers a user would pick against kiln's torch-cuda
engine, on a benchmark model of the chosen shape (GPT-2 small; `--shape smollm2-135m`, a
Llama-family model of SmolLM2-135M's shape), 32 + 128 tokens, at batch 1 and 16,
interleaved in one process (each row's median, and its ratio to HF eager, from the same run).

Rows:
* `hf-eager-fp16`: Hugging Face `generate`, eager, fp16 — what most people run first.
* `hf-static-compile-fp16`: HF's StaticCache with the forward compiled by torch.compile
  (`reduce-overhead`: CUDA graphs) from a Python loop. `generate(cache_implementation=
  "static")` plus a compiled forward — the documented recipe — fails in transformers 5.17
  (generate compiles the forward itself, and the two collide; docs/performance.md, "The
  Hugging Face peer on the GPU"), so this is the working form of that recipe.
  If it fails on this model, its row says so, with the error, and has no numbers.
* `kiln-torch-cuda-fp16`: the engine `kiln build` makes with build.backend torch-cuda.
* at batch 1, the fp16 weight-read floor: the engine's weights read once per token at the
  GPU's memory bandwidth (a row computed, not timed; its name gives kiln's ratio to it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.generation import SHAPES, BenchRow, BenchSetup, benchmark_model_dir, random_prompts, rows_from_samples, time_interleaved

BATCHES = (1, 16)
# Memory bandwidth by GPU name (bytes/s, the vendor's figure), for the weight-read floor.
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
MAX_CONTEXT = 1024  # the engines' cache: enough for 32 + 128, and GPT-2's whole context


@dataclass(frozen=True)
class CudaRows:
    batch: int
    rows: list[BenchRow]


def cuda_rows(work: Path, setup: BenchSetup, shape: str = "gpt2-small", batches: tuple[int, ...] = BATCHES) -> list[CudaRows]:
    """Build (or reuse) the fp16 torch-cuda engine of the benchmark model; time the peers and
    it, batch by batch."""
    import torch

    from components.errors import BackendUnavailable

    if not torch.cuda.is_available():
        raise BackendUnavailable(f"kiln bench --device cuda needs a CUDA GPU; torch {torch.__version__} sees none")
    model_dir = benchmark_model_dir(work / shape / "model", SHAPES[shape], setup.seed)
    engine_path = torch_cuda_engine(model_dir, work / shape / "engines", max(batches), setup)
    prompts = random_prompts(max(batches), setup.prompt_tokens, SHAPES[shape]["vocab_size"], setup.seed)
    hf = _hf_fp16(model_dir)
    peer = StaticCacheLoop(_hf_fp16(model_dir))
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling

    with load_engine(engine_path) as engine:
        sampling = Sampling(max_new_tokens=setup.new_tokens, stop_at_eos=False)
        results = []
        for batch in batches:
            ids = torch.tensor(prompts[:batch], device="cuda")
            candidates: dict[str, Callable[[], None]] = {
                "hf-eager-fp16": _synced(lambda ids=ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=setup.new_tokens,
                                                                       min_new_tokens=setup.new_tokens, do_sample=False)),
                "hf-static-compile-fp16": _synced(lambda ids=ids: peer.generate(ids, setup.new_tokens)),
                "kiln-torch-cuda-fp16": lambda batch=batch: engine.generate(prompts[:batch], sampling),
            }  # fmt: skip
            failed = _failing(candidates, "hf-static-compile-fp16")
            samples = time_interleaved(candidates, replace(setup, warmup=max(setup.warmup, 2)))  # two: compile, then capture
            rows = rows_from_samples(samples, setup.new_tokens, baseline="hf-eager-fp16")
            if failed is not None:
                rows.insert(1, failed)
            if batch == 1:
                rows += _floor_rows(rows, engine.manifest.parameter_count, torch.cuda.get_device_name(), setup)
            results.append(CudaRows(batch, rows))
    return results


def _failing(candidates: dict[str, Callable[[], None]], name: str) -> BenchRow | None:
    """Run `name` once; if it raises, take it out of the timing and give the row that says so."""
    try:
        candidates[name]()
    except Exception as err:  # a peer's failure is a result of the bench, whatever its type
        del candidates[name]
        message = " ".join(str(err).split())[:160]
        return BenchRow(f"{name} FAILED: {type(err).__name__}: {message}", math.nan, math.nan, math.nan, ())
    return None


def _floor_rows(rows: list[BenchRow], parameters: int | None, gpu: str, setup: BenchSetup) -> list[BenchRow]:
    """The fp16 weight-read floor of a generation (every token reads every weight once), named
    with kiln's ratio to it; none where the GPU's bandwidth is not known."""
    bandwidth = next((value for name, value in BANDWIDTH.items() if name in gpu), None)
    if bandwidth is None or parameters is None:
        return []
    floor_ms = setup.new_tokens * 2 * parameters / bandwidth * 1000.0
    kiln = next(row for row in rows if row.name.startswith("kiln-"))
    hf = next(row for row in rows if row.name == "hf-eager-fp16")
    name = f"fp16 weight-read floor ({2 * parameters / 1e6:.0f} MB / {bandwidth / 1e12:.2g} TB/s): kiln {kiln.median_ms / floor_ms:.2f}x it"
    return [BenchRow(name, floor_ms, floor_ms / setup.new_tokens, hf.median_ms / floor_ms, ())]


def torch_cuda_engine(model_dir: Path, out_root: Path, slots: int, setup: BenchSetup) -> Path:
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams, ShapeRange
    from components.engine_dir import Lineage
    from components.families import shape_of
    from components.model_dir import model_from_directory

    model = model_from_directory(model_dir)
    context = min(MAX_CONTEXT, shape_of(json.loads((model_dir / "config.json").read_text())).max_positions)
    profiles = ProfileParams(batch=ShapeRange(min=1, opt=1, max=slots), prompt=ShapeRange(min=1, opt=setup.prompt_tokens, max=128),
                             context=ShapeRange(min=2, opt=setup.prompt_tokens + setup.new_tokens, max=context))  # fmt: skip
    lineage = Lineage(source_model_path=str(model.path), source_model_sha256=model.sha256, onnx_sha256="-", data_md5="benchmark")
    return torch_engine_from_model(model.path, "fp16", lineage, profiles, out_root).path


def _hf_fp16(model_dir: Path):
    import torch

    from components.model_dir import load_model

    model = load_model(model_dir).to("cuda", torch.float16)
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
        self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
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
