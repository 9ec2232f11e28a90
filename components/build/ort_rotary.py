"""ONNX Runtime's engine graph: a Llama's rotary embedding as one RotaryEmbedding node.

transformers rotates q and k with `x * cos + rotate_half(x) * sin`: eight nodes for each of
them in every layer, on (batch, heads, sequence, head_dim) tensors that the export transposed
for it. ONNX Runtime's RotaryEmbedding (a contrib operator with CPU kernels) rotates the
(batch, sequence, hidden) projection itself, so attention reads it without transposes. Its
tables are indexed by position ids; here they are built from the graph's own angles each
call (row b * sequence + s holds that token's), so each row keeps its own positions, left
padding included, whatever the rope variant. onnxscript's rule for these tables looks for
`inv_freq @ position_ids`, which transformers 5 no longer writes (it multiplies), and
GroupQueryAttention's own rotary derives a prompt's positions from the first row's; hence
this match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from components.build.ort_graph import Graph


@dataclass(frozen=True)
class Rotary:
    """One rotate-half rotary embedding, as found."""

    source: str  # the rotated (batch, heads, sequence, head_dim) tensor
    angles: str  # (batch, sequence, head_dim / 2): each token's angles, whose cos and sin rotate it
    half: int  # head_dim / 2


def rotary_of(graph: Graph, name: str) -> Rotary | None:
    """The rotary embedding that made `name`: Add(Mul(x, cos), Mul(Concat(-x₂, x₁), sin)),
    with cos and sin those of Concat(angles, angles) unsqueezed over the heads; None if
    `name` is made otherwise."""
    add = graph.made_by(name, "Add")
    products = [graph.made_by(operand, "Mul") for operand in add.input] if add is not None else []
    if len(products) != 2 or None in products:
        return None
    rotated = next((m for m in products if any(graph.made_by(i, "Concat") for i in m.input)), None)
    direct = next((m for m in products if m is not rotated), None)
    if rotated is None or direct is None:
        return None
    halves = next(graph.producer[i] for i in rotated.input if graph.made_by(i, "Concat"))
    sin_angles = _angles(graph, next(i for i in rotated.input if i != halves.output[0]), "Sin")
    source = next((i for i in direct.input if _angles(graph, i, "Cos") is None), None)
    cos_angles = next((a for i in direct.input if (a := _angles(graph, i, "Cos")) is not None), None)
    if source is None or cos_angles is None or cos_angles != sin_angles:
        return None
    half = _rotated_half(graph, halves, source)
    return Rotary(source, cos_angles, half) if half else None


def _angles(graph: Graph, name: str, function: str) -> str | None:
    """X where `name` is Unsqueeze(function(Concat(X, X)), over the heads' axis)."""
    unsqueeze = graph.made_by(name, "Unsqueeze")
    applied = graph.made_by(unsqueeze.input[0], function) if unsqueeze is not None else None
    twice = graph.made_by(applied.input[0], "Concat") if applied is not None else None
    axes = graph.constant(unsqueeze.input[1]) if unsqueeze is not None and len(unsqueeze.input) > 1 else None
    if twice is None or len(twice.input) != 2 or twice.input[0] != twice.input[1] or axes is None or axes.tolist() != [1]:
        return None
    return twice.input[0]


def _rotated_half(graph: Graph, halves: onnx.NodeProto, source: str) -> int | None:
    """h where `halves` is Concat(-source[..., h:], source[..., :h]) on the last axis."""
    negated = graph.made_by(halves.input[0], "Neg")
    second = graph.made_by(negated.input[0], "Slice") if negated is not None else None
    first = graph.made_by(halves.input[1], "Slice")
    if second is None or first is None or second.input[0] != source or first.input[0] != source:
        return None
    bounds = [[graph.constant(name) for name in node.input[1:]] for node in (first, second)]
    if any(value is None or value.size != 1 for each in bounds for value in each):
        return None
    (start1, end1, axis1, *step1), (start2, _, axis2, *step2) = ([int(v.reshape(())) for v in each] for each in bounds)
    last = {3, -1}
    if start1 != 0 or start2 != end1 or end1 <= 0 or axis1 not in last or axis2 not in last or {*step1, *step2} - {1}:
        return None
    return end1


def rotary_tables(rotary: Rotary) -> list[onnx.NodeProto]:
    """The cos and sin tables (one row per token of this call) and each token's row, once
    for all layers that share `rotary.angles`."""
    stem = _stem(rotary)
    cos, sin, positions = _table_names(rotary)
    width = numpy_helper.from_array(np.array([-1, rotary.half], np.int64))
    return [
        helper.make_node("Constant", [], [f"{stem}_width"], value=width),
        helper.make_node("Cos", [rotary.angles], [f"{stem}_cos_rows"]),
        helper.make_node("Reshape", [f"{stem}_cos_rows", f"{stem}_width"], [cos]),
        helper.make_node("Sin", [rotary.angles], [f"{stem}_sin_rows"]),
        helper.make_node("Reshape", [f"{stem}_sin_rows", f"{stem}_width"], [sin]),
        helper.make_node("Shape", [cos], [f"{stem}_rows"], start=0, end=1),
        helper.make_node("Squeeze", [f"{stem}_rows"], [f"{stem}_count"]),
        helper.make_node("Constant", [], [f"{stem}_zero"], value=numpy_helper.from_array(np.array(0, np.int64))),
        helper.make_node("Constant", [], [f"{stem}_step"], value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("Range", [f"{stem}_zero", f"{stem}_count", f"{stem}_step"], [f"{stem}_flat"]),
        helper.make_node("Shape", [rotary.angles], [f"{stem}_batch_sequence"], start=0, end=2),
        helper.make_node("Reshape", [f"{stem}_flat", f"{stem}_batch_sequence"], [positions]),
    ]


def _stem(rotary: Rotary) -> str:
    return f"kiln_rotary_{rotary.angles}"


def _table_names(rotary: Rotary) -> tuple[str, str, str]:
    stem = _stem(rotary)
    return f"{stem}_cos", f"{stem}_sin", f"{stem}_positions"


def rotated(source: str, rotary: Rotary, heads: int, output: str) -> onnx.NodeProto:
    """RotaryEmbedding of a (batch, sequence, heads * head_dim) tensor with `rotary`'s tables."""
    cos, sin, positions = _table_names(rotary)
    return helper.make_node("RotaryEmbedding", [source, positions, cos, sin], [output], domain="com.microsoft", interleaved=0, num_heads=heads)
