"""Typed configuration: params.yaml is read once, at the entry point, into `Params`.

Every section forbids unknown keys, so a typo in params.yaml is an error that names the
key instead of a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from cronsim import CronSim, CronSimError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- data sources


class CPythonDocsSource(_Section):
    """The default corpus: CPython's bundled pydoc topics and stdlib docstrings (offline),
    and text files of your own matched by `glob` (`kiln data add` writes them there; none
    at first, so the default data is the docs alone)."""

    kind: Literal["cpython-docs"] = "cpython-docs"
    glob: str | None = "corpus/**/*.txt"


class TextFilesSource(_Section):
    """Local text files matched by a glob, relative to the project root."""

    kind: Literal["text-files"]
    glob: str


class HFDatasetSource(_Section):
    """A Hugging Face dataset (local path or hub id where the hub is reachable)."""

    kind: Literal["hf-dataset"]
    name: str
    split: str = "train"
    text_field: str = "text"


CorpusSource = Annotated[
    CPythonDocsSource | TextFilesSource | HFDatasetSource, Field(discriminator="kind")
]


class SplitParams(_Section):
    eval_fraction: float = Field(0.05, gt=0, lt=0.5)
    calibration_fraction: float = Field(0.05, gt=0, lt=0.5)


class DataParams(_Section):
    source: CorpusSource = CPythonDocsSource()
    path: str = "data"
    min_chars: int = Field(64, ge=1)
    max_chars: int = Field(4000, ge=16)
    split: SplitParams = SplitParams()
    dvc_push: bool = True


# ---------------------------------------------------------------- model


class TokenizerParams(_Section):
    vocab_size: int = Field(4096, ge=300)
    min_frequency: int = Field(2, ge=1)


class ArchitectureParams(_Section):
    """The model trained from scratch: a GPT-2, or a Llama (RMSNorm, SwiGLU, rotary
    positions, grouped-query attention, tied embeddings as small Llamas have)."""

    family: Literal["gpt2", "llama"] = "gpt2"
    n_layer: int = Field(2, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=8)
    n_positions: int = Field(256, ge=16)
    # Llama only. None: as many KV heads as heads; an MLP of 8/3 n_embd (GPT-2's 4 n_embd
    # in parameters, SwiGLU having three matrices); rope_theta 10000.
    n_kv_heads: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(None, ge=8)
    rope_theta: float | None = Field(None, gt=0)

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
    batch_size: int = Field(16, ge=1)
    block_size: int = Field(128, ge=8)
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    eval_batches: int = Field(20, ge=1)
    seed: int = 0
    threads: int | None = Field(None, ge=1)


class ModelParams(_Section):
    # None: train a tokenizer and a model of `architecture.family` from scratch. A path or
    # hub id: start from that model (any family kiln builds); with training.steps > 0 it is
    # fine-tuned, with 0 it is used as is.
    pretrained: str | None = None
    tokenizer: TokenizerParams = TokenizerParams()
    architecture: ArchitectureParams = ArchitectureParams()
    training: TrainingParams = TrainingParams()


# ---------------------------------------------------------------- export / build


class ExportParams(_Section):
    opset: int = Field(18, ge=17)
    parity_tolerance: float = Field(1e-4, gt=0)


class ShapeRange(_Section):
    """min / opt / max of one dynamic dimension in an optimization profile."""

    min: int = Field(ge=0)
    opt: int = Field(ge=0)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class ProfileParams(_Section):
    # max: the most sequences `kiln serve` decodes together (its continuous batch).
    batch: ShapeRange = ShapeRange(min=1, opt=1, max=16)
    prompt: ShapeRange = ShapeRange(min=1, opt=32, max=128)
    # Total context (past + new tokens) in the generation phase.
    context: ShapeRange = ShapeRange(min=2, opt=64, max=256)


Precision = Literal["fp32", "fp16", "int8", "int4"]
TORCH_CUDA_PRECISIONS = ("fp32", "fp16")  # what the torch-cuda backend builds (no int8 program)
ORT_ONLY_PRECISIONS = ("int4",)  # graphs of ONNX Runtime's own operators (MatMulNBits)


class KeepFloatParams(_Section):
    """Nodes left in float when the rest of the graph is quantized."""

    op_types: list[str] = ["LayerNormalization", "Softmax"]
    name_patterns: list[str] = []  # regular expressions matched against node names
    attention_scores: bool = True  # the activation × activation MatMuls (Q·Kᵀ, attn·V)
    # A SwiGLU MLP's down projection (Llama, Qwen2, Mistral): its input, silu(gate)·up, has
    # outliers that one int8 scale per tensor clips (the default-size Llama's top-1
    # agreement 0.957 with it quantized, 0.971 float; perplexity +0.32 % vs -0.01 %).
    swiglu_down: bool = True


class Int8Params(_Section):
    # The linear layers hold the weights (and the time); quantizing residual Adds, embedding
    # Gathers or reshapes costs quality and buys no int8 kernel.
    op_types: list[str] = ["MatMul", "Gemm"]
    calibration_method: Literal["minmax", "entropy", "percentile"] = "percentile"
    per_channel: bool = True
    # 7-bit weights. x86 CPUs without VNNI (AVX2 only) multiply int8 with VPMADDUBSW, whose
    # pairwise int16 sums saturate on full-range weights: the same engine computed a
    # different model there (the default int8 engine's top-1 agreement 0.98 → 0.95, BLEU
    # down 26 %). With weights in ±64 no sum can saturate (ONNX Runtime's quantization docs
    # name this remedy): the default engine's logits came out bit-identical on an AVX2-only
    # EPYC and an AVX-512-VNNI Xeon, where full-range weights differed by up to 2.0.
    reduce_range: bool = True
    keep_float: KeepFloatParams = KeepFloatParams()


class Int4Params(_Section):
    """Weight-only 4-bit blocks (ONNX Runtime's MatMulNBits) for every linear layer with a
    constant weight: at batch 1 a token's time is reading the weights, and 4 bits read half
    of int8's bytes. Activations stay float; nothing is calibrated."""

    block_size: int = Field(32, ge=16, le=256)  # weights per scale, along the input dimension
    symmetric: bool = True  # False: a zero point per block too
    # MatMulNBits' arithmetic: 4 quantizes the activations to int8 per block and multiplies
    # with int8 kernels (VNNI where the CPU has it); 0 dequantizes the weights to float.
    accuracy_level: Literal[0, 1, 2, 3, 4] = 4
    # The LM head (the tied embedding's transpose, GPT-2's largest matrix): float it read 154
    # of GPT-2-small's 243 MB a token. 8-bit blocks keep its logits close; 4 bits measured no
    # faster on 2 cores (the step is not only reads there). llama.cpp keeps it above 4 bits too.
    lm_head_bits: Literal[4, 8] | None = 8

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, block_size: int) -> int:
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two (MatMulNBits' blocks), not {block_size}")
        return block_size


class Fp16Params(_Section):
    # RMSNormalization (Llama's norm) is an ONNX op from opset 23 only; below it the export
    # decomposes it, and the precision stage finds the decomposition (x², mean, rsqrt).
    keep_fp32_op_types: list[str] = ["LayerNormalization", "RMSNormalization", "Softmax"]


class PrecisionParams(_Section):
    build: list[Precision] = Field(default_factory=lambda: ["fp32", "int8"], min_length=1)
    int8: Int8Params = Int8Params()
    int4: Int4Params = Int4Params()
    fp16: Fp16Params = Fp16Params()


class CalibrationParams(_Section):
    samples: int = Field(128, ge=1)
    buckets: int = Field(4, ge=1)
    decode_steps: int = Field(4, ge=0)  # decode-step feeds with a real past, per prompt
    near_duplicate_threshold: float = Field(0.8, gt=0, le=1)  # MinHash Jaccard estimate
    seed: int = 0


class TensorRTParams(_Section):
    workspace_mib: int = Field(4096, ge=64)
    optimization_level: int = Field(3, ge=0, le=5)
    timing_cache: str = ".kiln/tensorrt/timing.cache"  # reused across builds; relative to the project root


class BuildParams(_Section):
    # auto: TensorRT where it imports and an NVIDIA GPU is present; else torch-cuda (fp32 and
    # fp16) where torch sees a CUDA GPU; else ONNX Runtime (components.build.resolve_backend).
    backend: Literal["auto", "onnxruntime", "tensorrt", "torch-cuda"] = "auto"
    profiles: ProfileParams = ProfileParams()
    tensorrt: TensorRTParams = TensorRTParams()


# ---------------------------------------------------------------- gates


class QualityLimits(_Section):
    min_top1_agreement: float = Field(ge=0, le=1)
    max_ppl_increase_pct: float = Field(ge=0)


class QualityGateParams(_Section):
    sequences: int = Field(32, ge=1)
    sequence_length: int = Field(64, ge=2)
    # Per precision: fp32 must match its reference; int8 may lose a little (TensorRT
    # deployments report < 2 % BLEU/ROUGE change for int8: we hold perplexity to that).
    limits: dict[Precision, QualityLimits] = {
        "fp32": QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=1.0),
        "fp16": QualityLimits(min_top1_agreement=0.98, max_ppl_increase_pct=1.5),
        "int8": QualityLimits(min_top1_agreement=0.97, max_ppl_increase_pct=2.0),
        "int4": QualityLimits(min_top1_agreement=0.93, max_ppl_increase_pct=3.0),
    }


class TextLimits(_Section):
    """How far below the reference model's own scores the engine's text may fall, in percent."""

    max_rouge_l_drop_pct: float = Field(ge=0)
    max_bleu_drop_pct: float = Field(ge=0)


class TextGateParams(_Section):
    """Greedy continuations of held-out prompts, by the engine and by the PyTorch model it
    came from, each scored against the held-out text that followed the prompt."""

    # Half of an int8 engine's continuations part from the model's somewhere, so the drop is
    # noisy: its bootstrap spread is ~1.7 points over 256 of them and ~1.1 over 512 (all
    # the default eval split holds), against a 2 % limit (docs/performance.md).
    sequences: int = Field(512, ge=1)
    prompt_tokens: int = Field(16, ge=1)
    new_tokens: int = Field(32, ge=1)
    limits: dict[Precision, TextLimits] = {
        "fp32": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "fp16": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "int8": TextLimits(max_rouge_l_drop_pct=2.0, max_bleu_drop_pct=2.0),
        "int4": TextLimits(max_rouge_l_drop_pct=5.0, max_bleu_drop_pct=5.0),
    }


class LatencyGateParams(_Section):
    prompt_tokens: int = Field(32, ge=1)
    new_tokens: int = Field(32, ge=1)
    warmup: int = Field(2, ge=0)
    runs: int = Field(10, ge=2)
    max_p95_ms: float = Field(500.0, gt=0)  # the default model takes ~10 ms; this catches a broken build


class ServingScenario(_Section):
    """Clients sending requests back to back through the server's scheduler, each request
    `prompt_tokens` + `new_tokens`; the budgets are p95 / p99 limits in milliseconds."""

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    clients: int = Field(ge=1, le=256)
    requests: int = Field(ge=1)  # per client
    prompt_tokens: int = Field(32, ge=1)
    new_tokens: int = Field(32, ge=1)
    max_ttft_p95_ms: float = Field(gt=0)
    max_tpot_p95_ms: float = Field(gt=0)
    max_request_p99_ms: float = Field(gt=0)


class ServingGateParams(_Section):
    # The default model answers a lone 32+32 request in ~10 ms and 16 at once in ~70 ms on 2
    # cores: like the latency gate's, these budgets catch a broken engine or scheduler.
    scenarios: list[ServingScenario] = [
        ServingScenario(name="single", clients=1, requests=8, max_ttft_p95_ms=100, max_tpot_p95_ms=20, max_request_p99_ms=500),
        ServingScenario(name="concurrent", clients=16, requests=2, max_ttft_p95_ms=1000, max_tpot_p95_ms=50, max_request_p99_ms=2000),
    ]


class ChampionGateParams(_Section):
    """How much worse than the engine being served (`champion`) a new engine may be, each
    measured on this run's data in this run; in percent."""

    max_nll_increase_pct: float = Field(1.0, ge=0)  # NLL per character on the eval split
    max_rouge_l_drop_pct: float = Field(2.0, ge=0)  # the text gate's ROUGE-L against held-out text
    max_p50_increase_pct: float = Field(25.0, ge=0)  # the latency gate's generation, timed turn by turn


class GateParams(_Section):
    quality: QualityGateParams = QualityGateParams()
    text: TextGateParams = TextGateParams()
    latency: LatencyGateParams = LatencyGateParams()
    serving: ServingGateParams = ServingGateParams()
    champion: ChampionGateParams = ChampionGateParams()


# ---------------------------------------------------------------- registry / sample


class RegistryParams(_Section):
    # None: an embedded SQLite store and local artifacts under mlruns/ in the project.
    tracking_uri: str | None = None
    model_name: str = Field("kiln-gpt2", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    experiment: str = "kiln"
    # The private key engines are signed with, outside the project and the registry; None:
    # $KILN_SIGNING_KEY, else ~/.config/kiln/signing-key.pem (`kiln keys init` makes it).
    signing_key: str | None = None
    # Public keys (PEM files, relative to the project) whose signatures are accepted; more
    # than one while keys rotate. With trust_own_key, also the signing key's own public half.
    trusted_keys: list[str] = []
    trust_own_key: bool = True
    # False only to migrate: unsigned versions then load with a warning; signed ones are
    # still verified.
    require_signature: bool = True


class SampleParams(_Section):
    """The completion `kiln run` prints from the registered engine (seeded: reproducible)."""

    prompt: str = "The list type"
    max_tokens: int = Field(40, ge=1)
    temperature: float = Field(0.8, ge=0, allow_inf_nan=False)
    top_p: float = Field(0.95, gt=0, le=1)
    seed: int = Field(0, ge=0)


class ServingParams(_Section):
    """`kiln serve`: which alias it follows and how it treats clients. Secrets never live
    here: the bearer token and the webhook secret come from KILN_API_KEY and
    KILN_WEBHOOK_SECRET."""

    alias: str = Field("champion", pattern=r"^[A-Za-z0-9_\-]+$")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    poll_interval_s: float = Field(10.0, ge=0)  # 0: follow the alias through webhooks only
    max_tokens: int = Field(256, ge=1)  # per request; the engine's profile may allow fewer
    max_waiting: int = Field(64, ge=1)  # queued sequences beyond the running batch; then 503
    max_body_bytes: int = Field(1 << 20, ge=1024)
    keep_versions: int = Field(3, ge=1)  # pulled versions kept in .kiln/serving
    webhook_max_age_s: float = Field(300.0, gt=0)
    # ONNX Runtime intra-op threads; None: all cores. One is the default because the HTTP
    # side needs a core too: on 2 cores, 16 clients got 7.1k tokens/s with 1, 4.6k-5.8k with 2.
    threads: int | None = Field(1, ge=1)
    max_n: int = Field(8, ge=1)  # choices a prompt (OpenAI's `n`); each is a sequence in the batch
    # A jinja chat template for versions whose model has none (one that has its own renders
    # with that, as it was built); None: /v1/chat/completions answers those with 400.
    chat_template: str | None = None


PROMETHEUS_DURATION = r"^[0-9]+(ms|s|m|h|d)$"  # one unit: what a rule's `for` and a scrape interval take


class MonitoringParams(_Section):
    """What `kiln monitoring` writes and `kiln up --monitoring` runs: how long a latency
    budget (gates.serving's) stays broken before its alert fires, and Prometheus's
    scrape and rule-evaluation interval."""

    latency_alert_after: str = Field("10m", pattern=PROMETHEUS_DURATION)  # e.g. 30s, 10m, 1h
    scrape_interval: str = Field("5s", pattern=PROMETHEUS_DURATION)


class TriggerParams(_Section):
    """`kiln deploy`: what starts a retrain-and-rebuild by itself, and how triggers that
    arrive while one runs are treated."""

    schedule: str | None = None  # cron, e.g. "0 3 * * *" (daily at 03:00); null: no schedule
    timezone: str = "UTC"
    on_data_change: bool = True  # `kiln data add`, and data.dvc moved behind kiln's back
    on_promotion: bool = True  # an alias set in MLflow → the verify-promotion flow
    verify_aliases: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]+$")]] = ["champion"]
    data_poll_interval_s: float = Field(10.0, ge=0)  # how often data.dvc is compared; 0: never
    # One rebuild runs at a time. "queue-one": a trigger during a run queues one more (later
    # triggers join it: it will see their data); "drop": triggers during a run are dropped.
    overlap: Literal["queue-one", "drop"] = "queue-one"
    webhook_host: str = "127.0.0.1"  # where `kiln deploy` receives MLflow's alias webhooks
    webhook_port: int = Field(8100, ge=1, le=65535)

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
    precisions: list[Precision] = Field(min_length=1)


class PoolParams(_Section):
    """`kiln deploy --pool`: the deployments on a Prefect process work pool, and one worker
    (`kiln worker TARGET`) per build target, on machines that share the project folder and
    an MLflow server (PostgreSQL store, shared artifacts): docs/automation.md, "Beyond one machine"."""

    name: str = Field("kiln", pattern=r"^[A-Za-z0-9_\-]+$")
    targets: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9\-]*$")], BuildTarget] = Field(
        default_factory=lambda: {"cpu": BuildTarget(precisions=["fp32", "int8"])}, min_length=1
    )

    @field_validator("targets")
    @classmethod
    def _not_the_control_queue(cls, targets: dict[str, BuildTarget]) -> dict[str, BuildTarget]:
        if CONTROL_QUEUE in targets:
            raise ValueError(f"{CONTROL_QUEUE!r} names the queue every worker takes rebuilds and verifications from; choose another target name")
        return targets


CONTROL_QUEUE = "control"  # the work queue of rebuild, request-rebuild and verify-promotion


class Params(_Section):
    data: DataParams = DataParams()
    model: ModelParams = ModelParams()
    export: ExportParams = ExportParams()
    calibration: CalibrationParams = CalibrationParams()
    precision: PrecisionParams = PrecisionParams()
    build: BuildParams = BuildParams()
    gates: GateParams = GateParams()
    registry: RegistryParams = RegistryParams()
    sample: SampleParams = SampleParams()
    serving: ServingParams = ServingParams()
    triggers: TriggerParams = TriggerParams()
    pool: PoolParams = PoolParams()
    monitoring: MonitoringParams = MonitoringParams()

    @model_validator(mode="after")
    def _shapes_fit(self) -> Params:
        """What can be known before any work: every length the pipeline will ask of an engine
        fits its profiles, and the profiles fit the model's context (for a model trained
        here; a pretrained model's context is checked once it is loaded)."""
        problems = shape_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _backends_build_their_precisions(self) -> Params:
        """torch-cuda has no int8 or int4 form, TensorRT no int4: say so before any work, not at
        the build stage."""
        asked = [("build.backend", self.build.backend, "precision.build", self.precision.build)]
        asked += [(f"pool.targets.{name}.backend", t.backend, f"pool.targets.{name}.precisions", t.precisions) for name, t in self.pool.targets.items()]
        for backend_key, backend, precisions_key, precisions in asked:
            other = [p for p in precisions if p not in TORCH_CUDA_PRECISIONS]
            if backend == "torch-cuda" and other:
                raise ValueError(f"{backend_key} torch-cuda builds {' and '.join(TORCH_CUDA_PRECISIONS)}; {precisions_key} has {', '.join(other)} (auto builds {', '.join(other)} on ONNX Runtime)")
            ort_only = [p for p in precisions if p in ORT_ONLY_PRECISIONS]
            if backend == "tensorrt" and ort_only:
                raise ValueError(f"{backend_key} tensorrt cannot build {', '.join(ort_only)} ({precisions_key}): those engines run ONNX Runtime's MatMulNBits (auto builds them on ONNX Runtime)")
        return self

    def digest(self) -> str:
        """sha256 of the canonical JSON of every parameter (the `params_sha256` tag)."""
        return section_digest(self)


def shape_problems(params: Params) -> list[str]:
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
    if params.model.pretrained is None:
        n_positions = params.model.architecture.n_positions
        checks.append((context <= n_positions, f"build.profiles.context.max ({context}) is longer than the model's context, model.architecture.n_positions ({n_positions})"))
    return [message for ok, message in checks if not ok]


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
