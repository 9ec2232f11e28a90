"""The model families kiln builds, and what a model directory's `config.json` says about
its shape in each family's own words (GPT-2's `n_layer`, Llama's `num_hidden_layers`).

Read from the JSON, not through transformers: the CLI checks a model directory before any
work without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from components.errors import TrainError

# model_type → the family's causal LM class in transformers (what `config.json` names).
FAMILIES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",  # Llama 2/3, SmolLM/SmolLM2, TinyLlama
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclass(frozen=True)
class ModelShape:
    """What the stages after training need of a model's architecture."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int  # fewer than num_heads: grouped-query attention
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    tied_embeddings: bool
    sliding_window: int | None = None  # attention sees only this many past tokens (Mistral)


def family_of(config: Mapping[str, Any], where: object = "the model") -> str:
    """The config's `model_type` if kiln builds that family; TrainError naming the supported
    families otherwise."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise TrainError(f"{where}: model_type {model_type!r} is not a family kiln builds (supported: {', '.join(FAMILIES)})")
    return model_type


def shape_of(config: Mapping[str, Any], where: object = "the model") -> ModelShape:
    """The shape of a model from its `config.json` (or a transformers config's `to_dict()`)."""
    family = family_of(config, where)
    if family == "gpt2":
        heads = config["n_head"]
        return ModelShape(
            family=family,
            num_layers=config["n_layer"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=config["n_embd"] // heads,
            hidden_size=config["n_embd"],
            vocab_size=config["vocab_size"],
            max_positions=config["n_positions"],
            tied_embeddings=config.get("tie_word_embeddings", True),
        )
    heads = config["num_attention_heads"]
    return ModelShape(
        family=family,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        max_positions=config["max_position_embeddings"],
        tied_embeddings=config.get("tie_word_embeddings", False),
        sliding_window=_sliding_window(family, config),
    )


def _sliding_window(family: str, config: Mapping[str, Any]) -> int | None:
    """Mistral attends within `sliding_window` when it is set; Qwen2 only where
    `use_sliding_window` says so (its released models leave it off)."""
    if family == "qwen2" and not config.get("use_sliding_window", False):
        return None
    return config.get("sliding_window")
