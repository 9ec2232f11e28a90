"""ONNX Runtime's weight blocks (MatMulNBits) written one weight at a time, on onnx_ir graphs.

ONNX Runtime's MatMulNBitsQuantizer takes a whole ModelProto: every weight in memory, and its
pre-processing (constant folding) copies them again; a Llama-3.2-1B shape's int4 stage peaked
at 21.7 GiB for 4.6 GiB of fp32 weights. Here each MatMul's weight stays where it is (the
export's external data, or the checkpoint: components.lazy_weights) and is packed, by the
quantizer's own routine (`DefaultWeightOnlyQuantizer.qbits_block_quant`, so the blocks are
bit-identical to its), when the graph is written: the same 1B int4 graph peaked at 2.6 GiB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Blocks:
    """One MatMulNBits setting: bits, block size along the input, symmetric or with zero
    points, and the accuracy level (the activations' type in ONNX Runtime's kernel)."""

    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int

    def pack(self, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (K, N) fp32 weight as blocks, scales and zero points, as the quantizer packs it."""
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

        config = DefaultWeightOnlyQuantConfig(block_size=self.block_size, is_symmetric=self.symmetric, accuracy_level=self.accuracy_level, bits=self.bits)
        return DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(weight, dtype=np.float32))


def constant_weight(value: ir.Value) -> ir.TensorProtocol | None:
    """A MatMul's right-hand side as a (K, N) tensor when it is constant: an initializer, or a
    [1, 0] Transpose of one (a tied LM head reads the embedding so), read only when asked."""
    if value.const_value is not None:
        return value.const_value if len(value.const_value.shape) == 2 else None
    node = value.producer()
    source = node.inputs[0] if node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
    if source is None or source.const_value is None or len(source.const_value.shape) != 2 or list(node.attributes.get_ints("perm", [1, 0])) != [1, 0]:
        return None
    return _transposed(source.const_value)


def weight_matmuls(graph: ir.Graph) -> list[ir.Node]:
    """The MatMuls with a constant 2-D weight: what MatMulNBits can replace."""
    return [node for node in graph if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and constant_weight(node.inputs[1]) is not None]


def to_matmul_nbits(model: ir.Model, nodes: Iterable[ir.Node], blocks: Blocks) -> int:
    """Each of `nodes` (MatMuls of `weight_matmuls`) as MatMulNBits named as the quantizer
    names it, its blocks packed when written; a weight's Transpose or initializer goes where
    nothing else reads it. How many were replaced."""
    graph, replaced = model.graph, 0
    for node in list(nodes):
        weight_value = node.inputs[1]
        weight = constant_weight(weight_value)
        k, n = weight.shape.numpy()
        packing = _OnePacking(lambda weight=weight: blocks.pack(_read_once(weight)))
        k_blocks, per_byte = -(-k // blocks.block_size), 8 // blocks.bits
        inputs = [node.inputs[0]]
        for suffix, index, dtype, shape in (
            (f"_Q{blocks.bits}", 0, ir.DataType.UINT8, [n, k_blocks, -(-blocks.block_size // per_byte)]),
            ("_scales", 1, ir.DataType.FLOAT, [n, k_blocks]),
            ("_zero_points", 2, ir.DataType.UINT8, [n, -(-k_blocks // per_byte)]),
        ):
            if suffix == "_zero_points" and blocks.symmetric:
                continue
            tensor = ir.LazyTensor(lambda packing=packing, index=index: ir.Tensor(packing.get()[index]), dtype=dtype, shape=ir.Shape(shape))
            inputs.append(_initializer(graph, f"{weight_value.name}{suffix}", tensor))
        attributes = {"K": int(k), "N": int(n), "bits": blocks.bits, "block_size": blocks.block_size}
        if blocks.accuracy_level:  # as the quantizer: 0 is left out, most execution providers lack it
            attributes["accuracy_level"] = blocks.accuracy_level
        replace_node(graph, node, ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=f"{node.name}_Q{blocks.bits}"))
        drop_if_unread(graph, weight_value)
        replaced += 1
    if replaced:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return replaced


def replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """`new` computes what `old`'s one output did, under the same name, in `old`'s place."""
    graph.insert_before(old, new)
    output, result = old.outputs[0], new.outputs[0]
    result.shape, result.type = output.shape, output.type
    name, output.name = output.name, f"{output.name}_replaced"
    output.replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    result.name = name


def drop_if_unread(graph: ir.Graph, value: ir.Value) -> None:
    """A weight nothing reads any more: its Transpose node (and what that read), or its initializer."""
    if value.uses() or value.is_graph_output():
        return
    producer = value.producer()
    if producer is not None:
        graph.remove(producer, safe=True)
        for source in producer.inputs:
            if source is not None:
                drop_if_unread(graph, source)
    elif value.name in graph.initializers:
        graph.initializers.pop(value.name)


def _transposed(table: ir.TensorProtocol) -> ir.LazyTensor:
    """A 2-D tensor transposed when it is read, not before."""
    rows, columns = table.shape.numpy()
    return ir.LazyTensor(lambda: ir.Tensor(np.ascontiguousarray(_read_once(table).T)), dtype=table.dtype, shape=ir.Shape([columns, rows]))


def _read_once(tensor: ir.TensorProtocol) -> np.ndarray:
    """A weight's values, its external data unmapped after (mapped pages count as resident)."""
    values = np.array(tensor.numpy(), copy=True)
    release = getattr(tensor, "release", None)
    if release is not None:
        release()
    return values


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


class _OnePacking:
    """One weight's blocks, scales and zero points come from one packing, which the writer
    asks for one after the other: the latest packing is kept, and only it (held in a class
    attribute, so a graph's weights are never packed in memory all at once)."""

    latest: tuple[_OnePacking, tuple[np.ndarray, ...]] | None = None

    def __init__(self, make: Callable[[], tuple[np.ndarray, ...]]) -> None:
        self._make = make

    def get(self) -> tuple[np.ndarray, ...]:
        if _OnePacking.latest is None or _OnePacking.latest[0] is not self:
            _OnePacking.latest = None  # the previous weight's packing goes before this one is made
            _OnePacking.latest = (self, self._make())
        return _OnePacking.latest[1]


# ---------------------------------------------------------------- graph structure


def gemms_as_matmuls(graph: ir.Graph) -> None:
    """Gemm(x, W, b) with a constant W as MatMul(x, W) + b, in place. MatMulNBits replaces
    MatMul only (ONNX Runtime's quantizer skips Gemm), and kiln's GPT-2 export writes its
    linear layers as Gemm; the arithmetic is the same. Transposed or scaled Gemms stay."""
    for node in list(graph):
        attributes = {name: node.attributes[name].value for name in ("transA", "transB", "alpha", "beta") if name in node.attributes}
        plain = attributes.get("transA", 0) == 0 and attributes.get("transB", 0) == 0 and attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0
        if node.op_type != "Gemm" or not plain or node.inputs[1].const_value is None:
            continue
        matmul = ir.node("MatMul", node.inputs[:2], name=f"{node.name}_MatMul")
        if len(node.inputs) < 3 or node.inputs[2] is None:
            replace_node(graph, node, matmul)
            continue
        graph.insert_before(node, matmul)
        matmul.outputs[0].name = f"{node.outputs[0].name}_matmul"
        replace_node(graph, node, ir.node("Add", [matmul.outputs[0], node.inputs[2]], name=f"{node.name}_Add"))


def lm_head_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The MatMuls whose constant weight projects onto the vocabulary (the logits' last dim)."""
    vocab = graph.outputs[0].shape[-1]
    return [node for node in weight_matmuls(graph) if constant_weight(node.inputs[1]).shape[-1] == vocab]


@dataclass(frozen=True)
class FloatHead:
    """An LM head's MatMul before quantization: its input and output values and its weight
    as rows, one per token (the tied embedding itself where it reads one)."""

    hidden: ir.Value
    logits_name: str
    rows: ir.Value

    @classmethod
    def of(cls, graph: ir.Graph, node: ir.Node) -> FloatHead:
        weight = node.inputs[1]
        producer = weight.producer()
        if producer is not None:  # Transpose(embedding): the table is the rows
            return cls(node.inputs[0], node.outputs[0].name, producer.inputs[0])
        rows = _transposed(weight.const_value)  # (hidden, vocab): its rows kept beside the blocks, transposed when written
        return cls(node.inputs[0], node.outputs[0].name, _initializer(graph, f"{node.outputs[0].name}_rescore_rows", rows))

    def rescore_top(self, graph: ir.Graph, top: int) -> None:
        """The quantized head's `top` highest logits of each position replaced by the float
        weights' (TopK, their rows gathered, one small MatMul, ScatterElements), in place.
        Greedy and top-k picks then see the float head's logits: blocks that keep the head's
        ranking are enough, while the float head would be the step's largest read."""
        logits = next(value for node in graph for value in node.outputs if value.name == self.logits_name)
        readers, outputs = list(logits.uses()), [i for i, value in enumerate(graph.outputs) if value is logits]
        stem, logits.name = f"{self.logits_name}_rescore", f"{self.logits_name}_quantized"
        count = min(top, int(self.rows.shape[0]))
        k = _initializer(graph, f"{stem}_k", ir.tensor(np.array([count], np.int64)))
        last = _initializer(graph, f"{stem}_last", ir.tensor(np.array([-1], np.int64)))
        top_k = ir.node("TopK", [logits, k], attributes={"axis": -1, "sorted": 0}, num_outputs=2, name=f"{stem}_top")
        gathered = ir.node("Gather", [self.rows, top_k.outputs[1]], attributes={"axis": 0}, name=f"{stem}_gather")  # (…, top, hidden)
        column = ir.node("Unsqueeze", [self.hidden, last], name=f"{stem}_column")  # (…, hidden, 1)
        product = ir.node("MatMul", [gathered.outputs[0], column.outputs[0]], name=f"{stem}_matmul")
        exact = ir.node("Squeeze", [product.outputs[0], last], name=f"{stem}_exact")
        rescored = ir.node("ScatterElements", [logits, top_k.outputs[1], exact.outputs[0]], attributes={"axis": -1}, name=stem)
        nodes = [top_k, gathered, column, product, exact, rescored]
        for value, name in zip([*top_k.outputs, *(n.outputs[0] for n in nodes[1:5])], ("values", "ids", "weights", "column", "product", "exact"), strict=True):
            value.name = f"{stem}_{name}"
        result = rescored.outputs[0]
        result.name, result.shape, result.type = self.logits_name, logits.shape, logits.type
        graph.insert_after(logits.producer(), nodes)
        for node, index in readers:  # what read the head's logits reads the rescored ones
            node.replace_input_with(index, result)
        for index in outputs:
            graph.outputs[index] = result
