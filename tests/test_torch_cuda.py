"""The torch-cuda backend: a static-KV program exported from the trained model, built and
run here on the CPU (target `cpu`) through the same `Engine` interface the gates use; what
needs CUDA is marked and runs on a GPU machine (benchmarks/gpu_static_kv/run_device.sh test)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from components.errors import BackendUnavailable, BuildError, EngineError
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer

from .conftest import assert_names_no_folder_of_this_machine

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"torch {torch.__version__} sees no CUDA GPU")


def torch_engine(project, params, tiny_model, data_version, precision: str = "fp32", device: str = "cpu"):
    from components.build.torch_cuda import torch_engine_from_model
    from components.engine_dir import Lineage

    lineage = Lineage(source_model_path=str(tiny_model.path), source_model_sha256=tiny_model.sha256, onnx_sha256="-", data_md5=data_version.md5)
    return torch_engine_from_model(tiny_model.path, precision, lineage, params.build.profiles, project / "torch-engines", device=device)


@pytest.fixture(scope="module")
def cpu_engine_dir(project, params, tiny_model, data_version):
    return torch_engine(project, params, tiny_model, data_version)


@pytest.fixture(scope="module")
def cpu_engine(cpu_engine_dir):
    from components.runtime import open_engine

    with open_engine(cpu_engine_dir) as engine:
        yield engine


def test_the_program_file_names_no_folder_of_this_machine(cpu_engine_dir):
    """Like the ONNX file: the engine's sha256 is its registry identity, so the same model
    built from another checkout or virtualenv must be the same bytes (torch.export keeps
    each node's stack trace, with absolute paths, unless they are dropped)."""
    assert_names_no_folder_of_this_machine(cpu_engine_dir.engine_file)


def test_the_engine_directory_holds_the_program_its_versions_and_its_measured_parity(cpu_engine_dir, params):
    manifest = cpu_engine_dir.manifest
    assert (manifest.backend, manifest.target, manifest.engine_file, manifest.opset) == ("torch-cuda", "cpu", "model.pt2", None)
    assert manifest.backend_version == torch.__version__ and manifest.runtime["torch"] == torch.__version__
    assert manifest.runtime["cuda"] == (torch.version.cuda or "none")
    assert json.loads(manifest.runtime["shape"])["n_layer"] == manifest.num_layers
    # Profiles from params, as for every backend: slots = the batch profile's max.
    assert manifest.profiles["generation"].batch.max == params.build.profiles.batch.max
    assert manifest.profiles["generation"].past.max + 1 == params.build.profiles.context.max
    # The build measured the program against the fp32 model; fp32 differs by summation order.
    assert 0 <= manifest.parity.prefill_max_abs_diff < 1e-4 and 0 <= manifest.parity.decode_max_abs_diff < 1e-4
    assert manifest.parity.tolerance == 1e-3


def test_scores_match_the_pytorch_model_on_left_padded_rows(cpu_engine, reference):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cpu_engine.manifest.vocab_size, (3, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # row 1 is a 7-token prompt, left-padded
    ours = cpu_engine.score(ids, mask)
    with torch.no_grad():
        full = reference(torch.as_tensor(ids)).logits.numpy()
        short = reference(torch.as_tensor(ids[1:2, 5:])).logits.numpy()
    np.testing.assert_allclose(ours[[0, 2]], full[[0, 2]], atol=1e-4)
    np.testing.assert_allclose(ours[1, 5:], short[0], atol=1e-4)


def test_greedy_generation_equals_the_onnx_runtime_engine_of_the_same_model_with_more_prompts_than_slots(cpu_engine, engine, engine_dir):
    tokenizer = EngineTokenizer(engine_dir.path)
    texts = ["The list", "A function is", "When a class", "Iterators", "The with statement is used", "Exceptions"]
    prompts = [tokenizer.encode(f"{t} {i}") for i in range(3) for t in texts]
    assert len(prompts) > cpu_engine.manifest.profiles["generation"].batch.max  # some wait for a slot
    sampling = Sampling(max_new_tokens=12, stop_at_eos=False)
    assert cpu_engine.generate(prompts, sampling) == [engine.generate([p], sampling)[0] for p in prompts]


def test_generation_stops_at_end_of_text_and_leaves_it_out_like_every_engine(cpu_engine, engine, engine_dir):
    prompt = EngineTokenizer(engine_dir.path).encode("The")
    eos = cpu_engine.manifest.eos_token_id
    long = cpu_engine.generate([prompt], Sampling(max_new_tokens=40, stop_at_eos=False))[0]
    stopped = cpu_engine.generate([prompt], Sampling(max_new_tokens=40, stop_at_eos=True))[0]
    assert eos not in stopped
    assert stopped == (long[: long.index(eos)] if eos in long else long)
    assert stopped == engine.generate([prompt], Sampling(max_new_tokens=40, stop_at_eos=True))[0]


def test_the_quality_gate_runs_on_the_torch_engine_as_on_any_other(cpu_engine, reference, cpu_engine_dir, data_version, params):
    from components.gates import eval_windows, quality_gate

    windows = eval_windows(EngineTokenizer(cpu_engine_dir.path), data_version.texts("eval"), params.gates.quality)
    result = quality_gate(cpu_engine, reference, windows, params.gates.quality)
    assert result.passed, result.failures()
    assert result.measured["top1_agreement"] == 1.0 and abs(result.measured["ppl_increase_pct"]) < 1e-3


def test_what_it_cannot_do_now_is_refused_by_name(cpu_engine, project, params, tiny_model, data_version):
    _, held = cpu_engine.prefill(np.ones((1, 2), np.int64), np.ones((1, 2), np.int64))  # a server's sequence holds slot 0
    with pytest.raises(EngineError, match="1 step-wise sequences hold the cache's slots; generate runs when none does"):
        cpu_engine.generate([[1, 2]], Sampling(max_new_tokens=2))
    held.rows([])  # the sequence leaves: its slot is free
    assert len(cpu_engine.generate([[1, 2]], Sampling(max_new_tokens=2, stop_at_eos=False))[0]) == 2
    with pytest.raises(BuildError, match="precision int8 has no torch-cuda form"):
        torch_engine(project, params, tiny_model, data_version, precision="int8")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"target": "sm_90", "runtime": {"cuda": "13.0"}}, "engine built for sm_90 with torch {torch} .CUDA 13.0.; this machine has no CUDA GPU"),
        ({"backend_version": "2.11.0+cu130"}, "engine built for cpu with torch 2.11.0\\+cu130 .*; this machine has torch {torch}"),
    ],
)
def test_an_engine_built_for_another_gpu_or_torch_is_refused_naming_both(cpu_engine_dir, tmp_path, edit, message):
    from components.engine_dir import load_engine_dir
    from components.runtime import open_engine

    if CUDA and "target" in edit:
        pytest.skip("this machine has a CUDA GPU")
    copy = tmp_path / "engine"
    shutil.copytree(cpu_engine_dir.path, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    for key, value in edit.items():
        manifest[key] = manifest[key] | value if isinstance(value, dict) else value
    if "target" not in edit:
        manifest["backend_version"] = edit["backend_version"]
    (copy / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(BackendUnavailable, match=message.format(torch=torch.__version__.replace("+", "\\+"))):
        open_engine(load_engine_dir(copy))


def test_auto_builds_on_onnx_runtime_here_and_torch_cuda_is_refused_without_a_gpu():
    from components.build import resolve_backend

    if CUDA:
        assert resolve_backend("auto", "fp16") in ("tensorrt", "torch-cuda") and resolve_backend("auto", "int8") != "torch-cuda"
        return
    assert resolve_backend("auto", "fp16") == "onnxruntime"
    with pytest.raises(BackendUnavailable, match=re.escape(f"build.backend is torch-cuda, but torch {torch.__version__} sees no CUDA GPU")):
        resolve_backend("torch-cuda", "fp16")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("backend", "reason"),
    [("onnxruntime", "ONNX Runtime's CPU provider has no bf16 or FP8 MatMul kernel"), ("tensorrt", "the precision stage makes no bf16 or FP8 graph")],
)
def test_bf16_and_fp8_are_built_by_torch_cuda_alone_and_another_backend_is_refused_by_name(backend, reason, precision):
    from components.build import resolve_backend

    with pytest.raises(BuildError, match=re.escape(f"{precision} engines are built by torch-cuda alone; build.backend {backend} cannot build them: ") + ".*" + re.escape(reason)):
        resolve_backend(backend, precision)
    if CUDA:  # torch-cuda, even where TensorRT runs
        assert resolve_backend("auto", precision) == resolve_backend("torch-cuda", precision) == "torch-cuda"
        return
    with pytest.raises(BackendUnavailable, match=re.escape(f"{precision} engines are built by torch-cuda alone, but torch {torch.__version__} sees no CUDA GPU")):
        resolve_backend("auto", precision)


def test_onnx_runtimes_cpu_provider_still_has_no_bf16_matmul():
    """The reason bf16 is refused on ONNX Runtime: where a new version gains the kernel,
    this fails, and the refusal can be revisited."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(name, TensorProto.BFLOAT16, [2, 2]) for name in ("a", "b", "c")]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "bf16", io[:2], io[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)  # what older runtimes read too
    onnx.checker.check_model(model)
    with pytest.raises(Exception, match="Could not find an implementation for MatMul"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_bf16_has_no_precision_graph_the_torch_cuda_build_makes_it_from_the_model(exported, params, project):
    from components.precision import precision_onnx

    graph = precision_onnx(exported, "bf16", None, params.precision, project / "precision-bf16")
    assert (graph.precision, graph.onnx, graph.fp32_sha256, graph.ort_only) == ("bf16", exported, exported.sha256, False)
    assert not (project / "precision-bf16").exists()  # nothing converted, nothing written


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_on_the_gpu_greedy_tokens_match_the_pytorch_model_for_32_steps(tmp_path, precision):
    """Built and run on the GPU (target sm_XY); needs no DVC or training, so that it runs on
    a GPU machine with only torch and transformers (benchmarks/gpu_static_kv/run_device.sh test)."""
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams
    from components.engine_dir import Lineage
    from components.model_dir import load_model
    from components.runtime import open_engine
    from benchmarks.generation import TINY, benchmark_model_dir

    model_dir = benchmark_model_dir(tmp_path / "model", TINY)
    lineage = Lineage(source_model_path=str(model_dir), source_model_sha256="random", onnx_sha256="-", data_md5="-")
    engine_dir = torch_engine_from_model(model_dir, precision, lineage, ProfileParams(), tmp_path / "engines", device="cuda")
    major, minor = torch.cuda.get_device_capability()
    assert engine_dir.manifest.target == f"sm_{major}{minor}" and engine_dir.manifest.runtime["gpu"] == torch.cuda.get_device_name()
    reference = load_model(model_dir)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    with open_engine(engine_dir) as engine, torch.no_grad():
        ours = engine.generate(prompts, Sampling(max_new_tokens=32, stop_at_eos=False))
        theirs = [reference.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 3:].tolist() for p in prompts]
        stepwise = greedy_step_by_step(engine, prompts, 32)  # kiln serve's path: slots, decode graphs, host argmax
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert agree == len(prompts) if precision == "fp32" else agree >= len(prompts) - 1  # fp16, bf16: a near-tie may round the other way
    assert sum(a == b for a, b in zip(stepwise, ours, strict=True)) >= len(prompts) - (precision != "fp32")


@needs_cuda
def test_on_the_gpu_one_sequence_runs_the_triton_step_and_keeps_the_pytorch_models_tokens(tmp_path):
    """A single sequence takes the hand-written Triton step (with programmatic dependent
    launch on sm_90 and later: kernels that start before the previous one ends, reading
    only weights and older cache rows until it has), which must not change a token."""
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams
    from components.engine_dir import Lineage
    from components.model_dir import load_model
    from components.runtime import open_engine
    from benchmarks.generation import TINY, benchmark_model_dir

    model_dir = benchmark_model_dir(tmp_path / "model", TINY)
    lineage = Lineage(source_model_path=str(model_dir), source_model_sha256="random", onnx_sha256="-", data_md5="-")
    engine_dir = torch_engine_from_model(model_dir, "fp32", lineage, ProfileParams(), tmp_path / "engines", device="cuda")
    reference = load_model(model_dir)
    with open_engine(engine_dir) as engine, torch.no_grad():
        step = engine.runner.fast_step
        assert step is not None and step.pdl == (torch.cuda.get_device_capability()[0] >= 9)
        for prompt in ([10, 20, 30], [7], list(range(40, 90))):  # one row per call: the Triton step
            ours = engine.generate([prompt], Sampling(max_new_tokens=64, stop_at_eos=False))[0]
            theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, len(prompt) :].tolist()
            assert ours == theirs


@pytest.mark.parametrize(("shape", "triton"), [("gpt2-small", True), ("smollm2-135m", True), ("llama3.1-8b", False), ("qwen2.5-7b", False)])
def test_the_one_row_triton_step_is_taken_only_at_the_widths_its_tiles_were_measured_at(shape, triton):
    """The Triton step read an 8B model's weights at a fifth of an H200's bandwidth, where
    the compiled step reads them near it: a wide model's one-row steps take the compiled step."""
    from transformers import AutoConfig

    from benchmarks.generation import SHAPES
    from components.runtime.static_kv import static_shape
    from components.runtime.torch_cuda import triton_step_suits

    fields = dict(SHAPES[shape])
    assert triton_step_suits(static_shape(AutoConfig.for_model(fields.pop("family"), **fields))) is triton


def greedy_step_by_step(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens through prefill and decode (rows in slots 0..n-1), as kiln serve's scheduler drives them."""
    from components.runtime.engine import left_pad

    ids, mask = left_pad(prompts, engine.manifest.eos_token_id)
    logits, state = engine.prefill(ids, mask)
    tokens = logits[:, -1].argmax(-1)
    out = [[t] for t in tokens.tolist()]
    for _ in range(new_tokens - 1):
        logits, state = engine.decode(state, tokens)
        tokens = logits.argmax(-1)
        for row, token in zip(out, tokens.tolist(), strict=True):
            row.append(token)
    state.rows([])
    return out


def test_step_by_step_decoding_gives_the_tokens_of_generate(cpu_engine, engine_dir):
    prompts = [EngineTokenizer(engine_dir.path).encode(t) for t in ("The list", "A function is defined", "When")]
    assert greedy_step_by_step(cpu_engine, prompts, 20) == cpu_engine.generate(prompts, Sampling(max_new_tokens=20, stop_at_eos=False))


def test_a_sequence_moved_into_a_freed_slot_keeps_its_cache(cpu_engine, engine_dir):
    """A sequence that leaves frees its slot, and a later one moves into it (kiln serve
    compacts the batch that way): the moved sequence's next logits are those it has alone."""
    from components.runtime.engine import left_pad

    tokenizer = EngineTokenizer(engine_dir.path)
    prompts = [tokenizer.encode(t) for t in ("The list type is", "A function is defined as the", "When the value of")]

    def after_steps(rows: list[list[int]], leave_after: int | None) -> np.ndarray:
        ids, mask = left_pad(rows, cpu_engine.manifest.eos_token_id)
        logits, state = cpu_engine.prefill(ids, mask)
        tokens = logits[:, -1].argmax(-1)
        for step in range(6):
            if step == leave_after:
                state, tokens = state.rows([0, 2]), tokens[[0, 2]]  # the middle one leaves
            logits, state = cpu_engine.decode(state, tokens)
            tokens = logits.argmax(-1)
        state.rows([])
        return logits[-1]

    moved, alone = after_steps(prompts, leave_after=3), after_steps(prompts[2:], leave_after=None)
    np.testing.assert_allclose(moved, alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_prompt_prefilled_after_its_cached_beginning_equals_the_whole_prefill_beside_a_running_sequence(family, cpu_engine_dir, family_engine_dirs):
    check_prefill_after(cpu_engine_dir if family == "gpt2" else family_engine_dirs[family], atol=1e-4)


def check_prefill_after(engine_dir, atol: float) -> None:
    """What a prefix cache's hit does on torch-cuda: the cached keys and values copied into
    the next free slot, the rest of the prompt prefilled after them while another sequence
    holds slot 0; the logits and the slot's cache are those of prefilling it whole."""
    from components.runtime import open_engine
    from components.runtime.engine import left_pad

    prompt, running = list(range(5, 45)), list(range(60, 71))
    with open_engine(engine_dir) as engine:

        def prefill(rows: list[list[int]]):
            return engine.prefill(*left_pad(rows, engine.manifest.eos_token_id))

        busy = prefill([running])[1]
        expected, whole = prefill([prompt])
        expected_kv = [part.clone() for part in engine.kv_of(whole, 0, len(prompt))]
        busy = busy.joined(whole).rows([0])
        _, beginning = prefill([prompt[:32]])
        cached = [part.clone() for part in engine.kv_of(beginning, 0, 32)]
        busy = busy.joined(beginning).rows([0])
        engine.runner.k_cache[:, 1].zero_()  # what the freed slot held must not be what is read
        engine.runner.v_cache[:, 1].zero_()
        logits, after = engine.prefill_after(cached, prompt[32:])
        assert after.slots == [1] and after.lengths.tolist() == [len(prompt)]
        np.testing.assert_allclose(logits, expected, atol=atol, rtol=0)
        for ours, theirs in zip(engine.kv_of(after, 0, len(prompt)), expected_kv, strict=True):
            torch.testing.assert_close(ours, theirs, atol=atol / 10, rtol=0)
        busy.joined(after).rows([])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hits_of_different_lengths_prefilled_in_one_pass_equal_their_whole_prefills(family, cpu_engine_dir, family_engine_dirs):
    check_prefill_after_each(cpu_engine_dir if family == "gpt2" else family_engine_dirs[family], atol=1e-4)


def check_prefill_after_each(engine_dir, atol: float) -> None:
    """A burst of prefix cache hits on torch-cuda, in one pass beside a running sequence:
    prompts of other lengths, cached to other depths; each row's logits and slot are those
    of prefilling its prompt whole."""
    from components.runtime import open_engine
    from components.runtime.engine import left_pad

    prompts, depths, running = [list(range(5, 45)), list(range(100, 121)), list(range(7, 60))], [32, 16, 48], list(range(60, 71))
    with open_engine(engine_dir) as engine:

        def prefill(rows: list[list[int]]):
            return engine.prefill(*left_pad(rows, engine.manifest.eos_token_id))

        busy = prefill([running])[1]
        expected, expected_kv, cached = [], [], []
        for prompt, depth in zip(prompts, depths, strict=True):
            logits, whole = prefill([prompt])
            expected.append(logits)
            expected_kv.append([part.clone() for part in engine.kv_of(whole, 0, len(prompt))])
            busy = busy.joined(whole).rows([0])
            _, beginning = prefill([prompt[:depth]])
            cached.append([part.clone() for part in engine.kv_of(beginning, 0, depth)])
            busy = busy.joined(beginning).rows([0])
        engine.runner.k_cache[:, 1:].zero_()  # what the freed slots held must not be what is read
        engine.runner.v_cache[:, 1:].zero_()
        logits, after = engine.prefill_after_each([(c, p[d:]) for c, p, d in zip(cached, prompts, depths, strict=True)])
        assert after.slots == [1, 2, 3] and after.lengths.tolist() == [len(p) for p in prompts]
        np.testing.assert_allclose(logits, np.concatenate(expected), atol=atol, rtol=0)
        for row, prompt in enumerate(prompts):
            for ours, theirs in zip(engine.kv_of(after, row, len(prompt)), expected_kv[row], strict=True):
                torch.testing.assert_close(ours, theirs, atol=atol / 10, rtol=0)
        busy.joined(after).rows([])


@needs_cuda
def test_on_the_gpu_a_prefix_cache_hit_prefills_as_the_whole_prompt_and_a_conversation_answers_as_without_it(family_dirs, tmp_path):
    from .test_prefix_cache import SHORT_TURNS, check_conversation

    engine_dir = family_engine(family_dirs["llama"], tmp_path, device="cuda")
    check_prefill_after(engine_dir, atol=2e-3)  # the prefill's compiled graphs against an eager step, in TF32
    check_conversation(engine_dir.path, engine_dir.path, SHORT_TURNS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_conversation_on_the_torch_engine_reuses_its_cached_turns_and_answers_as_without_them(family, cpu_engine_dir, engine_dir, family_engine_dirs):
    from .test_prefix_cache import SHORT_TURNS, check_conversation

    if family == "gpt2":
        check_conversation(cpu_engine_dir.path, engine_dir.path)
    else:
        check_conversation(family_engine_dirs[family].path, family_engine_dirs[family].path, SHORT_TURNS)


def test_the_servers_scheduler_batches_requests_over_the_cache_slots_each_with_its_own_sampling(cpu_engine_dir, engine, engine_dir):
    """kiln serve's continuous batching on a torch-cuda engine: more requests than slots,
    joining and leaving between steps (unequal lengths), greedy and sampled ones together.
    Greedy rows equal the ONNX Runtime engine's; a sampled row equals itself alone with its seed."""
    import threading

    from components.runtime import open_engine
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    torch_engine_ = open_engine(cpu_engine_dir)
    done, batches = threading.Semaphore(0), []
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=32, observe=lambda turn: batches.append(turn.decoded))

    def sequence(text: str, sampling: Sampling) -> Sequence:
        return Sequence(tokenizer.encode(text), sampling, lambda e: done.release() if isinstance(e, Finished) else None)

    greedy = [sequence(f"The list {i}", Sampling(max_new_tokens=4 + i % 7, stop_at_eos=False)) for i in range(19)]
    sampled = [sequence("A function is", Sampling(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=7, stop_at_eos=False)) for _ in range(2)]
    scheduler.submit(greedy[:3] + sampled[:1] + greedy[3:])
    for _ in range(20):
        assert done.acquire(timeout=60)
    scheduler.submit(sampled[1:])  # alone this time: the same seed gives the same tokens
    assert done.acquire(timeout=60)
    assert max(batches) == cpu_engine_dir.manifest.profiles["generation"].batch.max
    for seq in greedy:
        assert seq.generated == engine.generate([seq.prompt], seq.sampling)[0]
    assert sampled[0].generated == sampled[1].generated and len(sampled[0].generated) == 9
    assert scheduler.close(timeout=10)


def test_a_sampled_generate_draws_what_kiln_serve_draws_for_the_same_seed_in_batches_over_the_slots(cpu_engine_dir, engine_dir):
    """The pipeline's sample completion is a sampled `generate`: drawn on the device from each
    prompt's seeded stream, as the server's scheduler draws a request's tokens, however many
    prompts share the slots (a torch-cuda `kiln build` failed at this step before)."""
    import threading

    from components.runtime import open_engine
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    sampling = Sampling(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=7, stop_at_eos=False)
    prompt = tokenizer.encode("A function is")
    slots = cpu_engine_dir.manifest.profiles["generation"].batch.max
    torch_engine_ = open_engine(cpu_engine_dir)
    rows = torch_engine_.generate([prompt] * (slots + 2), sampling)
    other_seed = torch_engine_.generate([prompt], Sampling(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=8, stop_at_eos=False))[0]
    done = threading.Event()
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=4)  # the engine is the scheduler's now
    served = Sequence(prompt, sampling, lambda e: done.set() if isinstance(e, Finished) else None)
    scheduler.submit([served])
    assert done.wait(60) and scheduler.close(timeout=10)
    assert len(served.generated) == 9 and rows == [served.generated] * (slots + 2)
    assert other_seed != served.generated


def test_constrained_rows_on_the_torch_engine_parse_and_leave_the_free_rows_of_their_batch_alone(cpu_engine_dir, engine, engine_dir):
    """A grammar's mask on the torch-cuda engine (here on the CPU): the batch takes one-step
    turns, masked and sampled where the logits are; the constrained answers parse, the free greedy rows
    equal the ONNX Runtime engine's, and a seeded constrained row equals itself alone."""
    import json
    import threading

    from components.runtime import open_engine
    from components.runtime.grammar import json_schema_grammar
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    torch_engine_ = open_engine(cpu_engine_dir)
    done = threading.Semaphore(0)
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=32)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)

    def sequence(text: str, sampling: Sampling) -> Sequence:
        return Sequence(tokenizer.encode(text), sampling, lambda e: done.release() if isinstance(e, Finished) else None)

    free = [sequence(f"The list {i}", Sampling(max_new_tokens=6, stop_at_eos=False)) for i in range(3)]
    constrained = [sequence("A function is", Sampling(max_new_tokens=40, temperature=0.9, seed=5, grammar=grammar)) for _ in range(2)]
    scheduler.submit(free + constrained[:1])
    for _ in range(4):
        assert done.acquire(timeout=60)
    scheduler.submit(constrained[1:])
    assert done.acquire(timeout=60)
    answer = json.loads(tokenizer.decode(constrained[0].generated))
    assert set(answer) == {"n", "ok"} and 0 <= answer["n"] <= 999
    assert constrained[0].generated == constrained[1].generated
    for seq in free:
        assert seq.generated == engine.generate([seq.prompt], seq.sampling)[0]
    assert scheduler.close(timeout=10)


def test_a_grammars_mask_on_the_device_forbids_exactly_the_tokens_the_host_mask_forbids():
    """The bitmask llguidance fills, applied where the logits are (torch) and on the host
    (numpy), over a vocabulary that is not a multiple of 32: the same -inf, the rows without
    a grammar untouched."""
    from components.runtime.torch_sampling import forbid_disallowed

    rng, vocab = np.random.default_rng(1), 50_257
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    on_device = torch.from_numpy(logits.copy())
    forbid_disallowed(on_device, torch.tensor([0, 2]), torch.from_numpy(bitmask))
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert np.array_equal(np.isinf(on_device.numpy()[[0, 2]]), ~allowed)
    assert np.array_equal(on_device.numpy()[1], logits[1]) and np.isfinite(on_device.numpy()[1]).all()
    assert 0.4 < allowed.mean() < 0.6  # both kinds of token were there to get wrong


def test_the_schedulers_log_probabilities_are_the_onnx_runtime_engines_prompt_and_generated_alike(cpu_engine_dir, engine_dir):
    """`echo` with logprobs needs every prompt position's logits from a prefill into the slots:
    the same numbers as the ONNX Runtime engine's (lm-eval scores through them)."""
    import threading

    from components.runtime import open_engine
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer, sampling = EngineTokenizer(engine_dir.path), Sampling(max_new_tokens=3, stop_at_eos=False, logprobs=2, prompt_logprobs=2)
    scored = {}
    for name, runtime in (("torch-cuda", open_engine(cpu_engine_dir)), ("onnxruntime", open_engine(engine_dir))):
        done = threading.Semaphore(0)
        scheduler = Scheduler(runtime, tokenizer, max_waiting=4)
        rows = [Sequence(tokenizer.encode(text), sampling, lambda e: done.release() if isinstance(e, Finished) else None) for text in ("The list type is", "A")]
        scheduler.submit(rows)
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        assert scheduler.close(timeout=10)
        scored[name] = [(seq.prompt_logprobs, seq.logprobs, seq.generated) for seq in rows]
    for ours, theirs in zip(scored["torch-cuda"], scored["onnxruntime"], strict=True):
        assert ours[2] == theirs[2] and ours[0][0] is None and theirs[0][0] is None
        for a, b in zip([*ours[0][1:], *ours[1]], [*theirs[0][1:], *theirs[1]], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_device_sampling_draws_from_the_nucleus_at_the_temperature_and_greedy_rows_take_the_argmax():
    from components.runtime.torch_sampling import sample_rows

    rows = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(rows, 1)
    drawn = sample_rows(logits, torch.full((rows,), 0.8), torch.full((rows,), 0.9), torch.full((rows,), 7), torch.arange(rows))
    probs = torch.softmax(logits[0] / 0.8, -1)
    nucleus = probs[:3] / probs[:3].sum()  # 0.647 + 0.185 < 0.9 <= + 0.099: three tokens kept
    assert np.allclose(np.bincount(drawn.numpy(), minlength=5) / rows, [*nucleus.tolist(), 0, 0], atol=0.01)
    temperature = torch.tensor([0.0, 0.0, 1.0])
    picked = sample_rows(torch.tensor([[0.0, 3.0, 1.0]] * 3), temperature, torch.ones(3), torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert picked[:2].tolist() == [1, 1]


def test_device_sampling_never_draws_a_token_whose_logit_is_minus_infinity_over_a_large_vocabulary():
    """A uniform of 24 bits rounded to 1.0 for one state in 2**24: its Gumbel noise was +inf,
    so that token won whatever its logit, and beside a grammar's -inf the sum was NaN, which
    argmax took (an H100 drew token 120728 of a 300-token tokenizer under a JSON schema)."""
    from components.runtime.torch_sampling import sample_rows, uniform_of

    extremes = uniform_of(torch.tensor([0, 0x1FF, 0xFFFFFE00, 0xFFFFFFFF]))
    assert (extremes > 0).all() and (extremes < 1).all()
    rng, vocab = np.random.default_rng(0), 151_936
    for draw in range(40):
        logits = np.full((2, vocab), -np.inf, np.float32)
        for row in range(2):
            logits[row, rng.choice(300, size=11, replace=False)] = rng.normal(size=11) * 3
        keys = torch.tensor([3 * 1_000_003, 3 * 1_000_003 + 1])
        picked = sample_rows(torch.from_numpy(logits), torch.ones(2), torch.ones(2), keys, torch.full((2,), draw)).numpy()
        assert np.isfinite(logits[[0, 1], picked]).all(), (draw, picked)


def test_a_rows_draw_is_its_streams_whatever_its_batch_and_survives_last_bit_differences_in_its_logits():
    """Draw n of a row depends on its key and n alone (not on the rows beside it), and the
    Gumbel-max draw keeps its token when another batch width's kernels change the logits
    in their last bits."""
    from components.runtime.torch_sampling import sample_rows

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50_257, generator=generator) * 0.5  # near-flat, as a random-weight model's
    temperature, top_p, keys, counters = torch.full((32,), 0.8), torch.full((32,), 0.95), torch.arange(32) * 7919, torch.arange(32)
    together = sample_rows(logits, temperature, top_p, keys, counters)
    alone = [sample_rows(logits[i : i + 1], temperature[:1], top_p[:1], keys[i : i + 1], counters[i : i + 1]).item() for i in range(32)]
    assert together.tolist() == alone
    nudged = logits + torch.randn(logits.shape, generator=generator) * 1e-3
    assert (sample_rows(nudged, temperature, top_p, keys, counters) == together).float().mean() >= 0.95
    assert (sample_rows(logits, temperature, top_p, keys, counters + 1) != together).any()  # the next draw is another


class Recorder:
    """A sequence's `emit`: keeps its events, and says when it has finished."""

    def __init__(self) -> None:
        import threading

        self.events: list = []
        self.finished = threading.Event()

    def __call__(self, event) -> None:
        from serving.scheduler import Failed, Finished

        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.finished.set()


def test_a_turn_nobody_waits_on_takes_several_steps_on_the_device_and_keeps_every_answer(cpu_engine_dir, engine, engine_dir):
    """Where the device samples, one call runs up to 16 steps (one host round trip for
    all): greedy answers stay the ONNX Runtime engine's, a stop string met mid-turn ends the
    answer exactly there, and a stream gets one delta per turn."""
    from components.runtime import open_engine
    from serving.scheduler import Delta, Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    torch_engine_ = open_engine(cpu_engine_dir)
    turns: list[int] = []
    decode_turn = torch_engine_.decode_turn
    torch_engine_.decode_turn = lambda state, ids, draws, steps, room=0: turns.append(steps) or decode_turn(state, ids, draws, steps, room)
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=8)
    greedy = Sampling(max_new_tokens=37, stop_at_eos=False)
    prompt = tokenizer.encode("The list type is")
    whole = engine.generate([prompt], greedy)[0]
    text, stop = tokenizer.decode(whole), tokenizer.decode(whole[20:22])  # in the second 16-step turn
    plain, stopped = Sequence(prompt, greedy, Recorder()), Sequence(prompt, greedy, Recorder(), stops=(stop,))
    scheduler.submit([plain])
    assert plain.emit.finished.wait(60)
    assert turns == [16, 16, 4]  # 37 tokens: the prefill's first, then 36 in three turns
    assert plain.generated == whole and plain.text == text
    deltas = [e for e in plain.emit.events if isinstance(e, Delta)]
    assert len(deltas) == 4 and "".join(d.text for d in deltas) == text
    scheduler.submit([stopped])
    assert stopped.emit.finished.wait(60)
    assert stopped.text == text[: text.index(stop)] and stopped.emit.events[-1].reason == "stop"
    assert stopped.generated == whole[: len(stopped.generated)] and len(stopped.generated) <= 22
    assert isinstance(stopped.emit.events[-1], Finished) and scheduler.close(timeout=10)


def test_a_turn_queued_before_the_host_reads_the_last_one_changes_no_answer(cpu_engine_dir, engine, engine_dir):
    """Run-ahead (on CUDA: the next turn queued on the device while the host handles this
    one), forced on the CPU: a lone stream takes its queued turns; sequences that join,
    leave and stop mid-turn around queued turns get the tokens they get without it."""
    from components.runtime import open_engine
    from serving.scheduler import Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    torch_engine_ = open_engine(cpu_engine_dir)
    runner = torch_engine_.runner
    runner.run_ahead = True
    hits: list[bool] = []
    decode_rows = runner.decode_rows

    def recorded(ids, positions, steps, room=0, most=None):
        queued = runner._queued
        hits.append(queued is not None and (queued.next_ids, queued.positions) == (list(ids), list(positions)))
        return decode_rows(ids, positions, steps, room, most)

    runner.decode_rows = recorded
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=16)
    prompt = tokenizer.encode("The list type is")
    alone = Sequence(prompt, Sampling(max_new_tokens=37, stop_at_eos=False), Recorder())
    scheduler.submit([alone])
    assert alone.emit.finished.wait(60)
    assert hits == [False, True, True]  # turns of 16, then the queued 16 and 4
    assert alone.generated == engine.generate([prompt], alone.sampling)[0]
    whole = alone.generated
    stop = tokenizer.decode(whole[20:22])
    crowd = [Sequence(tokenizer.encode(f"A function {i} is"), Sampling(max_new_tokens=5 + 6 * i, stop_at_eos=False), Recorder()) for i in range(6)]
    stopped = Sequence(prompt, Sampling(max_new_tokens=37, stop_at_eos=False), Recorder(), stops=(stop,))
    late = [Sequence(tokenizer.encode(f"When {i}"), Sampling(max_new_tokens=9, stop_at_eos=False), Recorder()) for i in range(2)]
    hits.clear()
    scheduler.submit(crowd[:3] + [stopped] + crowd[3:])
    assert crowd[0].emit.finished.wait(60)
    scheduler.submit(late)  # while the others run, some behind a queued turn
    for seq in [*crowd, stopped, *late]:
        assert seq.emit.finished.wait(60)
    assert any(hits) and not all(hits)
    for seq in crowd + late:
        assert seq.generated == engine.generate([seq.prompt], seq.sampling)[0]
    assert stopped.text == tokenizer.decode(whole)[: tokenizer.decode(whole).index(stop)]
    assert scheduler.close(timeout=10)


def test_its_registry_tags_and_version_page_say_what_it_was_built_from_and_for(cpu_engine_dir, params, tiny_model):
    from components.gates import GateReport, GateResult
    from flows.lineage import version_description, version_tags

    report = GateReport((GateResult("quality", True, {"top1_agreement": 1.0}, {"min_top1_agreement": 0.99}),))
    tags = version_tags(params, cpu_engine_dir, report, "0" * 40)
    assert (tags["backend"], tags["target"], tags["runtime.torch"], tags["precision_onnx_sha256"]) == ("torch-cuda", "cpu", torch.__version__, "none")
    assert "runtime.shape" not in tags
    page = version_description(params, tiny_model, cpu_engine_dir, report, None, "0" * 40, None)
    assert f"torch-cuda {torch.__version__} · `cpu`" in page and "- model → fp32 `torch.export` program over a static KV cache (torch " in page


# ---------------------------------------------------------------------------- the Llama family

FAMILIES = ("llama", "qwen2", "mistral")
FAMILY_PROMPTS = [[5, 17, 42], [7], [9, 10, 11, 12, 13, 14, 15, 16], [100, 3]]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """A tiny random model directory per family (no DVC, no training: they also serve the GPU
    tests on a machine without DVC). A large init range gives diverse greedy tokens (with the
    default 0.02 a random model repeats a token and a parity test proves little), and biases
    large enough that a wrongly laid out Qwen2 q/k/v bias would show."""
    from components.config import ModelParams, TokenizerParams
    from components.runtime.static_kv import randomize_biases
    from components.train import tokenizer_from_texts

    from .model_families import random_model_dir

    root = tmp_path_factory.mktemp("families")
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "def function(argument): return value " * 20]
    tokenizer = tokenizer_from_texts(texts, ModelParams(tokenizer=TokenizerParams(vocab_size=300, min_frequency=1)))
    # torch's draws: the GPU tests' tolerances were measured on them, comparing on one machine.
    dirs = {family: random_model_dir(family, tokenizer, root / family, torch_draws=True, initializer_range=0.3) for family in FAMILIES}
    from transformers import AutoModelForCausalLM

    qwen2 = AutoModelForCausalLM.from_pretrained(dirs["qwen2"]).eval()
    randomize_biases(qwen2, std=0.5)
    qwen2.save_pretrained(str(dirs["qwen2"]))
    return dirs


def family_engine(model_dir, root, precision: str = "fp32", device: str = "cpu", slots: int = 4):
    from components.build.torch_cuda import torch_engine_from_model
    from components.config import ProfileParams, ShapeRange
    from components.engine_dir import Lineage
    from components.model_dir import model_from_directory

    # The model's own digest: it names the engine folder, one per model.
    lineage = Lineage(source_model_path=str(model_dir), source_model_sha256=model_from_directory(model_dir).sha256, onnx_sha256="-", data_md5="-")
    profiles = ProfileParams(batch=ShapeRange(min=1, opt=1, max=slots), context=ShapeRange(min=2, opt=64, max=128))
    return torch_engine_from_model(model_dir, precision, lineage, profiles, root, device=device)


def test_an_engine_of_one_slot_builds_and_generates_what_hugging_face_does(family_dirs, tmp_path):
    """build.profiles.batch.max 1 (one sequence at a time, or all a small card holds): the
    program's row count is then a fixed 1, which torch.export cannot take as a dynamic size."""
    from components.runtime import open_engine

    engine_dir = family_engine(family_dirs["llama"], tmp_path, slots=1)
    assert engine_dir.manifest.profiles["generation"].batch.max == 1
    with open_engine(engine_dir) as engine:
        tokens = engine.generate(FAMILY_PROMPTS[:1], Sampling(max_new_tokens=6, stop_at_eos=False))
    assert tokens == hf_greedy_tokens(hf_reference(family_dirs["llama"]), FAMILY_PROMPTS[:1], 6)


@pytest.fixture(scope="module")
def family_engine_dirs(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("family-engines")
    return {family: family_engine(path, root) for family, path in family_dirs.items()}


def hf_reference(model_dir):
    from components.model_dir import load_model

    return load_model(model_dir)


def hf_greedy_tokens(reference, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            reference.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def test_rotary_frequencies_and_llama3_scaling_are_transformers_own():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from components.runtime.static_kv import rotary_frequencies

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    for rope in (None, llama3, {"rope_type": "linear", "factor": 4.0}):
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_theta=500000.0, rope_scaling=rope)
        inv_freq, scaling = rotary_frequencies(config)
        theirs = LlamaRotaryEmbedding(config)
        assert torch.equal(inv_freq, theirs.inv_freq) and scaling == theirs.attention_scaling
    # llama3 scaling leaves the high frequencies alone and divides the lowest by the factor.
    plain, _ = rotary_frequencies(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0))
    assert inv_freq.shape == plain.shape == (8,)
    scaled, _ = rotary_frequencies(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, rope_scaling=llama3))
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 8.0)


def test_a_rope_that_changes_with_the_sequence_length_is_refused_by_name():
    from transformers import LlamaConfig

    from components.runtime.static_kv import rotary_frequencies

    with pytest.raises(ValueError, match="rope type 'dynamic' is not one a static program implements"):
        rotary_frequencies(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_each_familys_engine_records_its_family_kv_heads_stop_ids_and_parameters(family_engine_dirs, family_dirs):
    for family, engine_dir in family_engine_dirs.items():
        manifest, reference = engine_dir.manifest, hf_reference(family_dirs[family])
        shape = json.loads(manifest.runtime["shape"])
        assert (manifest.model_family, shape["family"], manifest.num_heads, manifest.num_kv_heads, manifest.kv_heads) == (family, family, 4, 2, 2)
        assert (manifest.num_layers, manifest.head_dim, manifest.max_positions) == (2, 16, 256)
        assert manifest.stop_ids == {reference.config.eos_token_id}
        # A tied embedding (the llama one) counts once.
        assert manifest.parameter_count == sum(p.numel() for p in reference.parameters())
        assert (family == "llama") == (manifest.parameter_count == sum(p.numel() for n, p in reference.named_parameters() if n != "lm_head.weight"))
        assert shape["qkv_bias"] == (family == "qwen2")
        assert 0 <= manifest.parity.prefill_max_abs_diff < 1e-4 and 0 <= manifest.parity.decode_max_abs_diff < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_greedy_tokens_equal_hugging_faces_generate(family_engine_dirs, family_dirs, family):
    from components.runtime import open_engine

    with open_engine(family_engine_dirs[family]) as engine:
        ours = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=16, stop_at_eos=False))
        stepwise = greedy_step_by_step(engine, FAMILY_PROMPTS, 16)  # kiln serve's path
    theirs = hf_greedy_tokens(hf_reference(family_dirs[family]), FAMILY_PROMPTS, 16)
    assert ours == theirs and stepwise == theirs
    assert len({t for row in theirs for t in row}) > 8  # diverse tokens: the comparison means something


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_scores_match_hugging_face_on_left_padded_rows(family_engine_dirs, family_dirs, family):
    from components.runtime import open_engine

    rng = np.random.default_rng(0)
    ids = rng.integers(0, family_engine_dirs[family].manifest.vocab_size, (3, 12))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # row 1 is a 7-token prompt, left-padded
    with open_engine(family_engine_dirs[family]) as engine:
        ours = engine.score(ids, mask)
    reference = hf_reference(family_dirs[family])
    with torch.no_grad():
        full = reference(torch.as_tensor(ids)).logits.numpy()
        short = reference(torch.as_tensor(ids[1:2, 5:])).logits.numpy()
    np.testing.assert_allclose(ours[[0, 2]], full[[0, 2]], atol=1e-4)
    np.testing.assert_allclose(ours[1, 5:], short[0], atol=1e-4)


def test_generation_stops_at_any_of_the_models_stop_ids(family_engine_dirs, tmp_path):
    """Llama 3 ends on `<|eot_id|>` as well as `<|end_of_text|>`: every id of the manifest's
    eos_token_ids ends a sequence, and none is part of the result."""
    from components.engine_dir import load_engine_dir
    from components.runtime import open_engine

    copy = tmp_path / "engine"
    shutil.copytree(family_engine_dirs["llama"].path, copy)
    with open_engine(load_engine_dir(copy)) as engine:
        long = engine.generate(FAMILY_PROMPTS[:2], Sampling(max_new_tokens=16, stop_at_eos=False))
    stops = [long[0][5], long[1][9]]  # a token each row emits, the first of its kind there
    manifest = json.loads((copy / "engine.json").read_text())
    (copy / "engine.json").write_text(json.dumps(manifest | {"eos_token_ids": [manifest["eos_token_id"], *stops]}))
    with open_engine(load_engine_dir(copy)) as engine:
        stopped = engine.generate(FAMILY_PROMPTS[:2], Sampling(max_new_tokens=16, stop_at_eos=True))
    for row, full in zip(stopped, long, strict=True):
        end = min(full.index(t) for t in stops if t in full)
        assert row == full[:end]


def test_a_sliding_window_shorter_than_the_context_is_refused_at_build(family_dirs, tmp_path):
    from transformers import AutoConfig

    model_dir = tmp_path / "mistral"
    shutil.copytree(family_dirs["mistral"], model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.sliding_window = 64
    config.save_pretrained(model_dir)
    with pytest.raises(BuildError, match="sliding window of 64 tokens, shorter than build.profiles.context.max .128."):
        family_engine(model_dir, tmp_path / "engines")


# ---------------------------------------------------------------------------- bf16


def bf16_model_dir(source, directory):
    """`source` saved again in bf16, as Llama 3 and Qwen2.5 are published: bf16 weights, and
    `dtype: bfloat16` in config.json."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype="float32").to(torch.bfloat16)
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file() and not (directory / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def bf16_dir(family_dirs, tmp_path_factory):
    return bf16_model_dir(family_dirs["llama"], tmp_path_factory.mktemp("bf16") / "llama")


def test_the_build_loads_a_model_in_the_dtype_it_was_saved_in_never_in_fp32(bf16_dir, family_dirs):
    """An 8B bf16 model is 16 GB on the host, not fp32's 32: every tensor of the loaded
    model is bf16, so no fp32 copy exists."""
    from components.build.torch_cuda import hf_model
    from components.model_dir import stored_dtype

    assert json.loads((bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_dtype(bf16_dir) == "bfloat16" and stored_dtype(family_dirs["llama"]) == "float32"
    loaded = hf_model(bf16_dir)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert {t.dtype for t in loaded.state_dict().values() if t.is_floating_point()} == {torch.bfloat16}
    assert {p.dtype for p in hf_model(family_dirs["llama"]).parameters()} == {torch.float32}


def test_a_models_dtype_is_read_from_either_key_and_is_fp32_where_none_is_recorded(bf16_dir, tmp_path):
    from components.errors import TrainError
    from components.model_dir import stored_dtype

    config = json.loads((bf16_dir / "config.json").read_text())
    for name, recorded, expected in (("old", {"torch_dtype": "bfloat16"}, "bfloat16"), ("none", {}, "float32")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "dtype"} | recorded))
        assert stored_dtype(tmp_path / name) == expected
    (tmp_path / "int8").mkdir()
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config | {"dtype": "int8"}))
    with pytest.raises(TrainError, match="config.json's dtype is 'int8'; kiln loads float32, float16, bfloat16"):
        stored_dtype(tmp_path / "int8")


@pytest.fixture(scope="module")
def bf16_engine_dir(family_dirs, tmp_path_factory):
    return family_engine(family_dirs["llama"], tmp_path_factory.mktemp("bf16-engines"), "bf16")


def test_a_bf16_engine_built_on_the_cpu_is_the_model_rounded_as_bf16_rounds(bf16_engine_dir, family_dirs):
    """torch's CPU kernels run every op of the program in bf16, so the build, its parity and
    the engine are checked here. Its tolerance is 8x fp16's (8 significant bits to 11): the
    same model's fp16 program, scored on the same tokens, differs from the fp32 model by a
    like fraction of bf16's difference (6x to 13x measured on these large-weight models)."""
    from components.build.torch_cuda import PARITY_TOLERANCE
    from components.runtime import open_engine
    from components.runtime.static_kv import causal_bias, static_model_from_hf

    manifest, tolerance = bf16_engine_dir.manifest, PARITY_TOLERANCE["bf16"]
    assert manifest.precision == "bf16" and manifest.parity.tolerance == tolerance == 8 * PARITY_TOLERANCE["fp16"]
    # Rounded, so not fp32 relabelled; within the tolerance, so not another model.
    assert 1e-3 < max(manifest.parity.prefill_max_abs_diff, manifest.parity.decode_max_abs_diff) < tolerance
    rng = np.random.default_rng(0)
    ids = rng.integers(0, manifest.vocab_size, (2, 12))
    with open_engine(bf16_engine_dir) as engine:
        assert engine.runner.dtype == torch.bfloat16 and engine.runner.k_cache.dtype == torch.bfloat16
        ours = engine.score(ids, np.ones_like(ids))
        tokens = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=8, stop_at_eos=False))
    reference = hf_reference(family_dirs["llama"])
    fp16 = static_model_from_hf(reference, dtype=torch.float16)
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    with torch.no_grad():
        theirs = reference(torch.as_tensor(ids)).logits.numpy()
        k_cache, v_cache = fp16.new_cache(2, 16)
        halves = fp16(torch.as_tensor(ids), positions, causal_bias(positions, torch.arange(16), torch.float16), positions, k_cache, v_cache).float().numpy()
    bf16_error, fp16_error = np.abs(ours - theirs).max(), np.abs(halves - theirs).max()
    assert ours.dtype == np.float32 and 4 * fp16_error < bf16_error < 16 * fp16_error
    assert first_divergence_margins(reference, FAMILY_PROMPTS, tokens, hf_greedy_tokens(reference, FAMILY_PROMPTS, 8)) < 2 * tolerance


def test_a_bf16_model_built_in_fp32_keeps_its_weights_and_is_held_to_bf16s_tolerance(bf16_dir, tmp_path):
    """bf16 → fp32 is exact, so the fp32 program holds the bf16 model's own weights; its
    parity reference is that model as saved, computed in bf16, whose rounding the tolerance
    adds to fp32's."""
    from components.build.torch_cuda import PARITY_TOLERANCE
    from components.runtime import open_engine

    engine_dir = family_engine(bf16_dir, tmp_path / "engines", "fp32")
    assert (engine_dir.manifest.precision, engine_dir.manifest.parity.tolerance) == ("fp32", PARITY_TOLERANCE["fp32"] + PARITY_TOLERANCE["bf16"])
    source = hf_reference(bf16_dir).model.embed_tokens.weight
    with open_engine(engine_dir) as engine:
        assert engine.runner.dtype == torch.float32
        assert torch.equal(engine.runner.model.embed.cpu(), source.float())


@needs_cuda
@pytest.mark.parametrize(("family", "precision"), [(family, "fp32") for family in FAMILIES] + [("llama", "fp16"), ("llama", "bf16")])
def test_on_the_gpu_each_familys_greedy_tokens_match_hugging_face_and_the_triton_step_the_decode_step(family_dirs, tmp_path, family, precision):
    """Built and run on the GPU: batched generation (Inductor-compiled step), kiln serve's
    step-wise path, and one-row generation through the Triton step; then the Triton step
    against the program's own decode step on the same random cache, token for token."""
    from components.build.torch_cuda import PARITY_TOLERANCE
    from components.runtime import open_engine
    from components.runtime.static_kv import DecodeStep
    from components.runtime.triton_decode import TritonLlamaDecodeStep

    engine_dir = family_engine(family_dirs[family], tmp_path / "engines", precision, device="cuda")
    theirs = hf_greedy_tokens(hf_reference(family_dirs[family]), FAMILY_PROMPTS, 32)
    with open_engine(engine_dir) as engine, torch.no_grad():
        batched = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=32, stop_at_eos=False))
        one_row = [engine.generate([p], Sampling(max_new_tokens=32, stop_at_eos=False))[0] for p in FAMILY_PROMPTS]
        stepwise = greedy_step_by_step(engine, FAMILY_PROMPTS, 32)
        runner, fast = engine.runner, engine.runner.fast_step
        assert isinstance(fast, TritonLlamaDecodeStep) and fast.pdl == (torch.cuda.get_device_capability()[0] >= 9)
        reference_step = DecodeStep(runner.model, runner.T)
        k1, v1 = torch.randn_like(runner.k_cache), torch.randn_like(runner.v_cache)
        k2, v2 = k1.clone(), v1.clone()
        state1 = [torch.tensor([5], device="cuda"), torch.tensor([40], device="cuda"), torch.tensor([True], device="cuda")]
        state2 = [t.clone() for t in state1]
        keys = runner.key_range[:64]
        for _ in range(8):
            assert reference_step(*state1, keys, k1, v1).tolist() == fast(*state2, keys, k2, v2).tolist()
            assert all(torch.equal(a, b) for a, b in zip(state1, state2, strict=True))
    written = slice(40, 48)  # the eight positions both steps wrote
    tolerance = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 0.16}[precision]  # bf16: 8x fp16's rounding
    torch.testing.assert_close(k1[:, :1, :, written], k2[:, :1, :, written], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(v1[:, :1, :, written], v2[:, :1, :, written], atol=tolerance, rtol=tolerance)
    for ours in (batched, one_row, stepwise):
        if precision == "fp32":
            assert ours == theirs
        else:  # fp16 and bf16 may round a near-tie the other way, and only a near-tie
            assert first_divergence_margins(hf_reference(family_dirs[family]), FAMILY_PROMPTS, ours, theirs) < 2 * PARITY_TOLERANCE[precision]


def first_divergence_margins(reference, prompts, ours, theirs) -> float:
    """The largest, over rows, of the reference's top-2 logit margin where our greedy tokens
    first leave its own (0 where they never do): a flip needs a margin below twice the
    largest logit error the build accepts."""
    worst = 0.0
    for prompt, mine, its in zip(prompts, ours, theirs, strict=True):
        at = next((i for i, (a, b) in enumerate(zip(mine, its, strict=True)) if a != b), None)
        if at is None:
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + its[:at]])).logits[0, -1]
        top2 = logits.topk(2).values
        worst = max(worst, float(top2[0] - top2[1]))
    return worst


# ---------------------------------------------------------------------------- fp8


def test_fp8_rows_map_each_rows_largest_weight_to_e4m3s_largest_and_round_trip_within_its_precision():
    """A scale per output row: a row of small weights keeps e4m3's whole precision (one scale
    for the matrix would flush it towards zero), and an all-zero row stays zero, not NaN."""
    from components.runtime.static_kv import FP8, FP8_MAX, fp8_rows

    w = torch.randn(3, 6, 64) * torch.tensor([1.0, 1e-4, 30.0, 1.0, 1.0, 0.0]).view(1, 6, 1)
    q, scale = fp8_rows(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (3, 6) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(-1)[:, :5], torch.full((3, 5), FP8_MAX))
    back = q.float() * scale.unsqueeze(-1)
    assert torch.isfinite(back).all() and torch.equal(back[:, 5], torch.zeros(3, 64))
    # e4m3 keeps 3 bits after the leading one: a rounding error of at most 2^-4 of the value
    # (subnormals, far below the row's largest, round to a step of 2^-9 of 448).
    error = (back - w).abs()
    assert (error <= w.abs() / 16 + scale.unsqueeze(-1) * 2.0**-9 + 1e-12).all()
    small = w[:, 1].abs().amax()  # its error is relative to its own size, not the matrix's
    assert 0 < error[:, 1].max() < small / 16 and back[:, 1].abs().amax() > small / 2


def test_fp8_linear_is_the_product_of_both_operands_as_e4m3_rounds_them():
    """Activations quantized per row as they come (dynamic), the weight per output row: the
    result is the exact product of the two rounded operands, and near the unrounded one."""
    from components.runtime.static_kv import FP8_MAX, fp8_linear, fp8_rows

    torch.manual_seed(0)
    x, w, bias = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(48, 64), torch.randn(48, dtype=torch.bfloat16)
    x[2] *= 100.0  # a row of outliers scales itself, not its neighbours
    q, scale = fp8_rows(w)
    ours = fp8_linear(x, q, scale, bias)
    x_scale = x.float().abs().amax(-1, keepdim=True) / FP8_MAX
    rounded = (x.float() / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    expected = rounded @ (q.float() * scale.unsqueeze(-1)).t() + bias.float()
    assert ours.dtype == torch.bfloat16 and ours.shape == (5, 48)
    torch.testing.assert_close(ours.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    exact = x.float() @ w.t() + bias.float()
    relative = (ours.float() - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert relative.max() < 0.08 and relative[2] < 0.08


@pytest.mark.parametrize(("capability", "name", "refused"), [((8, 0), "NVIDIA A100-SXM4-80GB", True), ((8, 6), "NVIDIA A10", True), ((8, 9), "NVIDIA L4", False), ((9, 0), "NVIDIA H200", False)])
def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores_naming_it(capability, name, refused):
    from components.build.torch_cuda import _check_fp8_gpu

    if refused:
        with pytest.raises(BuildError, match=rf"fp8 engines need a GPU with FP8 tensor cores \(compute capability 8.9 or newer.*this {name} is sm_{capability[0]}{capability[1]}"):
            _check_fp8_gpu(capability, name)
    else:
        _check_fp8_gpu(capability, name)


def test_fp8_is_refused_for_gpt2_before_any_program_is_made(tmp_path):
    from benchmarks.generation import TINY, benchmark_model_dir

    model_dir = benchmark_model_dir(tmp_path / "model", TINY)
    with pytest.raises(BuildError, match="fp8 engines are built for the Llama family"):
        family_engine(model_dir, tmp_path / "engines", "fp8")
    assert not (tmp_path / "engines").exists() or not any((tmp_path / "engines").iterdir())


@pytest.fixture(scope="module")
def fp8_engine_dir(family_dirs, tmp_path_factory):
    return family_engine(family_dirs["llama"], tmp_path_factory.mktemp("fp8-engines"), "fp8")


def test_an_fp8_engine_holds_e4m3_projections_and_is_the_model_within_fp8s_rounding(fp8_engine_dir, bf16_engine_dir, family_dirs):
    """torch's CPU kernels run torch._scaled_mm, so the FP8 program is built, exported, saved,
    loaded and checked here: e4m3 weights with row scales (half the bytes bf16 reads), a bf16
    cache, logits further from the model than bf16's but within fp8's tolerance."""
    from components.build.torch_cuda import PARITY_TOLERANCE
    from components.runtime import open_engine

    manifest = fp8_engine_dir.manifest
    assert manifest.precision == "fp8" and manifest.parity.tolerance == PARITY_TOLERANCE["fp8"]
    fp8_error = max(manifest.parity.prefill_max_abs_diff, manifest.parity.decode_max_abs_diff)
    bf16_error = max(bf16_engine_dir.manifest.parity.prefill_max_abs_diff, bf16_engine_dir.manifest.parity.decode_max_abs_diff)
    assert bf16_error < fp8_error < manifest.parity.tolerance
    assert manifest.kv_bytes_per_token == bf16_engine_dir.manifest.kv_bytes_per_token
    with open_engine(fp8_engine_dir) as engine:
        weights = dict(engine.runner.model.named_parameters())
        assert {weights[n].dtype for n in ("w_qkv", "w_o", "w_gate_up", "w_down")} == {torch.float8_e4m3fn}
        assert {weights[n].dtype for n in ("s_qkv", "s_o", "s_gate_up", "s_down")} == {torch.float32}
        assert engine.runner.dtype == engine.runner.k_cache.dtype == torch.bfloat16 and engine.runner.fast_step is None
        tokens = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=8, stop_at_eos=False))
    reference = hf_reference(family_dirs["llama"])
    assert first_divergence_margins(reference, FAMILY_PROMPTS, tokens, hf_greedy_tokens(reference, FAMILY_PROMPTS, 8)) < 2 * manifest.parity.tolerance


@needs_cuda
@pytest.mark.parametrize("precision", ["fp8", "int4"])
def test_on_the_gpu_fp8_and_int4_engines_keep_the_models_greedy_tokens_but_for_near_ties(family_dirs, int4_model_dir, tmp_path, precision):
    """Built on the GPU (fp8: sm_89+): batched generation (the compiled step's FP8 GEMMs or
    int4 kernel), one row at a time, and kiln serve's step-wise path agree with the model but
    for near-ties."""
    from components.build.torch_cuda import FP8_CAPABILITY
    from components.runtime import open_engine

    if precision == "fp8" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip(f"{torch.cuda.get_device_name()} has no FP8 tensor cores")
    model_dir = family_dirs["llama"] if precision == "fp8" else int4_model_dir
    engine_dir = family_engine(model_dir, tmp_path / "engines", precision, device="cuda")
    reference = hf_reference(model_dir)
    theirs = hf_greedy_tokens(reference, FAMILY_PROMPTS, 32)
    with open_engine(engine_dir) as engine, torch.no_grad():
        batched = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=32, stop_at_eos=False))
        one_row = [engine.generate([p], Sampling(max_new_tokens=32, stop_at_eos=False))[0] for p in FAMILY_PROMPTS]
        stepwise = greedy_step_by_step(engine, FAMILY_PROMPTS, 32)
    for ours in (batched, one_row, stepwise):
        assert first_divergence_margins(reference, FAMILY_PROMPTS, ours, theirs) < 2 * engine_dir.manifest.parity.tolerance


@needs_cuda
def test_on_the_gpu_kiln_build_gates_registers_and_serves_a_bf16_models_bf16_and_fp8_engines_to_the_openai_client(family_dirs, tmp_path):
    """A bf16 Llama through `kiln build --model DIR` on torch-cuda, as a user runs it on a GPU:
    bf16 and (sm_89+) fp8 engines built, gated against the model, registered and signed, then
    each version pulled, verified and answered to the `openai` client with the engine's own
    greedy text. Random weights know no text and their next-token margins are thin: the text
    gate's limits are the toy models' (tests/test_families.py), and the quality limits are
    set under what this model measured built on the CPU (bf16 top-1 0.956, where params.yaml
    asks 0.97; fp8 0.675, perplexity +2.9 %): what fp8 keeps of a model is tested with
    margins (test_on_the_gpu_fp8_and_int4_engines_keep_the_models_greedy_tokens...)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from mlflow import MlflowClient
    from openai import OpenAI

    from components.build.torch_cuda import FP8_CAPABILITY
    from components.config import PrecisionParams, QualityLimits
    from components.runtime import open_engine
    from registry import registry_target
    from serving.app import ServerSettings, create_app
    from serving.engine_process import RuntimeOptions
    from serving.sources import VersionSource

    from .conftest import make_project, new_project_store, tiny_params
    from .live_server import LiveServer
    from .test_families import toy_model_gates

    root = make_project(tmp_path / "p")
    new_project_store(root)
    model_dir = bf16_model_dir(family_dirs["llama"], root / "models" / "tiny-llama-bf16")
    precisions = ["bf16", "fp8"] if torch.cuda.get_device_capability() >= FP8_CAPABILITY else ["bf16"]
    params = tiny_params(root, precision=PrecisionParams(build=precisions))
    params = params.model_copy(update={"build": params.build.model_copy(update={"backend": "torch-cuda"})})
    gates = toy_model_gates(params.gates)
    limits = gates.quality.limits | {"bf16": QualityLimits(min_top1_agreement=0.90, max_ppl_increase_pct=2.0), "fp8": QualityLimits(min_top1_agreement=0.5, max_ppl_increase_pct=20.0)}
    params = params.model_copy(update={"gates": gates.model_copy(update={"quality": gates.quality.model_copy(update={"limits": limits})})})
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    kiln = str(Path(sys.executable).parent / "kiln")
    result = subprocess.run([kiln, "build", "--model", str(model_dir)], cwd=root, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    print(output[-6000:])  # the gates' tables, in the device run's log
    assert result.returncode == 0, output[-3000:]
    assert "no ONNX export: torch-cuda builds every engine of this run from the model" in output
    assert not (root / ".kiln" / "stages" / "onnx").exists()  # an 8B model's would be 32 GB

    target = registry_target(params.registry, root)
    client = MlflowClient(target.tracking_uri, registry_uri=target.tracking_uri)
    versions = {v.tags["precision"]: v for v in client.search_model_versions(f"name='{target.model_name}'")}
    assert sorted(versions) == sorted(precisions)
    major, minor = torch.cuda.get_device_capability()
    for precision, version in versions.items():
        tags = version.tags
        assert (tags["backend"], tags["target"], tags["gates.passed"], tags["onnx_sha256"]) == ("torch-cuda", f"sm_{major}{minor}", "true", "none"), (precision, tags)
        assert float(tags["gates.quality.top1_agreement"]) >= limits[precision].min_top1_agreement
        assert tags["gates.quality.reference"] == "PyTorch, float32 on cuda, computed before the engine was loaded", tags["gates.quality.reference"]
        source = VersionSource(target, version.version, root / "serving" / precision)  # pulled and its signature verified
        with LiveServer(create_app(source, ServerSettings(poll_interval_s=0, max_tokens=16, runtime=RuntimeOptions(max_waiting=4)))) as live:
            openai = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
            answer = openai.completions.create(model=target.model_name, prompt="The list type", max_tokens=12, temperature=0)
        served = source.pull(source.resolve())
        tokenizer = EngineTokenizer(served.engine_dir.path)
        assert served.engine_dir.manifest.precision == precision
        with open_engine(served.engine_dir) as engine:
            expected = tokenizer.decode(engine.generate([tokenizer.encode_prompt("The list type")], Sampling(max_new_tokens=12))[0])
        # Random tokens may end inside a UTF-8 character, which the server's text leaves out.
        assert answer.choices[0].text == expected.rstrip("\ufffd") and answer.usage.completion_tokens == 12, (precision, answer, expected)


# ---------------------------------------------------------------------------- int4


def test_int4_groups_span_each_groups_range_in_16_codes_and_round_trip_within_half_a_step():
    """Asymmetric groups of 128 inputs: w ≈ (code - 8) × scale + zero, the codes 0..15 spanning
    each group's min..max, so every weight is within half a step (plus bf16's rounding of the
    scale and zero point) of its value, and a group of small weights keeps its own steps."""
    from components.runtime.static_kv import INT4_GROUP, int4_groups

    torch.manual_seed(0)
    w = torch.randn(16, 4 * INT4_GROUP)
    w[3, :INT4_GROUP] *= 1e-3
    codes, scales_zeros = int4_groups(w)
    assert codes.dtype == torch.int32 and codes.shape == w.shape and 0 <= codes.min() and codes.max() <= 15
    assert scales_zeros.shape == (4, 16, 2) and scales_zeros.dtype == torch.bfloat16
    scale, zero = (scales_zeros[..., i].float().t().repeat_interleave(INT4_GROUP, 1) for i in (0, 1))
    back = (codes.float() - 8) * scale + zero
    assert ((back - w).abs() <= 0.5 * scale * 1.02 + 1e-6).all()
    assert (back - w)[3, :INT4_GROUP].abs().max() < 1e-3 * w[3, :INT4_GROUP].abs().max() * 1e3 / 15


def test_int4_linear_multiplies_by_the_weight_its_codes_stand_for():
    from components.runtime.static_kv import INT4_GROUP, int4_groups, int4_linear, int4_packed

    torch.manual_seed(0)
    x, w, bias = torch.randn(3, 2 * INT4_GROUP, dtype=torch.bfloat16), torch.randn(48, 2 * INT4_GROUP), torch.randn(48, dtype=torch.bfloat16)
    codes, scales_zeros = int4_groups(w)
    scale, zero = (scales_zeros[..., i].float().t().repeat_interleave(INT4_GROUP, 1) for i in (0, 1))
    expected = x.float() @ ((codes.float() - 8) * scale + zero).t() + bias.float()
    ours = int4_linear(x, int4_packed(codes), scales_zeros, bias)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.fixture(scope="module")
def int4_model_dir(tmp_path_factory):
    """A Llama of hidden size 128: int4's groups of 128 need every projection's input width a multiple."""
    from benchmarks.generation import benchmark_model_dir

    shape = {"family": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 256, "initializer_range": 0.1}  # fmt: skip
    return benchmark_model_dir(tmp_path_factory.mktemp("int4") / "model", shape)


def test_an_int4_engine_holds_packed_4_bit_projections_and_is_the_model_within_int4s_rounding(int4_model_dir, tmp_path):
    from components.build.torch_cuda import PARITY_TOLERANCE
    from components.runtime import open_engine

    engine_dir = family_engine(int4_model_dir, tmp_path / "engines", "int4")
    bf16_dir = family_engine(int4_model_dir, tmp_path / "engines", "bf16")
    manifest = engine_dir.manifest
    errors = [max(m.parity.prefill_max_abs_diff, m.parity.decode_max_abs_diff) for m in (bf16_dir.manifest, manifest)]
    assert manifest.precision == "int4" and manifest.parity.tolerance == PARITY_TOLERANCE["int4"]
    assert errors[0] < errors[1] < manifest.parity.tolerance
    with open_engine(engine_dir) as engine:
        weights = dict(engine.runner.model.named_parameters())
        projections = sum(weights[n].numel() * weights[n].element_size() for n in ("w_qkv", "w_o", "w_gate_up", "w_down"))
        with open_engine(bf16_dir) as dense:
            dense_bytes = sum(p.numel() * p.element_size() for n, p in dense.runner.model.named_parameters() if n in ("w_qkv", "w_o", "w_gate_up", "w_down"))
        assert projections == dense_bytes // 4  # 4 bits a weight against bf16's 16
        assert engine.runner.fast_step is None and engine.runner.dtype == torch.bfloat16
        reference = hf_reference(int4_model_dir)
        tokens = engine.generate(FAMILY_PROMPTS, Sampling(max_new_tokens=8, stop_at_eos=False))
    assert first_divergence_margins(reference, FAMILY_PROMPTS, tokens, hf_greedy_tokens(reference, FAMILY_PROMPTS, 8)) < 2 * manifest.parity.tolerance


def test_int4_is_refused_for_a_model_whose_widths_are_not_multiples_of_its_groups(family_dirs, tmp_path):
    with pytest.raises(BuildError, match="int4 engines quantize each projection's inputs in groups of 128; this model's hidden_size 64 and num_attention_heads × head_dim 64 are not multiples of 128 \\(build bf16 or fp8\\)"):
        family_engine(family_dirs["llama"], tmp_path / "engines", "int4")


def test_int4_is_torch_cudas_on_a_gpu_onnx_runtimes_elsewhere_and_never_tensorrts():
    from components.build import resolve_backend

    assert resolve_backend("auto", "int4") == ("torch-cuda" if CUDA else "onnxruntime")
    assert resolve_backend("onnxruntime", "int4") == "onnxruntime" and resolve_backend("auto", "int4", ort_only=True) == "onnxruntime"
    with pytest.raises(BuildError, match="int4 engines run ONNX Runtime's MatMulNBits or torch-cuda's 4-bit kernel; build.backend tensorrt cannot build them"):
        resolve_backend("tensorrt", "int4")
    with pytest.raises(BuildError, match="int4 engines run ONNX Runtime's MatMulNBits; build.backend torch-cuda cannot build them"):
        resolve_backend("torch-cuda", "int4", ort_only=True)  # ONNX Runtime's graph, once made
