"""The export stage: ONNX with a KV cache, dynamic shapes, parity with PyTorch."""

import onnx
import pytest

from components.config import ExportParams
from components.errors import ExportError
from components.export import onnx_from_model


def test_the_graph_takes_and_returns_the_kv_cache(exported):
    graph = onnx.load(str(exported.path)).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    layers = exported.layout.num_layers
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs[3:] == [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert outputs == ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]


def test_batch_sequence_and_past_are_dynamic(exported):
    graph = onnx.load(str(exported.path)).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert all(isinstance(d, str) for d in dims["input_ids"])
    key = dims["past_key_values.0.key"]
    assert isinstance(key[0], str) and isinstance(key[2], str)
    assert key[1] == exported.layout.num_heads and key[3] == exported.layout.head_dim


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
