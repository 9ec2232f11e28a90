"""ONNX Runtime's engine graph: attention fused into GroupQueryAttention and linear layers
without their 2-D views compute what the export does, and the engine appends to its cache
in place."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from components.build.onnxruntime import write_engine_file
from components.build.ort_attention import fuse_attention
from components.build.ort_linear import read_unflattened
from components.runtime.engine import left_pad


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def fused_copy(source: Path, destination: Path, heads: int, kv_heads: int) -> int:
    model = onnx.load(str(source))
    layers = fuse_attention(model, heads, kv_heads)
    onnx.save(model, str(destination))
    return layers


def assert_computes_the_same(original: Path, fused: Path) -> None:
    """A left-padded batch's prefill (every real position's logits, every cache) and a decode
    step on that cache: the same numbers to float rounding. Token ids below 256: every
    test model's vocabulary has them."""
    ours, theirs = session(original), session(fused)
    pasts = [i for i in ours.get_inputs() if i.name.startswith("past_key_values.")]
    kv_heads, head_dim = pasts[0].shape[1], pasts[0].shape[3]
    rng = np.random.default_rng(0)
    ids, mask = left_pad([rng.integers(1, 256, 9).tolist(), rng.integers(1, 256, 4).tolist()], 0)
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "logits_positions": np.arange(9)}
    feeds |= {p.name: np.zeros((2, kv_heads, 0, head_dim), np.float32) for p in pasts}
    expected, got = ours.run(None, feeds), theirs.run(None, feeds)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[0][real], expected[0][real], atol=1e-4)
    for want, have in zip(expected[1:], got[1:], strict=True):  # the padding's own keys are never read
        np.testing.assert_allclose(have.transpose(0, 2, 1, 3)[real], want.transpose(0, 2, 1, 3)[real], atol=1e-4)
    step = {"input_ids": np.array([[5], [6]]), "attention_mask": np.concatenate([mask, np.ones((2, 1), np.int64)], 1)}
    step |= {"position_ids": positions[:, -1:] + 1, "logits_positions": np.zeros(1, np.int64)}
    step |= {p.name: cache for p, cache in zip(pasts, expected[1:], strict=True)}
    np.testing.assert_allclose(theirs.run(None, step)[0], ours.run(None, step)[0], atol=1e-4)


def test_fused_attention_computes_what_the_export_does(exported, tmp_path):
    layout = exported.layout
    fused = tmp_path / "fused.onnx"
    assert fused_copy(exported.path, fused, layout.num_heads, layout.num_kv_heads) == layout.num_layers
    assert sum(n.op_type == "GroupQueryAttention" for n in onnx.load(str(fused)).graph.node) == layout.num_layers
    assert not [n for n in onnx.load(str(fused)).graph.node if n.op_type == "Softmax"]
    assert_computes_the_same(exported.path, fused)


def test_a_graph_where_one_layer_differs_is_left_whole(exported):
    """All or none: one layer unfused would hand the runtime a cache it cannot grow in place."""
    model = onnx.load(str(exported.path))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    softmax.op_type = "LogSoftmax"  # that layer no longer reads as eager attention
    before = model.SerializeToString()
    assert fuse_attention(model, exported.layout.num_heads, exported.layout.num_kv_heads) == 0
    assert model.SerializeToString() == before


def test_an_int4_engine_takes_q_k_v_whole_and_its_linear_layers_unflattened(int4_graph, tmp_path):
    """GPT-2 splits one tensor into q, k and v, and views each linear layer's input as 2-D and
    the product back: the engine file hands attention the unsplit tensor and each MatMulNBits
    the (batch, sequence, features) activations, and computes the same numbers."""
    engine_file = tmp_path / "model.onnx"
    assert write_engine_file(int4_graph, engine_file) == {"kv_in_place": True}
    graph = onnx.load(str(engine_file)).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert attention and all(n.input[1] == n.input[2] == "" for n in attention)
    assert "Split" not in producers.values()
    assert not [n.name for n in graph.node if n.op_type == "MatMulNBits" and producers.get(n.input[0]) == "Reshape"]
    assert_computes_the_same(int4_graph.onnx.path, engine_file)


def test_a_linear_layer_whose_views_do_not_undo_each_other_keeps_them(int4_graph, exported):
    """The second view must restore the first's leading dimensions (the recorded shapes say
    so); where it does not, that layer stays as the export wrote it."""
    model = onnx.load(str(int4_graph.onnx.path))
    matmul = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    readers = {name: node for node in model.graph.node for name in node.input}
    view = readers[readers[matmul.output[0]].output[0]]  # the bias Add, then the view back
    shape = next(v for v in model.graph.value_info if v.name == view.output[0]).type.tensor_type.shape
    shape.dim[0].dim_param = "another_batch"
    fuse_attention(model, exported.layout.num_heads, exported.layout.num_kv_heads)  # as the build does: attention's output is then 3-D too
    assert read_unflattened(model) == 4 * exported.layout.num_layers - 1
    nodes = {n.name: n for n in model.graph.node}
    assert view.name in nodes and producer_of(model, nodes[matmul.name].input[0]).op_type == "Reshape"


def producer_of(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def test_the_engine_decodes_into_the_buffer_its_cache_is_in(engine, engine_dir):
    """Each decode step writes its keys and values after the past, where the past is: the
    step copies no cache. A state whose rows change, or that is decoded again, gets a new
    buffer, once."""
    graph = onnx.load(str(engine_dir.engine_file)).graph
    assert engine.manifest.kv_in_place
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.node) == engine.manifest.num_layers
    _, state = engine.prefill(*left_pad([[5, 6, 7], [8]], engine.manifest.eos_token_id))
    _, first = engine.decode(state, np.array([9, 10]))
    _, second = engine.decode(first, np.array([11, 12]))
    assert all(np.shares_memory(a, b) for a, b in zip(first.cache, second.cache, strict=True))
    assert second.cache[0].shape[2] == 5
    kept = [part.copy() for part in second.cache]
    engine.decode(first, np.array([20, 21]))  # `first` again, other tokens: `second` keeps its own
    assert all(np.array_equal(a, b) for a, b in zip(second.cache, kept, strict=True))
    _, alone = engine.decode(second.rows([1]), np.array([13]))
    assert not any(np.shares_memory(a, b) for a, b in zip(second.cache, alone.cache, strict=True))
