"""`kiln bench --device cuda`: the GPU peers a user would pick against kiln's torch-cuda
engine, on the GPT-2-small-shaped benchmark model, 32 + 128 tokens, at batch 1 and 16,
interleaved in one process (each row's median, and its ratio to HF eager, from the same run).

Rows:
* `hf-eager-fp16`: Hugging Face `generate`, eager, fp16 — what most people run first.
* `hf-static-compile-fp16`: HF's StaticCache with the forward compiled by torch.compile
  (`reduce-overhead`: CUDA graphs) from a Python loop. `generate(cache_implementation=
  "static")` plus a compiled forward — the documented recipe — fails in transformers 5.17
  (generate compiles the forward itself, and the two collide; benchmarks/gpu_static_kv/
  REPORT.md §5), so this is the working form of that recipe.
* `kiln-torch-cuda-fp16`: the engine `kiln build` makes with build.backend torch-cuda.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.generation import GPT2_SMALL, SHAPES, BenchRow, BenchSetup, benchmark_model_dir, random_prompts, rows_from_samples, time_interleaved

BATCHES = (1, 16)


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
            samples = time_interleaved(candidates, replace(setup, warmup=max(setup.warmup, 2)))  # two: compile, then capture
            results.append(CudaRows(batch, rows_from_samples(samples, setup.new_tokens, baseline="hf-eager-fp16")))
    return results


def torch_cuda_engine(model_dir: Path, out_root: Path, slots: int, setup: BenchSetup) -> Path:
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams, ShapeRange
    from components.engine_dir import Lineage
    from components.model_dir import model_from_directory

    model = model_from_directory(model_dir)
    context = GPT2_SMALL["n_positions"]
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
