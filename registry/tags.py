"""The tags kiln writes in MLflow, of three kinds, each a section below: version tags, on
each registered version (what the engine is, where it came from, how its gates went, who
forced or verified it); registered-model tags, on the registered model (each recorded move
of an alias); and run tags, on MLflow runs (who is registering, which run trained the model).
They show on a version's page in the MLflow UI and in `kiln lineage VERSION`, and they are
what kiln itself reads back: a version without `gates.passed: true` is never aliased or
served, and a download whose engine file does not match `engine_sha256` is refused.

Every module of kiln names a tag through this module, never as a string of its own, so
that a tag cannot be written under one spelling and read under another.
"""

from __future__ import annotations

# ---------------------------------------------------------------- version tags: the engine's identity

ENGINE_SHA256 = "engine_sha256"  # sha256 of the engine file; every download is checked against it
PROFILES_SHA256 = "profiles_sha256"  # sha256 of the shapes the engine accepts (batch, prompt, context); with engine_sha256, one engine is one version
CHAT_TEMPLATE_SHA256 = "chat_template_sha256"  # sha256 of the chat template the server renders chats with; "none": the model has none
SIGNING_KEY = "signing_key"  # fingerprint of the key that signed the engine directory (its model.sig): sha256 of the public key's PEM

# ---------------------------------------------------------------- version tags: what it is and where it came from

BACKEND = "backend"  # the runtime that runs the engine: onnxruntime, tensorrt or torch-cuda
BACKEND_VERSION = "backend_version"  # that runtime's version when the engine was built
PRECISION = "precision"  # fp32, fp16, bf16, fp8, int8 or int4
TARGET = "target"  # `cpu`, or the GPU's compute capability (`sm_90`)
MODEL_FAMILY = "model_family"  # gpt2, llama, qwen2 or mistral
PARAMETER_COUNT = "parameter_count"  # parameters of the source model (a tied embedding counted once)
KV_HEADS = "kv_heads"  # the KV cache's heads (fewer than the attention's: grouped-query attention)
DATA_MD5 = "data_md5"  # the data version the model was trained and gated on (the md5 in data.dvc)
CALIBRATION_DIGEST = "calibration_digest"  # digest of the int8 calibration set (Q/DQ int8 only); "none": nothing was calibrated
SOURCE_MODEL_SHA256 = "source_model_sha256"  # sha256 of the model directory the engine was built from (trained or pretrained)
ONNX_SHA256 = "onnx_sha256"  # sha256 of the fp32 ONNX export of that model
PRECISION_ONNX_SHA256 = "precision_onnx_sha256"  # sha256 of the ONNX graph of the engine's precision; "none" for torch-cuda (built from the model)
GIT_COMMIT = "git_commit"  # the commit of the kiln checkout that built the engine; "unknown" outside a git checkout
PARAMS_SHA256 = "params_sha256"  # sha256 of every parameter of params.yaml, as read (defaults included)
TRAINING_RUN_ID = "training_run_id"  # the MLflow run that trained the model (the version's page links to it)
TRAINING_KERNELS = "training_kernels"  # how torch computed while training: reproducible (held to AVX2) or native; "none": not trained
RUNTIME_PREFIX = "runtime."  # `runtime.<name>`: the versions the engine was built with (torch, CUDA, the GPU)

# ---------------------------------------------------------------- version tags: the gates

GATES_PREFIX = "gates."  # `gates.<gate>.<measure>`: each gate's numbers and how they were measured (`gates.latency.threads`); `<measure>_low` / `_high`: its interval; `<measure>.excluded`: why it was left out of the verdict
GATES_PASSED = "gates.passed"  # "true" / "false": nothing is aliased or served without "true" (or a forced reason)
GATES_VERDICT = "gates.verdict"  # passed / failed / inconclusive (an interval straddled a limit; not aliased either)
GATES_MEASURED_ON = "gates.measured_on"  # the machine the gates ran on (CPU model, cores, instruction sets; the GPU)
CHAMPION_GATE_PASSED = "gates.champion.passed"  # the champion gate: it decides `challenger`, not gates.passed

# ---------------------------------------------------------------- version tags: promotion and verification

FORCED_REASON = "promotion.forced_reason"  # why a person promoted a version whose gates did not pass (`kiln promote --force --reason`)
FORCED_BY = "promotion.forced_by"  # who forced that promotion
FORCED_AT = "promotion.forced_at"  # when (ISO 8601, UTC)
VERIFICATION_PREFIX = "verification."  # `verification.<check>`: what verify-promotion found (passed, the numbers, the data version, the machine, who, when)

# ---------------------------------------------------------------- run tags

RUN_HOST = "kiln.host"  # the host of the process registering: with kiln.pid, tells a registration whose process died from one in progress
RUN_PID = "kiln.pid"  # the process id registering, on that host
RUN_MODEL_SHA256 = "kiln.model_sha256"  # on a training run: the sha256 of the model it trained, by which it is found again
RUN_KIND = "kiln.kind"  # what the run is: "training" for a training run
RUN_TRAINING_RUN_ID = "kiln.training_run_id"  # on an engine's run: the training run of its model

# ---------------------------------------------------------------- tag values

TRUE, FALSE = "true", "false"  # how a yes-or-no tag reads


def flag(value: bool) -> str:
    """A boolean as a tag value."""
    return TRUE if value else FALSE


def gate_number(gate: str, measure: str) -> str:
    """The tag of one gate number, `gates.<gate>.<measure>` (`gates.latency.p50_ms`)."""
    return f"{GATES_PREFIX}{gate}.{measure}"


def gate_limit(gate: str, measure: str) -> str:
    """The tag of a gate number's limit as its gate applied it (`gates.quality.top1_agreement.limit`: ">= 0.9")."""
    return f"{gate_number(gate, measure)}.limit"


def gate_excluded(gate: str, measure: str) -> str:
    """The tag saying why a gate number was left out of its gate's verdict (components.gates writes it)."""
    return f"{gate_number(gate, measure)}.excluded"


def runtime(name: str) -> str:
    """The tag of one runtime fact of the engine (`runtime.torch`)."""
    return RUNTIME_PREFIX + name


def verification(check: str) -> str:
    """The tag of one verify-promotion record (`verification.passed`)."""
    return VERIFICATION_PREFIX + check


# ---------------------------------------------------------------- registered-model tags


def alias_moves_prefix(alias: str) -> str:
    """The start of the registered-model tags that record a person's moves of `alias`: `<alias>.moves.`."""
    return f"{alias}.moves."


def alias_move(alias: str, number: int) -> str:
    """`<alias>.moves.<nnnn>`: one move of an alias made by `kiln promote` or `kiln rollback`,
    numbered from 0001 (`champion.moves.0001`); its value holds the version, the version
    before, who, when (UTC) and why, as JSON, and the model's page in the MLflow UI shows it."""
    return f"{alias_moves_prefix(alias)}{number:04d}"
