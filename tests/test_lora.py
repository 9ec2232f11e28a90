"""LoRA fine-tuning (model.fine_tuning.lora): only adapters on the targeted linear layers
train, on the fine-tuning schedule; they are merged into the weights before the model is
saved, so what export and the gates see is a plain transformers model."""

import json
import re

import pytest

from components.config import FineTuningParams, LoraParams, ModelParams, Params, load_params
from components.errors import ConfigError, TrainError
from components.train import ADAPTER, model_from_data

from .model_families import random_model_dir

RANK = 4
TARGETS = ["down_proj", "q_proj", "v_proj"]  # k_proj, o_proj, gate_proj and up_proj left as they are


def lora_tuning(steps: int = 30, **lora) -> FineTuningParams:
    """A short fine-tune at a rate that moves a random model's adapters visibly in 30 steps."""
    adapters = LoraParams(**(dict(enabled=True, rank=RANK, dropout=0.0, target_modules=TARGETS) | lora))
    return FineTuningParams(enabled=True, steps=steps, batch_size=8, block_size=32, learning_rate=1e-2, warmup_steps=2, eval_batches=1, threads=2, lora=adapters)


@pytest.fixture(scope="module")
def base(tmp_path_factory, params, data_version):
    """A Llama-family model (grouped-query attention, tied embeddings) with random weights,
    with the byte-level tokenizer of the tiny corpus. Drawn at 5 times transformers' usual
    spread: at 0.02 a random model's logits are near uniform, and its frozen embeddings and
    norms let the adapters move the loss by a few hundredths in 30 steps, not tenths."""
    from components.train import tokenizer_from_texts

    tokenizer = tokenizer_from_texts(data_version.texts("train"), params.model)
    return random_model_dir("llama", tokenizer, tmp_path_factory.mktemp("lora") / "random-llama", initializer_range=0.1)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, base, data_version):
    return model_from_data(data_version, ModelParams(pretrained=str(base), fine_tuning=lora_tuning()), tmp_path_factory.mktemp("lora-tuned"))


def weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def projection_sizes(config: dict) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each linear layer of a Llama block, from its config."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    return {
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden),
    }  # fmt: skip


# ---------------------------------------------------------------- the merged model


def test_lora_moves_the_targeted_projections_and_leaves_every_other_weight_bit_identical(base, tuned):
    import torch

    before, after = weights(base), weights(tuned.path)
    assert before.keys() == after.keys()  # the same tensors: no lora_A/lora_B, no base_layer
    targeted = {name for name in before if any(f".{target}." in name for target in TARGETS)}
    assert len(targeted) == 2 * len(TARGETS)  # two layers
    for name in targeted:
        assert not torch.equal(before[name], after[name]), f"{name} did not move: the adapters were not merged"
    untouched = [name for name in before if name not in targeted]
    assert any("embed_tokens" in name for name in untouched) and any("norm" in name for name in untouched)
    assert [name for name in untouched if not torch.equal(before[name], after[name])] == []


def test_the_saved_model_is_plain_transformers_with_no_adapter_tensors(tuned):
    from transformers import AutoModelForCausalLM

    from components.model_dir import model_from_directory

    assert not (tuned.path / "adapter_config.json").exists()  # transformers would load it through PEFT
    assert [name for name in weights(tuned.path) if "lora" in name] == []
    model = AutoModelForCausalLM.from_pretrained(str(tuned.path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name or "base_layer" in name for name, _ in model.named_parameters())
    assert model_from_directory(tuned.path).sha256 == tuned.sha256  # the model directory contract holds


def test_the_saved_adapter_on_the_pretrained_model_computes_what_the_merged_model_does(base, tuned):
    """The adapter kept beside the weights is the one merged into them."""
    import torch
    from peft import PeftModel

    from components.model_dir import load_model

    config = json.loads((tuned.path / ADAPTER / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, 32.0, str(base))
    assert config["target_modules"] == sorted(config["target_modules"])  # the same bytes whatever the hash seed
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(load_model(base), str(tuned.path / ADAPTER)).eval()(input_ids=ids).logits
        merged = load_model(tuned.path)(input_ids=ids).logits
        plain = load_model(base)(input_ids=ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4)
    assert not torch.allclose(plain, merged, atol=1e-4)


def test_the_loss_goes_down_over_the_lora_steps(base, tuned, data_version):
    from transformers import AutoTokenizer

    from components.model_dir import load_model
    from components.train import _token_stream, evaluate_perplexity

    steps = [step for step, _ in tuned.loss_curve]
    losses = [loss for _, loss in tuned.loss_curve]
    assert steps == [0, 10, 20, 29]  # the fine-tuning schedule's steps, logged as any training's
    assert losses[-1] < losses[0] - 0.3, losses  # 6.31 to 5.71 where it was measured
    eval_ids = _token_stream(AutoTokenizer.from_pretrained(str(base)), data_version.texts("eval"))
    before = evaluate_perplexity(load_model(base), eval_ids, lora_tuning())
    assert tuned.eval_perplexity < 0.8 * before  # the merged model, on the eval split: 348 from 554


def test_the_training_record_says_lora_was_used_and_how(tuned):
    record = json.loads((tuned.path / "kiln_training.json").read_text())
    assert record["lora"] | {"trainable_parameters": 0, "parameters": 0} == {
        "rank": RANK, "alpha": 32.0, "dropout": 0.0, "target_modules": TARGETS, "adapted_layers": 6,
        "trainable_parameters": 0, "parameters": 0, "adapter": "adapter",
    }  # fmt: skip
    assert record["params"]["fine_tuning"]["lora"]["rank"] == RANK


# ---------------------------------------------------------------- what trains


def test_the_trainable_count_is_rank_times_inputs_plus_outputs_of_each_target(tuned):
    config = json.loads((tuned.path / "config.json").read_text())
    sizes = projection_sizes(config)
    record = json.loads((tuned.path / "kiln_training.json").read_text())["lora"]
    per_layer = sum(sum(sizes[target]) for target in TARGETS)
    assert record["trainable_parameters"] == RANK * per_layer * config["num_hidden_layers"]
    assert record["parameters"] == sum(t.numel() for t in weights(tuned.path).values())  # tied: the head is the embeddings


def test_all_linear_adapts_every_projection_but_the_output_head(base):
    from components.model_dir import load_model
    from components.train import with_lora_adapters

    config = json.loads((base / "config.json").read_text())
    adapted = with_lora_adapters(load_model(base), LoraParams(enabled=True, rank=8), str(base))
    trainable = {name for name, p in adapted.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert adapted.record["target_modules"] == sorted(projection_sizes(config))
    assert adapted.record["trainable_parameters"] == 8 * sum(sum(s) for s in projection_sizes(config).values()) * config["num_hidden_layers"]


def test_lora_on_gpt2s_transposed_layers_merges_into_the_right_orientation(tmp_path, params, data_version):
    """GPT-2's Conv1D keeps its weight as (inputs, outputs): the adapter must be merged so."""
    import torch
    from peft import PeftModel

    from components.model_dir import load_model
    from components.train import fresh_model, tokenizer_from_texts

    tokenizer = tokenizer_from_texts(data_version.texts("train"), params.model)
    gpt2 = tmp_path / "random-gpt2"
    fresh_model(tokenizer, params.model).save_pretrained(str(gpt2))
    tokenizer.save_pretrained(str(gpt2))
    tuning = lora_tuning(steps=3, target_modules="all-linear")
    tuned = model_from_data(data_version, ModelParams(pretrained=str(gpt2), fine_tuning=tuning), tmp_path / "tuned")
    width = params.model.architecture.n_embd
    per_layer = (width + 3 * width) + (width + width) + (width + 4 * width) + (4 * width + width)  # c_attn, attn c_proj, c_fc, mlp c_proj
    record = json.loads((tuned.path / "kiln_training.json").read_text())["lora"]
    assert record["trainable_parameters"] == RANK * per_layer * params.model.architecture.n_layer
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(load_model(gpt2), str(tuned.path / ADAPTER)).eval()(input_ids=ids).logits
        merged = load_model(tuned.path)(input_ids=ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4)


# ---------------------------------------------------------------- settings


def test_lora_settings_decide_the_models_identity_only_while_lora_is_on(base):
    def identity(**lora):
        return ModelParams(pretrained=str(base), fine_tuning=FineTuningParams(enabled=True, lora=LoraParams(**lora))).identity()

    assert "lora" not in identity()["fine_tuning"]  # as before LoRA existed: no fine-tuned model trains again for it
    assert identity(rank=8) == identity(rank=64)  # off, its settings decide nothing
    assert identity(enabled=True, rank=8) != identity(enabled=True, rank=16)
    assert identity(enabled=True) != identity()


def test_a_rank_of_zero_is_refused_naming_the_setting(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("model:\n  pretrained: m\n  fine_tuning:\n    enabled: true\n    lora: {enabled: true, rank: 0}\n")
    with pytest.raises(ConfigError, match=r"model\.fine_tuning\.lora\.rank"):
        load_params(path)


def test_lora_without_fine_tuning_is_refused_naming_both_settings():
    with pytest.raises(ValueError, match=r"lora\.enabled is true and enabled is false: LoRA trains adapters while fine-tuning"):
        Params.model_validate({"model": {"pretrained": "m", "fine_tuning": {"lora": {"enabled": True}}}})


def test_an_unknown_target_module_is_named_with_the_models_own_before_any_training(tmp_path, monkeypatch, base, data_version):
    from components import train

    monkeypatch.setattr(train, "_fit", lambda *_: pytest.fail("training started"))
    tuning = lora_tuning(target_modules=["q_proj", "query"])
    with pytest.raises(TrainError, match=r"model\.fine_tuning\.lora\.target_modules names 'query', which .* has no linear layer of: its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj"):
        model_from_data(data_version, ModelParams(pretrained=str(base), fine_tuning=tuning), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no model folder, not even a partial one


def test_an_adapter_on_a_tied_output_head_is_refused(tmp_path, monkeypatch, base, data_version):
    from components import train

    monkeypatch.setattr(train, "_fit", lambda *_: pytest.fail("training started"))
    with pytest.raises(TrainError, match=r"output head \(lm_head\), whose weight .* shares with its input embeddings"):
        model_from_data(data_version, ModelParams(pretrained=str(base), fine_tuning=lora_tuning(target_modules=["lm_head"])), tmp_path)


def test_the_run_log_says_what_lora_trains(tmp_path, caplog, base, data_version):
    import logging

    with caplog.at_level(logging.INFO, logger="components.train"):
        model_from_data(data_version, ModelParams(pretrained=str(base), fine_tuning=lora_tuning(steps=2)), tmp_path)
    expected = rf"fine-tuning {base} with LoRA rank 4 \(3,328 trainable of [\d,]+ parameters\), 2 steps at learning rate 0.01"
    assert any(re.fullmatch(expected, record.getMessage()) for record in caplog.records), caplog.text


def test_the_training_run_in_mlflow_keeps_the_adapter(tmp_path, registry_target, params, base, tuned, data_version):
    from mlflow import MlflowClient

    from components.train import write_loss_plot
    from flows.lineage import training_record
    from registry import log_training

    tuning = params.model_copy(update={"model": ModelParams(pretrained=str(base), fine_tuning=lora_tuning())})
    plot = write_loss_plot(tuned, tmp_path / "loss" / "loss.png")
    run = log_training(registry_target, tuned.sha256, training_record(tuning, tuned, data_version.md5, plot.parent))
    client = MlflowClient(registry_target.tracking_uri)
    assert {a.path for a in client.list_artifacts(run.run_id, "adapter")} == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    assert client.get_run(run.run_id).data.params["model.fine_tuning.lora.rank"] == str(RANK)
