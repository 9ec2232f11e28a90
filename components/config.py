"""Typed configuration: params.yaml is read once, at the entry point, into `Params`.

Every section forbids unknown keys, so a typo in params.yaml is an error that names the
key instead of a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from cronsim import CronSim, CronSimError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.errors import ConfigError
from components.onnx_files import PROTOBUF_LIMIT_MB


class _Section(BaseModel):
    # Each key's docstring is its description (the params reference is generated from them).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# ---------------------------------------------------------------- data sources


class CPythonDocsSource(_Section):
    """The default corpus: CPython's bundled pydoc topics and stdlib docstrings (offline),
    and text files of your own matched by `glob` (`kiln data add` writes them there; none
    at first, so the default data is the docs alone)."""

    kind: Literal["cpython-docs"] = "cpython-docs"
    """`cpython-docs`: CPython's bundled pydoc topics and stdlib docstrings (offline), plus your own files."""
    glob: str | None = "corpus/**/*.txt"
    """Your own text files beside the docs, relative to the project (`kiln data add` copies files there); null: the docs alone."""


class TextFilesSource(_Section):
    """Local text files matched by a glob, relative to the project root."""

    kind: Literal["text-files"]
    """`text-files`: local text files only."""
    glob: str
    """The files, relative to the project root."""


class HFDatasetSource(_Section):
    """A Hugging Face dataset (local path or hub id where the hub is reachable)."""

    kind: Literal["hf-dataset"]
    """`hf-dataset`: a Hugging Face dataset."""
    name: str
    """A local dataset path, or a hub id where the hub is reachable."""
    split: str = "train"
    """The dataset split to read."""
    text_field: str = "text"
    """The column holding the text."""


CorpusSource = Annotated[
    CPythonDocsSource | TextFilesSource | HFDatasetSource, Field(discriminator="kind")
]


class SplitParams(_Section):
    eval_fraction: float = Field(0.05, gt=0, lt=0.5)
    """Share of passages held out for evaluation (gates, perplexity)."""
    calibration_fraction: float = Field(0.05, gt=0, lt=0.5)
    """Share of passages kept for int8 calibration."""


class DataParams(_Section):
    source: CorpusSource = CPythonDocsSource()
    """Where the corpus comes from (`kind`: cpython-docs, text-files or hf-dataset)."""
    path: str = "data"
    """The data folder, relative to the project; DVC tracks it as `<path>.dvc`."""
    min_chars: int = Field(64, ge=1)
    """Passages shorter than this (after cleaning) are dropped."""
    max_chars: int = Field(4000, ge=16)
    """Longer passages are cut into pieces of at most this many characters."""
    split: SplitParams = SplitParams()
    """How passages are divided into train, eval and calibration (by a hash of their text)."""
    dvc_push: bool = True
    """Push each new data version to the DVC remote (`.kiln/dvc-remote` by default)."""


# ---------------------------------------------------------------- model


class TokenizerParams(_Section):
    vocab_size: int = Field(4096, ge=300)
    """Size of the byte-level BPE vocabulary trained from scratch."""
    min_frequency: int = Field(2, ge=1)
    """A merge must occur this often in the training text to enter the vocabulary."""


class ArchitectureParams(_Section):
    """The model trained from scratch: a GPT-2, or a Llama (RMSNorm, SwiGLU, rotary
    positions, grouped-query attention, tied embeddings as small Llamas have)."""

    family: Literal["gpt2", "llama"] = "gpt2"
    """The model trained from scratch: `gpt2` or `llama`."""
    n_layer: int = Field(2, ge=1)
    """Transformer layers."""
    n_head: int = Field(4, ge=1)
    """Attention heads per layer."""
    n_embd: int = Field(128, ge=8)
    """Hidden width (a multiple of `n_head`)."""
    n_positions: int = Field(256, ge=16)
    """The model's context in tokens (the engine profiles must fit inside it)."""
    n_kv_heads: int | None = Field(None, ge=1)
    """Llama only: key/value heads (grouped-query attention; divides `n_head`); null: as many as heads."""
    intermediate_size: int | None = Field(None, ge=8)
    """Llama only: the SwiGLU MLP's width; null: 8/3 of `n_embd`, rounded up to a multiple of 8."""
    rope_theta: float | None = Field(None, gt=0)
    """Llama only: the rotary embedding's base; null: 10000."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ArchitectureParams:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.family == "llama" and self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_heads ({self.kv_heads}) must divide n_head ({self.n_head})")
        return self

    @model_validator(mode="after")
    def _llama_keys_only_for_llama(self) -> ArchitectureParams:
        given = [key for key in ("n_kv_heads", "intermediate_size", "rope_theta") if getattr(self, key) is not None]
        if self.family != "llama" and given:
            raise ValueError(f"{', '.join(given)} apply to family llama only; family is {self.family}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or -(-8 * self.n_embd // 3 // 8) * 8  # rounded up to a multiple of 8


class TrainingParams(_Section):
    steps: int = Field(1200, ge=0)
    """Optimizer steps."""
    batch_size: int = Field(16, ge=1)
    """Sequences per optimizer step."""
    block_size: int = Field(128, ge=8)
    """Tokens per training sequence."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak AdamW learning rate (after warm-up, then cosine decay)."""
    warmup_steps: int = Field(100, ge=0)
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay."""
    eval_batches: int = Field(20, ge=1)
    """Batches of the eval split the reported eval perplexity is measured on."""
    seed: int = 0
    """Seed of initialisation and batch order."""
    threads: int | None = Field(None, ge=1)
    """torch threads while training; null: torch's default (with `reproducible`: 2)."""
    reproducible: bool = False
    """Train with torch's kernels held to AVX2 (ATen's CPU capability, MKL's conditional numerical reproducibility, oneDNN's ISA) and a fixed thread count, in a process of its own: the same data and params give the same model bytes on any x86-64 CPU with AVX2, at a cost in training time (docs/reproducibility.md)."""


class LoraParams(_Section):
    """LoRA (low-rank adaptation, through PEFT): the pretrained weights stay frozen and a pair
    of small matrices is trained beside each targeted linear layer, then merged into its
    weight before the model is saved, so export and every stage after see a plain model.
    Trains a 1B model where every weight and its AdamW state would not fit (or not in time)."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight; false: full fine-tuning."""
    rank: int = Field(16, ge=1, le=1024)
    """Rank r of each adapter: r × (inputs + outputs) trained parameters per targeted layer."""
    alpha: float = Field(32.0, gt=0)
    """Scale of the adapters' update (alpha / rank multiplies it); twice the rank is the common choice."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: Literal["all-linear"] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = "all-linear"
    """The linear layers given adapters: `all-linear` (every one but the output head), or module names such as `[q_proj, v_proj]` (GPT-2's: `c_attn`, `c_proj`, `c_fc`)."""


class FineTuningParams(TrainingParams):
    """Fine-tuning a pretrained model on the train split. Off unless enabled: a pretrained
    model is built as it is. The defaults suit a model that already knows language (a small
    learning rate, a few hundred steps), not one trained from scratch."""

    enabled: bool = False
    """Fine-tune `model.pretrained` before it is exported; false: build it as it is."""
    steps: int = Field(200, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(8, ge=1)
    """Sequences per optimizer step."""
    learning_rate: float = Field(2e-5, gt=0)
    """Peak AdamW learning rate (after warm-up, then cosine decay); a pretrained model forgets at from-scratch rates."""
    warmup_steps: int = Field(20, ge=0)
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    # Left out of the section's dump while off: the model's identity (the train stage's key)
    # and the params digest move only when LoRA is on, as they did before it existed.
    lora: LoraParams = Field(LoraParams(), exclude_if=lambda lora: not lora.enabled)
    """LoRA adapters instead of every weight (off unless enabled); LoRA usually wants a higher `learning_rate` than full fine-tuning, around 1e-4 to 2e-4."""

    @model_validator(mode="after")
    def _lora_only_while_fine_tuning(self) -> FineTuningParams:
        if self.lora.enabled and not self.enabled:
            raise ValueError("lora.enabled is true and enabled is false: LoRA trains adapters while fine-tuning, so set enabled: true as well (or lora.enabled: false)")
        return self


class ModelParams(_Section):
    pretrained: str | None = None
    """null: train a tokenizer and a model from scratch; a local model directory (or a hub id in the local Hugging Face cache): build it as it is, or fine-tuned with `fine_tuning`."""
    tokenizer: TokenizerParams = TokenizerParams()
    """The tokenizer trained from scratch (not with `pretrained`)."""
    architecture: ArchitectureParams = ArchitectureParams()
    """The model trained from scratch (not with `pretrained`)."""
    training: TrainingParams = TrainingParams()
    """How the model is trained from scratch (not with `pretrained`)."""
    fine_tuning: FineTuningParams = FineTuningParams()
    """How a pretrained model is fine-tuned, if at all."""

    @model_validator(mode="after")
    def _fine_tunes_a_pretrained_model(self) -> ModelParams:
        if not self.pretrained and self.fine_tuning.enabled:
            raise ValueError("model.fine_tuning.enabled fine-tunes model.pretrained, which is null: set it, or train from scratch with model.training")
        return self

    @property
    def schedule(self) -> TrainingParams | None:
        """What the train stage runs: `training` from scratch, `fine_tuning` when enabled on a
        pretrained model, None for a pretrained model built as it is."""
        if self.pretrained is None:
            return self.training
        return self.fine_tuning if self.fine_tuning.enabled else None

    def identity(self) -> dict:
        """The settings that decide the model (the train stage's key and record): a pretrained
        model's does not move when the from-scratch settings do, nor the reverse."""
        unused = {"fine_tuning"} if self.pretrained is None else {"tokenizer", "architecture", "training"}
        return self.model_dump(mode="json", exclude=unused)

    def plan(self) -> str:
        """One line for the run's log: what the train stage does with the model."""
        schedule = self.schedule
        if schedule is None:
            return f"model: {self.pretrained}, built as it is (model.fine_tuning.enabled: true fine-tunes it first)"
        what = f"fine-tuning {self.pretrained}" if self.pretrained else f"training a {self.architecture.family} model from scratch"
        if self.pretrained and self.fine_tuning.lora.enabled:
            what += f" with LoRA rank {self.fine_tuning.lora.rank} adapters merged into its weights"
        return f"model: {what}, {schedule.steps} steps at learning rate {schedule.learning_rate:g}"


# ---------------------------------------------------------------- export / build


class ExportParams(_Section):
    opset: int = Field(18, ge=17)
    """ONNX opset of the export."""
    parity_tolerance: float = Field(1e-4, gt=0)
    """Largest |Δlogits| allowed between the ONNX graph and PyTorch on the parity checks."""
    external_data_above_mb: int = Field(PROTOBUF_LIMIT_MB, ge=0, le=PROTOBUF_LIMIT_MB)
    """Weights over this size go to `model.onnx.data` beside the graph, in this stage and every one after it (one ONNX file holds at most 2 GB: protobuf's limit, the default); 0: always."""
    parity_layers: int | None = Field(None, ge=1)
    """Decoder layers the parity check compares, the model's first ones exported again on their own; null: the whole graph where the model in fp32 and its graph fit this machine's memory, else 2."""


class ShapeRange(_Section):
    """min / opt / max of one dynamic dimension in an optimization profile."""

    min: int = Field(ge=0)
    """Smallest size the engine accepts."""
    opt: int = Field(ge=0)
    """The size the engine is tuned for (TensorRT's optimization profile)."""
    max: int = Field(ge=1)
    """Largest size the engine accepts."""

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class ProfileParams(_Section):
    batch: ShapeRange = ShapeRange(min=1, opt=1, max=16)
    """Sequences decoded together; its max is `kiln serve`'s largest continuous batch."""
    prompt: ShapeRange = ShapeRange(min=1, opt=32, max=128)
    """Prompt lengths in tokens (the prefill)."""
    context: ShapeRange = ShapeRange(min=2, opt=64, max=256)
    """Total context (past + new tokens) during generation; unset: the model's own (`n_positions` from scratch; a pretrained model's, capped by what this machine's memory holds for `batch.max` sequences)."""


Precision = Literal["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
TORCH_CUDA_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int4")  # what the torch-cuda backend builds (no int8 program)
# Built by ONNX Runtime (MatMulNBits) and torch-cuda (a 4-bit weight kernel), not by kiln's TensorRT backend.
NOT_TENSORRT_PRECISIONS = ("int4",)
# Made by the torch-cuda build from the model, with no precision ONNX of their own.
TORCH_CUDA_ONLY_PRECISIONS = ("bf16", "fp8")
# Why the other backends cannot build them (measured: ONNX Runtime 1.32 finds no CPU MatMul for bf16).
NOT_TORCH_CUDA = {
    "onnxruntime": "ONNX Runtime's CPU provider has no bf16 or FP8 MatMul kernel",
    "tensorrt": "kiln's TensorRT engines are built from the precision ONNX, and the precision stage makes no bf16 or FP8 graph",
}


class KeepFloatParams(_Section):
    """Nodes left in float when the rest of the graph is quantized."""

    op_types: list[str] = ["LayerNormalization", "Softmax"]
    """ONNX operator types left in float."""
    name_patterns: list[str] = []
    """Regular expressions matched against node names; matching nodes stay float."""
    attention_scores: bool = True
    """Keep the activation × activation MatMuls (Q·Kᵀ, attention·V) float."""
    # Its input, silu(gate)·up, has outliers one int8 scale clips; measured: docs/performance.md,
    # "Measured choices in the code".
    swiglu_down: bool = True
    """qdq: keep a SwiGLU MLP's down projection float (its input's outliers clip under one int8 scale; blocks have a scale per block)."""


def _power_of_two(block_size: int) -> int:
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (MatMulNBits' blocks), not {block_size}")
    return block_size


class Int8Params(_Section):
    # ONNX Runtime runs 8-bit weight blocks faster than Q/DQ's QGemm (no Q/DQ glue in a
    # decode step; a scale per 64 weights reads little more than the weights), and closer to
    # the model; TensorRT builds Q/DQ. Measured: docs/performance.md, "Measured choices in the code".
    scheme: Literal["auto", "blocks", "qdq"] = "auto"
    """blocks: 8-bit weight blocks with int8 activations per block (ONNX Runtime's MatMulNBits; nothing calibrated), ONNX Runtime only; qdq: Q/DQ nodes with calibrated activations, what TensorRT builds; auto: the engine's backend's (blocks on ONNX Runtime)."""
    block_size: int = Field(64, ge=16, le=256)
    """blocks: weights per scale along the input dimension (a power of two)."""
    # The linear layers hold the weights (and the time); quantizing residual Adds, embedding
    # Gathers or reshapes costs quality and buys no int8 kernel.
    op_types: list[str] = ["MatMul", "Gemm"]
    """qdq: operator types quantized (the linear layers, which hold the weights and the time)."""
    calibration_method: Literal["minmax", "entropy", "percentile"] = "percentile"
    """qdq: how activation ranges are chosen from the calibration feeds: `minmax`, `entropy` or `percentile`."""
    per_channel: bool = True
    """qdq: one weight scale per output channel rather than per tensor."""
    # AVX2-only CPUs sum int8 products pairwise in int16 (VPMADDUBSW), which saturates on
    # full-range weights; measured: docs/performance.md, "Measured choices in the code".
    # (ONNX Runtime's AVX2 kernel for 8-bit blocks puts one product in each int16 lane.)
    reduce_range: bool = True
    """qdq: 7-bit weights (±64), so CPUs without VNNI cannot saturate their int16 sums: the same logits on every x86 CPU."""
    keep_float: KeepFloatParams = KeepFloatParams()
    """Nodes left in float (blocks: the linear layers it names)."""

    _block_size_is_a_power_of_two = field_validator("block_size")(_power_of_two)

    def scheme_for(self, backend: str) -> Literal["blocks", "qdq"]:
        """The int8 form an engine of `backend` is built from."""
        if self.scheme != "auto":
            return self.scheme
        return "blocks" if backend == "onnxruntime" else "qdq"


class Int4Params(_Section):
    """Weight-only 4-bit blocks (ONNX Runtime's MatMulNBits) for every linear layer with a
    constant weight: at batch 1 a token's time is reading the weights, and 4 bits read half
    of int8's bytes. Activations stay float; nothing is calibrated."""

    # 128, GPTQ's and AWQ's group size: ONNX Runtime's 4-bit kernel was compute-bound at 32
    # (measured: docs/performance.md, "Measured choices in the code").
    block_size: int = Field(128, ge=16, le=256)
    """Weights per scale along the input dimension (a power of two)."""
    symmetric: bool = True
    """Symmetric blocks; false adds a zero point per block."""
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4
    """MatMulNBits' arithmetic: 4 quantizes activations to int8 per block (int8 kernels, VNNI where present); 0 dequantizes the weights to float."""
    # The tied LM head is GPT-2's largest matrix; measured: docs/performance.md, "Measured
    # choices in the code".
    lm_head_bits: Literal[4, 8] | None = 4
    """Bits of the LM head's blocks; null: float."""
    lm_head_rescore_top: int = Field(64, ge=0)
    """The head's highest logits per position computed again from its float weights: greedy and top-k picks (up to this many) see the float head's logits, the rest keep the blocks'; 0: none."""

    _block_size_is_a_power_of_two = field_validator("block_size")(_power_of_two)

    @model_validator(mode="after")
    def _rescoring_needs_a_quantized_head(self) -> Int4Params:
        if self.lm_head_rescore_top and self.lm_head_bits is None:
            raise ValueError("lm_head_rescore_top rescores a quantized LM head; with lm_head_bits null the head is float already: set lm_head_rescore_top to 0")
        return self


class Fp16Params(_Section):
    # RMSNormalization (Llama's norm) is an ONNX op from opset 23 only; below it the export
    # decomposes it, and the precision stage finds the decomposition (x², mean, rsqrt).
    keep_fp32_op_types: list[str] = ["LayerNormalization", "RMSNormalization", "Softmax"]
    """Operator types kept in fp32 (norms, including RMSNorm's decomposition, and softmax)."""


class PrecisionParams(_Section):
    build: list[Precision] = Field(default_factory=lambda: ["fp32", "int8"], min_length=1)
    """The precisions each run builds, gates and registers (bf16 and fp8: torch-cuda only; fp8 on GPUs with FP8 tensor cores)."""
    int8: Int8Params = Int8Params()
    """int8: 8-bit weight blocks (ONNX Runtime) or static Q/DQ quantization (TensorRT)."""
    int4: Int4Params = Int4Params()
    """int4 weight-only block quantization (ONNX Runtime's graph; torch-cuda quantizes the model itself, in groups of 128)."""
    fp16: Fp16Params = Fp16Params()
    """fp16 conversion."""

    def for_backend(self, backend: str) -> PrecisionParams:
        """These settings with int8's scheme resolved for an engine of `backend`."""
        return self.model_copy(update={"int8": self.int8.model_copy(update={"scheme": self.int8.scheme_for(backend)})})

    def calibrates(self, backend: str) -> bool:
        """Whether an int8 engine of `backend` needs the calibration set (Q/DQ does)."""
        return "int8" in self.build and self.int8.scheme_for(backend) == "qdq"


class CalibrationParams(_Section):
    samples: int = Field(128, ge=1)
    """Calibration prompts drawn from the calibration split."""
    buckets: int = Field(4, ge=1)
    """Token-length buckets the prompts are stratified over (between the prompt profile's min and max)."""
    decode_steps: int = Field(4, ge=0)
    """Decode-step feeds per prompt, with a real past, so decode activations are calibrated too."""
    near_duplicate_threshold: float = Field(0.8, gt=0, le=1)
    """Prompts whose MinHash Jaccard estimate reaches this are near duplicates; one is kept."""
    seed: int = 0
    """Seed of the draw."""


class TensorRTParams(_Section):
    workspace_mib: int = Field(4096, ge=64)
    """TensorRT's builder workspace in MiB."""
    optimization_level: int = Field(3, ge=0, le=5)
    """TensorRT's builder optimization level (0-5)."""
    timing_cache: str = ".kiln/tensorrt/timing.cache"
    """Timing cache reused across builds, relative to the project root."""


class BuildParams(_Section):
    backend: Literal["auto", "onnxruntime", "tensorrt", "torch-cuda"] = "auto"
    """`auto`: TensorRT where it runs, else torch-cuda where torch sees a GPU, else ONNX Runtime; or one of them by name."""
    profiles: ProfileParams = ProfileParams()
    """The shapes every engine accepts."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """torch-cuda: the share of the GPU's memory an engine may hold (weights, KV cache, activations); its cache holds as many of build.profiles.batch.max sequences as fit."""
    tensorrt: TensorRTParams = TensorRTParams()
    """TensorRT's builder settings."""


# ---------------------------------------------------------------- gates


class QualityLimits(_Section):
    min_top1_agreement: float = Field(ge=0, le=1)
    """Least share of positions where the engine's top token is the model's."""
    max_ppl_increase_pct: float = Field(ge=0)
    """Most the engine's perplexity may exceed the model's, in percent."""


def _budget_holds_first_look(params):
    if params.max_sequences < params.sequences:
        raise ValueError(f"max_sequences ({params.max_sequences}) must be at least sequences ({params.sequences})")
    return params


class QualityGateParams(_Section):
    sequences: int = Field(32, ge=1)
    """Eval-split sequences scored first; more (doubling) while an interval straddles a limit."""
    max_sequences: int = Field(128, ge=1)
    """The gate's budget: the most sequences it scores before an undecided verdict stays inconclusive."""
    max_minutes: float | None = Field(15.0, gt=0)
    """The gate's time budget: after its first sample it scores more only where, at its pace so far, they fit this many minutes (an undecided verdict then stays inconclusive, saying so); null: up to max_sequences whatever that takes."""
    sequence_length: int = Field(64, ge=2)
    """Tokens per scored sequence."""
    # Per precision: fp32 must match its reference; int8 may lose a little (TensorRT
    # deployments report < 2 % BLEU/ROUGE change for int8: we hold perplexity to that).
    limits: dict[Precision, QualityLimits] = {
        "fp32": QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=1.0),
        "fp16": QualityLimits(min_top1_agreement=0.98, max_ppl_increase_pct=1.5),
        # bf16 keeps 8 significant bits to fp16's 11: 8x the rounding, so more near-ties flip
        # (top-1 as int8's); unbiased rounding moves perplexity little (fp16's limit).
        "bf16": QualityLimits(min_top1_agreement=0.97, max_ppl_increase_pct=1.5),
        # FP8 weights and activations, each with its own scales: held to int8's limits.
        "fp8": QualityLimits(min_top1_agreement=0.97, max_ppl_increase_pct=2.0),
        "int8": QualityLimits(min_top1_agreement=0.97, max_ppl_increase_pct=2.0),
        "int4": QualityLimits(min_top1_agreement=0.93, max_ppl_increase_pct=3.0),
    }
    """Limits per precision."""

    _budget = model_validator(mode="after")(_budget_holds_first_look)


class TextLimits(_Section):
    """How far below the reference model's own scores the engine's text may fall, in percent."""

    max_rouge_l_drop_pct: float = Field(ge=0)
    """Most the engine's ROUGE-L may fall below the model's, in percent."""
    max_bleu_drop_pct: float = Field(ge=0)
    """Most the engine's BLEU may fall below the model's, in percent."""


class TextGateParams(_Section):
    """Greedy continuations of held-out prompts, by the engine and by the PyTorch model it
    came from, each scored against the held-out text that followed the prompt."""

    sequences: int = Field(128, ge=1)
    """Held-out prompts continued by both first; more (doubling) while an interval straddles a limit."""
    max_sequences: int = Field(512, ge=1)
    """The gate's budget: the most prompts it continues before an undecided verdict stays inconclusive."""
    max_minutes: float | None = Field(15.0, gt=0)
    """The gate's time budget: after its first prompts it continues more only where, at its pace so far, they fit this many minutes (an undecided verdict then stays inconclusive, saying so); null: up to max_sequences whatever that takes."""
    prompt_tokens: int = Field(16, ge=1)
    """Tokens of each prompt."""
    new_tokens: int = Field(32, ge=1)
    """Tokens each continuation generates."""
    limits: dict[Precision, TextLimits] = {
        "fp32": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "fp16": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "bf16": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "fp8": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "int8": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "int4": TextLimits(max_rouge_l_drop_pct=5.0, max_bleu_drop_pct=5.0),
    }
    """Limits per precision."""

    _budget = model_validator(mode="after")(_budget_holds_first_look)


class LatencyGateParams(_Section):
    prompt_tokens: int = Field(32, ge=1)
    """Prompt tokens of the timed generation."""
    new_tokens: int = Field(32, ge=1)
    """New tokens of the timed generation."""
    warmup: int = Field(2, ge=0)
    """Untimed generations first."""
    runs: int = Field(10, ge=2)
    """Timed generations."""
    max_p95_ms: float = Field(500.0, gt=0)
    """Most the p95 of a generation may take, in milliseconds (catches a broken build), unless `max_p95_over_floor` allows more."""
    max_p95_over_floor: float | None = Field(6.0, gt=1)
    """Or this many times the generation's read floor (the bytes each step reads at this machine's measured bandwidth), whichever is larger: the budget that scales with the model. null: max_p95_ms alone."""


class ServingScenario(_Section):
    """Clients sending requests back to back through the server's scheduler, each request
    `prompt_tokens` + `new_tokens`; the budgets are p95 / p99 limits in milliseconds."""

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    """The scenario's name in reports and tags."""
    clients: int = Field(ge=1, le=256)
    """Concurrent clients."""
    requests: int = Field(ge=1)
    """Requests each client sends, back to back."""
    prompt_tokens: int = Field(32, ge=1)
    """Prompt tokens per request."""
    new_tokens: int = Field(32, ge=1)
    """New tokens per request."""
    max_ttft_p95_ms: float = Field(gt=0)
    """Budget for the p95 time to first token, in milliseconds."""
    max_tpot_p95_ms: float = Field(gt=0)
    """Budget for the p95 time per output token, in milliseconds."""
    max_request_p99_ms: float = Field(gt=0)
    """Budget for the p99 of whole requests, in milliseconds (also the latency alert's threshold)."""
    max_over_floor: float | None = Field(6.0, gt=1)
    """Or each budget this many times its floor, whichever is larger: per output token, a step's read floor with `clients` rows (the bytes it reads at this machine's measured bandwidth); to first token, the prompt's first token measured unloaded, once per client that may queue ahead; a request, both. The budgets that scale with the model. null: the milliseconds alone."""


class ServingGateParams(_Section):
    # Like the latency gate's, these budgets catch a broken engine or scheduler, not a slow CPU.
    scenarios: list[ServingScenario] = [
        ServingScenario(name="single", clients=1, requests=8, max_ttft_p95_ms=100, max_tpot_p95_ms=20, max_request_p99_ms=500),
        ServingScenario(name="concurrent", clients=16, requests=2, max_ttft_p95_ms=1000, max_tpot_p95_ms=50, max_request_p99_ms=2000),
    ]
    """The load scenarios run through the server's scheduler, each with its budgets."""


class ChampionGateParams(_Section):
    """How much worse than the engine being served (`champion`) a new engine may be, each
    measured on this run's data in this run; in percent."""

    max_nll_increase_pct: float = Field(1.0, ge=0)
    """Most the new engine's NLL per character on the eval split may exceed the champion's, in percent."""
    max_rouge_l_drop_pct: float = Field(2.0, ge=0)
    """Most its text gate ROUGE-L may fall below the champion's, in percent."""
    max_p50_increase_pct: float = Field(25.0, ge=0)
    """Most its median generation latency may exceed the champion's, in percent."""


class GateParams(_Section):
    confidence: float = Field(0.95, gt=0.5, lt=1)
    """How sure a sampled gate must be: each measure's interval (paired bootstrap over the sequences) at this confidence over all the gate's looks decides passed, failed or inconclusive."""
    quality: QualityGateParams = QualityGateParams()
    """Next-token agreement and perplexity against the PyTorch model."""
    text: TextGateParams = TextGateParams()
    """ROUGE-L and BLEU of generated text against held-out text."""
    latency: LatencyGateParams = LatencyGateParams()
    """Generation latency as kiln serve runs the engine."""
    serving: ServingGateParams = ServingGateParams()
    """Latency through the server's scheduler under load."""
    champion: ChampionGateParams = ChampionGateParams()
    """The new engine against the one being served."""


# ---------------------------------------------------------------- registry / sample


MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"  # what MLflow and a URL path take without escaping


def model_name_for(model: ModelParams) -> str:
    """The registered name a model gets where params.yaml names none: a pretrained model's own
    (its directory's or hub id's last part), else `kiln-<family>`."""
    if model.pretrained is None:
        return f"kiln-{model.architecture.family}"
    last = Path(model.pretrained.rstrip("/")).name or "model"
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", last).lstrip("-_.")
    return name or "model"


class RegistryParams(_Section):
    tracking_uri: str | None = None
    """The MLflow tracking server or database; null: an embedded SQLite store under `mlruns/`."""
    model_name: str | None = Field(None, pattern=MODEL_NAME)
    """The registered model's name in MLflow, and the `model` clients name; null: the pretrained model's directory name (`Qwen2.5-0.5B-Instruct`), else `kiln-<family>` for a model trained from scratch."""
    experiment: str = "kiln"
    """The MLflow experiment runs are logged to."""
    signing_key: str | None = None
    """The private key engines are signed with (outside the project); null: `$KILN_SIGNING_KEY`, else `~/.config/kiln/signing-key.pem`."""
    trusted_keys: list[str] = []
    """Public keys (PEM, relative to the project) whose signatures are accepted; list two while keys rotate."""
    trust_own_key: bool = True
    """Also accept signatures of this machine's own signing key."""
    require_signature: bool = True
    """Refuse unsigned versions; false only while migrating a store (they then load with a warning)."""


class SampleParams(_Section):
    """The completion `kiln run` prints from the registered engine (seeded: reproducible)."""

    prompt: str = "The list type"
    """The prompt of the completion `kiln run` prints from the registered challenger."""
    max_tokens: int = Field(40, ge=1)
    """Tokens it generates."""
    temperature: float = Field(0.8, ge=0, allow_inf_nan=False)
    """Its sampling temperature (0: greedy)."""
    top_p: float = Field(0.95, gt=0, le=1)
    """Its nucleus sampling mass."""
    seed: int = Field(0, ge=0)
    """Its seed (the sample is reproducible)."""


class FleetParams(_Section):
    """`kiln fleet deploy`: `kiln serve` as replicas on a Ray cluster (Ray Serve), each node's
    proxy behind HAProxy."""

    address: str = "auto"
    """The Ray cluster (`ray start --head` prints it; `kiln fleet start` starts one here); auto: the one this machine belongs to."""
    replicas: int = Field(2, ge=1)
    """Replicas, each an engine process with its own scheduler, pulling and verifying the version on its node."""
    cpus_per_replica: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each replica (fractions work); the engine's threads are serving.threads."""
    max_replicas_per_node: int | None = Field(None, ge=1)
    """At most this many replicas on a node (1 spreads them: a node lost loses one); null: as Ray packs them."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Requests Ray hands one replica at once; Ray's default (5) would cap kiln's continuous batching."""
    port: int = Field(8200, ge=1, le=65535)
    """The port of each node's Ray Serve proxy (HAProxy's servers)."""
    haproxy_port: int = Field(8300, ge=1, le=65535)
    """The port the generated HAProxy configuration listens on for clients."""


class ServingParams(_Section):
    """`kiln serve`: which alias it follows and how it treats clients. Secrets never live
    here: the bearer token and the webhook secret come from KILN_API_KEY and
    KILN_WEBHOOK_SECRET."""

    alias: str = Field("champion", pattern=r"^[A-Za-z0-9_\-]+$")
    """The alias `kiln serve` serves and follows."""
    host: str = "127.0.0.1"
    """The address it binds."""
    port: int = Field(8000, ge=1, le=65535)
    """The port it listens on."""
    poll_interval_s: float = Field(10.0, ge=0)
    """How often it re-reads the alias, in seconds; 0: only when a webhook arrives."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens a request may generate (the engine's context may allow fewer)."""
    max_waiting: int = Field(64, ge=1)
    """Sequences that may wait beyond the running batch; more are answered 503 with Retry-After."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body; larger is 413."""
    keep_versions: int = Field(3, ge=1)
    """Pulled versions kept in the serving cache (`.kiln/serving`)."""
    webhook_max_age_s: float = Field(300.0, gt=0)
    """Webhook deliveries older than this are refused (replays)."""
    # One by default: the HTTP side needs a core too (docs/performance.md, "Measured choices
    # in the code").
    threads: int | None = Field(1, ge=1)
    """ONNX Runtime intra-op threads of the engine process; null: all cores (the HTTP side needs one too)."""
    max_n: int = Field(8, ge=1)
    """Most choices per prompt (OpenAI's `n`)."""
    chat_template: str | None = None
    """A jinja chat template for versions whose model has none; null: chat completions answer those with 400."""
    prefix_cache_mib: int = Field(1024, ge=0)
    """Memory the engine process may keep prompts' KV caches in, so that a prompt beginning with one seen before (a conversation's next turn, a shared system prompt) prefills only the rest (ONNX Runtime: host memory; torch-cuda: the device's, at most half what is free); 0: no prefix cache."""
    tool_format: Literal["hermes", "llama3_json", "mistral"] | None = None
    """The tool-call format of a chat template that writes none kiln recognises (Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`); null: tools on such a version are a 400."""
    fleet: FleetParams = FleetParams()
    """Replicas on a Ray cluster (`kiln fleet`)."""


class CanaryParams(_Section):
    """`kiln promote --canary`: a version through traffic steps on the fleet, each checked
    against live Prometheus (Flagger's analysis, with its field names)."""

    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$")
    """How long each step is held before its check (Flagger's `interval`)."""
    threshold: int = Field(2, ge=1)
    """Failed checks before the canary is rolled back."""
    stepWeight: int = Field(10, ge=1, le=100)  # noqa: N815 (Flagger's name)
    """The canary's share grows by this many percent a step."""
    maxWeight: int = Field(50, ge=1, le=100)  # noqa: N815
    """The last step's share; after it passes, the version becomes champion (all traffic)."""
    stepWeights: list[int] | None = None  # noqa: N815
    """Explicit shares instead of stepWeight/maxWeight, e.g. [10, 25, 50]."""
    min_success_rate: float = Field(99.0, ge=0, le=100)
    """Percent of the canary's requests that must not fail (5xx, refused busy)."""
    max_p99_ms: float = Field(5000.0, gt=0)
    """Budget for the canary's p99 request duration."""
    max_p99_ratio: float = Field(1.2, gt=0)
    """The canary's p99 may be at most this times the stable version's over the same interval."""
    replicas: int = Field(1, ge=1)
    """Replicas of the canary version while it is on trial."""
    prometheus_url: str = "http://127.0.0.1:9090"
    """The Prometheus that scrapes the fleet (`kiln fleet deploy` writes its scrape configuration)."""

    @property
    def weights(self) -> tuple[int, ...]:
        if self.stepWeights:
            return tuple(self.stepWeights)
        return tuple(range(self.stepWeight, self.maxWeight, self.stepWeight)) + (self.maxWeight,)

    @property
    def interval_s(self) -> float:
        number, unit = float(self.interval.rstrip("mshd")), self.interval.lstrip("0123456789")
        return number * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


PROMETHEUS_DURATION = r"^[0-9]+(ms|s|m|h|d)$"  # one unit: what a rule's `for` and a scrape interval take


class MonitoringParams(_Section):
    """What `kiln monitoring` writes and `kiln up --monitoring` runs: how long a latency
    budget (gates.serving's) stays broken before its alert fires, and Prometheus's
    scrape and rule-evaluation interval."""

    latency_alert_after: str = Field("10m", pattern=PROMETHEUS_DURATION)
    """How long a latency budget stays broken before its alert fires (a Prometheus duration)."""
    scrape_interval: str = Field("5s", pattern=PROMETHEUS_DURATION)
    """Prometheus's scrape and rule-evaluation interval (`kiln up --monitoring`)."""


class TriggerParams(_Section):
    """`kiln deploy`: what starts a retrain-and-rebuild by itself, and how triggers that
    arrive while one runs are treated."""

    schedule: str | None = None
    """A cron schedule for rebuilds (e.g. `0 3 * * *`); null: none."""
    timezone: str = "UTC"
    """The schedule's IANA time zone."""
    on_data_change: bool = True
    """Rebuild when the data changes (`kiln data add`, or data.dvc moved)."""
    on_promotion: bool = True
    """Verify a version when an alias is set in MLflow (verify-promotion)."""
    verify_aliases: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]+$")]] = ["champion"]
    """The aliases whose moves start verify-promotion."""
    data_poll_interval_s: float = Field(10.0, ge=0)
    """How often data.dvc is compared with the last run's data version, in seconds; 0: never."""
    overlap: Literal["queue-one", "drop"] = "queue-one"
    """Triggers during a rebuild: `queue-one` queues one more run (later triggers join it), `drop` drops them."""
    webhook_host: str = "127.0.0.1"
    """Where `kiln deploy` receives MLflow's alias webhooks."""
    webhook_port: int = Field(8100, ge=1, le=65535)
    """Its port."""

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, timezone: str) -> str:
        try:
            ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{timezone!r} is not an IANA time zone (e.g. UTC, Europe/Berlin)") from None
        return timezone

    @field_validator("schedule")
    @classmethod
    def _cron(cls, schedule: str | None) -> str | None:
        if schedule is not None:
            try:
                CronSim(schedule, datetime.now())  # the cron parser Prefect's schedules use
            except CronSimError as err:
                raise ValueError(f"{schedule!r} is not a cron expression ({err}); e.g. \"0 3 * * *\" is daily at 03:00") from None
        return schedule


class BuildTarget(_Section):
    """What one kind of machine builds: its backend and precisions (a row of the build matrix)."""

    backend: Literal["onnxruntime", "tensorrt", "torch-cuda"] = "onnxruntime"
    """The backend this kind of machine builds with."""
    precisions: list[Precision] = Field(min_length=1)
    """The precisions it builds."""


class PoolParams(_Section):
    """`kiln deploy --pool`: the deployments on a Prefect process work pool, and one worker
    (`kiln worker TARGET`) per build target, on machines that share the project folder and
    an MLflow server (PostgreSQL store, shared artifacts): docs/automation.md, "Beyond one machine"."""

    name: str = Field("kiln", pattern=r"^[A-Za-z0-9_\-]+$")
    """The Prefect work pool's name."""
    targets: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9\-]*$")], BuildTarget] = Field(
        default_factory=lambda: {"cpu": BuildTarget(precisions=["fp32", "int8"])}, min_length=1
    )
    """The build matrix: one `kiln worker TARGET` per kind of machine."""

    @field_validator("targets")
    @classmethod
    def _not_the_control_queue(cls, targets: dict[str, BuildTarget]) -> dict[str, BuildTarget]:
        if CONTROL_QUEUE in targets:
            raise ValueError(f"{CONTROL_QUEUE!r} names the queue every worker takes rebuilds and verifications from; choose another target name")
        return targets


CONTROL_QUEUE = "control"  # the work queue of rebuild, request-rebuild and verify-promotion


class Params(_Section):
    data: DataParams = DataParams()
    """The corpus and its versioned splits."""
    model: ModelParams = ModelParams()
    """The model: trained from scratch or pretrained."""
    export: ExportParams = ExportParams()
    """The ONNX export."""
    calibration: CalibrationParams = CalibrationParams()
    """The curated int8 calibration set."""
    precision: PrecisionParams = PrecisionParams()
    """The precisions built and how."""
    build: BuildParams = BuildParams()
    """The engine build: backend and shapes."""
    gates: GateParams = GateParams()
    """What an engine must pass before it may be aliased."""
    registry: RegistryParams = RegistryParams()
    """The MLflow registry and engine signing."""
    sample: SampleParams = SampleParams()
    """The sample completion a run prints."""
    serving: ServingParams = ServingParams()
    """`kiln serve`."""
    canary: CanaryParams = CanaryParams()
    """`kiln promote --canary`: a version through traffic steps on the fleet."""
    triggers: TriggerParams = TriggerParams()
    """`kiln deploy`: what starts a rebuild by itself."""
    pool: PoolParams = PoolParams()
    """`kiln deploy --pool`: builds spread over machines."""
    monitoring: MonitoringParams = MonitoringParams()
    """The alerting rules and `kiln up --monitoring`'s Prometheus."""

    @model_validator(mode="after")
    def _named(self) -> Params:
        """registry.model_name, from the model where params.yaml names none: every verb that
        reads these params (run, serve, promote) then names the same registered model."""
        if self.registry.model_name is None:  # frozen: set once, here, as validation ends
            # Unset as far as fields_set tells, `model_name: null` too: `kiln build --model DIR` names it after DIR.
            unnamed = set(self.registry.model_fields_set) - {"model_name"}
            named = RegistryParams.model_construct(_fields_set=unnamed, **(dict(self.registry) | {"model_name": model_name_for(self.model)}))
            object.__setattr__(self, "registry", named)
        return self

    @model_validator(mode="after")
    def _context_of_the_model(self) -> Params:
        """build.profiles.context.max, where params.yaml sets none, is the context of the model
        trained from scratch (a pretrained model's is read from its directory: components.model_fit)."""
        profiles = self.build.profiles
        if self.model.pretrained is None and "context" not in profiles.model_fields_set:
            positions = self.model.architecture.n_positions
            context = ShapeRange(min=min(profiles.context.min, positions), opt=min(profiles.context.opt, positions), max=positions)
            # Still unset as far as fields_set tells: `kiln build --model DIR` fits it to DIR.
            derived = ProfileParams.model_construct(_fields_set=set(profiles.model_fields_set), **(dict(profiles) | {"context": context}))
            object.__setattr__(self, "build", self.build.model_copy(update={"profiles": derived}))  # frozen: set once, as validation ends
        return self

    @model_validator(mode="after")
    def _shapes_fit(self) -> Params:
        """What can be known before any work: every length the pipeline will ask of an engine
        fits its profiles (the profiles against the model: once the model is known)."""
        problems = shape_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _backends_build_their_precisions(self) -> Params:
        """torch-cuda has no int8 or int4 form, TensorRT no int4, only torch-cuda has bf16: say
        so before any work, not at the build stage."""
        asked = [("build.backend", self.build.backend, "precision.build", self.precision.build)]
        asked += [(f"pool.targets.{name}.backend", t.backend, f"pool.targets.{name}.precisions", t.precisions) for name, t in self.pool.targets.items()]
        for backend_key, backend, precisions_key, precisions in asked:
            other = [p for p in precisions if p not in TORCH_CUDA_PRECISIONS]
            if backend == "torch-cuda" and other:
                raise ValueError(f"{backend_key} torch-cuda builds {', '.join(TORCH_CUDA_PRECISIONS)}; {precisions_key} has {', '.join(other)} (auto builds {', '.join(other)} on ONNX Runtime)")
            torch_only = [p for p in precisions if p in TORCH_CUDA_ONLY_PRECISIONS]
            if backend in NOT_TORCH_CUDA and torch_only:
                raise ValueError(f"{backend_key} {backend} cannot build {', '.join(torch_only)} ({precisions_key}): {NOT_TORCH_CUDA[backend]} (torch-cuda builds it, and auto on a CUDA GPU)")
            not_trt = [p for p in precisions if p in NOT_TENSORRT_PRECISIONS or (p == "int8" and self.precision.int8.scheme == "blocks")]
            if backend == "tensorrt" and not_trt:
                qdq = "; TensorRT builds int8 from Q/DQ: precision.int8.scheme qdq or auto" if "int8" in not_trt else ""
                raise ValueError(f"{backend_key} tensorrt cannot build {', '.join(not_trt)} ({precisions_key}): those engines run ONNX Runtime's MatMulNBits or torch-cuda's 4-bit kernel (auto builds them){qdq}")
        return self

    def digest(self) -> str:
        """sha256 of the canonical JSON of every parameter (the `params_sha256` tag)."""
        return section_digest(self)


def shape_problems(params: Params) -> list[str]:
    """What the pipeline asks of an engine that does not fit its profiles. The profiles
    against the model's context: `scratch_model_problems` for the model trained from
    scratch, components.model_fit for a model directory."""
    profiles, latency, quality = params.build.profiles, params.gates.latency, params.gates.quality
    context = profiles.context.max
    checks = [
        (profiles.prompt.max < context, f"build.profiles.prompt.max ({profiles.prompt.max}) must be below build.profiles.context.max ({context}) so a longest prompt can still generate"),
        (quality.sequence_length <= profiles.prompt.max, f"gates.quality.sequence_length ({quality.sequence_length}) exceeds build.profiles.prompt.max ({profiles.prompt.max})"),
        (latency.prompt_tokens <= profiles.prompt.max, f"gates.latency.prompt_tokens ({latency.prompt_tokens}) exceeds build.profiles.prompt.max ({profiles.prompt.max})"),
        (latency.prompt_tokens + latency.new_tokens <= context, f"gates.latency.prompt_tokens + new_tokens ({latency.prompt_tokens + latency.new_tokens}) exceeds build.profiles.context.max ({context})"),
        (params.sample.max_tokens < context, f"sample.max_tokens ({params.sample.max_tokens}) leaves no room for a prompt in build.profiles.context.max ({context})"),
    ]
    for s in params.gates.serving.scenarios:
        checks.append((s.prompt_tokens <= profiles.prompt.max, f"gates.serving scenario {s.name}: prompt_tokens ({s.prompt_tokens}) exceeds build.profiles.prompt.max ({profiles.prompt.max})"))
        checks.append((s.prompt_tokens + s.new_tokens <= context, f"gates.serving scenario {s.name}: prompt_tokens + new_tokens ({s.prompt_tokens + s.new_tokens}) exceeds build.profiles.context.max ({context})"))
    return [message for ok, message in checks if not ok]


def scratch_model_problems(params: Params) -> list[str]:
    """The profiles against the context of the model trained from scratch: checked where a
    run trains one (`kiln build --model DIR` builds another, whatever the architecture says)."""
    context, n_positions = params.build.profiles.context.max, params.model.architecture.n_positions
    if params.model.pretrained is None and context > n_positions:
        return [f"build.profiles.context.max ({context}) is longer than the model's context, model.architecture.n_positions ({n_positions})"]
    return []


def section_digest(section: BaseModel) -> str:
    """sha256 of a section's canonical JSON: the cache key of the stages it drives."""
    canonical = json.dumps(section.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_params(path: Path) -> Params:
    """Read and validate params.yaml; every problem is a ConfigError naming file and key."""
    if not path.is_file():
        raise ConfigError(f"params file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}".replace("\n", " ")) from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, found {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {_describe(err)}") from err


def _describe(err: ValidationError) -> str:
    return "; ".join(_describe_one(e) for e in err.errors())


def _describe_one(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    if not where:  # a check across sections: its message names the keys
        return str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "value_error":  # a check of ours: its message names the value
        return f"{where}: {str(error['msg']).removeprefix('Value error, ')}"
    return f"{where}: {error['msg']} (got {error.get('input')!r})"
