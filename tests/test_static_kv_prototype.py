"""CPU parity of the torch-cuda backend's static-KV models (components/runtime/static_kv.py)
against Hugging Face: fp32, no GPU needed; on a GPU machine benchmarks/gpu_static_kv/run_device.sh
test runs them beside the CUDA tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when it is first imported (which torch may do early): set it
    # before anything, so triton_decode's kernels run on Triton's CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import GPT2Config, GPT2LMHeadModel

from components.runtime.static_kv import StaticKVGPT2, StaticKVRunner, causal_bias, randomize_biases

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [5, 4, 3]]


def _hf(**overrides) -> GPT2LMHeadModel:
    # A large init range and an untied head give diverse greedy tokens; with GPT-2's
    # default init a random model repeats one token and a parity test proves little.
    cfg = dict(
        n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=128, initializer_range=0.3,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(cfg | overrides))).eval()
    randomize_biases(model)
    return model


@pytest.fixture(scope="module")
def hf() -> GPT2LMHeadModel:
    return _hf()


@torch.no_grad()
def hf_greedy(model: GPT2LMHeadModel, prompt: list[int], n: int) -> list[int]:
    """Reference: full recomputation each step, no cache at all."""
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


@torch.no_grad()
def test_prefill_and_decode_logits_match_hf(hf: GPT2LMHeadModel) -> None:
    model = StaticKVGPT2.from_hf(hf)
    T = 64
    kc, vc = model.new_cache(num_slots=4, max_context=T)
    prompts = PROMPTS[:3]
    P = max(map(len, prompts))
    ids = torch.zeros(3, P, dtype=torch.long)
    pos = torch.full((3, P), T)  # right padding writes to the scratch column
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        pos[i, : len(p)] = torch.arange(len(p))
    last = torch.tensor([[len(p) - 1] for p in prompts])
    logits = model(ids, pos, causal_bias(pos, torch.arange(32), torch.float32), last, kc, vc)[:, 0]
    for i, p in enumerate(prompts):
        ref = hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    # Three decode steps, each row at its own position.
    seqs = [list(p) for p in prompts]
    cur = logits.argmax(-1)
    for _ in range(3):
        step_pos = torch.tensor([len(s) for s in seqs]).view(3, 1)
        for s, t in zip(seqs, cur.tolist()):
            s.append(t)
        logits = model(cur.view(3, 1), step_pos, causal_bias(step_pos, torch.arange(32), torch.float32), torch.zeros(3, 1, dtype=torch.long), kc, vc)[:, 0]
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], hf(torch.tensor([s])).logits[0, -1], atol=1e-4, rtol=1e-4)
        cur = logits.argmax(-1)


@torch.no_grad()
def test_score_left_padded_matches_hf(hf: GPT2LMHeadModel) -> None:
    # kiln's gates feed left-padded batches and read every position's logits.
    model = StaticKVGPT2.from_hf(hf)
    prompts = PROMPTS[:3]
    P = max(map(len, prompts))
    ids = torch.zeros(3, P, dtype=torch.long)
    mask = torch.zeros(3, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    logits = model.score(ids, mask)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i, P - len(p) :], hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("slots,max_chunk,linear_layout", [(2, 32, False), (4, 4, True), (1, 1, False)])
def test_continuous_batching_greedy_matches_hf(hf: GPT2LMHeadModel, slots: int, max_chunk: int, linear_layout: bool) -> None:
    # More prompts than slots: later prompts are admitted as earlier ones finish.
    model = StaticKVGPT2.from_hf(hf, linear_layout=linear_layout)
    runner = StaticKVRunner(model, num_slots=slots, max_context=64, max_chunk=max_chunk, attn_bucket=16)
    got = runner.generate(PROMPTS, 12)
    assert got == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_unequal_lengths_free_slots_early(hf: GPT2LMHeadModel) -> None:
    # A sequence that stops on its stop token frees its slot for the waiting prompt.
    ref = [hf_greedy(hf, p, 10) for p in PROMPTS]
    stop = ref[0][3]
    runner = StaticKVRunner(StaticKVGPT2.from_hf(hf), num_slots=2, max_context=64, max_chunk=4)
    got = runner.generate(PROMPTS, 10, stop_token=stop)
    expected = [r[: r.index(stop) + 1] if stop in r else r for r in ref]
    assert got == expected


def test_gpt2_small_shape_tied_head_matches_hf() -> None:
    # The benchmark's shape: tied lm_head, 12 layers, 50257 vocabulary.
    hf = _hf(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024, initializer_range=0.02, tie_word_embeddings=True)
    model = StaticKVGPT2.from_hf(hf)
    assert model.tied
    prompt = list(range(100, 132))
    runner = StaticKVRunner(model, num_slots=2, max_context=64)
    got = runner.generate([prompt], 4)
    assert got == [hf_greedy(hf, prompt, 4)]


def test_export_roundtrip_matches_eager(hf: GPT2LMHeadModel, tmp_path: Path) -> None:
    from components.build.torch_cuda import export_program

    model = StaticKVGPT2.from_hf(hf)
    torch.export.save(export_program(model, num_slots=4, max_context=64), tmp_path / "model.pt2")
    program = torch.export.load(tmp_path / "model.pt2").module()
    from_program = StaticKVRunner(model, num_slots=4, max_context=64, decode_core=program, prefill_core=program)
    eager = StaticKVRunner(model, num_slots=4, max_context=64)
    assert from_program.generate(PROMPTS, 8) == eager.generate(PROMPTS, 8)


@pytest.mark.skipif(not os.environ.get("KILN_SLOW"), reason="Inductor on CPU takes ~30 s; set KILN_SLOW=1")
def test_compiled_step_matches_eager(hf: GPT2LMHeadModel) -> None:
    model = StaticKVGPT2.from_hf(hf)
    compiled = StaticKVRunner(model, num_slots=4, max_context=64, compile_step=True)
    eager = StaticKVRunner(model, num_slots=4, max_context=64)
    assert compiled.generate(PROMPTS, 8) == eager.generate(PROMPTS, 8)


def _triton_interpreter():
    """triton_decode under Triton's CPU interpreter, or skip (the project venv has no Triton)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter check is for machines without a GPU")
    pytest.importorskip("triton")
    from components.runtime import triton_decode

    return triton_decode


@pytest.mark.parametrize(
    "tiles",
    [None, {"QKV": (4, 1024), "OPROJ": (2, 1024), "FC": (4, 1024), "MPROJ": (2, 1024), "HEAD": (8, 1024), "ATTN_BLOCK_T": 256}],
)
def test_triton_step_matches_decode_step(hf: GPT2LMHeadModel, tiles: dict | None) -> None:
    td = _triton_interpreter()
    from components.runtime.static_kv import DecodeStep

    model = StaticKVGPT2.from_hf(hf)
    ref, fast = DecodeStep(model, 64), td.TritonDecodeStep(dict(model.named_parameters()), model.shape, 64)
    if tiles:
        for k, v in tiles.items():
            setattr(fast, k, v)
    assert_steps_agree(model, ref, fast)


def assert_steps_agree(model, ref, fast) -> None:
    """Three decode steps of the Triton step and the model's own on copies of one random
    cache: the same tokens, state and written cache rows. Rows at different positions, one
    inactive row parked on the scratch column."""
    kc1, vc1 = model.new_cache(4, 64)
    kc1.normal_()
    vc1.normal_()
    kc2, vc2 = kc1.clone(), vc1.clone()
    state1 = [torch.tensor([5, 17, 900]), torch.tensor([3, 10, 64]), torch.tensor([True, True, False])]
    state2 = [t.clone() for t in state1]
    keys = torch.arange(32)
    with torch.no_grad():
        for _ in range(3):
            assert ref(*state1, keys, kc1, vc1).tolist() == fast(*state2, keys, kc2, vc2).tolist()
            assert all(torch.equal(a, b) for a, b in zip(state1, state2))
    torch.testing.assert_close(kc1[:, :2], kc2[:, :2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vc1[:, :2], vc2[:, :2], atol=1e-4, rtol=1e-4)


def test_runner_with_triton_step_matches_hf(hf: GPT2LMHeadModel) -> None:
    td = _triton_interpreter()
    model = StaticKVGPT2.from_hf(hf)
    fast = td.TritonDecodeStep(dict(model.named_parameters()), model.shape, 64)
    runner = StaticKVRunner(model, num_slots=2, max_context=64, fast_step=fast, fast_max_width=2, attn_bucket=16)
    assert runner.generate(PROMPTS, 8) == [hf_greedy(hf, p, 8) for p in PROMPTS]


# ---------------------------------------------------------------------------- the Llama family


def _llama(family: str = "llama", **overrides):
    """A tiny Llama-family model (grouped-query attention: 4 query heads on 2 KV heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, initializer_range=0.3, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **(cfg | overrides))).eval()
    randomize_biases(model, std=0.5)  # Qwen2's q/k/v biases; the others have none
    return model


@pytest.mark.parametrize("gqa", ["fold", "sdpa", "repeat"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_llama_family_continuous_batching_greedy_matches_hf_with_each_way_of_grouping_queries(family: str, gqa: str) -> None:
    from components.runtime.static_kv import StaticKVLlama

    hf = _llama(family)
    runner = StaticKVRunner(StaticKVLlama.from_hf(hf, gqa=gqa), num_slots=2, max_context=64, max_chunk=4, attn_bucket=16)
    assert runner.generate(PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


def test_a_runner_stops_a_sequence_at_the_first_of_several_stop_tokens(hf: GPT2LMHeadModel) -> None:
    ref = [hf_greedy(hf, p, 10) for p in PROMPTS]
    stops = {ref[0][3], ref[2][6]}
    runner = StaticKVRunner(StaticKVGPT2.from_hf(hf), num_slots=2, max_context=64, max_chunk=4)
    ends = [next((i for i, t in enumerate(r) if t in stops), None) for r in ref]
    assert runner.generate(PROMPTS, 10, stop_token=stops) == [r if e is None else r[: e + 1] for r, e in zip(ref, ends)]


# The fused step (3 kernels a layer: default tiles, then several CTAs per head's O-proj
# slice and per MLP block; then attention over the cache in several passes and the
# keys, values and hidden size as before run 11), and the five-kernel step it replaces.
LLAMA_STEP_VARIANTS = {
    "fused": {},
    "fused-small-tiles": {"ATTN_O_BLOCK_N": 16, "MLP_TILE": 1024},
    "fused-attn-passes-unsplit": {"ATTN_O_BLOCK_T": 16, "ATTN_O_LATE_CAST": False, "MLP_SPLIT_K": False, "MLP_TILE": 1024},
    "five-kernel": {"FUSED": False},
}


@pytest.mark.parametrize("variant", list(LLAMA_STEP_VARIANTS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_triton_llama_step_matches_decode_step(family: str, variant: str) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = _llama(family, tie_word_embeddings=family == "llama", rope_scaling=llama3 if family == "llama" else None)
    assert_triton_llama_step_agrees(hf, LLAMA_STEP_VARIANTS[variant])


def test_triton_llama_step_with_a_hidden_size_of_two_tiles_matches_decode_step() -> None:
    # 96 = 64 + 32 columns: the MLP's split tiles (the default) both hold real columns.
    hf = _llama("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    assert_triton_llama_step_agrees(hf, {"MLP_TILE": 1024})


def assert_triton_llama_step_agrees(hf, attributes: dict) -> None:
    td = _triton_interpreter()
    from components.runtime.static_kv import DecodeStep, StaticKVLlama

    model = StaticKVLlama.from_hf(hf)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    ref, fast = DecodeStep(model, 64), td.triton_decode_step(params, model.shape, 64)
    for k, v in attributes.items():
        setattr(fast, k, v)
    assert_steps_agree(model, ref, fast)
