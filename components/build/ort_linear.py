"""ONNX Runtime's engine graph: block-quantized linear layers read (batch, sequence, features)
as it comes, and those that read one tensor are one node.

GPT-2's linear layers (transformers' Conv1D) flatten the activations to two dimensions for
addmm and view the product back: a Reshape before and after every MatMulNBits, which takes
any number of leading dimensions itself. A decode step runs each node it keeps, so the views
go (GPT-2-small: 96 of a step's ~280 nodes). A layer is rewritten only where the graph's
recorded shapes show that the second view restores the first one's leading dimensions.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from components.build.ort_graph import Graph, attribute, drop_unused, forget_shapes


def read_unflattened(model: onnx.ModelProto, base_dir: str = "") -> int:
    """Every MatMulNBits between such views reads the unflattened activations, in place; the
    number of layers rewritten. `base_dir`: where the weights are, for a model loaded without them."""
    graph = Graph(model.graph, base_dir)
    changed = [_without_views(graph, node) for node in list(model.graph.node) if node.op_type == "MatMulNBits"]
    rewritten = [names for names in changed if names]
    if rewritten:
        drop_unused(model.graph)
        forget_shapes(model.graph, set().union(*rewritten))
    return len(rewritten)


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


def pack_shared_inputs(model: onnx.ModelProto, base_dir: str = "") -> int:
    """Every group of MatMulNBits that read one tensor with the same settings (a Llama's q, k
    and v; its gate and up) as one node over their weights side by side, and a Split back
    into their outputs, in place; the number of nodes packed. One wide matmul reads the
    activations once and keeps both threads busy: SmolLM2's 30 layers of q, k and v alone,
    0.48 → 0.33 ms a token; gate and up 1.16 → 0.93 (docs/performance.md). Symmetric blocks
    only: zero points pack several rows a byte. `base_dir`: as read_unflattened's."""
    graph = Graph(model.graph, base_dir)
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and len(node.input) == 3 and all(name in graph.initializers for name in node.input[1:]):
            settings = tuple(sorted((a.name, a.i) for a in node.attribute if a.name != "N"))
            groups.setdefault((node.input[0], settings), []).append(node)
    packed = [group for group in groups.values() if len(group) > 1]
    for index, group in enumerate(packed):
        _pack(model.graph, graph, group, f"kiln_packed_{index}")
    if packed:
        used = {name for node in model.graph.node for name in node.input}
        kept = [init for init in model.graph.initializer if init.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
    return sum(map(len, packed))


def _pack(proto: onnx.GraphProto, graph: Graph, group: list[onnx.NodeProto], name: str) -> None:
    """`group`'s weights and scales concatenated along N in one MatMulNBits, where the first
    of them was; a Split gives each its own output."""
    widths = [attribute(node, "N") for node in group]
    weights, scales = ([numpy_helper.to_array(graph.initializers[node.input[i]], graph.base_dir) for node in group] for i in (1, 2))
    proto.initializer.extend(
        [numpy_helper.from_array(np.concatenate(weights), f"{name}_weights"), numpy_helper.from_array(np.concatenate(scales), f"{name}_scales"),
         numpy_helper.from_array(np.array(widths, np.int64), f"{name}_widths")]
    )  # fmt: skip
    wide = onnx.helper.make_node("MatMulNBits", [group[0].input[0], f"{name}_weights", f"{name}_scales"], [f"{name}_out"], name=name, domain="com.microsoft")
    wide.attribute.extend([a for a in group[0].attribute if a.name != "N"] + [onnx.helper.make_attribute("N", sum(widths))])
    split = onnx.helper.make_node("Split", [f"{name}_out", f"{name}_widths"], [node.output[0] for node in group], name=f"{name}_split", axis=-1)
    at = list(proto.node).index(group[0])
    for node in group:
        proto.node.remove(node)
    proto.node.insert(at, split)
    proto.node.insert(at, wide)
