"""How many sequences a torch-cuda engine's KV cache holds on a card, from what the card's
memory leaves after the weights.

The build sizes the cache (slots × context) to the card it builds on: as many slots as fit
in `build.gpu_memory_utilization` of the card's memory once the program's weights are on it
and room is kept for activations and CUDA graphs, up to `build.profiles.batch.max`. The
runtime checks, before it allocates the cache, that the card it loads on still has that
room. Either says by how much a profile falls short, instead of running out of memory
midway.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
# cuBLAS workspaces, the compiled steps' code and the CUDA graphs' private pools.
FIXED_RESERVE = GIB


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class CardMemory:
    """A card's memory, as CUDA reports it now (`torch.cuda.mem_get_info`)."""

    name: str
    total: int
    free: int

    @classmethod
    def of(cls, device: str = "cuda") -> CardMemory:
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return cls(torch.cuda.get_device_name(torch.device(device)), total, free)

    @property
    def in_use(self) -> int:
        return self.total - self.free


@dataclass(frozen=True)
class Activations:
    """The widest call's scratch: a prefill (or a gate's scoring) of `rows` × `tokens`."""

    rows: int
    tokens: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @property
    def bytes(self) -> int:
        """Hidden states and the MLP's widest tensors in the model's dtype, and every position's
        logits (scoring keeps them all: in the dtype, then in fp32), plus FIXED_RESERVE."""
        per_token = (4 * self.hidden + 3 * self.intermediate) * self.dtype_bytes + self.vocab * (self.dtype_bytes + 4)
        return self.rows * self.tokens * per_token + FIXED_RESERVE


@dataclass(frozen=True)
class SlotPlan:
    """The cache the build gives an engine: `slots` sequences of `context` tokens."""

    slots: int
    context: int
    slot_bytes: int  # one sequence's KV cache at full context
    budget: int  # what the card leaves for the cache

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def text(self, card: CardMemory) -> str:
        return (
            f"KV cache: {self.slots} slots × {self.context} tokens = {gib(self.cache_bytes)} "
            f"of the {gib(self.budget)} this {card.name} leaves for it"
        )


def plan_slots(card: CardMemory, utilization: float, activations: Activations, slot_bytes: int, context: int, batch_min: int, batch_max: int) -> SlotPlan:
    """As many slots as fit in `utilization` of the card, less what is in use (the weights,
    other processes) and the activations' room, up to `batch_max`; BuildError naming the
    shortfall when not even `batch_min` fit."""
    from components.errors import BuildError

    budget = int(card.total * utilization) - card.in_use - activations.bytes
    slots = min(batch_max, max(budget, 0) // slot_bytes)
    if slots < batch_min:
        need = batch_min * slot_bytes
        raise BuildError(
            f"build.profiles: {batch_min} sequence{'s' if batch_min > 1 else ''} × {context} tokens of KV cache need {gib(need)}; "
            f"this {card.name} leaves {gib(max(budget, 0))} for it ({utilization:.0%} of its {gib(card.total)} = build.gpu_memory_utilization, "
            f"less {gib(card.in_use)} in use with the weights and {gib(activations.bytes)} for activations and graphs): "
            f"short by {gib(need - max(budget, 0))}; lower build.profiles.context.max or batch.min, or raise build.gpu_memory_utilization"
        )
    return SlotPlan(slots, context, slot_bytes, budget)


def check_cache_fits(card: CardMemory, slots: int, context: int, slot_bytes: int, activations: Activations) -> None:
    """EngineError before the cache is allocated where this card has not the room the build
    planned for (another card, or memory other processes hold)."""
    from components.errors import EngineError

    need = slots * slot_bytes + activations.bytes
    if need > card.free:
        raise EngineError(
            f"the engine's KV cache ({slots} slots × {context} tokens, {gib(slots * slot_bytes)}) and {gib(activations.bytes)} for activations "
            f"do not fit the {gib(card.free)} this {card.name} has free after the weights: short by {gib(need - card.free)} "
            f"(free memory on the card, or rebuild the engine on it: the build sizes the cache to the card)"
        )


def activations_of(shape, rows: int, tokens: int, dtype_bytes: int) -> Activations:
    """The widest call of a static model of `shape` (GPT-2's or the Llama family's)."""
    hidden = getattr(shape, "hidden_size", None) or shape.n_embd
    intermediate = getattr(shape, "intermediate_size", None) or shape.n_inner
    return Activations(rows, tokens, hidden, intermediate, shape.vocab_size, dtype_bytes)


def slot_bytes_of(shape, context: int, dtype_bytes: int) -> int:
    """One slot of the cache: keys and values of every layer for `context` positions and
    the scratch column (components.runtime.static_kv.new_cache's layout)."""
    return 2 * shape.num_layers * shape.cache_heads * (context + 1) * shape.head_dim * dtype_bytes
