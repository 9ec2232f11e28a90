"""The train stage: a byte-level BPE tokenizer and a small GPT-2 or Llama trained from
scratch on the train split, or an existing Hugging Face model loaded (and optionally
fine-tuned: every weight, or LoRA adapters merged into the weights before it is saved)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from components.config import LoraParams, ModelParams, TrainingParams
from components.data import DataVersion
from components.errors import TrainError
from components.families import shape_of
from components.files import stage_output
from components.model_dir import TRAINING_RECORD, TrainedModel, load_model, model_from_directory, pretrained_directory, quiet_transformers
from components.progress import stage_progress

EOS = "<|endoftext|>"
# Part of the output folder's name and of the Prefect cache key (flows.caching): bump it when
# this stage's code changes what it makes, and only this stage and those after it rebuild.
STAGE_VERSION = "1"
# Where a LoRA fine-tune keeps its adapter in the model directory (PEFT's own layout: it
# loads onto `model.pretrained` with PeftModel.from_pretrained). The weights beside it
# already hold the adapter merged.
ADAPTER = "adapter"

_log = logging.getLogger(__name__)


def model_from_data(data: DataVersion, params: ModelParams, out_root: Path) -> TrainedModel:
    """Train from scratch (or fine-tune a pretrained model); the result lands in a directory
    named by the content of what went in, written atomically. A pretrained model built as it
    is never comes here: the pipeline loads its directory."""
    schedule: TrainingParams | None = params.schedule
    if schedule is None:
        raise TrainError(f"model.pretrained {params.pretrained} is built as it is: there is nothing to train (model.fine_tuning.enabled: true fine-tunes it)")
    digest = hashlib.sha256(json.dumps(params.identity(), sort_keys=True).encode()).hexdigest()
    key = f"v{STAGE_VERSION}-{digest[:12]}-{data.md5.removesuffix('.dir')[:12]}"
    build = _train_reproducibly if schedule.reproducible else _train_into
    return model_from_directory(stage_output(out_root / key, TRAINING_RECORD, lambda staging: build(staging, data, params)))


# ---------------------------------------------------------------- kernels

# torch picks its CPU kernels by instruction set (ATen's vectorized code, MKL's GEMMs, oneDNN)
# and splits its sums by thread count; each choice rounds otherwise. Held to AVX2 and a fixed
# thread count, every x86-64 CPU with AVX2 runs the same code and sums in the same order.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "DNNL_MAX_CPU_ISA": "AVX2"}
PORTABLE_THREADS = 2


def _train_reproducibly(target: Path, data: DataVersion, params: ModelParams) -> None:
    """`_train_into` in a fresh process whose torch reads PORTABLE_KERNELS before it loads:
    they are read once, when torch first computes, so this process's torch cannot be held."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if "avx2" not in _cpu_flags():
        raise TrainError("model.training.reproducible holds torch's kernels to AVX2, which this CPU does not have: set it to false here")
    schedule: TrainingParams = _schedule(params)
    threads = schedule.threads or PORTABLE_THREADS
    section = "training" if params.pretrained is None else "fine_tuning"
    held = params.model_copy(update={section: schedule.model_copy(update={"threads": threads})})
    environment = PORTABLE_KERNELS | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        process.submit(_train_held, environment, target, data, held).result()


def _train_held(environment: dict[str, str], target: Path, data: DataVersion, params: ModelParams) -> None:
    import os
    import sys

    if "torch" in sys.modules:  # it would have read its settings already (a main module that imports it)
        raise TrainError("torch was imported before the reproducible training process could hold its kernels")
    os.environ.update(environment)
    # This process has no logging set up: the stage's lines (what is trained) go to stderr, as its progress does.
    stages = logging.getLogger("components")
    stages.setLevel(logging.INFO)
    stages.addHandler(logging.StreamHandler(sys.stderr))
    stages.propagate = False
    _train_into(target, data, params)


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def kernels_record(reproducible: bool, threads: int) -> dict[str, str | int]:
    """How this process's torch computes: the training record keeps it (it is part of the
    model's identity: another choice trains other bytes)."""
    import os

    import torch

    held = {name: os.environ.get(name, "") for name in PORTABLE_KERNELS} if reproducible else {}
    return {"mode": "reproducible" if reproducible else "native", "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads} | held


# ---------------------------------------------------------------- training


def _schedule(params: ModelParams) -> TrainingParams:
    schedule: TrainingParams | None = params.schedule
    assert schedule is not None, "model_from_data trains only where a schedule applies"
    return schedule


def _train_into(target: Path, data: DataVersion, params: ModelParams) -> None:
    import torch

    schedule: TrainingParams = _schedule(params)
    quiet_transformers()
    torch.manual_seed(schedule.seed)
    if schedule.threads:
        torch.set_num_threads(schedule.threads)
    lora = params.fine_tuning.lora if params.pretrained and params.fine_tuning.lora.enabled else None
    if params.pretrained:
        model, tokenizer = _pretrained(pretrained_directory(params.pretrained))
    else:
        tokenizer = tokenizer_from_texts(data.texts("train"), params)
        model = fresh_model(tokenizer, params)
    adapted = with_lora_adapters(model, lora, params.pretrained) if lora else None  # refuses bad targets before any training
    if adapted is not None:
        trainable, total = adapted.record["trainable_parameters"], adapted.record["parameters"]
        _log.info(
            "fine-tuning %s with LoRA rank %d (%s trainable of %s parameters), %d steps at learning rate %g",
            params.pretrained, lora.rank, f"{trainable:,}", f"{total:,}", schedule.steps, schedule.learning_rate,
        )  # fmt: skip
    train_ids = _token_stream(tokenizer, data.texts("train"))
    eval_ids = _token_stream(tokenizer, data.texts("eval"))
    curve = _fit(adapted.model if adapted is not None else model, train_ids, schedule)
    if adapted is not None:
        adapted.save_adapter(target / ADAPTER)
        model = adapted.merged()  # what is saved, evaluated, exported and gated: a plain model
    perplexity = evaluate_perplexity(model, eval_ids, schedule)
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    record = {
        "eval_perplexity": perplexity,
        "uniform_perplexity": float(model.config.vocab_size),
        "loss_curve": curve,
        "data_md5": data.md5,
        "params": params.identity(),
    } | ({"kernels": kernels_record(schedule.reproducible, torch.get_num_threads())} if curve else {}) | ({"lora": adapted.record} if adapted is not None else {})
    (target / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")


# ---------------------------------------------------------------- LoRA


class LoraAdapted:
    """A pretrained model with LoRA adapters (PEFT) on its targeted linear layers: only the
    adapters train; `merged()` folds them into the weights and gives back the plain model."""

    def __init__(self, model, lora: LoraParams, targets: list[str], base_name: str) -> None:
        import warnings

        from peft import LoraConfig, get_peft_model
        from transformers.pytorch_utils import Conv1D

        parameters = sum(p.numel() for p in model.parameters())
        modules = dict(model.named_modules())
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,  # full names, resolved by with_lora_adapters: nothing is left to PEFT's matching
            fan_in_fan_out=isinstance(modules[targets[0]], Conv1D),  # GPT-2's layers store their weight transposed
            bias="none",
            task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():  # PEFT asks transformers 5 by the name it deprecated
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            self.model = get_peft_model(model, config)
        self.model.peft_config["default"].base_model_name_or_path = base_name  # as params.yaml names it, not this machine's path
        self.record = {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": sorted({name.rsplit(".", 1)[-1] for name in targets}),
            "adapted_layers": len(targets),
            "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "parameters": parameters,
            "adapter": ADAPTER,
        }

    def save_adapter(self, path: Path) -> None:
        """PEFT's adapter folder, written to the same bytes for the same adapter: PEFT keeps
        target_modules as a set (its order changes with each process's hash seed), and its
        model card is an empty template."""
        self.model.save_pretrained(str(path))
        config_file = path / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["target_modules"] = sorted(config["target_modules"])
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (path / "README.md").unlink(missing_ok=True)

    def merged(self):
        """The model with each adapter's scaled B·A added into its layer's weight, the adapter
        layers removed (NaN or inf in a merged weight is refused: safe_merge)."""
        try:
            return self.model.merge_and_unload(safe_merge=True).eval()
        except ValueError as err:
            raise TrainError(f"merging the LoRA adapters into the weights failed: {err}") from err


def with_lora_adapters(model, lora: LoraParams, base_name: str) -> LoraAdapted:
    """`model` with adapters on the layers `lora.target_modules` names; TrainError naming the
    setting for a name no linear layer of the model has, before any training."""
    import torch
    from transformers.pytorch_utils import Conv1D

    linear = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear | Conv1D)}
    head = model.get_output_embeddings()
    heads = [name for name, module in linear.items() if module is head]
    if lora.target_modules == "all-linear":
        targets = [name for name in linear if name not in heads]
    else:
        unknown = [wanted for wanted in lora.target_modules if not any(_names(name, wanted) for name in linear)]
        if unknown:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise TrainError(
                f"model.fine_tuning.lora.target_modules names {', '.join(map(repr, unknown))}, which {base_name} has no linear layer of: "
                f"its linear layers are {', '.join(kinds)} (or all-linear: every one but the output head)"
            )
        targets = [name for name in linear if any(_names(name, wanted) for wanted in lora.target_modules)]
        tied = getattr(model.config, "tie_word_embeddings", False) and [name for name in targets if name in heads]
        if tied:
            raise TrainError(
                f"model.fine_tuning.lora.target_modules names the output head ({tied[0]}), whose weight {base_name} shares with its input embeddings: "
                "an adapter merged into it would change both. Leave it out"
            )
    if not targets:
        raise TrainError(f"model.fine_tuning.lora.target_modules: {base_name} has no linear layer but its output head to adapt")
    return LoraAdapted(model, lora, sorted(targets), base_name)


def _names(module: str, wanted: str) -> bool:
    """A target names a module by its full name or its last parts (`q_proj`, `self_attn.q_proj`), as PEFT matches them."""
    return module == wanted or module.endswith(f".{wanted}")


def tokenizer_from_texts(texts: Sequence[str], params: ModelParams):
    """A byte-level BPE (GPT-2's scheme) trained on the texts, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=params.tokenizer.vocab_size,
        min_frequency=params.tokenizer.min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)


def fresh_model(tokenizer, params: ModelParams):
    """A randomly initialised model of `params.architecture`, sized to the tokenizer."""
    return _fresh_llama(tokenizer, params) if params.architecture.family == "llama" else _fresh_gpt2(tokenizer, params)


def _fresh_gpt2(tokenizer, params: ModelParams):
    from transformers import GPT2Config, GPT2LMHeadModel

    arch = params.architecture
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=arch.n_positions,
        n_embd=arch.n_embd,
        n_layer=arch.n_layer,
        n_head=arch.n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return GPT2LMHeadModel(config)


def _fresh_llama(tokenizer, params: ModelParams):
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = params.architecture
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.n_embd,
        intermediate_size=arch.mlp_width,
        num_hidden_layers=arch.n_layer,
        num_attention_heads=arch.n_head,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=arch.n_positions,
        rope_theta=arch.rope_theta or 10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def _pretrained(path: Path):
    from transformers import AutoTokenizer

    model = load_model(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:
        raise TrainError(f"cannot load the tokenizer of {path}: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _token_stream(tokenizer, texts: Sequence[str]):
    """All texts as one id tensor, each followed by EOS (GPT-2's document separator)."""
    import torch

    ids: list[int] = []
    for encoding in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(encoding)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _fit(model, ids, params: TrainingParams) -> list[tuple[int, float]]:
    """AdamW with linear warm-up and cosine decay on random windows of the token stream.

    A plain loop rather than transformers.Trainer: it needs `accelerate`, prints tqdm bars,
    and a fixed step budget with a rich progress bar is all this stage wants.
    """
    import torch

    if params.steps == 0:
        return []
    if len(ids) <= params.block_size + 1:
        raise TrainError(f"the train split has {len(ids)} tokens, fewer than one block of {params.block_size}")
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]  # every weight, or LoRA's adapters alone
    optimizer = torch.optim.AdamW(trained, lr=params.learning_rate, weight_decay=params.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_scale(step, params))
    generator = torch.Generator().manual_seed(params.seed)
    curve = []
    with stage_progress("train", total=params.steps) as advance:
        for step in range(params.steps):
            starts = torch.randint(0, len(ids) - params.block_size - 1, (params.batch_size,), generator=generator)
            batch = torch.stack([ids[s : s + params.block_size] for s in starts.tolist()])
            loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            schedule.step()
            if step % 10 == 0 or step == params.steps - 1:
                curve.append((step, round(loss.item(), 4)))
            advance(1, f"loss {loss.item():.3f}")
    model.eval()
    return curve


def _lr_scale(step: int, params: TrainingParams) -> float:
    if step < params.warmup_steps:
        return (step + 1) / params.warmup_steps
    progress = (step - params.warmup_steps) / max(1, params.steps - params.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def evaluate_perplexity(model, ids, params: TrainingParams) -> float:
    """exp(mean next-token loss) over non-overlapping eval blocks."""
    import torch

    block = min(params.block_size, shape_of(model.config.to_dict()).max_positions)
    blocks = ids[: (len(ids) // block) * block].view(-1, block)[: params.eval_batches * params.batch_size]
    if len(blocks) == 0:
        raise TrainError(f"the eval split has {len(ids)} tokens, fewer than one block of {block}")
    losses = []
    with torch.no_grad():
        for batch in blocks.split(params.batch_size):
            mask = torch.ones_like(batch)
            losses.append(model(input_ids=batch, attention_mask=mask, labels=batch).loss.item() * len(batch))
    return math.exp(sum(losses) / len(blocks))


def write_loss_plot(model: TrainedModel, path: Path) -> Path:
    """The training loss by step, with the eval perplexity in the title: the training run's
    picture in MLflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*model.loss_curve, strict=True) if model.loss_curve else ((), ())
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(steps, losses, color="#4c72b0")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (nats per token)")
    if model.eval_perplexity is not None:
        axes.set_title(f"eval perplexity {model.eval_perplexity:.2f} (uniform guess {model.uniform_perplexity or 0:.0f})", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
