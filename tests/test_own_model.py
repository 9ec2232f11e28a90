"""A newcomer's own model: built as it is unless fine-tuning is asked for, named after its
directory, and given the context it was made for, capped by what this machine's memory
holds for the running batch's KV cache."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from components.config import FineTuningParams, ModelParams, Params
from components.errors import ConfigError, TrainError
from components.files import directory_sha256
from components.model_fit import GIB, with_model_context

from .conftest import make_project, new_project_store, tiny_params
from .test_cli import kiln

LLAMA_3B = {  # Llama-3.2-3B's config.json, the keys kiln reads
    "model_type": "llama", "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_size": 3072, "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True, "dtype": "bfloat16",
}  # fmt: skip


def model_dir(directory: Path, config: dict, weight_bytes: int) -> Path:
    """A model directory whose config.json is `config` and whose weight file has the size of
    the real one (sparse: nothing is written)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    with (directory / "model.safetensors").open("wb") as weights:
        weights.truncate(weight_bytes)
    return directory


def with_memory(monkeypatch, gib: float) -> None:
    monkeypatch.setattr("components.model_fit.machine_memory", lambda: int(gib * GIB))


# ---------------------------------------------------------------- params


def test_a_pretrained_model_is_built_as_it_is_unless_fine_tuning_is_asked_for():
    model = Params.model_validate({"model": {"pretrained": "models/Qwen2.5-0.5B-Instruct"}}).model
    assert model.schedule is None
    assert "built as it is" in model.plan()
    tuned = Params.model_validate({"model": {"pretrained": "m", "fine_tuning": {"enabled": True}}}).model
    assert tuned.schedule == tuned.fine_tuning
    assert tuned.schedule.learning_rate <= 1e-4 < Params().model.training.learning_rate  # not the from-scratch rate
    assert "fine-tuning m, 200 steps at learning rate 2e-05" in tuned.plan()
    adapted = Params.model_validate({"model": {"pretrained": "m", "fine_tuning": {"enabled": True, "lora": {"enabled": True, "rank": 8}}}}).model
    assert "fine-tuning m with LoRA rank 8 adapters merged into its weights, 200 steps" in adapted.plan()


def test_fine_tuning_without_a_pretrained_model_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"model\.fine_tuning\.enabled fine-tunes model\.pretrained, which is null"):
        Params.model_validate({"model": {"fine_tuning": {"enabled": True}}})


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ({"pretrained": "/models/Qwen2.5-0.5B-Instruct/"}, "Qwen2.5-0.5B-Instruct"),
        ({"pretrained": "meta-llama/Llama-3.2-1B"}, "Llama-3.2-1B"),
        ({"pretrained": "models/my model (v2)"}, "my-model-v2-"),
        ({}, "kiln-gpt2"),
        ({"architecture": {"family": "llama"}}, "kiln-llama"),
    ],
)
def test_the_registered_name_comes_from_the_model_where_params_name_none(model, name):
    assert Params.model_validate({"model": model}).registry.model_name == name


def test_a_name_in_params_wins_over_the_models():
    params = Params.model_validate({"model": {"pretrained": "/m/Qwen2.5-0.5B"}, "registry": {"model_name": "support-bot"}})
    assert params.registry.model_name == "support-bot"


def test_a_model_trained_from_scratch_gets_its_own_context_where_params_set_none():
    assert Params.model_validate({"model": {"architecture": {"n_positions": 512}}}).build.profiles.context.max == 512
    assert Params().build.profiles.context.max == 256


def test_a_context_past_the_scratch_models_is_a_problem_only_for_a_run_that_trains_it():
    from components.config import scratch_model_problems

    long = Params.model_validate({"build": {"profiles": {"context": {"min": 2, "opt": 64, "max": 1024}}}})  # `kiln build --model DIR` builds DIR's
    assert scratch_model_problems(long) == ["build.profiles.context.max (1024) is longer than the model's context, model.architecture.n_positions (256)"]
    assert scratch_model_problems(Params()) == []


def test_the_train_stage_refuses_a_model_built_as_it_is(tmp_path, data_version, tiny_model):
    from components.train import model_from_data

    with pytest.raises(TrainError, match="built as it is: there is nothing to train"):
        model_from_data(data_version, ModelParams(pretrained=str(tiny_model.path)), tmp_path)


def test_fine_tuning_starts_from_the_pretrained_weights_on_its_own_schedule(tmp_path, data_version, tiny_model):
    import torch

    from components.model_dir import load_model
    from components.train import model_from_data

    schedule = FineTuningParams(enabled=True, steps=3, batch_size=2, block_size=16, warmup_steps=1, eval_batches=1)
    tuned = model_from_data(data_version, ModelParams(pretrained=str(tiny_model.path), fine_tuning=schedule), tmp_path)
    before, after = load_model(tiny_model.path).state_dict(), load_model(tuned.path).state_dict()
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < moved < 1e-3  # three steps at 2e-5 move each weight by at most ~6e-5
    assert [step for step, _ in tuned.loss_curve] == [0, 2]
    assert json.loads((tuned.path / "kiln_training.json").read_text())["params"]["fine_tuning"]["learning_rate"] == 2e-5


# ---------------------------------------------------------------- the context a model directory gets


def test_the_context_is_the_models_own_where_memory_holds_it(tmp_path, monkeypatch):
    with_memory(monkeypatch, 512)
    fitted, note = with_model_context(Params(), model_dir(tmp_path / "m", LLAMA_3B | {"max_position_embeddings": 8192}, 6 * GIB))
    assert fitted.build.profiles.context.max == 8192
    assert note == "build.profiles.context.max 8192 from the model's 8192 positions"


def test_the_context_is_capped_by_the_memory_the_slots_kv_needs_and_says_so(tmp_path, monkeypatch):
    # 24 GiB, 11.9 GiB of fp32 weights (3.2B parameters): half the rest, 6.0 GiB, for 16
    # slots' KV of 28 layers x 8 heads x 128 x 2 x 4 B = 224 KiB a token: 1766 tokens, 1536 rounded.
    with_memory(monkeypatch, 24)
    fitted, note = with_model_context(Params(), model_dir(tmp_path / "m", LLAMA_3B, int(3.2e9) * 2))
    assert fitted.build.profiles.context.max == 1536
    assert "capped by memory: 16 slots × 1536 tokens × 224 KiB of KV" in note and "131072 positions" in note
    fewer_slots = Params.model_validate({"build": {"profiles": {"batch": {"min": 1, "opt": 1, "max": 4}}}})
    assert with_model_context(fewer_slots, tmp_path / "m")[0].build.profiles.context.max == 6912  # 7067 rounded: a quarter of the slots, four times the context


def test_a_context_in_params_is_kept_as_set(tmp_path, monkeypatch):
    with_memory(monkeypatch, 24)
    params = Params.model_validate({"model": {"pretrained": "m"}, "build": {"profiles": {"context": {"min": 2, "opt": 64, "max": 4096}}}})
    fitted, note = with_model_context(params, model_dir(tmp_path / "m", LLAMA_3B, int(3.2e9) * 2))
    assert fitted.build.profiles.context.max == 4096 and note is None


def test_a_model_whose_weights_leave_no_memory_is_refused_naming_both_sizes(tmp_path, monkeypatch):
    with_memory(monkeypatch, 8)
    with pytest.raises(ConfigError, match=r"does not fit this machine: 11\.9 GiB of weights at fp32 .* in 8\.0 GiB"):
        with_model_context(Params(), model_dir(tmp_path / "m", LLAMA_3B, int(3.2e9) * 2))


def test_a_model_too_big_to_build_here_is_refused_before_any_work_naming_both_sizes(tmp_path, tiny_model):
    from components.model_fit import check_build_memory

    model = shutil.copytree(tiny_model.path, tmp_path / "big")
    with (model / "model.safetensors").open("r+b") as weights:
        weights.truncate(int(8e9) * 4)  # an 8B model's fp32 weights (sparse: nothing written)
    with pytest.raises(ConfigError, match=r"too big to build here: 8\.00B parameters need about 40\.7 GiB .* in float32, and run its int4 engine\), and this machine has 24\.0 GiB"):
        check_build_memory(model, 24 * GIB, "int4")
    check_build_memory(model, 64 * GIB, "fp32")  # where it fits, nothing is said


def test_the_bench_which_times_the_fp32_model_beside_its_engines_is_refused_where_both_do_not_fit():
    """`kiln bench --shape llama3.2-3b` with an fp32 engine holds Hugging Face's fp32 model and
    the engine at once: refused on 24 GiB, where the build alone (one after the other) fits."""
    from components.model_fit import build_memory, check_parameters_fit

    assert build_memory(int(3.21e9), "fp32", "float32") < 24 * GIB
    with pytest.raises(ConfigError, match=r"3\.21B parameters need about 29\.5 GiB at the stages' peak \(it runs in float32 beside its fp32 engine\)"):
        check_parameters_fit(int(3.21e9), 24 * GIB, "the llama3.2-3b bench model", "fp32", side_by_side=True)
    check_parameters_fit(int(3.21e9), 24 * GIB, "the llama3.2-3b bench model", "int8", side_by_side=True)


def test_the_gates_compute_a_model_in_fp32_where_it_fits_and_in_its_saved_dtype_where_not(tmp_path):
    """A 3B model's fp32 weights (12 GiB) beside its engine and the stages' files killed a
    24 GB build: its gates compute it in bf16, as it was published, and the build's memory
    is planned for that; on a bigger machine they compute it in fp32. An 8B model in bf16
    (15 GiB) and its int4 engine fit 24 GB one after the other, not together."""
    from components.model_fit import build_memory, reference_beside_engine, reference_dtype

    model = model_dir(tmp_path / "m", LLAMA_3B, int(3.2e9) * 2)  # bf16 weights (sparse: nothing written)
    assert reference_dtype(model, 24 * GIB) == "bfloat16" and reference_dtype(model, 64 * GIB) == "float32"
    assert build_memory(int(8.03e9), "int4", "bfloat16") < 24 * GIB < build_memory(int(8.03e9), "int4", "float32")
    engine = tmp_path / "engine"
    engine.mkdir()
    with (engine / "model.onnx.data").open("wb") as weights:
        weights.truncate(int(3.2e9))  # an int8 engine
    assert reference_beside_engine(model, "bfloat16", engine, 24 * GIB) and not reference_beside_engine(model, "bfloat16", engine, 12 * GIB)


def test_a_sliding_window_bounds_the_derived_context(tmp_path, monkeypatch):
    with_memory(monkeypatch, 512)
    mistral = LLAMA_3B | {"model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    assert with_model_context(Params(), model_dir(tmp_path / "m", mistral, GIB))[0].build.profiles.context.max == 4096


def test_kiln_build_of_a_directory_names_it_after_the_directory_where_params_name_nothing(tmp_path, tiny_model):
    from components.model_fit import fit_to_model

    model = shutil.copytree(tiny_model.path, tmp_path / "support-bot-v3")
    written = tiny_params(tmp_path).model_dump(mode="json")
    del written["registry"]["model_name"], written["build"]["profiles"]["context"]
    fitted, notes = fit_to_model(Params.model_validate(written), model)
    assert fitted.registry.model_name == "support-bot-v3"
    assert notes == [
        "build.profiles.context.max 128 from the model's 128 positions",
        "registered as support-bot-v3, the model directory's name: registry.model_name: support-bot-v3 in params.yaml names it for kiln serve and kiln promote too",
    ]
    named, notes = fit_to_model(Params.model_validate(written | {"registry": {"model_name": "chosen"}}), model)
    assert named.registry.model_name == "chosen" and len(notes) == 1


def test_kiln_build_with_the_repositorys_params_yaml_names_the_model_after_its_directory(tmp_path, tiny_model):
    """The repository's params.yaml says `model_name: null`: that names nothing, as leaving it
    out does (a Qwen2 directory built with it was registered as kiln-gpt2)."""
    from components.config import load_params
    from components.model_fit import named_after

    model = shutil.copytree(tiny_model.path, tmp_path / "Qwen2.5-0.5B")
    named, note = named_after(load_params(Path(__file__).parents[1] / "params.yaml"), model)
    assert named.registry.model_name == "Qwen2.5-0.5B" and note.startswith("registered as Qwen2.5-0.5B")


# ---------------------------------------------------------------- kiln run on a pretrained directory


def test_kiln_run_builds_a_pretrained_directory_as_it_is_under_its_own_name_and_context(tmp_path, tiny_model):
    root = make_project(tmp_path / "p")
    new_project_store(root)
    shutil.copytree(tiny_model.path, root / "models" / "tiny-gpt2-chat")
    params = tiny_params(root).model_dump(mode="json")
    params["model"] = {"pretrained": "models/tiny-gpt2-chat"}
    params["registry"]["model_name"] = None
    del params["build"]["profiles"]["context"]
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    result = kiln("run", cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "model: models/tiny-gpt2-chat, built as it is" in output
    assert "build.profiles.context.max 128 from the model's 128 positions" in output
    assert "tiny-gpt2-chat version 1 @challenger (fp32) — registered" in output
    assert not (root / ".kiln" / "stages" / "models").exists()  # no training stage: the directory itself was exported
    engine = json.loads(next((root / ".kiln" / "stages" / "engines").rglob("engine.json")).read_text())
    assert engine["lineage"]["source_model_sha256"] == directory_sha256(root / "models" / "tiny-gpt2-chat")
    assert engine["profiles"]["generation"]["past"]["max"] == 127  # context 128


def test_a_model_published_in_bf16_exports_in_fp32_at_parity(tmp_path, tiny_model, params):
    # Llama 3 and Qwen2.5 are saved in bf16, and transformers 5 loads a model in its saved dtype.
    import onnx
    import torch

    from components.export import onnx_from_model
    from components.model_dir import load_model, model_from_directory

    bf16 = tmp_path / "bf16"
    load_model(tiny_model.path).to(torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model.path / name, bf16 / name)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    exported = onnx_from_model(model_from_directory(bf16), params.export, tmp_path / "onnx")
    assert exported.parity.passed
    types = {t.data_type for t in onnx.load(str(exported.path)).graph.initializer}
    assert onnx.TensorProto.BFLOAT16 not in types and onnx.TensorProto.FLOAT in types
