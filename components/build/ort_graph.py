"""Lookups and clean-up over an ONNX graph, shared by the rewrites that make ONNX Runtime's
engine graph (components.build.ort_attention, ort_rotary and ort_linear)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

Dim = int | str | None  # a size, a symbolic name, or unknown


class Graph:
    """Lookups over one graph, built once; `rename_reads` keeps them current."""

    def __init__(self, graph: onnx.GraphProto, base_dir: str = "") -> None:
        self.graph, self.base_dir = graph, base_dir  # where external data is, for a graph loaded without it
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {init.name: init for init in graph.initializer}
        self.inputs = {value.name: value.type.tensor_type.elem_type for value in graph.input}
        self.outputs = {value.name for value in graph.output}
        self.shapes: dict[str, list[Dim]] = {
            value.name: [dim.dim_value if dim.HasField("dim_value") else dim.dim_param or None for dim in value.type.tensor_type.shape.dim]
            for value in (*graph.value_info, *graph.input, *graph.output)
            if value.type.tensor_type.HasField("shape")
        }

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name], self.base_dir)
        node = self.made_by(name, "Constant")
        return numpy_helper.to_array(node.attribute[0].t) if node is not None and node.attribute[0].name == "value" else None

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)

    def rename_reads(self, old: str, new: str) -> None:
        """Every node that reads `old` reads `new` instead (the same values)."""
        readers = self.consumers.pop(old, [])
        for node in readers:
            for index, name in enumerate(node.input):
                if name == old:
                    node.input[index] = new
        self.consumers.setdefault(new, []).extend(readers)


def attribute(node: onnx.NodeProto, name: str) -> object:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def drop_unused(graph: onnx.GraphProto) -> None:
    """Nodes whose outputs nothing reads, until none are left (what a rewrite bypassed)."""
    while True:
        read = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
        kept = [node for node in graph.node if any(out in read for out in node.output)]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


def forget_shapes(graph: onnx.GraphProto, names: set[str]) -> None:
    """Drop the recorded shapes of `names` (a rewrite changed them; ONNX Runtime infers its own)."""
    kept = [value for value in graph.value_info if value.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def topological_order(graph: onnx.GraphProto) -> None:
    """ONNX wants each node after the producers of its inputs."""
    available = {value.name for value in graph.input} | {init.name for init in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [node for node in pending if all(name in available for name in node.input)]
        if not ready:
            raise ValueError(f"the rewritten graph has a cycle or an unproduced input at {pending[0].name or pending[0].op_type}")
        for node in ready:
            available.update(node.output)
        ordered += ready
        ready_ids = {id(node) for node in ready}
        pending = [node for node in pending if id(node) not in ready_ids]
    del graph.node[:]
    graph.node.extend(ordered)
