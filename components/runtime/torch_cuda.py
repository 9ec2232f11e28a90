"""The torch-cuda runner: the exported static-KV program over a KV cache on the device.

The cache is the engine's profile: `slots` rows (the batch profile's max) of `context`
positions. Two ways through the same program:

* `generate` and `score` (the gates, `kiln bench`, warm-up): the runner of
  components.runtime.static_kv batches prompts continuously over the slots, with prefill and
  k-step greedy decode captured in CUDA graphs (Inductor-compiled; one-row steps through the
  Triton kernels of components.runtime.triton_decode where Triton is installed).
* `prefill` and `decode_turn` (kiln serve's scheduler): each sequence in a slot of the same
  cache (`SlotState`); a turn runs up to `max_turn_steps` steps in one graph and samples
  every row on the device with its own settings (components.runtime.torch_sampling), so
  only token ids cross to the host. Rows are slots 0..n-1 in order: a prefill fills the
  next free slots, and dropping rows moves the later ones down (the program reads
  `cache[:, :rows]` as a view, never a gather). `decode` hands one step's logits to the
  host instead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components.engine_dir import EngineDir, EngineManifest
from components.errors import BackendUnavailable, EngineError, ShapeOutOfProfile
from components.runtime.engine import Engine, Picked, advanced, left_pad
from components.runtime.logprobs import TokenLogprob, logprobs_of
from components.runtime.sampling import Draws, Sampling
from components.runtime.static_kv import LogitsStepGraphs, PrefillGraphs, SampledStepGraphs, left_padded_positions


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
        self._step = LogitsStepGraphs(self.runner, self.manifest.vocab_size)  # `decode`: logits to the host
        self._sampled = SampledStepGraphs(self.runner)  # kiln serve's turns of sampled rows
        self._prefill_graphs = PrefillGraphs(self.runner, self.manifest.vocab_size)  # and its admissions
        # A request that arrives mid-turn waits for the turn's end: 16 steps bound what that
        # adds to its time to first token (~3 ms for GPT-2-small on an H200) while sharing
        # a turn's one round trip to the host among 16 tokens.
        self.max_turn_steps = min(16, self.runner.max_chunk)
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
        if self.device == "cuda":
            self._check_cache_room(shape, slots, context, next(program.parameters()).dtype.itemsize)
        fast_step = _triton_step(program, shape, context) if self.device == "cuda" else None
        return StaticKVRunner(program, shape=shape, num_slots=slots, max_context=context, compile_step=self.device == "cuda", fast_step=fast_step)

    def _check_cache_room(self, shape, slots: int, context: int, dtype_bytes: int) -> None:
        """The cache the build sized to its card must fit this one, now the weights are on it."""
        from components.runtime.gpu_memory import CardMemory, activations_of, check_cache_fits, slot_bytes_of

        activations = activations_of(shape, slots, self.manifest.profiles["context"].sequence.max, dtype_bytes)
        check_cache_fits(CardMemory.of(self.device), slots, context, slot_bytes_of(shape, context, dtype_bytes), activations)

    # ------------------------------------------------------------ what the gates and bench call

    def score(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Every position's logits (batch, sequence, vocab) for left-padded rows, through the
        program and the runner's cache (at most `slots` rows at a time)."""
        import torch

        from components.runtime.static_kv import causal_bias

        self._check_context(input_ids.shape)
        self._check_no_slots_held("score")
        self.runner.drop_queued()
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
        self._check_context(input_ids.shape)
        B, held = len(input_ids), self._held
        if held + B > self.runner.S:
            raise ShapeOutOfProfile(f"{held} sequences hold slots and {B} more do not fit the engine's {self.runner.S}")
        self.runner.drop_queued()
        logits = self._prefill_every_position(input_ids, attention_mask) if every_position else self._prefill_last(input_ids, attention_mask)
        self._held = held + B
        return logits, SlotState(self, list(range(held, held + B)), attention_mask.sum(axis=1).astype(np.int64))

    def prefill_after(self, cached: list, new_ids: list[int]) -> tuple[np.ndarray, SlotState]:
        """A prompt whose first tokens' keys and values `cached` holds (a prefix cache's hit,
        `kv_of`'s parts: every layer's keys, then every layer's values) into the next free slot, and
        the rest prefilled after them; the last position's logits (1, 1, vocab)."""
        return self.prefill_after_each([(cached, new_ids)])

    def prefill_after_each(self, hits: list[tuple[list, list[int]]]) -> tuple[np.ndarray, SlotState]:
        """Prefix cache hits, each `(cached, new_ids)`, into the next free slots: each one's
        cached keys and values copied into its slot, and the rest of every prompt prefilled in
        one pass of the prefill graphs, each row at its own positions (attending to its cached
        columns too): one replay for a burst of hits, not one each."""
        import torch

        runner, first, rows = self.runner, self._held, len(hits)
        longest = max(len(new_ids) for _, new_ids in hits)
        self._check_context((rows, longest))
        if first + rows > runner.S:
            raise ShapeOutOfProfile(f"{first} sequences hold slots and {rows} more do not fit the engine's {runner.S}")
        for cached, new_ids in hits:
            if not new_ids or cached[0].shape[2] + len(new_ids) > runner.T:
                raise ShapeOutOfProfile(f"{cached[0].shape[2]} cached and {len(new_ids)} new tokens do not fit the engine's context of {runner.T}")
        self.runner.drop_queued()
        # Right-aligned in a bucketed prompt width, as `_prefill_last` places prompts; the other
        # rows and the padding write to the scratch column.
        width, prompt = runner._width(first + rows - 1), min(-(-longest // runner.prompt_bucket) * runner.prompt_bucket, runner.T)
        ids = torch.zeros(width, prompt, dtype=torch.long)
        positions = torch.full((width, prompt), runner.T, dtype=torch.long)
        lengths = []
        for slot, (cached, new_ids) in enumerate(hits, start=first):
            (keys, values), new = cached, len(new_ids)
            tokens = keys.shape[2]
            runner.k_cache[:, slot, :, :tokens] = keys
            runner.v_cache[:, slot, :, :tokens] = values
            ids[slot, prompt - new :] = torch.tensor(new_ids)
            positions[slot, prompt - new :] = torch.arange(tokens, tokens + new)
            lengths.append(tokens + new)
        logits = self._prefill_graphs(ids, positions, rows=slice(first, first + rows), attended=runner._attn_len(max(lengths)))
        self._held = first + rows
        return logits[:, None].numpy(), SlotState(self, list(range(first, first + rows)), np.array(lengths, np.int64))

    def kv_of(self, state: SlotState, row: int, tokens: int) -> list:
        """The keys and values of a row's first `tokens` positions in its slot (views of the
        device cache; a prefix cache copies what it keeps): every layer's keys, then every
        layer's values, each (layers, kv heads, tokens, head dim). Two parts, not two per
        layer: each part is a kernel launch wherever the prefix cache copies or joins it."""
        slot, runner = state.slots[row], self.runner
        return [runner.k_cache[:, slot, :, :tokens], runner.v_cache[:, slot, :, :tokens]]

    def prefix_cache_budget(self, requested: int) -> int:
        """On a GPU, at most half the memory free once the engine has its slots: the prefix
        cache's blocks share the card with the graphs' workspaces."""
        if self.device != "cuda":
            return requested
        import torch

        return min(requested, torch.cuda.mem_get_info()[0] // 2)

    def _prefill_last(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Through the prefill graphs: rows and prompt width rounded up (more left padding,
        which writes to the scratch column) so that few graphs serve every admission."""
        import torch

        runner, (B, P), held = self.runner, input_ids.shape, self._held
        width, prompt = runner._width(held + B - 1), min(-(-P // runner.prompt_bucket) * runner.prompt_bucket, runner.T)
        ids = torch.zeros(width, prompt, dtype=torch.long)
        positions = torch.full((width, prompt), runner.T, dtype=torch.long)
        ids[held : held + B, prompt - P :] = torch.from_numpy(input_ids)
        positions[held : held + B, prompt - P :] = left_padded_positions(torch.from_numpy(attention_mask), scratch=runner.T)
        return self._prefill_graphs(ids, positions, rows=slice(held, held + B))[:, None].numpy()

    def _prefill_every_position(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Eagerly (`echo` with logprobs scores a prompt: rare, and every position's logits
        are (rows, prompt, vocab) on the host anyway)."""
        import torch

        from components.runtime.static_kv import causal_bias

        runner, (B, P), held = self.runner, input_ids.shape, self._held
        # Rows 0..held-1 are the running sequences: their tokens go to the scratch column.
        ids = torch.zeros(held + B, P, dtype=torch.long, device=self.device)
        ids[held:] = torch.as_tensor(input_ids, device=self.device)
        positions = torch.full((held + B, P), runner.T, dtype=torch.long, device=self.device)
        positions[held:] = left_padded_positions(torch.as_tensor(attention_mask, device=self.device), scratch=runner.T)
        with torch.no_grad():
            bias = causal_bias(positions, runner.key_range[:P], runner.dtype)
            every = torch.arange(P, device=self.device).expand(held + B, P)
            logits = runner.model(ids, positions, bias, every, runner.k_cache, runner.v_cache)[held:]
        return logits.float().cpu().numpy()

    def decode(self, state: SlotState, next_ids: np.ndarray) -> tuple[np.ndarray, SlotState]:
        """One token for every held slot; its logits (batch, vocab) and the advanced state.
        On CUDA the step is a graph per (rows, attended length) bucket."""
        self._check_turn(state, len(next_ids), int(state.lengths.max()))
        self.runner.drop_queued()
        logits = self._step(next_ids.tolist(), state.lengths.tolist())
        return logits.numpy(), SlotState(self, state.slots, state.lengths + 1)

    def decode_turn(self, state: SlotState, next_ids: np.ndarray, draws: list[Draws], steps: int = 1, room: int = 0) -> tuple[Picked, SlotState]:
        """`steps` decode steps for every held slot, sampled on the device: greedy turns
        through `generate`'s k-step graphs, others through graphs that sample each row with
        its own settings and stream (and compute log probabilities where asked). Only the
        picked ids (and asked-for log probabilities) come back to the host. Greedy turns
        with `room` queue the next turn before the host reads this one
        (`StaticKVRunner.decode_rows`): a turn may then bring another number of steps."""
        self._check_turn(state, len(next_ids), int(state.lengths.max()) + steps - 1)
        if not 1 <= steps <= self.max_turn_steps:
            raise EngineError(f"a turn takes 1..{self.max_turn_steps} steps, not {steps}")
        ids, positions = next_ids.tolist(), state.lengths.tolist()
        asked = [d.sampling.logprobs for d in draws]
        if any(d.sampling.grammar is not None for d in draws):
            # A grammar's mask is the host's to fill, token by token: the batch takes one-step
            # turns (what a constrained row costs the graphs). The logits stay on the device,
            # masked and sampled there: the mask goes over (vocab / 8 bytes a row), tokens come back.
            self.runner.drop_queued()
            logits = self._step.on_device(ids, positions)
            return self._picked(logits, draws), SlotState(self, state.slots, state.lengths + 1)
        if all(d.sampling.greedy for d in draws) and all(n is None for n in asked):
            picked = Picked(self.runner.decode_rows(ids, positions, steps, min(room, self.runner.T - int(state.lengths.max())), self.max_turn_steps), {}, {})
            steps = picked.tokens.shape[1]
        else:
            self.runner.drop_queued()
            settings = [(d.sampling.temperature, d.sampling.top_p, d.key, d.drawn) for d in draws]
            tokens, logprobs = self._sampled(ids, positions, settings, steps, logprobs=any(n is not None for n in asked))
            picked = Picked(tokens, _token_logprobs(logprobs, asked) if logprobs else {}, {})
        return picked, SlotState(self, state.slots, state.lengths + steps)

    @property
    def turn_queued(self) -> bool:
        return self.runner.turn_queued

    def pick(self, logits: np.ndarray, draws: list[Draws]) -> Picked:
        """The prefill's first tokens, drawn by the same rule and streams as the device's
        turns (draw 0 of each row's stream), so a seeded request samples alike however it
        is batched; log probabilities as every engine computes them."""
        import torch

        return self._picked(torch.tensor(logits, dtype=torch.float32), draws)  # a copy: a grammar masks it in place

    def _picked(self, logits, draws: list[Draws]) -> Picked:
        """Each row's token from `logits` ((rows, vocab) fp32, where the step left them), within
        its grammar, by `torch_sampling`'s rule: only the tokens (and asked-for log
        probabilities, of the masked logits) come to the host."""
        import torch

        from components.runtime.torch_sampling import sample_rows

        failed = self._constrain(logits, draws)
        if all(d.sampling.greedy for d in draws):
            tokens = logits.argmax(-1)  # no sort of the vocabulary for nothing
        else:
            settings = torch.tensor([(d.sampling.temperature, d.sampling.top_p) for d in draws], dtype=torch.float32, device=logits.device)
            streams = torch.tensor([(d.key, d.drawn) for d in draws], dtype=torch.long, device=logits.device)
            tokens = sample_rows(logits, settings[:, 0], settings[:, 1], streams[:, 0], streams[:, 1])
        tokens = tokens.cpu().numpy()
        logprobs = {
            row: logprobs_of(logits[row : row + 1].cpu().numpy(), [int(tokens[row])], d.sampling.logprobs)
            for row, d in enumerate(draws)
            if d.sampling.logprobs is not None and row not in failed
        }
        return Picked(tokens[:, None], logprobs, failed | advanced(draws, tokens, failed))

    def _constrain(self, logits, draws: list[Draws]) -> dict[int, str]:
        """What each row's grammar forbids set to -inf in `logits`, in place, where they are:
        llguidance fills the rows' bitmasks on the host; the rows that cannot go on, with the reason."""
        if all(d.sampling.grammar is None for d in draws):
            return {}
        import torch

        from components.runtime.grammar import allowed_tokens
        from components.runtime.torch_sampling import forbid_disallowed

        started = time.perf_counter()
        constraints, failed = self.constraints(draws, logits.shape[-1])
        rows, bitmask, refused = allowed_tokens(constraints, logits.shape[-1])
        device = logits.device
        forbid_disallowed(logits, torch.tensor(rows, device=device), torch.from_numpy(bitmask).to(device))
        self.mask_clock.seconds += time.perf_counter() - started
        self.mask_clock.rows += len(rows)
        return failed | refused

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        raise EngineError("torch-cuda engines keep their KV cache on the device: use prefill and decode (slots), score or generate")

    def _check_turn(self, state: SlotState, rows: int, last_position: int) -> None:
        if state.slots != list(range(self._held)):
            raise EngineError(f"a decode step needs the state of every held slot, in order (0..{self._held - 1}); got {state.slots}")
        self._check_generation(rows, last_position)

    def _check_no_slots_held(self, what: str) -> None:
        """`score` and `generate` use the cache from slot 0: not while the server's sequences hold slots."""
        if self._held:
            raise EngineError(f"{self._held} step-wise sequences hold the cache's slots; {what} runs when none does")

    def _keep(self, slots: list[int], lengths: list[int]) -> list[int]:
        """Keep only `slots` (held ones, in order, holding `lengths` tokens), moved to
        0..n-1; the rest are free. A move copies the positions the slot holds, not its
        whole context."""
        self.runner.drop_queued()
        for new, (old, used) in enumerate(zip(slots, lengths, strict=True)):
            if new != old:
                self.runner.k_cache[:, new, :, :used].copy_(self.runner.k_cache[:, old, :, :used])
                self.runner.v_cache[:, new, :, :used].copy_(self.runner.v_cache[:, old, :, :used])
        self._held = len(slots)
        return list(range(len(slots)))

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Greedy continuations, batched continuously over the cache's slots (more prompts
        than slots wait for one); stops at the end-of-text token when asked, which, as for
        every engine, is not part of the result (any of the model's stop ids: Llama 3 has two).
        Sampled ones are drawn as kiln serve draws them (`_sampled_rows`)."""
        if not prompts or any(not p for p in prompts):
            raise ShapeOutOfProfile("every prompt needs at least one token")
        self._check_total(max(map(len, prompts)) + sampling.max_new_tokens)
        self._check_no_slots_held("generate")
        if not sampling.greedy:
            rows = [row for start in range(0, len(prompts), self.runner.S) for row in self._sampled_rows(prompts[start : start + self.runner.S], sampling)]
            return [[t for t in row if t not in self.manifest.stop_ids] for row in rows] if sampling.stop_at_eos else rows
        stops = self.manifest.stop_ids
        rows = self.runner.generate(prompts, sampling.max_new_tokens, stop_token=stops if sampling.stop_at_eos else None)
        return [[t for t in row if t not in stops] for row in rows] if sampling.stop_at_eos else rows

    def _sampled_rows(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Each prompt's tokens drawn on the device by one-step sampled turns, from its own
        seeded stream (`Draws`), as the server's scheduler drives them; up to the first stop id."""
        draws = [Draws(sampling) for _ in prompts]
        logits, state = self.prefill(*left_pad(prompts, self.manifest.eos_token_id))
        tokens = self.pick(logits[:, -1], draws).tokens[:, -1]
        rows, stopped = [[t] for t in tokens.tolist()], np.isin(tokens, list(self.manifest.stop_ids)) & sampling.stop_at_eos
        for _ in range(sampling.max_new_tokens - 1):
            if stopped.all():
                break
            for d in draws:
                d.drawn += 1
            picked, state = self.decode_turn(state, tokens, draws)
            tokens = picked.tokens[:, -1]
            for row, token, done in zip(rows, tokens.tolist(), stopped, strict=True):
                if not done:
                    row.append(token)
            stopped |= np.isin(tokens, list(self.manifest.stop_ids)) & sampling.stop_at_eos
        state.rows([])
        return rows

    def warm_up(self, prompt_tokens: int, new_tokens: int) -> None:
        """Compile and capture the graphs of one row and of a full batch of this shape."""
        self.runner.warm_up(sorted({1, self.runner.S}), prompt_tokens, new_tokens)

    def prepare_to_serve(self, prompt_tokens: int = 32, attended: int = 128) -> None:
        """Capture the graphs of kiln serve's turns for short requests (prompts up to
        `prompt_tokens`, up to `attended` positions) at every row width and turn length,
        greedy and sampled (compiling the sampled step):
        a graph captured on first use stalls every running stream for its eager run, which
        set the p99 of 16 streaming clients. Longer requests capture theirs on first use."""
        if not self.runner.use_graphs:
            return  # nothing to capture on the CPU
        self._check_no_slots_held("prepare_to_serve")
        for draws in (Draws(Sampling()), Draws(Sampling(temperature=1.0))):  # greedy turns, sampled turns
            for width in self.runner.widths:
                for steps in (1 << i for i in range(self.max_turn_steps.bit_length())):
                    ids = np.zeros((width, prompt_tokens), np.int64)
                    state = self.prefill(ids, np.ones_like(ids))[1]
                    while int(state.lengths.max()) + steps <= min(attended, self.runner.T):
                        state = self.decode_turn(state, np.zeros(width, np.int64), [draws] * width, steps)[1]
                    state.rows([])

    def close(self) -> None:
        self.runner = None


# The widest hidden size the one-row Triton step's tiles were measured at (GPT-2-small 768,
# SmolLM2 576; docs/performance.md#on-the-gpu). At Llama-3.1-8B's 4096 its whole-row tiles
# and 4-column down-projection tiles read the weights at a fraction of the card's bandwidth
# (5.2x the read floor on an H200, where HF's compiled static cache took 1.6x; kiln's compiled
# step took 1.29x on an H100): wider models take the compiled step.
TRITON_STEP_MAX_HIDDEN = 1024


def triton_step_suits(shape) -> bool:
    """Whether the one-row Triton step is the faster one for a model of this shape."""
    hidden = shape.hidden_size if hasattr(shape, "hidden_size") else shape.n_embd
    return hidden <= TRITON_STEP_MAX_HIDDEN


def _triton_step(program, shape, max_context: int):
    """The one-row Triton decode step of the model's family, where Triton is installed (it
    ships with CUDA torch) and the model is narrow enough for its tiles."""
    if not triton_step_suits(shape):
        return None
    try:
        from components.runtime.triton_decode import triton_decode_step
    except ImportError:
        return None
    if "s_qkv" in dict(program.named_parameters()):
        return None  # the Triton kernels read 16- and 32-bit weights: fp8 and int4 take the compiled step
    # Buffers too: the Llama family's rotary frequencies are one.
    return triton_decode_step(dict(program.named_parameters()) | dict(program.named_buffers()), shape, max_context)


def _token_logprobs(computed: tuple[np.ndarray, np.ndarray, np.ndarray], asked: list[int | None]) -> dict[int, list[TokenLogprob]]:
    """The device's log probabilities as every engine reports them, for the rows that asked."""
    chosen, top_ids, top_values = (a.tolist() for a in computed)
    return {
        row: [TokenLogprob(lp, tuple(zip(ids[:n], values[:n], strict=True))) for lp, ids, values in zip(chosen[row], top_ids[row], top_values[row], strict=True)]
        for row, n in enumerate(asked)
        if n is not None
    }


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
        lengths = self.lengths[keep]
        return SlotState(self.engine, self.engine._keep([self.slots[i] for i in keep], lengths.tolist()), lengths)
