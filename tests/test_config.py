"""params.yaml is read once into typed config; every mistake names the key that is wrong."""

import re
from pathlib import Path

import pytest

from components.config import Params, load_params
from components.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_the_shipped_params_file_is_valid_and_trains_from_scratch_on_cpython_docs():
    params = load_params(REPO / "params.yaml")
    assert params.data.source.kind == "cpython-docs"
    assert params.model.pretrained is None
    assert params.build.backend == "auto"
    assert params.precision.build == ["fp32", "int8"]


def test_the_shipped_params_file_states_exactly_the_defaults():
    # params.yaml documents every parameter; the defaults in config.py are the same facts,
    # so an edit to one without the other is a failing test, not a silent drift.
    assert load_params(REPO / "params.yaml") == Params()


def test_an_empty_file_means_every_default(tmp_path):
    assert load_params(write(tmp_path, "")) == Params()


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.trainig: unknown key"):
        load_params(write(tmp_path, "model:\n  trainig:\n    steps: 3\n"))


def test_wrong_type_is_named_with_the_value_found(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.training\.steps: .*integer.*'many'"):
        load_params(write(tmp_path, "model:\n  training:\n    steps: many\n"))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


def test_invalid_yaml_is_reported_as_such(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(write(tmp_path, "data: [1,\n"))


def test_a_profile_range_must_be_ordered(tmp_path):
    with pytest.raises(ConfigError, match=r"build\.profiles\.prompt.*min <= opt <= max"):
        load_params(write(tmp_path, "build:\n  profiles:\n    prompt: {min: 64, opt: 32, max: 128}\n"))


def test_heads_must_divide_the_width(tmp_path):
    with pytest.raises(ConfigError, match="multiple of n_head"):
        load_params(write(tmp_path, "model:\n  architecture: {n_embd: 30, n_head: 4}\n"))


def test_digest_changes_with_any_parameter():
    assert Params().digest() != Params.model_validate({"sample": {"max_tokens": 7}}).digest()
    assert Params().digest() == Params().digest()


def test_a_serving_gate_scenario_past_the_profiles_is_named(tmp_path):
    scenario = "{name: long, clients: 2, requests: 1, prompt_tokens: 200, new_tokens: 100, max_ttft_p95_ms: 1, max_tpot_p95_ms: 1, max_request_p99_ms: 1}"
    with pytest.raises(ConfigError, match=r"gates.serving scenario long: prompt_tokens \(200\) exceeds build.profiles.prompt.max \(128\)"):
        load_params(write(tmp_path, f"gates:\n  serving:\n    scenarios: [{scenario}]\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("build:\n  backend: torch-cuda\n", "build.backend torch-cuda builds fp32, fp16, bf16, fp8, int4; precision.build has int8 (auto builds int8 on ONNX Runtime)"),
        ("pool:\n  targets:\n    gpu: {backend: torch-cuda, precisions: [fp16, int8]}\n", "pool.targets.gpu.backend torch-cuda builds fp32, fp16, bf16, fp8, int4; pool.targets.gpu.precisions has int8"),
    ],
)
def test_torch_cuda_asked_for_int8_is_a_config_error_before_any_work(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(write(tmp_path, text))
    assert load_params(write(tmp_path, text.replace("int8", "fp32") if "pool" in text else text + "precision:\n  build: [fp16]\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("build:\n  backend: onnxruntime\n", "build.backend onnxruntime cannot build bf16 (precision.build): ONNX Runtime's CPU provider has no bf16 or FP8 MatMul kernel"),
        ("build:\n  backend: tensorrt\n", "build.backend tensorrt cannot build bf16 (precision.build): kiln's TensorRT engines are built from the precision ONNX, and the precision stage makes no bf16 or FP8 graph"),
    ],
)
def test_bf16_asked_of_a_backend_other_than_torch_cuda_is_named_with_the_reason(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(write(tmp_path, text + "precision:\n  build: [fp16, bf16]\n"))
    with pytest.raises(ConfigError, match=re.escape("pool.targets.gpu.backend onnxruntime cannot build bf16 (pool.targets.gpu.precisions)")):
        load_params(write(tmp_path, "pool:\n  targets:\n    gpu: {precisions: [bf16]}\n"))  # a target's backend defaults to onnxruntime


def test_bf16_is_a_precision_of_torch_cuda_and_auto_with_limits_of_its_own(tmp_path):
    for backend in ("torch-cuda", "auto"):
        params = load_params(write(tmp_path, f"build:\n  backend: {backend}\nprecision:\n  build: [bf16, fp16]\n"))
        assert params.precision.build == ["bf16", "fp16"]
    # Limits of its own in the defaults, in the shipped params.yaml, and settable like the others'.
    for shipped in (Params(), load_params(REPO / "params.yaml")):
        assert shipped.gates.quality.limits["bf16"].min_top1_agreement == 0.97 and shipped.gates.text.limits["bf16"].max_bleu_drop_pct == 2.0
        assert shipped.gates.quality.limits["bf16"].max_ppl_increase_pct == shipped.gates.quality.limits["fp16"].max_ppl_increase_pct
    assert Params().gates.quality.limits["bf16"].min_top1_agreement <= Params().gates.quality.limits["fp16"].min_top1_agreement
    limits = "gates:\n  quality:\n    limits:\n      bf16: {min_top1_agreement: 0.95, max_ppl_increase_pct: 2.0}\n"
    assert load_params(write(tmp_path, limits)).gates.quality.limits["bf16"].min_top1_agreement == 0.95
    with pytest.raises(ConfigError, match="precision.build.0: Input should be 'fp32', 'fp16', 'bf16', 'fp8', 'int8' or 'int4'"):
        load_params(write(tmp_path, "precision:\n  build: [bfloat16]\n"))


def test_int4_asked_of_tensorrt_and_a_block_size_that_is_no_power_of_two_are_named(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("build.backend tensorrt cannot build int4 (precision.build): those engines run ONNX Runtime's MatMulNBits or torch-cuda's 4-bit kernel")):
        load_params(write(tmp_path, "build:\n  backend: tensorrt\nprecision:\n  build: [fp16, int4]\n"))
    with pytest.raises(ConfigError, match="block_size must be a power of two"):
        load_params(write(tmp_path, "precision:\n  int4: {block_size: 48}\n"))
    assert load_params(write(tmp_path, "precision:\n  build: [fp32, int4]\n  int4: {block_size: 64, symmetric: false}\n")).precision.int4.block_size == 64


def test_int8_blocks_asked_of_tensorrt_are_named_with_the_scheme_tensorrt_builds(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("build.backend tensorrt cannot build int8 (precision.build): those engines run ONNX Runtime's MatMulNBits or torch-cuda's 4-bit kernel (auto builds them); TensorRT builds int8 from Q/DQ: precision.int8.scheme qdq or auto")):
        load_params(write(tmp_path, "build:\n  backend: tensorrt\nprecision:\n  build: [fp16, int8]\n  int8: {scheme: blocks}\n"))
    assert load_params(write(tmp_path, "build:\n  backend: tensorrt\nprecision:\n  build: [fp16, int8]\n")).precision.int8.scheme_for("tensorrt") == "qdq"
    with pytest.raises(ConfigError, match="block_size must be a power of two"):
        load_params(write(tmp_path, "precision:\n  int8: {block_size: 96}\n"))


def test_llama_keys_under_a_gpt2_architecture_are_named(tmp_path):
    with pytest.raises(ConfigError, match="n_kv_heads, rope_theta apply to family llama only; family is gpt2"):
        load_params(write(tmp_path, "model:\n  architecture: {n_kv_heads: 2, rope_theta: 10000}\n"))


def test_kv_heads_must_divide_the_heads(tmp_path):
    with pytest.raises(ConfigError, match=r"n_kv_heads \(3\) must divide n_head \(4\)"):
        load_params(write(tmp_path, "model:\n  architecture: {family: llama, n_head: 4, n_kv_heads: 3}\n"))


def test_a_family_kiln_does_not_train_is_named(tmp_path):
    with pytest.raises(ConfigError, match="model.architecture.family"):
        load_params(write(tmp_path, "model:\n  architecture: {family: bert}\n"))
