"""The TensorRT backend: its build configuration is checked everywhere; building and
running an engine needs TensorRT and an NVIDIA GPU (marked, skipped elsewhere)."""

import pytest
from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath

from components.build.tensorrt import MIB, polygraphy_loaders, trt_build_plan
from components.config import TensorRTParams
from components.errors import BackendUnavailable
from components.precision import precision_onnx
from components.runtime.availability import tensorrt_ready
from components.runtime.tensorrt import check_compatible

TRT_READY, TRT_MISSING = tensorrt_ready()
needs_tensorrt = pytest.mark.skipif(not TRT_READY, reason=f"TensorRT cannot run here: {TRT_MISSING}")


@pytest.fixture(scope="module")
def int8_graph(project, exported, calibration, params):
    return precision_onnx(exported, "int8", calibration, params.precision.for_backend("tensorrt"), project / "precision")


@pytest.fixture(scope="module")
def plan(int8_graph, params, tmp_path_factory):
    build = params.build.model_copy(update={"tensorrt": TensorRTParams(workspace_mib=512, optimization_level=4)})
    return trt_build_plan(int8_graph, build, tmp_path_factory.mktemp("trt") / "timing.cache")


def test_the_network_is_the_strongly_typed_precision_onnx(plan, int8_graph):
    assert plan.onnx_path == int8_graph.onnx.path  # the Q/DQ graph: precision comes from it
    assert plan.strongly_typed


def test_two_profiles_context_with_empty_past_and_generation_with_one_token(plan, params, exported):
    context, generation = plan.profiles
    prompt, total = params.build.profiles.prompt, params.build.profiles.context
    assert context["input_ids"] == ((1, prompt.min), (1, prompt.opt), (params.build.profiles.batch.max, prompt.max))
    assert {shape[2] for shapes in (context[n] for n in exported.layout.past_names) for shape in shapes} == {0}
    assert {shape[1] for shape in generation["input_ids"]} == {1}
    key = generation["past_key_values.0.key"]
    assert [s[2] for s in key] == [max(total.min - 1, 1), total.opt - 1, total.max - 1]
    # logits for a prefill's last position (and the opt shape it is built for) up to scoring's every position
    assert context["logits_positions"] == ((1,), (1,), (prompt.max,))
    assert generation["logits_positions"] == ((1,), (1,), (1,))


def test_every_input_of_a_profile_has_consistent_ranges(plan):
    for shapes in plan.profiles:
        for low, opt, high in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(low, opt, high))
        for which in range(3):  # the mask spans past + new tokens at min, opt and max alike
            new = shapes["input_ids"][which][1]
            past = shapes["past_key_values.0.key"][which][2]
            assert shapes["attention_mask"][which][1] == past + new
            assert shapes["position_ids"][which] == shapes["input_ids"][which]


def test_polygraphy_loaders_carry_workspace_timing_cache_and_optimization_level(plan):
    loaders = polygraphy_loaders(plan)
    assert isinstance(loaders.network, NetworkFromOnnxPath) and loaders.network.strongly_typed
    assert isinstance(loaders.config, CreateConfig)
    assert len(loaders.config.profiles) == 2
    assert loaders.config.memory_pool_limits.workspace_bytes == 512 * MIB
    assert loaders.config.timing_cache_path == str(plan.timing_cache)
    assert loaders.config.builder_optimization_level == 4
    assert isinstance(loaders.engine_bytes, EngineBytesFromNetwork)
    assert loaders.engine_bytes.timing_cache_path == str(plan.timing_cache)  # reused by the next build


def test_an_engine_from_another_tensorrt_or_gpu_is_refused_naming_both(engine_dir):
    manifest = engine_dir.manifest.model_copy(update={"backend": "tensorrt", "backend_version": "11.4.0", "target": "sm_90"})
    check_compatible(manifest, "11.4.0", "sm_90")
    with pytest.raises(BackendUnavailable, match=r"TensorRT 11\.4\.0 for sm_90; this machine has TensorRT 11\.5\.0 on sm_89"):
        check_compatible(manifest, "11.5.0", "sm_89")


def test_the_timing_cache_lives_in_the_projects_state_folder_wherever_kiln_starts(params, tmp_path, monkeypatch):
    from components.build import timing_cache_of

    monkeypatch.chdir(tmp_path)
    assert timing_cache_of(params.build, tmp_path / "project") == tmp_path / "project" / ".kiln" / "tensorrt" / "timing.cache"


def test_the_skip_guard_asks_what_the_build_and_runtime_use_and_says_which_is_missing():
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        assert (TRT_READY, TRT_MISSING) == (False, "the tensorrt backend needs the tensorrt package, which is not installed")
    elif not TRT_READY:  # tensorrt is there: what is missing is the CUDA runtime or a GPU
        assert "CUDA runtime" in TRT_MISSING or "no NVIDIA GPU" in TRT_MISSING or "reports none" in TRT_MISSING


def test_asking_for_tensorrt_where_it_cannot_run_says_why():
    from components.build import resolve_backend

    if TRT_READY:
        pytest.skip("TensorRT runs here")
    with pytest.raises(BackendUnavailable, match="build.backend is tensorrt, but"):
        resolve_backend("tensorrt")
    assert resolve_backend("auto") == "onnxruntime"


@pytest.mark.tensorrt
@needs_tensorrt
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_tensorrt_engine_generates_like_onnx_runtime_and_passes_its_gate(
    precision, project, params, tiny_model, exported, data_version, calibration, engine, reference
):
    from components.build import engine_from_onnx
    from components.runtime import load_engine
    from components.runtime.sampling import Sampling

    graph = precision_onnx(exported, precision, calibration, params.precision.for_backend("tensorrt"), project / "precision")
    build = params.build.model_copy(update={"backend": "tensorrt"})
    built = engine_from_onnx(graph, tiny_model, data_version, build, project / "trt-engines", project)
    assert built.manifest.backend == "tensorrt" and built.manifest.target.startswith("sm_")
    trt_engine = load_engine(built.path)
    greedy = Sampling(max_new_tokens=8, stop_at_eos=False)
    prompt = [[5, 17, 42, 8]]
    if precision == "fp32":
        assert trt_engine.generate(prompt, greedy) == engine.generate(prompt, greedy)
    from components.gates import eval_windows, quality_gate
    from components.runtime.tokenizer import EngineTokenizer

    windows = eval_windows(EngineTokenizer(built.path), data_version.texts("eval"), params.gates.quality)
    assert quality_gate(trt_engine, reference, windows, params.gates.quality).passed


def test_the_kv_profiles_of_a_grouped_query_model_have_its_kv_heads_not_its_query_heads(params):
    from components.build.packaging import profiles_from_params
    from components.build.tensorrt import profile_shapes
    from components.export import KVLayout

    layout = KVLayout(num_layers=2, num_heads=9, head_dim=64, vocab_size=49152, max_positions=2048, family="llama", num_kv_heads=3, parameter_count=1)
    for phase in profiles_from_params(params.build.profiles).values():
        shapes = profile_shapes(layout, phase)
        assert {shape[1] for name in layout.past_names for shape in shapes[name]} == {3}
        assert {shape[3] for name in layout.past_names for shape in shapes[name]} == {64}
