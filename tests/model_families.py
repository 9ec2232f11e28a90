"""Tiny models of the families kiln builds, made from transformers' own config classes with
random weights and saved locally (no downloads), with tokenizers of each kind."""

from __future__ import annotations

import json
from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# Per family, what sets it apart: Llama 3's rope scaling and tied embeddings, Qwen2's q/k/v
# biases (made non-zero below), Mistral's sliding window (longer than any test's context).
EXTRA = {
    "llama": dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=4096, tie_word_embeddings=False),
}


def fill_from_numpy(model, seed: int) -> None:
    """Every weight drawn by numpy's generator (the same bytes on every CPU), as transformers
    initialises them: normal with the config's initializer_range, biases normal(0, 0.02)
    (zero would hide them), norms' scales kept at one. torch's own `normal_` draws other
    numbers on a CPU without AVX-512 (its vectorised path is built for AVX2 only), so a model
    made with it, and every gate number measured on it, would depend on the machine."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.split(".")[-2].startswith("ln_"):
                continue
            std = 0.02 if name.endswith(".bias") else model.config.initializer_range
            parameter.copy_(torch.from_numpy(rng.normal(0.0, std, tuple(parameter.shape)).astype(np.float32)))


def sentencepiece_style_tokenizer(texts: list[str], vocab_size: int = 640):
    """A SentencePiece-derived BPE as Llama 2 and TinyLlama ship it in tokenizer.json: `▁`
    for spaces, byte fallback to `<0xNN>` tokens (ordinary vocabulary entries, as there)
    for what the vocabulary lacks, and a post-processor that prepends BOS."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    trained.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    pieces = specials + [f"<0x{byte:02X}>" for byte in range(256)] + [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if t not in specials]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.add_special_tokens(specials)
    bpe.pre_tokenizer = metaspace
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>")


def random_model_dir(family: str, tokenizer, directory: Path, extra_eos: tuple[int, ...] = (), seed: int = 0, chat_template: str | None = None, torch_draws: bool = False, **overrides) -> Path:
    """A model directory of `family`, sized to `tokenizer`, with random weights. `extra_eos`:
    more ids that end generation (generation_config.json lists them as Llama 3's does).
    `chat_template`: saved in chat_template.jinja for llama (as transformers 5 saves one),
    in tokenizer_config.json for the others (as older models ship it). `torch_draws`: weights
    from torch's own initialisation (biases drawn by torch too), for tests whose tolerances
    were measured on those draws and compare on one machine; otherwise `fill_from_numpy`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    settings = SMALL | EXTRA[family] | dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos) | overrides
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings)).eval()
    if torch_draws:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, 0.02)
    else:
        fill_from_numpy(model, seed)
    if extra_eos:
        model.generation_config.eos_token_id = [eos, *extra_eos]
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    if chat_template is not None and family == "llama":
        (directory / "chat_template.jinja").write_text(chat_template)
    elif chat_template is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": chat_template}))
    return directory
