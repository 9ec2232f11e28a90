"""ONNX Runtime's engine graph: block-quantized linear layers read (batch, sequence, features)
as it comes.

GPT-2's linear layers (transformers' Conv1D) flatten the activations to two dimensions for
addmm and view the product back: a Reshape before and after every MatMulNBits, which takes
any number of leading dimensions itself. A decode step runs each node it keeps, so the views
go (GPT-2-small: 96 of a step's ~280 nodes). A layer is rewritten only where the graph's
recorded shapes show that the second view restores the first one's leading dimensions.
"""

from __future__ import annotations

import onnx

from components.build.ort_graph import Graph, attribute, drop_unused, forget_shapes


def read_unflattened(model: onnx.ModelProto) -> int:
    """Every MatMulNBits between such views reads the unflattened activations, in place; the
    number of layers rewritten."""
    graph = Graph(model.graph)
    changed: set[str] = set()
    for node in list(model.graph.node):
        if node.op_type == "MatMulNBits":
            changed |= _without_views(graph, node)
    if changed:
        drop_unused(model.graph)
        forget_shapes(model.graph, changed)
    return sum(node.op_type == "MatMulNBits" and node.output[0] in changed for node in model.graph.node)


def _without_views(graph: Graph, matmul: onnx.NodeProto) -> set[str]:
    """Rewrites one layer: `matmul` reads what its flattening Reshape read, and whatever read
    the Reshape back reads the product (or product + bias). The tensors whose shapes changed;
    none where the pattern or the shapes differ."""
    flatten = graph.made_by(matmul.input[0], "Reshape")
    if flatten is None:
        return set()
    source = flatten.input[0]
    shape, k, n = graph.shapes.get(source), attribute(matmul, "K"), attribute(matmul, "N")
    target = graph.constant(flatten.input[1])
    if not shape or len(shape) < 3 or shape[-1] != k or None in shape or target is None or target.tolist() != [-1, k]:
        return set()
    product = [matmul.output[0]]
    bias = _bias_add(graph, product[0])
    if bias is not None:
        product.append(bias.output[0])
    views = list(graph.consumers.get(product[-1], []))
    restored = [*shape[:-1], n]
    restores = [v.op_type == "Reshape" and graph.shapes.get(v.output[0]) == restored and v.output[0] not in graph.outputs for v in views]
    if product[-1] in graph.outputs or not views or not all(restores):
        return set()
    matmul.input[0] = source
    for view in views:
        graph.rename_reads(view.output[0], product[-1])
    return set(product)


def _bias_add(graph: Graph, product: str) -> onnx.NodeProto | None:
    """The Add of a constant bias vector that alone reads `product`, if any."""
    readers = graph.consumers.get(product, [])
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    other = next((name for name in readers[0].input if name != product), None)
    constant = graph.constant(other) if other else None
    return readers[0] if constant is not None and constant.ndim == 1 else None
