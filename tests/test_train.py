"""The train stage: a tokenizer and a small GPT-2 from scratch, or an existing model."""

import shutil

import pytest

from components.config import ModelParams, TrainingParams
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


def test_a_pretrained_directory_is_used_as_is_with_zero_steps(tmp_path, data_version, tiny_model):
    params = ModelParams(pretrained=str(tiny_model.path), training=TrainingParams(steps=0))
    model = model_from_data(data_version, params, tmp_path)
    import torch

    mine, theirs = load_model(model.path).state_dict(), load_model(tiny_model.path).state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


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
