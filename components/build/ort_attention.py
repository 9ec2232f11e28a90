"""ONNX Runtime's engine graph: each layer's attention as one GroupQueryAttention node.

The export writes attention as transformers' eager ops: the cache grown by Concat(past, new),
repeated for grouped-query heads, then MatMul, scale, mask, Softmax, MatMul. Every decode
step copies the whole cache. ONNX Runtime's GroupQueryAttention (a contrib operator with CPU
kernels) takes past and new keys and values, and appends in place when the runtime binds
past and present to one buffer (components.runtime.onnxruntime does). No library rewrites
this export's pattern: onnxruntime.transformers' fusions do not match it (they expect its own exporter's graphs), and
onnxscript's stop at the attention scores, the cache still concatenated. So it is matched
here, with q, k and v taken whole where one Split made them, a Llama's rotary as ONNX
Runtime's operator (components.build.ort_rotary), and the output handed on without the
export's head transposes. TensorRT cannot run the operator: only ONNX Runtime engines get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from components.build.ort_graph import Graph, attribute, drop_unused, topological_order
from components.build.ort_rotary import rotary_of, rotary_tables, rotated

ATTENTION_MASK = "attention_mask"
_SEQLENS = "kiln_seqlens_k"  # per row, the tokens in the cache after this call, less one
_TOTAL = "kiln_total_sequence_length"
_TO_HEADS = [0, 2, 1, 3]  # (batch, heads, sequence, head_dim) <-> (batch, sequence, heads, head_dim)
_REPEAT_KV = ("Reshape", "Expand", "Unsqueeze")  # transformers' repeat_kv, for fewer kv heads


@dataclass
class _Layer:
    """One layer's eager attention, as found: its tensors and the nodes the fused node replaces."""

    query: str  # (batch, heads, sequence, head_dim), as every family's export has it
    key: str  # the new positions only, (batch, kv_heads, sequence, head_dim)
    value: str
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    bias: str  # the additive mask: causal and padding, (batch, 1, sequence, total)
    output: str  # attention's result, (batch, heads, sequence, head_dim)
    scale: float
    replaced: list[onnx.NodeProto] = field(default_factory=list)


def _grown_cache(graph: Graph, name: str, replaced: list[onnx.NodeProto]) -> onnx.NodeProto | None:
    """The Concat(past input, new) that `name` reads, through repeat_kv; it must be a graph
    output (the present cache), and float32 (what the runtime binds)."""
    node = graph.producer.get(name)
    while node is not None and node.op_type in _REPEAT_KV:
        replaced.append(node)
        node = graph.producer.get(node.input[0])
    if node is None or node.op_type != "Concat" or len(node.input) != 2:
        return None
    if graph.inputs.get(node.input[0]) != TensorProto.FLOAT or node.output[0] not in graph.outputs:
        return None
    replaced.append(node)
    return node


def _layer_at(graph: Graph, softmax: onnx.NodeProto) -> _Layer | None:
    """The eager attention around `softmax`: Softmax(MatMul(q, Transpose(k)) * scale + bias),
    then MatMul with v; None where the pattern differs (that layer stays as it is)."""
    replaced = [softmax]
    add = graph.made_by(softmax.input[0], "Add")
    if add is None:
        return None
    scaled = next((graph.producer[name] for name in add.input if graph.made_by(name, "Mul")), None)
    if scaled is None:
        return None
    bias = next(name for name in add.input if name != scaled.output[0])
    scores = next((graph.producer[name] for name in scaled.input if graph.made_by(name, "MatMul")), None)
    scale = next((value for name in scaled.input if (value := graph.constant(name)) is not None), None)
    if scores is None or scale is None or scale.size != 1:
        return None
    key_t = graph.made_by(scores.input[1], "Transpose")
    readers = graph.consumers.get(softmax.output[0], [])
    if key_t is None or len(readers) != 1 or readers[0].op_type != "MatMul" or readers[0].input[0] != softmax.output[0]:
        return None
    weighted = readers[0]
    replaced += [add, scaled, scores, key_t, weighted]
    keys = _grown_cache(graph, key_t.input[0], replaced)
    values = _grown_cache(graph, weighted.input[1], replaced)
    if keys is None or values is None:
        return None
    return _Layer(
        query=scores.input[0], key=keys.input[1], value=values.input[1],
        past_key=keys.input[0], past_value=values.input[0], present_key=keys.output[0], present_value=values.output[0],
        bias=bias, output=weighted.output[0], scale=float(scale.reshape(())), replaced=replaced,
    )  # fmt: skip


def fuse_attention(model: onnx.ModelProto, num_heads: int, kv_heads: int, base_dir: str = "") -> int:
    """Every layer's attention in `model` as GroupQueryAttention, in place; the number of
    layers fused. All or none: a graph where any layer's pattern differs is left as it was
    (its cache then grows by Concat, which the runtime handles too). `base_dir`: where the
    weights are, for a model loaded without its external data."""
    graph = Graph(model.graph, base_dir)
    if ATTENTION_MASK not in graph.inputs:
        return 0
    layers = [_layer_at(graph, node) for node in model.graph.node if node.op_type == "Softmax"]
    presents = sum(name.startswith("present") for name in graph.outputs)
    if not layers or any(layer is None for layer in layers) or 2 * len(layers) != presents:
        return 0
    replaced = {id(node) for layer in layers for node in layer.replaced}
    nodes = _sequence_lengths()
    tables: set[str] = set()
    for index, layer in enumerate(layers):
        nodes += _fused(graph, layer, index, (num_heads, kv_heads), tables)
    kept = [node for node in model.graph.node if id(node) not in replaced]
    del model.graph.node[:]
    model.graph.node.extend(nodes + kept)
    drop_unused(model.graph)
    topological_order(model.graph)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(layers)


def _sequence_lengths() -> list[onnx.NodeProto]:
    """GroupQueryAttention's lengths, from the mask's width (every row's cache is that wide;
    the bias masks left padding): the width, and per row the width less one."""
    one = numpy_helper.from_array(np.array([1], np.int64))
    return [
        helper.make_node("Shape", [ATTENTION_MASK], ["kiln_batch"], start=0, end=1),
        helper.make_node("Shape", [ATTENTION_MASK], ["kiln_width"], start=1, end=2),
        helper.make_node("Cast", ["kiln_width"], ["kiln_width_int32"], to=TensorProto.INT32),
        helper.make_node("Squeeze", ["kiln_width_int32"], [_TOTAL]),
        helper.make_node("Constant", [], ["kiln_one"], value=one),
        helper.make_node("Sub", ["kiln_width", "kiln_one"], ["kiln_last"]),
        helper.make_node("Expand", ["kiln_last", "kiln_batch"], ["kiln_seqlens_int64"]),
        helper.make_node("Cast", ["kiln_seqlens_int64"], [_SEQLENS], to=TensorProto.INT32),
    ]


def _fused(graph: Graph, layer: _Layer, index: int, heads: tuple[int, int], tables: set[str]) -> list[onnx.NodeProto]:
    """The GroupQueryAttention node of one layer, with what turns its tensors to (batch,
    sequence, hidden) and its output back to what the graph reads. `tables`: the rotary
    tables already written (the layers share them)."""
    num_heads, kv_heads = heads
    prefix = f"kiln_attention_{index}"
    nodes: list[onnx.NodeProto] = []
    flat = [
        _projected(graph, name, f"{prefix}_{role}", count, (nodes, tables))
        for role, name, count in (("q", layer.query, num_heads), ("k", layer.key, kv_heads), ("v", layer.value, kv_heads))
    ]
    packed = _packed(graph, flat, num_heads, kv_heads)
    inputs = [*([packed, "", ""] if packed else flat), layer.past_key, layer.past_value, _SEQLENS, _TOTAL, "", "", "", layer.bias]
    output = f"{prefix}_out"
    nodes.append(
        helper.make_node(
            "GroupQueryAttention", inputs, [output, layer.present_key, layer.present_value],
            name=prefix, domain="com.microsoft", num_heads=num_heads, kv_num_heads=kv_heads, scale=layer.scale,
        )
    )  # fmt: skip
    if not _merged_heads_read(graph, layer.output, output):
        nodes.append(helper.make_node("Constant", [], [f"{prefix}_heads"], value=numpy_helper.from_array(np.array([0, 0, num_heads, -1], np.int64))))
        nodes.append(helper.make_node("Reshape", [output, f"{prefix}_heads"], [f"{prefix}_bshd"]))
        nodes.append(helper.make_node("Transpose", [f"{prefix}_bshd"], [layer.output], perm=_TO_HEADS))
    return nodes


def _packed(graph: Graph, flat: list[str], num_heads: int, kv_heads: int) -> str | None:
    """The one (batch, sequence, q | k | v) tensor that q, k and v were split from (GPT-2's
    c_attn), which GroupQueryAttention takes whole: one node less a layer, no split copies."""
    split = graph.made_by(flat[0], "Split")
    if split is None or list(split.output) != flat or graph.rank(split.input[0]) != 3:
        return None
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    sizes = graph.constant(split.input[1]) if len(split.input) > 1 and split.input[1] else None
    if axis not in (-1, 2):
        return None
    if sizes is None:  # equal thirds
        return split.input[0] if num_heads == kv_heads else None
    head_dim = int(sizes[0]) // num_heads
    return split.input[0] if sizes.tolist() == [head_dim * num_heads, head_dim * kv_heads, head_dim * kv_heads] else None


def _merged_heads_read(graph: Graph, heads: str, merged: str) -> bool:
    """Where the graph reads attention's (batch, heads, sequence, head_dim) result only through
    Transpose to (batch, sequence, heads, head_dim) and Reshapes (the export merging heads),
    those Reshapes read GroupQueryAttention's (batch, sequence, hidden) output instead: the
    same values in the same order. True if so; `merged`'s shape is recorded for
    components.build.ort_linear."""
    readers = graph.consumers.get(heads, [])
    if len(readers) != 1 or readers[0].op_type != "Transpose" or list(attribute(readers[0], "perm")) != _TO_HEADS:
        return False
    transposed = readers[0].output[0]
    views = graph.consumers.get(transposed, [])
    if transposed in graph.outputs or not views or any(view.op_type != "Reshape" or view.input[0] != transposed for view in views):
        return False
    graph.rename_reads(transposed, merged)
    shape = graph.shapes.get(transposed)
    if shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape[2:]):
        graph.graph.value_info.append(helper.make_tensor_value_info(merged, TensorProto.FLOAT, [*shape[:2], shape[2] * shape[3]]))
    return True


def _projected(graph: Graph, name: str, prefix: str, heads: int, written: tuple[list[onnx.NodeProto], set[str]]) -> str:
    """`name` (batch, heads, sequence, head_dim) as (batch, sequence, hidden); where it is a
    rotary embedding's result, the rotation applied by ONNX Runtime's operator to the
    unrotated projection (components.build.ort_rotary)."""
    nodes, tables = written
    rotary = rotary_of(graph, name)
    if rotary is None:
        return _flattened(graph, name, prefix, nodes)
    source = _flattened(graph, rotary.source, prefix, nodes)
    if rotary.angles not in tables:
        nodes += rotary_tables(rotary)
        tables.add(rotary.angles)
    nodes.append(rotated(source, rotary, heads, f"{prefix}_rotated"))
    return f"{prefix}_rotated"


def _flattened(graph: Graph, name: str, prefix: str, nodes: list[onnx.NodeProto]) -> str:
    """`name` (batch, heads, sequence, head_dim) as (batch, sequence, hidden): the tensor it
    was made from where the export transposed a (batch, sequence, hidden) view (no new
    node), else a Transpose and a Reshape."""
    transpose = graph.made_by(name, "Transpose")
    if transpose is not None and list(attribute(transpose, "perm")) == _TO_HEADS:
        view = graph.made_by(transpose.input[0], "Reshape")
        source = view.input[0] if view is not None else None
        if source is not None and graph.rank(source) == 3:
            return source
    nodes.append(helper.make_node("Transpose", [name], [f"{prefix}_bshd"], perm=_TO_HEADS))
    nodes.append(helper.make_node("Constant", [], [f"{prefix}_shape"], value=numpy_helper.from_array(np.array([0, 0, -1], np.int64))))
    nodes.append(helper.make_node("Reshape", [f"{prefix}_bshd", f"{prefix}_shape"], [f"{prefix}_flat"]))
    return f"{prefix}_flat"
