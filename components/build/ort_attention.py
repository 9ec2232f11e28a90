"""ONNX Runtime's engine graph: each layer's attention as one GroupQueryAttention node.

The export writes attention as transformers' eager ops: the cache grown by Concat(past, new),
repeated for grouped-query heads, then MatMul, scale, mask, Softmax, MatMul. Every decode
step copies the whole cache. ONNX Runtime's GroupQueryAttention (a contrib operator with CPU
kernels) takes past and new keys and values, and appends in place when the runtime binds
past and present to one buffer (components.runtime.onnxruntime does). No library rewrites
this export's pattern (onnxruntime.transformers' fusions do not match it: FACTS.md), so
it is matched here. TensorRT cannot run the operator: only ONNX Runtime engines get it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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


class _Graph:
    """Lookups over one graph, built once."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {init.name: init for init in graph.initializer}
        self.inputs = {value.name: value.type.tensor_type.elem_type for value in graph.input}
        self.outputs = {value.name for value in graph.output}
        self.ranks = {
            value.name: len(value.type.tensor_type.shape.dim)
            for value in (*graph.value_info, *graph.input, *graph.output)
            if value.type.tensor_type.HasField("shape")
        }

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.made_by(name, "Constant")
        return numpy_helper.to_array(node.attribute[0].t) if node is not None and node.attribute[0].name == "value" else None

    def grown_cache(self, name: str, replaced: list[onnx.NodeProto]) -> onnx.NodeProto | None:
        """The Concat(past input, new) that `name` reads, through repeat_kv; it must be a
        graph output (the present cache), and float32 (what the runtime binds)."""
        node = self.producer.get(name)
        while node is not None and node.op_type in _REPEAT_KV:
            replaced.append(node)
            node = self.producer.get(node.input[0])
        if node is None or node.op_type != "Concat" or len(node.input) != 2:
            return None
        if self.inputs.get(node.input[0]) != TensorProto.FLOAT or node.output[0] not in self.outputs:
            return None
        replaced.append(node)
        return node


def _layer_at(graph: _Graph, softmax: onnx.NodeProto) -> _Layer | None:
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
    keys = graph.grown_cache(key_t.input[0], replaced)
    values = graph.grown_cache(weighted.input[1], replaced)
    if keys is None or values is None:
        return None
    return _Layer(
        query=scores.input[0], key=keys.input[1], value=values.input[1],
        past_key=keys.input[0], past_value=values.input[0], present_key=keys.output[0], present_value=values.output[0],
        bias=bias, output=weighted.output[0], scale=float(scale.reshape(())), replaced=replaced,
    )  # fmt: skip


def fuse_attention(model: onnx.ModelProto, num_heads: int, kv_heads: int) -> int:
    """Every layer's attention in `model` as GroupQueryAttention, in place; the number of
    layers fused. All or none: a graph where any layer's pattern differs is left as it was
    (its cache then grows by Concat, which the runtime handles too)."""
    graph = _Graph(model.graph)
    if ATTENTION_MASK not in graph.inputs:
        return 0
    layers = [_layer_at(graph, node) for node in model.graph.node if node.op_type == "Softmax"]
    presents = sum(name.startswith("present") for name in graph.outputs)
    if not layers or any(layer is None for layer in layers) or 2 * len(layers) != presents:
        return 0
    replaced = {id(node) for layer in layers for node in layer.replaced}
    nodes = _sequence_lengths()
    for index, layer in enumerate(layers):
        nodes += _fused(graph, layer, index, num_heads, kv_heads)
    kept = [node for node in model.graph.node if id(node) not in replaced]
    del model.graph.node[:]
    model.graph.node.extend(nodes + kept)
    _drop_unused(model.graph)
    _topological_order(model.graph)
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


def _fused(graph: _Graph, layer: _Layer, index: int, num_heads: int, kv_heads: int) -> list[onnx.NodeProto]:
    """The GroupQueryAttention node of one layer, with what turns its tensors to (batch,
    sequence, hidden) and its output back to the (batch, heads, sequence, head_dim) the graph reads."""
    prefix = f"kiln_attention_{index}"
    nodes: list[onnx.NodeProto] = []
    flat = [_flattened(graph, name, f"{prefix}_{role}", nodes) for role, name in (("q", layer.query), ("k", layer.key), ("v", layer.value))]
    inputs = [*flat, layer.past_key, layer.past_value, _SEQLENS, _TOTAL, "", "", "", layer.bias]
    nodes.append(
        helper.make_node(
            "GroupQueryAttention", inputs, [f"{prefix}_out", layer.present_key, layer.present_value],
            name=prefix, domain="com.microsoft", num_heads=num_heads, kv_num_heads=kv_heads, scale=layer.scale,
        )
    )  # fmt: skip
    nodes.append(helper.make_node("Constant", [], [f"{prefix}_heads"], value=numpy_helper.from_array(np.array([0, 0, num_heads, -1], np.int64))))
    nodes.append(helper.make_node("Reshape", [f"{prefix}_out", f"{prefix}_heads"], [f"{prefix}_bshd"]))
    nodes.append(helper.make_node("Transpose", [f"{prefix}_bshd"], [layer.output], perm=_TO_HEADS))
    return nodes


def _flattened(graph: _Graph, name: str, prefix: str, nodes: list[onnx.NodeProto]) -> str:
    """`name` (batch, heads, sequence, head_dim) as (batch, sequence, hidden): the tensor it
    was made from where the export transposed a (batch, sequence, hidden) view (no new
    node), else a Transpose and a Reshape."""
    transpose = graph.made_by(name, "Transpose")
    if transpose is not None and list(transpose.attribute[0].ints) == _TO_HEADS:
        view = graph.made_by(transpose.input[0], "Reshape")
        source = view.input[0] if view is not None else None
        if source is not None and graph.ranks.get(source) == 3:
            return source
    nodes.append(helper.make_node("Transpose", [name], [f"{prefix}_bshd"], perm=_TO_HEADS))
    nodes.append(helper.make_node("Constant", [], [f"{prefix}_shape"], value=numpy_helper.from_array(np.array([0, 0, -1], np.int64))))
    nodes.append(helper.make_node("Reshape", [f"{prefix}_bshd", f"{prefix}_shape"], [f"{prefix}_flat"]))
    return f"{prefix}_flat"


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Nodes whose outputs nothing reads, until none are left (the replaced layers' views)."""
    while True:
        read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
        unused = [node for node in graph.node if not any(out in read for out in node.output)]
        if not unused:
            return
        for node in unused:
            graph.node.remove(node)


def _topological_order(graph: onnx.GraphProto) -> None:
    """ONNX wants each node after the producers of its inputs."""
    available = {value.name for value in graph.input} | {init.name for init in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [node for node in pending if all(name in available for name in node.input)]
        if not ready:
            raise ValueError(f"the fused graph has a cycle or an unproduced input at {pending[0].name or pending[0].op_type}")
        for node in ready:
            available.update(node.output)
        ordered += ready
        ready_ids = {id(node) for node in ready}
        pending = [node for node in pending if id(node) not in ready_ids]
    del graph.node[:]
    graph.node.extend(ordered)
