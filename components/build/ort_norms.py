"""ONNX Runtime's engine graph: a Llama's RMSNorm as one node.

Below opset 23 the export decomposes RMSNorm into seven nodes (x², mean, + ε, √, 1/·, × x,
× weight), 61 times in SmolLM2-135M. ONNX Runtime's own fusion looks for a Div where the
export has a Reciprocal, so it leaves them. onnxscript's ONNX Runtime fusion rules (the
exporter's library) match the export and write ONNX Runtime's SimplifiedLayerNormalization,
with the residual Add before it as SkipSimplifiedLayerNormalization.
"""

from __future__ import annotations

import onnx


def fuse_rms_norms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` with every decomposed RMSNorm fused, and how many; `model` itself where none is."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    if not any(node.op_type == "Reciprocal" for node in model.graph.node):
        return model, 0
    ir_model = ir.from_proto(model)
    try:
        ShapeInferencePass()(ir_model)  # the rules check element types
        fused = fuse_rms_normalization(ir_model)
        if not fused:
            return model, 0
        fuse_skip_rms_normalization(ir_model)
        RemoveUnusedNodesPass()(ir_model)
        return ir.to_proto(ir_model), fused
    finally:
        _drop_weights(ir_model)


def _drop_weights(ir_model) -> None:
    """onnxscript's rule matchers are module-level and keep the last graph they matched, and
    its initializers keep `model`'s tensors: an 8B engine stage left its 6.8 GiB of packed
    weights resident through the gates that followed. The graph they keep holds none."""
    for value in ir_model.graph.initializers.values():
        value.const_value = None
