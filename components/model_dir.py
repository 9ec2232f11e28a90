"""The model-directory contract: a Hugging Face causal LM directory (weights, config,
tokenizer, and kiln's training record when kiln trained it) and its identity.

Export, gates and the CLI load models through here, not through the training stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from components.config import ProfileParams, SampleParams
from components.errors import ConfigError, TrainError
from components.files import directory_sha256

TRAINING_RECORD = "kiln_training.json"


@dataclass(frozen=True)
class TrainedModel:
    """A Hugging Face model directory (weights, config, tokenizer) and its identity."""

    path: Path
    sha256: str
    eval_perplexity: float | None = None
    uniform_perplexity: float | None = None
    loss_curve: tuple[tuple[int, float], ...] = field(default=())

    @property
    def content_digest(self) -> str:
        return self.sha256

    @property
    def output_dir(self) -> Path:
        return self.path

    def is_intact(self) -> bool:
        """Still on disk and unchanged since it was made (a cached result may outlive its files)."""
        return self.path.is_dir() and directory_sha256(self.path) == self.sha256


def model_from_directory(path: Path) -> TrainedModel:
    """A model directory as a TrainedModel, after checking that it loads."""
    check_model_directory(path)
    record = _read_record(path)
    return TrainedModel(
        path=path,
        sha256=directory_sha256(path),
        eval_perplexity=record.get("eval_perplexity"),
        uniform_perplexity=record.get("uniform_perplexity"),
        loss_curve=tuple(tuple(point) for point in record.get("loss_curve", ())),
    )


def check_model_directory(path: Path) -> None:
    """Raise TrainError naming what is wrong if `path` is not a loadable causal LM directory."""
    if not path.is_dir():
        raise TrainError(f"model directory not found: {path}")
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).is_file():
            raise TrainError(f"model directory {path} has no {required}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TrainError(f"model directory {path} has no weights (*.safetensors or *.bin)")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise TrainError(f"model directory {path}: config.json is not valid JSON ({err})") from err
    if config.get("model_type") != "gpt2":
        raise TrainError(f"model directory {path}: model_type {config.get('model_type')!r}, kiln exports gpt2")


def load_model(path: Path):
    """The PyTorch model of a model directory, in eval mode; TrainError if it cannot load."""
    from transformers import AutoModelForCausalLM

    check_model_directory(path)
    quiet_transformers()
    try:
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()
    except Exception as err:  # safetensors, torch and transformers each raise their own types
        raise TrainError(f"cannot load model from {path}: {type(err).__name__}: {err}") from err


def quiet_transformers() -> None:
    """transformers' per-shard tqdm bars and advice warnings drown the stage progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _read_record(path: Path) -> dict:
    try:
        return json.loads((path / TRAINING_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def check_fits_model(model: TrainedModel, profiles: ProfileParams, sample: SampleParams) -> None:
    """What params.yaml asks of a model, checked once the model exists and before any export
    or registration: the build profiles fit its context (`n_positions`), and the sample
    prompt, in its tokens, fits the profiles. ConfigError naming the keys otherwise."""
    check_fits_model_directory(model.path, profiles, sample)


def check_fits_model_directory(path: Path, profiles: ProfileParams, sample: SampleParams) -> None:
    """check_fits_model on a model directory as it lies (`kiln build`, before any work):
    reads its config and tokenizer only, not the weights' sha256."""
    from components.runtime.tokenizer import EngineTokenizer

    n_positions = json.loads((path / "config.json").read_text()).get("n_positions")
    if n_positions is not None and profiles.context.max > n_positions:
        raise ConfigError(
            f"build.profiles.context.max ({profiles.context.max}) is longer than the context of {path} (n_positions {n_positions})"
        )
    prompt_tokens = len(EngineTokenizer(path).encode(sample.prompt))
    if not profiles.prompt.min <= prompt_tokens <= profiles.prompt.max:
        raise ConfigError(
            f"sample.prompt is {prompt_tokens} tokens; build.profiles.prompt admits {profiles.prompt.min}..{profiles.prompt.max}"
        )
    if prompt_tokens + sample.max_tokens > profiles.context.max:
        raise ConfigError(
            f"sample.prompt ({prompt_tokens} tokens) plus sample.max_tokens ({sample.max_tokens}) exceeds build.profiles.context.max ({profiles.context.max})"
        )
