"""A model directory's weights read one tensor at a time, in the dtype they were saved in.

The stages that write a model's weights into ONNX (export, and the int8/int4 blocks made from
its checkpoint) read each tensor when they write it, so no stage holds the whole model in
fp32: a Llama-3.2-1B shape's export peaked at 10.9 GiB loading the model first and 2.0 GiB
reading this way (docs/performance.md). llama.cpp's converter and ONNX Runtime GenAI's
builder read checkpoints the same way.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from components.errors import ExportError

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"


class Checkpoint:
    """The weight files of a model directory: safetensors (sharded or not), else torch's
    `.bin` (memory-mapped, so a read touches one tensor's pages)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._torch_shards: dict[Path, dict[str, torch.Tensor]] = {}

    @cached_property
    def files(self) -> dict[str, Path]:
        """Every stored tensor's key and the file that holds it."""
        for index in (SAFETENSORS_INDEX, TORCH_INDEX):
            if (self.folder / index).is_file():
                return {key: self.folder / name for key, name in json.loads((self.folder / index).read_text())["weight_map"].items()}
        shards = sorted(self.folder.glob("*.safetensors")) or sorted(self.folder.glob("*.bin"))
        if not shards:
            raise ExportError(f"model directory {self.folder} has no weights (*.safetensors or *.bin)")
        return {key: shard for shard in shards for key in self._keys(shard)}

    def read(self, key: str) -> torch.Tensor:
        """One stored tensor, as saved (dtype and layout)."""
        shard = self.files[key]
        if shard.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(shard), framework="pt") as f:
                return f.get_tensor(key)
        return self._torch_shard(shard)[key]

    def key_of(self, name: str, base_prefix: str) -> str | None:
        """The stored key of a parameter called `name` in the loaded model: the same name, or
        without or with the base model's prefix (GPT-2's original checkpoints store `h.0...`
        for `transformer.h.0...`, as transformers' loader allows)."""
        stem = name.removeprefix(f"{base_prefix}.")
        return next((key for key in (name, stem, f"{base_prefix}.{stem}") if key in self.files), None)

    def _keys(self, shard: Path) -> list[str]:
        if shard.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(shard), framework="pt") as f:
                return list(f.keys())
        return list(self._torch_shard(shard))

    def _torch_shard(self, shard: Path) -> dict[str, torch.Tensor]:
        import torch

        if shard not in self._torch_shards:  # mmap: the pages are read as the tensors are, not at load
            self._torch_shards[shard] = torch.load(str(shard), map_location="cpu", mmap=True, weights_only=True)
        return self._torch_shards[shard]


def parameter_keys(model: torch.nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Each of `model`'s parameter names (tied ones under every name) → the stored key of its
    tensor. Tied parameters are one tensor and the checkpoint stores it under one of their
    names (a tied LM head is saved as the embedding). ExportError naming what is missing."""
    base_prefix = getattr(model, "base_model_prefix", "")
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    keys, missing = {}, []
    for names in tied.values():
        stored = next((key for key in (checkpoint.key_of(n, base_prefix) for n in names) if key is not None), None)
        if stored is None:
            missing.append(names[0])
        keys |= dict.fromkeys(names, stored)
    if missing:
        raise ExportError(f"{checkpoint.folder}: the weight files hold no tensor for {len(missing)} of the model's parameters ({', '.join(missing[:3])}...)")
    return keys
