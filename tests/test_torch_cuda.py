"""The torch-cuda backend: a static-KV program exported from the trained model, built and
run here on the CPU (target `cpu`) through the same `Engine` interface the gates use; what
needs CUDA is marked and runs on a GPU machine (benchmarks/gpu_static_kv/run_device.sh)."""

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
    with pytest.raises(EngineError, match="generate greedily"):
        cpu_engine.generate([[1, 2]], Sampling(max_new_tokens=2, temperature=0.7))
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


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
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
    assert agree == len(prompts) if precision == "fp32" else agree >= len(prompts) - 1  # fp16: a near-tie may round the other way
    assert sum(a == b for a, b in zip(stepwise, ours, strict=True)) >= len(prompts) - (precision == "fp16")


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
    scheduler = Scheduler(torch_engine_, tokenizer, max_waiting=32, observe=lambda running, waiting, decoded: batches.append(running))

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


def test_its_registry_tags_and_version_page_say_what_it_was_built_from_and_for(cpu_engine_dir, params, tiny_model):
    from components.gates import GateReport, GateResult
    from flows.lineage import version_description, version_tags

    report = GateReport((GateResult("quality", True, {"top1_agreement": 1.0}, {"min_top1_agreement": 0.99}),))
    tags = version_tags(params, cpu_engine_dir, report, "0" * 40)
    assert (tags["backend"], tags["target"], tags["runtime.torch"], tags["precision_onnx_sha256"]) == ("torch-cuda", "cpu", torch.__version__, "none")
    assert "runtime.shape" not in tags
    page = version_description(params, tiny_model, cpu_engine_dir, report, None, "0" * 40, None)
    assert f"torch-cuda {torch.__version__} · `cpu`" in page and "- model → fp32 `torch.export` program over a static KV cache (torch " in page
