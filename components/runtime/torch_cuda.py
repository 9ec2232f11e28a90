"""The torch-cuda runner: the exported static-KV program over a KV cache on the device.

The cache is the engine's profile: `slots` rows (the batch profile's max) of `context`
positions. Two ways through the same program:

* `generate` and `score` (the gates, `kiln bench`, warm-up): the runner of
  components.runtime.static_kv batches prompts continuously over the slots, with prefill and
  k-step greedy decode captured in CUDA graphs (Inductor-compiled; one-row steps through the
  Triton kernels of components.runtime.triton_decode where Triton is installed).
* `prefill` and `decode` (kiln serve's scheduler): one step at a time, each sequence in a
  slot of the same cache (`SlotState`), the logits of each step on the host so that every
  request samples with its own settings. Rows are slots 0..n-1 in order: a prefill fills
  the next free slots, and dropping rows moves the later ones down (the program reads
  `cache[:, :rows]` as a view, never a gather).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.engine_dir import EngineDir, EngineManifest
from components.errors import BackendUnavailable, EngineError, ShapeOutOfProfile
from components.runtime.engine import Engine
from components.runtime.sampling import Sampling
from components.runtime.static_kv import LogitsStepGraphs, left_padded_positions


def device_for(manifest: EngineManifest) -> str:
    """Where the engine runs here: `cuda` for an `sm_XY` engine on a GPU of that
    architecture with the torch it was built with, `cpu` for a CPU-built one; else
    BackendUnavailable naming what it was built for and what this machine has."""
    import torch

    built = f"{manifest.target} with torch {manifest.backend_version} (CUDA {manifest.runtime.get('cuda', '?')})"
    if _release(manifest.backend_version) != _release(torch.__version__):
        raise BackendUnavailable(f"engine built for {built}; this machine has torch {torch.__version__}")
    if manifest.target == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"engine built for {built}; this machine has no CUDA GPU (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    major, minor = torch.cuda.get_device_capability()
    here = f"sm_{major}{minor}"
    if here != manifest.target:
        raise BackendUnavailable(f"engine built for {built}; this GPU is {torch.cuda.get_device_name()} ({here})")
    return "cuda"


def _release(version: str) -> tuple[str, ...]:
    """'2.11.0+cu130' → ('2', '11'): programs are exported and loaded by the same torch minor."""
    return tuple(version.split("+")[0].split(".")[:2])


class TorchCudaEngine(Engine):
    """Greedy generation and scoring through the exported program and its runner."""

    def __init__(self, engine_dir: EngineDir, compile_cache: Path | None = None) -> None:
        super().__init__(engine_dir)
        self.device = device_for(self.manifest)
        if self.device == "cuda":
            # Inductor's and Triton's compiled kernels, kept beside the engine: a second load
            # skips their compilation (the engine directory itself stays as it was hashed).
            cache = compile_cache or engine_dir.path.parent / f"{engine_dir.path.name}.compile-cache"
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
            os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        self.runner = self._runner()
        self._step = LogitsStepGraphs(self.runner, self.manifest.vocab_size)  # kiln serve's decode step
        self._held = 0  # slots 0.._held-1 belong to step-wise sequences (prefill/decode)

    def _runner(self):
        import torch

        from components.runtime.static_kv import StaticKVRunner, static_shape_from_json

        try:
            program = torch.export.load(self.engine_dir.engine_file).module()
        except Exception as err:  # torch raises several types for a bad archive
            raise EngineError(f"torch cannot load the program {self.engine_dir.engine_file}: {err}") from err
        program.to(self.device)
        shape = static_shape_from_json(self.manifest.runtime["shape"])
        slots, context = self.manifest.profiles["generation"].batch.max, self.manifest.profiles["generation"].past.max + 1
        fast_step = _triton_step(program, shape, context) if self.device == "cuda" else None
        return StaticKVRunner(program, shape=shape, num_slots=slots, max_context=context, compile_step=self.device == "cuda", fast_step=fast_step)

    # ------------------------------------------------------------ what the gates and bench call

    def score(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Every position's logits (batch, sequence, vocab) for left-padded rows, through the
        program and the runner's cache (at most `slots` rows at a time)."""
        import torch

        from components.runtime.static_kv import causal_bias

        self._check_context(input_ids.shape)
        self._check_no_slots_held("score")
        runner, (B, P) = self.runner, input_ids.shape
        ids = torch.as_tensor(input_ids, device=self.device)
        positions = left_padded_positions(torch.as_tensor(attention_mask, device=self.device), scratch=runner.T)
        with torch.no_grad():
            bias = causal_bias(positions, runner.key_range[:P], runner.dtype)
            picked = torch.arange(P, device=self.device).expand(B, P)
            logits = runner.model(ids, positions, bias, picked, runner.k_cache, runner.v_cache)
        return logits.float().cpu().numpy()

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, every_position: bool = False) -> tuple[np.ndarray, SlotState]:
        """Left-padded prompts into the next free slots; the logits of each row's last token,
        (batch, 1, vocab), or of every position, and their state (join it to the running
        one: `state.joined`)."""
        import torch

        from components.runtime.static_kv import causal_bias

        self._check_context(input_ids.shape)
        runner, (B, P), held = self.runner, input_ids.shape, self._held
        if held + B > runner.S:
            raise ShapeOutOfProfile(f"{held} sequences hold slots and {B} more do not fit the engine's {runner.S}")
        # Rows 0..held-1 are the running sequences: their tokens go to the scratch column.
        ids = torch.zeros(held + B, P, dtype=torch.long, device=self.device)
        ids[held:] = torch.as_tensor(input_ids, device=self.device)
        positions = torch.full((held + B, P), runner.T, dtype=torch.long, device=self.device)
        positions[held:] = left_padded_positions(torch.as_tensor(attention_mask, device=self.device), scratch=runner.T)
        with torch.no_grad():
            bias = causal_bias(positions, runner.key_range[:P], runner.dtype)
            if every_position:
                last = torch.arange(P, device=self.device).expand(held + B, P)
            else:
                last = torch.full((held + B, 1), P - 1, dtype=torch.long, device=self.device)
            logits = runner.model(ids, positions, bias, last, runner.k_cache, runner.v_cache)[held:]
        self._held = held + B
        return logits.float().cpu().numpy(), SlotState(self, list(range(held, held + B)), attention_mask.sum(axis=1).astype(np.int64))

    def decode(self, state: SlotState, next_ids: np.ndarray) -> tuple[np.ndarray, SlotState]:
        """One token for every held slot; its logits (batch, vocab) and the advanced state.
        On CUDA the step is a graph per (rows, attended length) bucket."""
        if state.slots != list(range(self._held)):
            raise EngineError(f"decode needs the state of every held slot, in order (0..{self._held - 1}); got {state.slots}")
        self._check_generation(len(next_ids), int(state.lengths.max()))
        logits = self._step(next_ids.tolist(), state.lengths.tolist())
        return logits.numpy(), SlotState(self, state.slots, state.lengths + 1)

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        raise EngineError("torch-cuda engines keep their KV cache on the device: use prefill and decode (slots), score or generate")

    def _check_no_slots_held(self, what: str) -> None:
        """`score` and `generate` use the cache from slot 0: not while the server's sequences hold slots."""
        if self._held:
            raise EngineError(f"{self._held} step-wise sequences hold the cache's slots; {what} runs when none does")

    def _keep(self, slots: list[int]) -> list[int]:
        """Keep only `slots` (held ones, in order), moved down to 0..n-1; the rest are free."""
        for new, old in enumerate(slots):
            if new != old:
                self.runner.k_cache[:, new].copy_(self.runner.k_cache[:, old])
                self.runner.v_cache[:, new].copy_(self.runner.v_cache[:, old])
        self._held = len(slots)
        return list(range(len(slots)))

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Greedy continuations, batched continuously over the cache's slots (more prompts
        than slots wait for one); stops at the end-of-text token when asked, which, as for
        every engine, is not part of the result (any of the model's stop ids: Llama 3 has two)."""
        if not sampling.greedy:
            raise EngineError("torch-cuda engines generate greedily (temperature 0); sampling is not captured in their graphs yet")
        if not prompts or any(not p for p in prompts):
            raise ShapeOutOfProfile("every prompt needs at least one token")
        self._check_total(max(map(len, prompts)) + sampling.max_new_tokens)
        self._check_no_slots_held("generate")
        stops = self.manifest.stop_ids
        rows = self.runner.generate(prompts, sampling.max_new_tokens, stop_token=stops if sampling.stop_at_eos else None)
        return [[t for t in row if t not in stops] for row in rows] if sampling.stop_at_eos else rows

    def warm_up(self, prompt_tokens: int, new_tokens: int) -> None:
        """Compile and capture the graphs of one row and of a full batch of this shape."""
        self.runner.warm_up(sorted({1, self.runner.S}), prompt_tokens, new_tokens)

    def close(self) -> None:
        self.runner = None


def _triton_step(program, shape, max_context: int):
    """The one-row Triton decode step of the model's family, where Triton is installed (it
    ships with CUDA torch)."""
    try:
        from components.runtime.triton_decode import triton_decode_step
    except ImportError:
        return None
    # Buffers too: the Llama family's rotary frequencies are one.
    return triton_decode_step(dict(program.named_parameters()) | dict(program.named_buffers()), shape, max_context)


@dataclass
class SlotState:
    """Step-wise sequences of a TorchCudaEngine: their slots (rows of the device cache) and
    how many tokens each holds. The scheduler's view of a batch, as DecodeState is for the
    engines whose cache lives on the host."""

    engine: TorchCudaEngine
    slots: list[int]
    lengths: np.ndarray  # (batch,) int64: tokens in each slot = the next token's position

    def joined(self, other: SlotState) -> SlotState:
        """This batch's rows followed by `other`'s (prefilled into the slots after these)."""
        return SlotState(self.engine, self.slots + other.slots, np.concatenate([self.lengths, other.lengths]))

    def rows(self, keep: list[int]) -> SlotState:
        """Only the rows `keep`; the others' slots are freed (later slots move down)."""
        return SlotState(self.engine, self.engine._keep([self.slots[i] for i in keep]), self.lengths[keep])
