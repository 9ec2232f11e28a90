"""The export stage: a model directory of any family kiln builds (components.families) →
ONNX with past key values, checked against PyTorch on a left-padded prompt (empty past)
and on decode steps (with past).

The model is traced on the meta device and its weights are written from the checkpoint one
at a time (components.lazy_weights), so the graph is written without the model in memory;
the parity check then loads the model in fp32 once, and frees it before ONNX Runtime loads
the graph."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from components.checkpoint import Checkpoint, parameter_keys
from components.config import ExportParams, section_digest
from components.engine_dir import LOGITS_POSITIONS
from components.errors import ExportError
from components.families import shape_of
from components.files import stage_output
from components.onnx_files import onnx_files, onnx_sha256
from components.model_dir import TrainedModel, first_layers, load_model, quiet_transformers, read_config
from components.model_fit import export_parity_fits
from components.resources import machine_memory

if TYPE_CHECKING:
    import onnx_ir

ONNX_FILE = "model.onnx"
TRUNCATED_PARITY_LAYERS = 2  # where the model in fp32 does not fit: enough for a layer to feed another
# Part of the output folder's name and of the Prefect cache key (flows.caching): bump it when
# this stage's code changes what it makes, and only this stage and those after it rebuild.
STAGE_VERSION = "7"  # 6: the mask built in a few ops; 7: traced on meta, weights written from the checkpoint


@dataclass(frozen=True)
class KVLayout:
    """The exported model's family and shapes: past/present tensors are (batch, kv_heads,
    length, head_dim); `num_heads` are the attention's query heads."""

    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    family: str
    num_kv_heads: int
    parameter_count: int

    @property
    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "position_ids", LOGITS_POSITIONS] + self.past_names

    @property
    def output_names(self) -> list[str]:
        return ["logits"] + [f"present.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")]

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")]


@dataclass(frozen=True)
class Parity:
    """Max |logits(ONNX Runtime) - logits(PyTorch)| over real (unpadded) positions; of the
    model's first `layers` decoder layers exported on their own where it is not None."""

    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    tolerance: float
    layers: int | None = None

    @property
    def passed(self) -> bool:
        return max(self.prefill_max_abs_diff, self.decode_max_abs_diff) <= self.tolerance


@dataclass(frozen=True)
class ExportedOnnx:
    path: Path
    sha256: str
    opset: int
    layout: KVLayout
    parity: Parity

    @property
    def content_digest(self) -> str:
        return self.sha256

    @property
    def output_dir(self) -> Path:
        return self.path.parent

    def is_intact(self) -> bool:
        """Still on disk and unchanged since it was made (a cached result may outlive its files)."""
        return all(f.is_file() for f in onnx_files(self.path)) and onnx_sha256(self.path) == self.sha256


def kv_layout_of(model) -> KVLayout:
    """The layout of a loaded transformers model (a tied embedding's weights counted once)."""
    shape = shape_of(model.config.to_dict())
    return KVLayout(
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_positions=shape.max_positions,
        family=shape.family,
        num_kv_heads=shape.num_kv_heads,
        parameter_count=model.num_parameters(),
    )


def onnx_from_model(model: TrainedModel, params: ExportParams, out_root: Path) -> ExportedOnnx:
    """Export with a KV cache (dynamic batch, sequence and past length) and check parity."""
    layout = kv_layout_of(_meta_model(model.path)[0])
    build = lambda staging: _export(model.path, params.opset, staging / ONNX_FILE, params.external_data_above_mb)  # noqa: E731
    target = stage_output(out_root / f"v{STAGE_VERSION}-{section_digest(params)[:12]}-{model.sha256[:12]}", ONNX_FILE, build)
    layers = params.parity_layers or (None if export_parity_fits(layout.parameter_count, machine_memory()) else TRUNCATED_PARITY_LAYERS)
    parity = _parity(model.path, target / ONNX_FILE, layout, params, layers)
    if not parity.passed:
        checked = "" if parity.layers is None else f" (its first {parity.layers} layers exported on their own)"
        raise ExportError(
            f"ONNX export of {model.path}{checked} misses parity with PyTorch: max |Δlogits| "
            f"prefill {parity.prefill_max_abs_diff:.3g}, decode {parity.decode_max_abs_diff:.3g}, "
            f"tolerance {parity.tolerance:g} (off by {max(parity.prefill_max_abs_diff, parity.decode_max_abs_diff) - parity.tolerance:.3g})"
        )
    return ExportedOnnx(path=target / ONNX_FILE, sha256=onnx_sha256(target / ONNX_FILE), opset=params.opset, layout=layout, parity=parity)


def _parity(model_dir: Path, graph: Path, layout: KVLayout, params: ExportParams, layers: int | None) -> Parity:
    """The graph against PyTorch, both in fp32; where `layers` is set (the model in fp32 would
    not fit), the model's first `layers` layers against a graph of them exported by the same
    code from the same weights: the conversion checked on the real shapes and weights, without
    the whole model in memory."""
    import tempfile

    if layers is None or layers >= layout.num_layers:
        return onnx_parity(graph, layout, torch_reference(_export_ready(load_model(model_dir)), layout), params.parity_tolerance)
    with tempfile.TemporaryDirectory(dir=graph.parent.parent, prefix=".parity-") as scratch:
        head = Path(scratch) / ONNX_FILE
        _export(model_dir, params.opset, head, params.external_data_above_mb, layers)
        model = _export_ready(load_model(model_dir, layers=layers))
        head_layout = kv_layout_of(model)
        parity = onnx_parity(head, head_layout, torch_reference(model, head_layout), params.parity_tolerance)
    return Parity(parity.prefill_max_abs_diff, parity.decode_max_abs_diff, parity.tolerance, layers)


def _export_ready(model):
    """The model as the graph computes it: eager attention over the whole context."""
    return _with_matmul_attention(_attending_to_the_whole_context(model))


def _meta_model(path: Path, layers: int | None = None):
    """The model of `path` (its first `layers` decoder layers where that is set) with its
    parameters on the meta device (no memory) and tied as saved; its buffers (the rotary
    frequencies, computed at init) moved to meta too, and returned by their name in the
    exported graph to be written from the CPU copies."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    read_config(path)  # a clear error for a directory without a config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path), **first_layers(layers)), dtype=torch.float32)
    model.tie_weights()  # init_empty_weights registers the parameters again, untied
    buffers = {}
    for prefix, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                # A CPU buffer beside meta inputs would trace a device copy into the graph.
                buffers[f"model.{prefix}.{name}" if prefix else f"model.{name}"] = buffer.clone()
                module._buffers[name] = buffer.to("meta")
    return _export_ready(model.eval()), buffers


def _attending_to_the_whole_context(model):
    """Mistral's sliding window, dropped: the engine then attends to its whole context,
    which is the same model wherever that context fits the window, and kiln refuses
    profiles that do not (components.model_dir.check_fits_model). Exported, the window's
    mask is a graph that ONNX Runtime's symbolic shape inference cannot follow."""
    if shape_of(model.config.to_dict()).sliding_window is not None:
        model.config.sliding_window = None
    return model


def _with_matmul_attention(model):
    """transformers' eager attention (matmul, additive mask, softmax, matmul) instead of SDPA:
    exported, SDPA's decomposition transposes every step's whole key cache through reshapes
    ONNX Runtime cannot fold into its matmul, and rebuilds a boolean mask with a NaN guard;
    eager's K^T folds into a FusedMatMul (GPT-2-small int8 at batch 1: 7.54 -> 6.46 ms a token)."""
    model.set_attn_implementation("eager")
    return model


def _kv_wrapper(model):
    """transformers 5 takes the cache as a DynamicCache; ONNX wants flat tensors in and out.
    The LM head is the widest matmul of a small model, and a prefill wants one position's
    logits of its prompt's 32 (a one-row prefill of the default int8 engine: 0.73 ms with
    every position's, 0.60 with the last's; GPT-2's 50k-word head weighs far more). So the
    logits are the LM head over the hidden states at `logits_positions` (what the model's
    own forward does with `logits_to_keep`), selected with index_select: one Gather in the
    graph. transformers' tensor indexing exported as Transpose + GatherND + Transpose, which
    ONNX Runtime 1.32's full optimizations crash on (a segmentation fault loading the fp16 graph)."""
    import torch
    from transformers import DynamicCache

    class FlatKVCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, logits_positions, *past):
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
            cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
            out = self.model.base_model(  # GPT-2's `transformer`, the others' `model`
                input_ids=input_ids,
                attention_mask=_additive_mask(attention_mask, input_ids.shape[1], self.model.dtype),
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            logits = self.model.lm_head(out.last_hidden_state.index_select(1, logits_positions))
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (logits, *present)

    return FlatKVCausalLM().eval()


def _additive_mask(attention_mask, new_tokens: int, dtype):
    """transformers' own causal and padding mask, (batch, 1, new, total) with 0 where a token
    sees a key and the dtype's minimum elsewhere, built in a few ops: the new tokens are the
    last `new_tokens` columns, and column j is seen from column i where j <= i and the mask
    has j. Built by transformers from the 2-D mask, it exported as ~30 shape and index nodes
    run every step (a quarter of the default model's graph)."""
    import torch

    total = attention_mask.shape[1]
    keys = torch.arange(total, device=attention_mask.device)
    queries = torch.arange(new_tokens, device=attention_mask.device) + (total - new_tokens)
    seen = (keys[None, :] <= queries[:, None])[None, None] & attention_mask[:, None, None, :].bool()
    return torch.where(seen, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype))


def _export(model_dir: Path, opset: int, path: Path, external_above_mb: int, layers: int | None = None) -> None:
    """The graph traced on the meta device, its weights bound to the checkpoint's tensors
    and written one at a time (external where they pass `external_above_mb`); of the first
    `layers` decoder layers alone where that is set."""
    import torch
    from torch.export import Dim

    from components.lazy_weights import bind_parameters, fold_weight_transposes  # onnx_ir: loaded when exporting

    model, buffers = _meta_model(model_dir, layers)
    layout = kv_layout_of(model)
    batch, sequence, past, total = Dim("batch"), Dim("sequence"), Dim("past_sequence"), Dim("total_sequence")
    example = [t.to("meta") for t in _example_inputs(layout, batch=2, sequence=3, past=2)]
    shapes = (
        {0: batch, 1: sequence},
        {0: batch, 1: total},  # torch.export derives total = past + sequence from the graph
        {0: batch, 1: sequence},
        {0: Dim("kept_positions")},
        tuple({0: batch, 2: past} for _ in layout.past_names),
    )
    try:
        with torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(
                _kv_wrapper(model),
                tuple(example),  # flat; torch groups the KV tensors as forward's *past
                input_names=layout.input_names,
                output_names=layout.output_names,
                dynamic_shapes=shapes,
                opset_version=opset,
                dynamo=True,
                optimize=False,  # after the weights are bound: the optimizer folds constants
                verbose=False,
            )
    except Exception as err:  # torch.export raises a zoo of types; all mean "export failed"
        raise ExportError(f"torch.onnx.export of the model failed: {type(err).__name__}: {err}") from err
    _drop_stack_traces(program.model)
    checkpoint = Checkpoint(model_dir)
    keys = {f"model.{name}": key for name, key in parameter_keys(model, checkpoint).items()}  # as _kv_wrapper holds it
    bind_parameters(program.model.graph, checkpoint, keys, buffers)
    fold_weight_transposes(program.model.graph)
    program.optimize()
    weights = sum(value.const_value.nbytes for value in program.model.graph.initializers.values() if value.const_value is not None)
    program.save(str(path), external_data=weights > external_above_mb << 20)  # beside it in model.onnx.data (components.onnx_files)


def _drop_stack_traces(model: onnx_ir.Model) -> None:
    """The exporter keeps each node's Python stack trace (absolute file paths, line numbers)
    in its metadata: the same model exported from another checkout or virtualenv, or after
    an edit of this file, was another file with another sha256, so another engine to the
    registry. The node's namespace and class hierarchy, which name no file, stay."""
    for graph in (model.graph, *model.functions.values()):
        for node in graph.all_nodes():
            node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The dynamo exporter warns about torchvision, pytree and axis renaming on every export."""
    import logging

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _example_inputs(layout: KVLayout, batch: int, sequence: int, past: int) -> list:
    import torch

    ids = torch.randint(0, layout.vocab_size, (batch, sequence))
    mask = torch.ones(batch, past + sequence, dtype=torch.long)
    positions = torch.arange(past, past + sequence).expand(batch, sequence)
    kept = torch.arange(1, sequence)  # fewer than `sequence`, so that torch.export keeps the two sizes apart
    kv = [torch.randn(batch, layout.num_kv_heads, past, layout.head_dim) for _ in layout.past_names]
    return [ids, mask, positions, kept, *kv]


@dataclass(frozen=True)
class _Reference:
    """PyTorch's logits for each feed of the parity check, the past left to the graph."""

    feeds: list[dict]  # without past key values
    logits: list  # numpy, one per feed
    real: object  # numpy bool mask of the prompt's real (unpadded) positions


def parity_against_torch(model, onnx_path: Path, layout: KVLayout, tolerance: float, decode_steps: int = 3) -> Parity:
    """Batch 3, left-padded prompt with an empty past, then greedy decode steps with the past."""
    return onnx_parity(onnx_path, layout, torch_reference(model, layout, decode_steps), tolerance)


def torch_reference(model, layout: KVLayout, decode_steps: int = 3) -> _Reference:
    """PyTorch's logits for a batch of 3 left-padded prompts with an empty past, then greedy
    decode steps with its own past: computed first, so the model can be freed before ONNX
    Runtime loads the graph (both in memory at once was twice the weights)."""
    import numpy as np
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, layout.vocab_size, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    feeds, logits, cache = [], [], None
    for step in range(decode_steps + 1):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        kept = np.arange(ids.shape[1]) if step == 0 else np.zeros(1, np.int64)
        feeds.append({"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": positions.numpy(), LOGITS_POSITIONS: kept})
        logits.append(out.logits.numpy())
        cache, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
        mask, positions = torch.cat([mask, torch.ones_like(ids)], dim=1), positions[:, -1:] + 1
    return _Reference(feeds, logits, real=feeds[0]["attention_mask"].astype(bool))


def onnx_parity(onnx_path: Path, layout: KVLayout, reference: _Reference, tolerance: float) -> Parity:
    """Max |logits(ONNX Runtime) - logits(PyTorch)| of the reference's feeds, the graph's own
    present key values fed back as its past."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    past = {name: np.zeros((3, layout.num_kv_heads, 0, layout.head_dim), np.float32) for name in layout.past_names}
    differences = []
    for feed, expected in zip(reference.feeds, reference.logits, strict=True):
        logits, *present = session.run(None, feed | past)
        differences.append(np.abs(logits - expected))
        past = dict(zip(layout.past_names, present))
    decode = max((float(d.max()) for d in differences[1:]), default=0.0)
    return Parity(prefill_max_abs_diff=float(differences[0][reference.real].max()), decode_max_abs_diff=decode, tolerance=tolerance)
