"""The train stage: a tokenizer and a small GPT-2 from scratch, or an existing model."""

import shutil

import pytest

from components.config import ModelParams
from components.errors import TrainError
from components.model_dir import load_model, model_from_directory
from components.train import model_from_data


def test_the_trained_model_beats_a_uniform_guess(tiny_model):
    assert tiny_model.eval_perplexity < tiny_model.uniform_perplexity / 2
    assert tiny_model.loss_curve[-1][1] < tiny_model.loss_curve[0][1]


def test_the_model_directory_holds_weights_config_and_tokenizer(tiny_model):
    names = {p.name for p in tiny_model.path.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= names


def test_same_data_and_params_reuse_the_trained_model(project, params, data_version, tiny_model):
    # Seeded training would reproduce the same weights: the files' times show it did not run.
    written = {p.name: p.stat().st_mtime_ns for p in tiny_model.path.iterdir()}
    again = model_from_data(data_version, params.model, project / "models")
    assert again.path == tiny_model.path
    assert again.sha256 == tiny_model.sha256
    assert {p.name: p.stat().st_mtime_ns for p in again.path.iterdir()} == written


def test_a_directory_without_weights_is_named(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model.path, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(TrainError, match="has no weights"):
        model_from_directory(broken)


def test_corrupt_weights_are_named(tmp_path, tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model.path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(TrainError, match=r"cannot load model from .*broken"):
        load_model(broken)


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(TrainError, match="model directory not found"):
        model_from_directory(tmp_path / "absent")


def test_a_llama_trains_from_scratch_with_grouped_query_attention_and_tied_embeddings(tmp_path, params, data_version):
    from components.config import ArchitectureParams
    from components.families import shape_of
    from components.model_dir import read_config

    architecture = ArchitectureParams(family="llama", n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, n_positions=128, rope_theta=50000.0)
    llama = params.model.model_copy(update={"architecture": architecture, "training": params.model.training.model_copy(update={"steps": 60})})
    model = model_from_data(data_version, llama, tmp_path)
    config = read_config(model.path)
    shape = shape_of(config)
    assert (shape.family, shape.num_heads, shape.num_kv_heads, shape.max_positions, shape.tied_embeddings) == ("llama", 4, 2, 128, True)
    assert config["rope_parameters"]["rope_theta"] == 50000.0 and config["intermediate_size"] == 88  # 8/3 × 32, to a multiple of 8
    assert model.loss_curve[-1][1] < model.loss_curve[0][1]


# ---------------------------------------------------------------- reproducible training

KERNEL_CHOICES = ({"ATEN_CPU_CAPABILITY": "avx512"}, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "SSE41"})


def short(params, reproducible: bool) -> ModelParams:
    return params.model.model_copy(update={"training": params.model.training.model_copy(update={"steps": 40, "threads": 2, "reproducible": reproducible})})


def test_training_held_to_avx2_makes_the_same_model_whatever_kernels_the_machine_would_pick(tmp_path, monkeypatch, params, data_version):
    """What another CPU would make torch choose, forced here through the environment the
    training starts in: held to AVX2, both give the same bytes, and the record says how."""
    made = []
    for index, choice in enumerate(KERNEL_CHOICES):
        with monkeypatch.context() as patch:
            for name, value in choice.items():
                patch.setenv(name, value)
            made.append(model_from_data(data_version, short(params, reproducible=True), tmp_path / f"choice-{index}"))
    assert made[0].sha256 == made[1].sha256
    assert made[0].kernels == {"mode": "reproducible", "cpu_capability": "AVX2", "threads": 2, "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "DNNL_MAX_CPU_ISA": "AVX2"}
    assert made[0].kernels_text == "reproducible (AVX2, 2 threads)"


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(), reason="this CPU has no AVX-512: torch's two kernel choices are one here")
def test_native_training_makes_another_model_under_each_kernel_choice(tmp_path, params, data_version):
    """The companion: without the setting, the same choices train different bytes (what the
    setting exists for), each in a fresh process, since torch reads the choice once."""
    import os
    import subprocess
    import sys

    script = (
        "import sys; from pathlib import Path; from components.data import DataVersion; from components.config import ModelParams; "
        "from components.train import model_from_data; "
        "print(model_from_data(DataVersion(Path(sys.argv[1]), sys.argv[2]), ModelParams.model_validate_json(sys.argv[3]), Path(sys.argv[4])).sha256)"
    )
    shas = []
    for index, choice in enumerate(KERNEL_CHOICES):
        arguments = [str(data_version.path), data_version.md5, short(params, reproducible=False).model_dump_json(), str(tmp_path / f"native-{index}")]
        out = subprocess.run([sys.executable, "-c", script, *arguments], env=os.environ | choice, capture_output=True, text=True, timeout=300, check=True)
        shas.append(out.stdout.split()[-1])
    assert shas[0] != shas[1]


def test_reproducible_training_needs_avx2_and_says_so(tmp_path, monkeypatch, params, data_version):
    from components import train

    monkeypatch.setattr(train, "_cpu_flags", lambda: {"sse4_2", "avx"})
    with pytest.raises(TrainError, match="model.training.reproducible holds torch's kernels to AVX2, which this CPU does not have"):
        model_from_data(data_version, short(params, reproducible=True), tmp_path)
