"""ONNX initializers that are read from the checkpoint when the graph is written, not before.

The export traces the model on the meta device (components.export), so its graph holds no
weights; each parameter's initializer is bound here to a `CheckpointTensor`, which onnx_ir
evaluates when it writes that initializer and drops after, one tensor at a time. A Linear's
weight reaches the graph through a Transpose, which the exporter's optimizer folds into a
transposed copy of every weight held at once; `fold_weight_transposes` folds them lazily
first, leaving the optimizer the same graph it would have made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import onnx_ir as ir

from components.checkpoint import Checkpoint
from components.errors import ExportError

if TYPE_CHECKING:
    import torch

# How torch's exporter marks what an initializer was in the exported program.
_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


class CheckpointTensor(ir.LazyTensor):
    """One checkpoint tensor in fp32 (the exported graph's dtype), read when evaluated;
    `transposed` for a Linear's (in, out) weight as MatMul takes it."""

    def __init__(self, checkpoint: Checkpoint, key: str, shape: tuple[int, ...], transposed: bool = False) -> None:
        self.checkpoint, self.key, self.transposed = checkpoint, key, transposed
        super().__init__(self._read, dtype=ir.DataType.FLOAT, shape=ir.Shape(shape), name=f"{key}^T" if transposed else key)

    def transpose(self) -> CheckpointTensor:
        rows, columns = self.shape.numpy()
        return CheckpointTensor(self.checkpoint, self.key, (columns, rows), not self.transposed)

    def _read(self) -> ir.Tensor:
        import torch

        weight = self.checkpoint.read(self.key).to(torch.float32)  # bf16 → fp32 exactly, this tensor only
        return ir.Tensor((weight.T if self.transposed else weight).contiguous().numpy())


def bind_parameters(graph: ir.Graph, checkpoint: Checkpoint, keys: Mapping[str, str], buffers: Mapping[str, torch.Tensor]) -> None:
    """Every parameter initializer (named as the traced module's parameter) bound to its
    checkpoint tensor, every buffer to its value computed on the CPU; ExportError for an
    initializer left without one (a constant the trace made on the meta device)."""
    for name, value in graph.initializers.items():
        kind = value.metadata_props.get(_KIND)
        if kind == "PARAMETER" and name in keys:
            value.const_value = CheckpointTensor(checkpoint, keys[name], tuple(value.shape.numpy()))
        elif kind == "BUFFER" and name in buffers:
            value.const_value = ir.Tensor(buffers[name].numpy())
        elif value.const_value is None or getattr(value.const_value.raw, "is_meta", False):
            raise ExportError(f"the exported graph's initializer {name} ({kind}) has no value: it was traced on the meta device and is no weight of the checkpoint")


def fold_weight_transposes(graph: ir.Graph) -> int:
    """Transpose(W) of a checkpoint weight that nothing else reads (every Linear's) as an
    initializer of W transposed, read when written; how many were folded. A weight read
    twice (a tied embedding and LM head: Gather and Transpose) keeps its Transpose node, as
    the exporter's optimizer leaves it."""
    folded = 0
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.inputs else None
        weight = source.const_value if source is not None else None
        if not isinstance(weight, CheckpointTensor) or len(source.uses()) != 1 or list(node.attributes.get_ints("perm", [])) != [1, 0]:
            continue
        output = node.outputs[0]
        transposed = weight.transpose()
        name, output.name = output.name, f"{output.name}_unfolded"
        constant = ir.Value(name=name, shape=transposed.shape, type=ir.TensorType(ir.DataType.FLOAT), const_value=transposed)
        graph.register_initializer(constant)
        output.replace_all_uses_with(constant, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        folded += 1
    return folded
