"""The names of the tags kiln writes in MLflow, in one place (DESIGN.md's registry contract).

Every product module names a tag through this module, never as a string of its own: a tag
written under one spelling and read under another would be a check that silently passes
(a version with no `gates.passed` reads as failed, one with no `engine_sha256` as
unverifiable). Tests state the contract with the literal names; an architecture test
keeps them out of the product modules.

Three kinds: version tags (one registered engine), registered-model tags (the recorded
alias moves) and run tags (who is registering, which run trained the model).
"""

from __future__ import annotations

# ---------------------------------------------------------------- version tags: the engine's identity

ENGINE_SHA256 = "engine_sha256"  # the engine file; what a download is verified against
PROFILES_SHA256 = "profiles_sha256"  # the shapes it accepts: with ENGINE_SHA256, one engine is one version
CHAT_TEMPLATE_SHA256 = "chat_template_sha256"  # the template the server renders chats with; "none": it has none
SIGNING_KEY = "signing_key"  # the fingerprint of the key that signed the engine directory (its model.sig)

# ---------------------------------------------------------------- version tags: what it is and where it came from

BACKEND = "backend"
BACKEND_VERSION = "backend_version"
PRECISION = "precision"
TARGET = "target"  # `cpu`, or the GPU's compute capability (`sm_90`)
MODEL_FAMILY = "model_family"  # gpt2, llama, qwen2, mistral
PARAMETER_COUNT = "parameter_count"  # of the source model (a tied embedding counted once)
KV_HEADS = "kv_heads"  # the KV cache's heads (fewer than the attention's: grouped-query attention)
DATA_MD5 = "data_md5"  # the data version (data.dvc)
CALIBRATION_DIGEST = "calibration_digest"
SOURCE_MODEL_SHA256 = "source_model_sha256"
ONNX_SHA256 = "onnx_sha256"
PRECISION_ONNX_SHA256 = "precision_onnx_sha256"
GIT_COMMIT = "git_commit"
PARAMS_SHA256 = "params_sha256"
TRAINING_RUN_ID = "training_run_id"
TRAINING_KERNELS = "training_kernels"  # how torch computed while training: reproducible (held to AVX2) or native; "none": not trained
RUNTIME_PREFIX = "runtime."  # runtime.<name>: the versions the engine was built with (torch, CUDA, GPU)

# ---------------------------------------------------------------- version tags: the gates

GATES_PREFIX = "gates."  # gates.<gate>.<measure>: the gate numbers (components.gates names them)
GATES_PASSED = "gates.passed"  # "true" / "false": nothing is aliased or served without "true" (or a forced reason)
GATES_VERDICT = "gates.verdict"  # passed / failed / inconclusive (an interval straddled a limit; not aliased either)
GATES_MEASURED_ON = "gates.measured_on"  # the machine the gates ran on
CHAMPION_GATE_PASSED = "gates.champion.passed"  # the champion gate: it decides `challenger`, not gates.passed

# ---------------------------------------------------------------- version tags: promotion and verification

FORCED_REASON = "promotion.forced_reason"  # set by `kiln promote --force --reason`
FORCED_BY = "promotion.forced_by"
FORCED_AT = "promotion.forced_at"
VERIFICATION_PREFIX = "verification."  # verification.<check>: verify-promotion's evidence

# ---------------------------------------------------------------- run tags

RUN_HOST = "kiln.host"  # with RUN_PID: tells a run whose registering process died from one in progress
RUN_PID = "kiln.pid"
RUN_MODEL_SHA256 = "kiln.model_sha256"  # a training run, found again by the model it trained
RUN_KIND = "kiln.kind"
RUN_TRAINING_RUN_ID = "kiln.training_run_id"  # an engine run's link to its training run

TRUE, FALSE = "true", "false"  # how a boolean tag reads


def flag(value: bool) -> str:
    """A boolean as a tag value."""
    return TRUE if value else FALSE


def gate_number(gate: str, measure: str) -> str:
    """The tag of one gate number, `gates.<gate>.<measure>` (`gates.latency.p50_ms`)."""
    return f"{GATES_PREFIX}{gate}.{measure}"


def runtime(name: str) -> str:
    """The tag of one runtime fact of the engine (`runtime.torch`)."""
    return RUNTIME_PREFIX + name


def verification(check: str) -> str:
    """The tag of one verify-promotion record (`verification.passed`)."""
    return VERIFICATION_PREFIX + check


def alias_moves_prefix(alias: str) -> str:
    """The registered-model tags that record a person's moves of `alias`: `<alias>.moves.`."""
    return f"{alias}.moves."


def alias_move(alias: str, number: int) -> str:
    """The registered-model tag of one recorded move (`champion.moves.0001`)."""
    return f"{alias_moves_prefix(alias)}{number:04d}"
