"""The precision stage: the exported fp32 ONNX → the ONNX that carries its precision.

TensorRT 11 builds strongly typed networks, so precision lives in the graph: Q/DQ nodes
(symmetric, zero point 0) for its int8, fp16 tensors for fp16. ONNX Runtime runs the same
graphs on the CPU, so their quality is measured here even where TensorRT is not installed.
ONNX Runtime's own int8 and int4 engines are weight blocks (MatMulNBits), which it runs
faster than Q/DQ and TensorRT cannot build (`precision.int8.scheme`).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx_ir as ir

from components.calibrate import CalibrationSet
from components.config import TORCH_CUDA_ONLY_PRECISIONS, Fp16Params, Int4Params, Int8Params, PrecisionParams, section_digest
from components.engine_dir import LOGITS_POSITIONS
from components.errors import BuildError
from components.export import ExportedOnnx
from components.files import stage_output
from components.onnx_files import data_file, has_external_data, onnx_files, onnx_sha256, save_ir, save_onnx
from components.progress import stage_progress
from components.weight_blocks import Blocks, FloatHead, gemms_as_matmuls, lm_head_nodes, to_matmul_nbits, weight_matmuls

ONNX_FILE = "model.onnx"
# Part of the output folder's name and of the Prefect cache key (flows.caching): bump it when
# this stage's code changes what it makes, and only this stage and those after it rebuild.
STAGE_VERSION = "9"  # 8: int4's LM head rescores its top logits; 9: blocks packed a weight at a time, from the export


@dataclass(frozen=True)
class PrecisionOnnx:
    """An ONNX graph in one precision, with what it was derived from."""

    onnx: ExportedOnnx  # path / sha256 / layout / parity of this graph
    precision: str
    fp32_sha256: str
    calibration_digest: str | None = None
    ort_only: bool = False  # of ONNX Runtime's own operators (MatMulNBits): int4, int8 blocks

    @property
    def content_digest(self) -> str:
        # The precision too: the fp32 export stands in for several precisions' graphs, and a
        # stage keyed on the graph alone would hand one precision's engine to another.
        return f"{self.precision}:{self.onnx.sha256}"

    @property
    def output_dir(self) -> Path:
        return self.onnx.output_dir

    def is_intact(self) -> bool:
        return self.onnx.is_intact()


def model_stand_in(onnx: ExportedOnnx, precision: str) -> PrecisionOnnx:
    """No graph of its own: the fp32 export stands in (fp32, and every torch-cuda engine,
    which is built from the model itself)."""
    return PrecisionOnnx(onnx=onnx, precision=precision, fp32_sha256=onnx.sha256)


def precision_onnx(
    onnx: ExportedOnnx, precision: str, calibration: CalibrationSet | None, params: PrecisionParams, out_root: Path
) -> PrecisionOnnx:
    """int8's `auto` scheme is taken as ONNX Runtime's (blocks): the pipeline resolves it for
    the engine's backend first (`PrecisionParams.for_backend`). bf16 has no graph: the
    torch-cuda build makes it from the model (the fp32 export stands in, as for fp32)."""
    if precision in ("fp32", *TORCH_CUDA_ONLY_PRECISIONS):
        return model_stand_in(onnx, precision)
    params = params.for_backend("onnxruntime")  # a scheme other than auto stays as it is
    calibrated = precision == "int8" and params.int8.scheme == "qdq"
    if calibrated and calibration is None:
        raise BuildError("an int8 Q/DQ graph needs a calibration set")
    settings = {"int8": params.int8, "int4": params.int4, "fp16": params.fp16}[precision]
    salt = calibration.digest[:12] if calibrated else "nocal"
    target = out_root / f"{precision}-v{STAGE_VERSION}-{section_digest(settings)[:10]}-{salt}-{onnx.sha256[:12]}"

    def build(staging: Path) -> None:
        if calibrated:
            int8_qdq_onnx(onnx, calibration, params.int8, staging / ONNX_FILE)
        elif precision == "int8":
            int8_blocks_onnx(onnx.path, params.int8, staging / ONNX_FILE)
        elif precision == "int4":
            int4_weight_only_onnx(onnx.path, params.int4, staging / ONNX_FILE)
        else:
            fp16_onnx(onnx.path, params.fp16, staging / ONNX_FILE)

    stage_output(target, ONNX_FILE, build)
    converted = replace(onnx, path=target / ONNX_FILE, sha256=onnx_sha256(target / ONNX_FILE))
    return PrecisionOnnx(
        onnx=converted,
        precision=precision,
        fp32_sha256=onnx.sha256,
        calibration_digest=calibration.digest if calibrated else None,
        ort_only=precision == "int4" or (precision == "int8" and not calibrated),
    )


# ---------------------------------------------------------------- int4


def int4_weight_only_onnx(source: Path, params: Int4Params, output: Path) -> None:
    """Every linear layer with a constant weight as MatMulNBits (4-bit blocks, one scale per
    `block_size` weights along the input), the LM head with `lm_head_bits` and its top
    `lm_head_rescore_top` logits computed again from its float weights; everything else as
    it was."""
    blocks = Blocks(4, params.block_size, params.symmetric, params.accuracy_level)
    body = lambda graph, heads: [node for node in weight_matmuls(graph) if node not in heads]  # noqa: E731
    _weight_blocks_onnx(source, output, body, blocks, params.lm_head_bits, params.lm_head_rescore_top)


def int8_blocks_onnx(source: Path, params: Int8Params, output: Path) -> None:
    """Every linear layer with a constant weight, the LM head included, as MatMulNBits with
    8-bit symmetric blocks and int8 activations per block (`scheme: blocks`); the nodes
    `keep_float` names stay float. Nothing is calibrated: each block's scale is its own.
    A SwiGLU down projection is quantized too: what kept it float under Q/DQ, its input's
    outliers under one scale per tensor, is gone with a scale per block."""
    per_block = params.model_copy(update={"keep_float": params.keep_float.model_copy(update={"swiglu_down": False})})

    def quantized(graph: ir.Graph, heads: list[ir.Node]) -> list[ir.Node]:
        kept = set(nodes_kept_float(graph, per_block))
        return [node for node in weight_matmuls(graph) if node.name not in kept]

    _weight_blocks_onnx(source, output, quantized, Blocks(8, params.block_size, symmetric=True, accuracy_level=4), None)


def _weight_blocks_onnx(
    source: Path, output: Path, quantized: Callable[[ir.Graph, list[ir.Node]], list[ir.Node]], blocks: Blocks, lm_head_bits: int | None, rescore_top: int = 0
) -> None:
    """`quantized(graph, the LM head's nodes)` as MatMulNBits of `blocks`, then the LM head
    with `lm_head_bits` where it was left out, and its top `rescore_top` logits rescored from
    its float weights. The source's weights stay on disk until each is written (external
    data is read a tensor at a time): one weight in memory, not the model twice."""
    model = ir.load(str(source))
    gemms_as_matmuls(model.graph)
    heads = lm_head_nodes(model.graph)
    to_matmul_nbits(model, quantized(model.graph, heads), blocks)
    if lm_head_bits is not None and heads:  # `quantized` left them out
        float_heads = [FloatHead.of(model.graph, head) for head in heads] if rescore_top else []
        to_matmul_nbits(model, heads, replace(blocks, bits=lm_head_bits))
        for head in float_heads:
            head.rescore_top(model.graph, rescore_top)
    save_ir(model, output, external=has_external_data(source))


# ---------------------------------------------------------------- int8


class CalibrationFeeds:
    """An onnxruntime `CalibrationDataReader` over both feeds an int8 model sees: each
    prompt with an empty past (context phase), then greedy decode steps whose past is the
    real KV cache the fp32 graph produced (generation phase).

    It supports `set_range` so quantize_static can collect one feed at a time
    (`CalibStridedMinMax`: 1): the histogram calibrators (entropy, percentile) stack all
    collected outputs into one array and fail on feeds of different lengths.
    """

    def __init__(self, fp32: ExportedOnnx, calibration: CalibrationSet) -> None:
        import onnxruntime as ort

        self._session = ort.InferenceSession(str(fp32.path), providers=["CPUExecutionProvider"])
        self._layout = fp32.layout
        self._prompts = calibration.prompts
        self._per_prompt = calibration.decode_steps + 1
        self._chain: tuple[int, list[dict[str, np.ndarray]]] = (-1, [])
        self.on_feed: Callable[[], None] = lambda: None
        self.set_range(0, len(self))

    def __len__(self) -> int:
        return len(self._prompts) * self._per_prompt

    def set_range(self, start_index: int, end_index: int) -> None:
        self._feeds = (self._feed(i) for i in range(start_index, end_index))

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)

    def rewind(self) -> None:
        self.set_range(0, len(self))

    def _feed(self, index: int) -> dict[str, np.ndarray]:
        self.on_feed()
        prompt, step = divmod(index, self._per_prompt)
        if self._chain[0] != prompt:  # feeds are read in order: each chain is computed once
            self._chain = (prompt, self._prompt_feeds(np.array([self._prompts[prompt]], np.int64)))
        return self._chain[1][step]

    def _prompt_feeds(self, ids: np.ndarray) -> list[dict[str, np.ndarray]]:
        layout = self._layout
        empty = np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), np.float32)
        every = np.arange(ids.shape[1], dtype=np.int64)  # the LM head calibrated over every position, as scoring uses it
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": every[None], LOGITS_POSITIONS: every}
        feeds = [feed | {name: empty for name in layout.past_names}]
        for _ in range(self._per_prompt - 1):
            logits, *present = self._session.run(None, feeds[-1])
            position = feeds[-1]["position_ids"][:, -1:] + 1
            feeds.append(
                {
                    "input_ids": logits[:, -1:].argmax(-1).astype(np.int64),
                    "attention_mask": np.ones((1, int(position[0, 0]) + 1), np.int64),
                    "position_ids": position,
                    LOGITS_POSITIONS: np.zeros(1, np.int64),
                }
                | dict(zip(layout.past_names, present))
            )
        return feeds


def int8_qdq_onnx(onnx: ExportedOnnx, calibration: CalibrationSet, params: Int8Params, output: Path) -> None:
    """Static Q/DQ quantization: symmetric int8 activations and weights (TensorRT needs
    zero point 0), per-channel weights, sensitive nodes left in float."""
    from onnxruntime.quantization import CalibrationMethod

    prepared = output.with_name("prepared.onnx")
    external = _pre_process(onnx.path, prepared)
    model = ir.load(str(prepared))  # node names only: external weights are not read
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile}
    feeds = CalibrationFeeds(onnx, calibration)
    # The histogram collectors print a line per collection (one per feed here): keep stdout
    # for the progress bar.
    with stage_progress("int8 calibration", total=len(feeds)) as advance, contextlib.redirect_stdout(io.StringIO()):
        feeds.on_feed = lambda: advance(1, "")
        _quantize(prepared, output, feeds, params, methods[params.calibration_method], nodes_kept_float(model.graph, params), external)
    for file in onnx_files(prepared):
        file.unlink()


def _pre_process(source: Path, prepared: Path) -> bool:
    """ONNX Runtime's pre-processing for quantization, `source` → `prepared`: symbolic shape
    inference, or ops whose shapes ORT cannot infer stay uncalibrated; constant folding (ORT's
    basic level: standard ONNX ops only), so a weight reached through a Transpose (the tied
    lm_head) becomes an initializer that is quantized once instead of on every step.
    auto_merge: the mask's key axis (the input's total_sequence) is the cache's past +
    sequence. Whether the weights are external, as in `source`."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    external = has_external_data(source)
    quant_pre_process(str(source), str(prepared), skip_optimization=False, auto_merge=True, save_as_external_data=external,
                      all_tensors_to_one_file=True, external_data_location=data_file(prepared).name)  # fmt: skip
    return external


def _quantize(prepared: Path, output: Path, feeds: CalibrationFeeds, params: Int8Params, method, kept_float: list[str], external: bool) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    quantize_static(
        str(prepared),
        str(output),
        feeds,
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=params.per_channel,
        reduce_range=params.reduce_range,
        op_types_to_quantize=list(params.op_types),
        calibrate_method=method,
        nodes_to_exclude=kept_float,
        use_external_data_format=external,
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            # A quantized MatMul/Gemm output would be requantized and dequantized again
            # before the next float op: pure loss, no int8 kernel behind it.
            "OpTypesToExcludeOutputQuantization": ["MatMul", "Gemm"],
            "CalibStridedMinMax": 1,  # one feed per collection: see CalibrationFeeds
            # A quantized activation read by several MatMuls (Llama's q/k/v, gate/up) gets a
            # Q/DQ pair per reader: ONNX Runtime fuses DQ + MatMul into an int8 kernel only
            # where the DQ has one consumer, and dequantized the weights on every step
            # otherwise (a Llama's int8 engine was 2x slower than its fp32 one).
            "DedicatedQDQPair": True,
        },
    )


def nodes_kept_float(graph: ir.Graph, params: Int8Params) -> list[str]:
    """Names of the nodes that stay float: by op type, by name pattern, and (optionally)
    the attention-score MatMuls, found structurally: neither input is a weight, and a
    SwiGLU MLP's down projection: its input is silu(gate)·up."""
    patterns = [re.compile(p) for p in params.keep_float.name_patterns]
    weights = _weight_tensors(graph)
    swiglu = _swiglu_products(graph) if params.keep_float.swiglu_down else set()
    kept = []
    for node in graph:
        reads = {value.name for value in node.inputs if value is not None}
        if node.op_type in params.keep_float.op_types or any(p.search(node.name) for p in patterns):
            kept.append(node.name)
        elif params.keep_float.attention_scores and node.op_type == "MatMul" and not reads & weights:
            kept.append(node.name)
        elif node.op_type in ("MatMul", "Gemm") and node.inputs[0].name in swiglu:
            kept.append(node.name)
    return kept


def _swiglu_products(graph: ir.Graph) -> set[str]:
    """The outputs of Mul(silu(a), b), silu(a) being Mul(a, Sigmoid(a)): SwiGLU's gated product."""

    def is_silu(value: ir.Value) -> bool:
        node = value.producer()
        if node is None or node.op_type != "Mul":
            return False
        sigmoids = [i.producer() for i in node.inputs if i is not None]
        return any(s is not None and s.op_type == "Sigmoid" and s.inputs[0] in node.inputs for s in sigmoids)

    return {node.outputs[0].name for node in graph if node.op_type == "Mul" and any(i is not None and is_silu(i) for i in node.inputs)}


def _weight_tensors(graph: ir.Graph) -> set[str]:
    """Initializers and what layout ops (Transpose, Reshape, Cast) make of them."""
    weights = set(graph.initializers)
    for node in graph:  # graph order is topological
        if node.op_type in {"Transpose", "Reshape", "Cast", "Identity"} and node.inputs and node.inputs[0] is not None and node.inputs[0].name in weights:
            weights.update(value.name for value in node.outputs)
    return weights


# ---------------------------------------------------------------- fp16


def fp16_onnx(source: Path, params: Fp16Params, output: Path) -> None:
    """fp16 weights and activations, with the norms, Softmax and the logits kept fp32."""
    import onnx as onnx_lib
    from onnxconverter_common import float16

    model = onnx_lib.load(str(source))
    # The dynamo export annotates intermediate tensors as float; the converter does not
    # rewrite every annotation, and a stale one fails the load. Shapes are re-inferred.
    del model.graph.value_info[:]
    _detach_graph_outputs(model)
    logits_node = next(node.name for node in model.graph.node if "logits" in node.output or "logits.inner" in node.output)
    converted = float16.convert_float_to_float16(
        model,
        keep_io_types=True,
        op_block_list=list(params.keep_fp32_op_types),
        # The lm_head (logits are computed, not only returned, in fp32); RMSNorm's
        # decomposition where that op type is kept (x² of an fp16 activation overflows past
        # 256); the rotary angles (position × frequency: fp16 has no digits left for them).
        node_block_list=[logits_node] + (rms_norm_nodes(model) if "RMSNormalization" in params.keep_fp32_op_types else []) + rotary_nodes(model),
        disable_shape_infer=False,
    )
    _drop_output_downcast(converted, "logits")
    save_onnx(converted, output, external=has_external_data(source))


def rms_norm_nodes(model) -> list[str]:
    """The nodes of each RMSNorm decomposed below opset 23, found by their structure: Pow(x, 2)
    → ReduceMean → Add(ε) → Sqrt → Reciprocal (or Div), and the Mul of x by that scale."""
    from onnx import numpy_helper

    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    constants |= {node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in model.graph.node if node.op_type == "Constant" and node.attribute[0].name == "value"}
    kept = []
    for mean in (node for node in model.graph.node if node.op_type == "ReduceMean"):
        square = producers.get(mean.input[0])
        exponent = constants.get(square.input[1]) if square is not None and square.op_type == "Pow" else None
        if exponent is None or exponent.size != 1 or float(exponent) != 2.0:
            continue
        chain, node = [square, mean], mean
        for op_types in ({"Add"}, {"Sqrt"}, {"Reciprocal", "Div"}, {"Mul"}):
            node = next((c for c in consumers.get(node.output[0], []) if c.op_type in op_types), None)
            if node is None:
                break
            chain.append(node)
        kept += [n.name for n in chain]
    return kept


def rotary_nodes(model) -> list[str]:
    """The rotary embedding's angle computation: every node upstream of a Cos or Sin (the
    positions, cast to float, times the inverse frequencies), and the Cos and Sin."""
    producers = {out: node for node in model.graph.node for out in node.output}
    pending = [node for node in model.graph.node if node.op_type in ("Cos", "Sin")]
    kept: dict[str, None] = {}
    while pending:
        node = pending.pop()
        if node.name not in kept:
            kept[node.name] = None
            pending += [producers[name] for name in node.input if name in producers]
    return list(kept)


def _detach_graph_outputs(model) -> None:
    """Make each graph output a leaf: its producer writes `<name>.inner`, consumers read that,
    and an Identity copies it to the output. The fp16 converter casts graph outputs back to
    fp32 in place, which would hand fp32 to nodes (the KV concat) that expect fp16."""
    from onnx import helper

    outputs = {o.name for o in model.graph.output}
    consumed = {name for node in model.graph.node for name in node.input} & outputs
    for node in model.graph.node:
        node.output[:] = [f"{o}.inner" if o in consumed else o for o in node.output]
        node.input[:] = [f"{i}.inner" if i in consumed else i for i in node.input]
    model.graph.node.extend(helper.make_node("Identity", [f"{o}.inner"], [o], name=f"{o}.leaf") for o in sorted(consumed))


def _drop_output_downcast(model, output: str) -> None:
    """The converter casts a blocked node's fp32 result to fp16 and declares the graph output
    fp16, keep_io_types notwithstanding: hand the fp32 result to an fp32 output instead."""
    from onnx import TensorProto

    cast = next(node for node in model.graph.node if output in node.output)
    to = next((a.i for a in cast.attribute if a.name == "to"), None)
    if cast.op_type != "Cast" or to != TensorProto.FLOAT16:
        return
    producer = next(node for node in model.graph.node if cast.input[0] in node.output)
    producer.output[:] = [output if name == cast.input[0] else name for name in producer.output]
    model.graph.node.remove(cast)
    declared = next(o for o in model.graph.output if o.name == output)
    declared.type.tensor_type.elem_type = TensorProto.FLOAT
