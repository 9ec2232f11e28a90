"""The model-directory contract: a Hugging Face causal LM directory (weights, config,
tokenizer, and kiln's training record when kiln trained it) and its identity.

Export, gates and the CLI load models through here, not through the training stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from components.config import ProfileParams, SampleParams
from components.engine_dir import CHAT_TEMPLATE
from components.errors import ConfigError, TrainError
from components.families import family_of, shape_of
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
    kernels: dict[str, str | int] = field(default_factory=dict)  # how torch computed while kiln trained it (components.train)

    @property
    def kernels_text(self) -> str:
        """`reproducible (AVX2, 2 threads)`, `native (AVX512, 2 threads)`, or `none` (not trained by kiln)."""
        if not self.kernels:
            return "none"
        threads = self.kernels["threads"]
        return f"{self.kernels['mode']} ({self.kernels['cpu_capability']}, {threads} thread{'' if threads == 1 else 's'})"

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
        kernels=record.get("kernels", {}),
    )


def pretrained_directory(name: str, root: Path | None = None) -> Path:
    """`model.pretrained` as a directory: a path (relative to the project `root`, else the
    current folder), else a hub id already in the local Hugging Face cache (nothing is
    downloaded: a build must not depend on the network)."""
    path = (root or Path.cwd()) / Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as err:  # huggingface_hub raises its own types for a missing or partial snapshot
        raise TrainError(
            f"model.pretrained {name!r} is not a local directory, and no copy of that hub id is in the local Hugging Face cache "
            f"(kiln downloads nothing: `hf download {name}` on a machine with network, or name the model's directory)"
        ) from err


def check_model_directory(path: Path) -> None:
    """Raise TrainError naming what is wrong if `path` is not a loadable causal LM directory."""
    if not path.is_dir():
        raise TrainError(f"model directory not found: {path}")
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).is_file():
            raise TrainError(f"model directory {path} has no {required}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TrainError(f"model directory {path} has no weights (*.safetensors or *.bin)")
    family_of(read_config(path), f"model directory {path}")


def read_config(path: Path) -> dict:
    """A model directory's `config.json`; TrainError if it is not a JSON object."""
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise TrainError(f"model directory {path}: config.json is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise TrainError(f"model directory {path}: config.json holds {type(config).__name__}, not an object")
    return config


# The float dtypes a model directory's weights are loaded in, as config.json names them.
MODEL_DTYPES = ("float32", "float16", "bfloat16")


def stored_dtype(path: Path) -> str:
    """The dtype a model directory's weights were saved in, as its config.json records it
    (`dtype`; `torch_dtype` in configs older transformers saved, most of the Hub's);
    float32 where it records none (GPT-2's own config predates the key)."""
    config = read_config(path)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in MODEL_DTYPES:
        raise TrainError(f"model directory {path}: config.json's dtype is {dtype!r}; kiln loads {', '.join(MODEL_DTYPES)}")
    return dtype


def first_layers(layers: int | None) -> dict[str, int]:
    """The config override that keeps a model's first `layers` decoder layers (none: all):
    every family kiln builds names them num_hidden_layers (GPT-2 too, through its attribute map)."""
    return {} if layers is None else {"num_hidden_layers": layers}


def load_model(path: Path, dtype: str = "float32", layers: int | None = None, device: str = "cpu"):
    """The PyTorch model of a model directory in fp32, in eval mode; TrainError if it cannot
    load. fp32 whatever the weights were saved in: transformers 5 loads a bf16 model (Llama 3,
    Qwen2.5) as bf16, which the export traces into a graph ONNX Runtime's CPU cannot run, and
    which the gates would compute at bf16's precision, not the model's weights' own. `dtype`
    another of MODEL_DTYPES where fp32 does not fit (components.model_fit.reference_dtype);
    `layers`: the first ones alone (the export's parity check of a model too big for fp32);
    `device`: where its weights are loaded (a GPU engine's gates compute it on the card)."""
    import torch
    from transformers import AutoModelForCausalLM

    check_model_directory(path)
    quiet_transformers()
    try:
        placed = {} if device == "cpu" else {"device_map": device}
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), **first_layers(layers), **placed).eval()
    except Exception as err:  # safetensors, torch and transformers each raise their own types
        raise TrainError(f"cannot load model from {path}: {type(err).__name__}: {err}") from err


def quiet_transformers() -> None:
    """transformers' per-shard tqdm bars and advice warnings drown the stage progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _read_record(path: Path) -> dict:
    return _read_json(path / TRAINING_RECORD)


def check_fits_model(model: TrainedModel, profiles: ProfileParams, sample: SampleParams) -> None:
    """What params.yaml asks of a model, checked once the model exists and before any export
    or registration: the build profiles fit its context (and its sliding window, which
    kiln's engines do not implement), and the sample prompt, in its tokens, fits the
    profiles. ConfigError naming the keys otherwise."""
    check_fits_model_directory(model.path, profiles, sample)


def check_fits_model_directory(path: Path, profiles: ProfileParams, sample: SampleParams) -> None:
    """check_fits_model on a model directory as it lies (`kiln build`, before any work):
    reads its config and tokenizer only, not the weights' sha256."""
    from components.runtime.tokenizer import EngineTokenizer

    shape = shape_of(read_config(path), f"model directory {path}")
    if profiles.context.max > shape.max_positions:
        raise ConfigError(
            f"build.profiles.context.max ({profiles.context.max}) is longer than the context of {path} ({shape.max_positions} positions)"
        )
    if shape.sliding_window is not None and shape.sliding_window < profiles.context.max:
        raise ConfigError(
            f"{path} attends within a sliding window of {shape.sliding_window} tokens, shorter than build.profiles.context.max "
            f"({profiles.context.max}); kiln's engines attend to the whole context: lower build.profiles.context.max to {shape.sliding_window} or less"
        )
    prompt_tokens = len(EngineTokenizer(path).encode_prompt(sample.prompt))
    if not profiles.prompt.min <= prompt_tokens <= profiles.prompt.max:
        raise ConfigError(
            f"sample.prompt is {prompt_tokens} tokens; build.profiles.prompt admits {profiles.prompt.min}..{profiles.prompt.max}"
        )
    if prompt_tokens + sample.max_tokens > profiles.context.max:
        raise ConfigError(
            f"sample.prompt ({prompt_tokens} tokens) plus sample.max_tokens ({sample.max_tokens}) exceeds build.profiles.context.max ({profiles.context.max})"
        )


def chat_template_of(path: Path) -> str | None:
    """The model's chat template where transformers finds it: `chat_template.jinja` (how
    transformers 5 saves one), else tokenizer_config.json's `chat_template`, a template or
    a list of named ones of which "default" is used; None when the model has none."""
    standalone = path / CHAT_TEMPLATE
    if standalone.is_file():
        return standalone.read_text()
    template = _read_json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def eos_token_ids(path: Path) -> list[int]:
    """Every id that ends generation: `generation_config.json`'s `eos_token_id` (an id or a
    list: Llama 3 ends on `<|eot_id|>` as well as `<|end_of_text|>`), `config.json`'s, and
    the tokenizer's `eos_token`; in that order, each once."""
    from tokenizers import Tokenizer

    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        found += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    token = _read_json(path / "tokenizer_config.json").get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and (tokenizer := path / "tokenizer.json").is_file():
        token_id = Tokenizer.from_file(str(tokenizer)).token_to_id(token)
        found += [token_id] if token_id is not None else []
    return list(dict.fromkeys(found))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
