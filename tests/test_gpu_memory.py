"""The torch-cuda engine's KV cache sized to the card: the arithmetic, on the CPU (the build
and the load that call it need a GPU: tests/test_torch_cuda.py runs them there)."""

from __future__ import annotations

import re

import pytest

from components.errors import BuildError, EngineError
from components.runtime.gpu_memory import GIB, Activations, CardMemory, activations_of, check_cache_fits, plan_slots, slot_bytes_of
from components.runtime.static_kv import LlamaShape

# Llama-3.1-8B's shape: 32 layers, 8 KV heads of 128, bf16.
LLAMA_8B = LlamaShape(
    family="llama", qkv_bias=False, o_bias=False,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, vocab_size=128256, max_positions=131072, eps=1e-5
)
H200 = CardMemory("NVIDIA H200", total=140 * GIB, free=140 * GIB - 16 * GIB)  # the 8B weights on it
H100 = CardMemory("NVIDIA H100 80GB HBM3", total=80 * GIB, free=80 * GIB - 16 * GIB)


def test_a_slot_is_keys_and_values_of_every_layer_for_the_context_and_the_scratch_column():
    # 2 (k, v) x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token, as vLLM counts Llama-3.1-8B's.
    assert slot_bytes_of(LLAMA_8B, 1023, 2) == 128 * 1024 * 1024
    assert slot_bytes_of(LLAMA_8B, 8191, 2) == 1 * GIB


def test_the_cache_takes_as_many_slots_as_the_card_leaves_room_for_up_to_the_profiles_max():
    activations = activations_of(LLAMA_8B, 64, 128, 2)
    # 90 % of 140 GiB, less 16 in use and 7.8 for activations: 102.2 GiB; a 32k-token slot is 4 GiB.
    plan = plan_slots(H200, 0.9, activations, slot_bytes_of(LLAMA_8B, 32767, 2), 32767, 1, 64)
    assert plan.slots == int((0.9 * 140 * GIB - 16 * GIB - activations.bytes) // (4 * GIB)) == 25
    assert plan.cache_bytes <= plan.budget
    assert plan.text(H200) == f"KV cache: 25 slots × 32767 tokens = 100.00 GiB of the {plan.budget / GIB:.2f} GiB this NVIDIA H200 leaves for it"
    # The profile's max caps it where memory would allow more; a smaller card gets fewer.
    assert plan_slots(H200, 0.9, activations, slot_bytes_of(LLAMA_8B, 1023, 2), 1023, 1, 64).slots == 64
    assert plan_slots(H100, 0.9, activations, slot_bytes_of(LLAMA_8B, 32767, 2), 32767, 1, 64).slots == 12
    # A lower utilization leaves more to other processes.
    assert plan_slots(H200, 0.5, activations, slot_bytes_of(LLAMA_8B, 32767, 2), 32767, 1, 64).slots == 11


def test_a_profile_that_cannot_fit_is_refused_naming_what_it_needs_what_the_card_leaves_and_the_shortfall():
    activations = activations_of(LLAMA_8B, 16, 128, 2)
    message = (
        "build.profiles: 4 sequences × 131071 tokens of KV cache need 64.00 GiB; this NVIDIA H100 80GB HBM3 leaves 53.31 GiB for it "
        "(90% of its 80.00 GiB = build.gpu_memory_utilization, less 16.00 GiB in use with the weights and 2.69 GiB for activations and graphs): "
        "short by 10.69 GiB; lower build.profiles.context.max or batch.min, or raise build.gpu_memory_utilization"
    )
    with pytest.raises(BuildError, match=re.escape(message)):
        plan_slots(H100, 0.9, activations, slot_bytes_of(LLAMA_8B, 131071, 2), 131071, 4, 16)
    # A card already full leaves nothing, and says so rather than a negative budget.
    full = CardMemory("NVIDIA H100 80GB HBM3", total=80 * GIB, free=2 * GIB)
    with pytest.raises(BuildError, match=r"leaves 0\.00 GiB for it .* short by 0\.12 GiB"):
        plan_slots(full, 0.9, activations, slot_bytes_of(LLAMA_8B, 1023, 2), 1023, 1, 16)


def test_activations_count_every_positions_logits_a_scoring_batch_holds():
    """The gates score every position: 16 rows × 128 tokens of Llama 3's 128k vocabulary are
    1.5 GiB of logits alone (in bf16, then fp32), which a cache sized without them would take."""
    activations = Activations(rows=16, tokens=128, hidden=4096, intermediate=14336, vocab=128256, dtype_bytes=2)
    logits = 16 * 128 * 128256 * (2 + 4)
    assert logits < activations.bytes - GIB < logits * 1.2
    assert activations_of(LLAMA_8B, 16, 128, 2) == activations


def test_the_load_refuses_a_cache_the_card_has_no_room_for_naming_the_shortfall():
    activations = activations_of(LLAMA_8B, 64, 128, 2)
    slot = slot_bytes_of(LLAMA_8B, 1023, 2)
    check_cache_fits(H200, 64, 1023, slot, activations)  # 8 GiB of cache on a card with 124 free
    busy = CardMemory("NVIDIA H200", total=140 * GIB, free=10 * GIB)
    with pytest.raises(EngineError, match=r"the engine's KV cache \(64 slots × 1023 tokens, 8\.00 GiB\) and \d+\.\d\d GiB for activations do not fit the 10\.00 GiB this NVIDIA H200 has free after the weights: short by \d+\.\d\d GiB"):
        check_cache_fits(busy, 64, 1023, slot, activations)
