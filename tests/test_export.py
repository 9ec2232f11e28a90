"""The export stage: ONNX with a KV cache, dynamic shapes, parity with PyTorch."""

import onnx
import pytest

from components.config import ExportParams
from components.errors import ExportError
from components.export import onnx_from_model

from .conftest import assert_names_no_folder_of_this_machine


def test_the_graph_takes_and_returns_the_kv_cache(exported):
    graph = onnx.load(str(exported.path)).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    layers = exported.layout.num_layers
    assert inputs[:4] == ["input_ids", "attention_mask", "position_ids", "logits_positions"]
    assert inputs[4:] == [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert outputs == ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]


def test_batch_sequence_and_past_are_dynamic(exported):
    graph = onnx.load(str(exported.path)).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert all(isinstance(d, str) for d in dims["input_ids"])
    key = dims["past_key_values.0.key"]
    assert isinstance(key[0], str) and isinstance(key[2], str)
    assert key[1] == exported.layout.num_heads and key[3] == exported.layout.head_dim


def test_the_onnx_file_names_no_folder_of_this_machine(exported):
    """The file's sha256 is the engine's identity in the registry: the same model exported
    from another checkout or virtualenv must be the same bytes. The exporter wrote each
    node's Python stack trace (absolute paths) into the file."""
    assert_names_no_folder_of_this_machine(exported.path)


def test_opset_is_at_least_17(exported):
    model = onnx.load(str(exported.path))
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17


def test_logits_match_pytorch_on_padded_prompts_and_decode_steps(exported):
    assert exported.parity.passed
    assert exported.parity.prefill_max_abs_diff <= 1e-4
    assert exported.parity.decode_max_abs_diff <= 1e-4


def test_missing_parity_raises_an_export_error_saying_by_how_much(tmp_path, tiny_model):
    with pytest.raises(ExportError, match=r"misses parity .* tolerance 1e-12 \(off by"):
        onnx_from_model(tiny_model, ExportParams(parity_tolerance=1e-12), tmp_path)


def test_parity_is_measured_not_assumed_a_changed_weight_shows_up(tmp_path, exported, tiny_model):
    """The parity check must see a difference that is there: scale one weight of the ONNX
    and the reported max |Δlogits| grows by orders of magnitude past the tolerance."""
    import numpy as np
    from onnx import numpy_helper

    from components.export import parity_against_torch
    from components.model_dir import load_model

    model = onnx.load(str(exported.path))
    weight = max(model.graph.initializer, key=lambda init: numpy_helper.to_array(init).size)  # the embedding / lm_head
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    onnx.save(model, str(tmp_path / "changed.onnx"))
    torch_model = load_model(tiny_model.path)
    changed = parity_against_torch(torch_model, tmp_path / "changed.onnx", exported.layout, 1e-4)
    assert not changed.passed
    assert min(changed.prefill_max_abs_diff, changed.decode_max_abs_diff) > 1e-2
    same = parity_against_torch(torch_model, exported.path, exported.layout, 1e-4)
    # Rounding noise, as the export measured it (threads and kernels may order sums otherwise).
    assert same.passed and max(same.prefill_max_abs_diff, exported.parity.prefill_max_abs_diff) < 1e-4


def test_the_exported_graph_matches_pytorch_on_inputs_the_parity_check_never_saw(exported, reference):
    """An independent check: ONNX Runtime vs PyTorch on other prompts, computed here."""
    import numpy as np
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    ids = np.array([[7, 3, 99, 250, 12, 5, 60, 61, 62, 63, 64]], np.int64)
    empty = np.zeros((1, exported.layout.num_heads, 0, exported.layout.head_dim), np.float32)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    feeds |= {name: empty for name in exported.layout.past_names}
    logits = session.run(["logits"], feeds | {"logits_positions": np.arange(ids.shape[1])})[0]
    last = session.run(["logits"], feeds | {"logits_positions": np.array([ids.shape[1] - 1])})[0]
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(logits - expected).max() < 1e-4
    assert last.shape == (1, 1, expected.shape[-1])  # a prefill computes the last position's logits only
    assert np.abs(last[:, 0] - expected[:, -1]).max() < 1e-4


def _graph_logits(path, layout):
    import numpy as np
    import onnxruntime as ort

    ids = np.array([[7, 3, 99, 250, 12, 5]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None], "logits_positions": np.arange(ids.shape[1])}
    feeds |= {name: np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), np.float32) for name in layout.past_names}
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def test_the_export_writes_each_weight_from_the_checkpoint_once_without_loading_the_model(tmp_path, tiny_model, exported, monkeypatch):
    """What lets a model bigger than memory in fp32 export: the graph is traced with no
    weights, and each one is read from the weight files when it is written, then dropped."""
    import collections

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from components.checkpoint import Checkpoint
    from components.export import _export

    reads, read, before_writing = collections.Counter(), Checkpoint.read, collections.Counter()
    monkeypatch.setattr(Checkpoint, "read", lambda self, key: reads.update([key]) or read(self, key))
    save = torch.onnx.ONNXProgram.save
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", lambda self, *a, **k: before_writing.update(reads) or save(self, *a, **k))

    def no_loading(*args, **kwargs):
        raise AssertionError("the export loaded the model's weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    _export(tiny_model.path, exported.opset, tmp_path / "model.onnx", 2047)
    stored = Checkpoint(tiny_model.path)
    big = {key for key in stored.files if read(stored, key).numel() > 8192}  # what the optimizer's constant folding skips
    assert big and {key: reads[key] for key in big} == dict.fromkeys(big, 1)
    assert not big & set(before_writing)  # read as written, not held from the start
    assert np.array_equal(_graph_logits(tmp_path / "model.onnx", exported.layout), _graph_logits(exported.path, exported.layout))


def test_torch_bin_weights_saved_without_the_base_models_prefix_export_the_same_graph(tmp_path, tiny_model, exported, reference):
    """GPT-2's own checkpoints store `h.0.attn...` for `transformer.h.0.attn...` in
    pytorch_model.bin, as many older models on the Hub do: transformers loads them, so must kiln."""
    import shutil

    import numpy as np
    import torch

    from components.export import _export

    folder = tmp_path / "bin"
    shutil.copytree(tiny_model.path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    prefix = f"{reference.base_model_prefix}."
    torch.save({name.removeprefix(prefix): t.clone() for name, t in reference.state_dict().items() if name != "lm_head.weight"}, folder / "pytorch_model.bin")
    _export(folder, exported.opset, tmp_path / "model.onnx", 2047)
    assert np.array_equal(_graph_logits(tmp_path / "model.onnx", exported.layout), _graph_logits(exported.path, exported.layout))


def test_weight_files_missing_a_parameter_are_refused_naming_it(tmp_path, tiny_model, exported):
    import shutil

    from safetensors.torch import load_file, save_file

    from components.export import _export

    folder = tmp_path / "partial"
    shutil.copytree(tiny_model.path, folder)
    weights = load_file(folder / "model.safetensors")
    dropped = next(key for key in weights if key.endswith("mlp.c_fc.weight"))
    save_file({k: v for k, v in weights.items() if k != dropped}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=rf"no tensor for 1 of the model's parameters \({dropped}"):
        _export(folder, exported.opset, tmp_path / "model.onnx", 2047)


def test_a_model_too_big_for_fp32_is_checked_on_its_first_layers_and_the_check_still_sees_a_wrong_weight(tmp_path, tiny_model, params, monkeypatch):
    """Where the model in fp32 and its graph would not fit (an 8B model: 32 GB), parity
    compares the first layers, exported on their own by the same code from the same weights,
    and says so; a conversion that gets a weight wrong still fails it."""
    import components.lazy_weights as lazy
    from components.export import TRUNCATED_PARITY_LAYERS

    monkeypatch.setattr("components.export.export_parity_fits", lambda parameters, memory: False)
    exported = onnx_from_model(tiny_model, params.export, tmp_path / "onnx")
    layers = exported.layout.num_layers
    assert exported.parity.passed and exported.parity.layers == (TRUNCATED_PARITY_LAYERS if TRUNCATED_PARITY_LAYERS < layers else None)
    first = params.export.model_copy(update={"parity_layers": 1})
    assert onnx_from_model(tiny_model, first, tmp_path / "first").parity.layers == 1 < layers
    read = lazy.CheckpointTensor._read
    monkeypatch.setattr(lazy.CheckpointTensor, "_read", lambda self: lazy.ir.Tensor(read(self).numpy() * (1.5 if "h.0.mlp" in self.key else 1.0)))
    with pytest.raises(ExportError, match=r"\(its first 1 layers exported on their own\) misses parity"):
        onnx_from_model(tiny_model, first, tmp_path / "broken")
