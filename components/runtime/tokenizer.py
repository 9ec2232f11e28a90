"""The engine directory's tokenizer through `tokenizers` alone (no transformers import)."""

from __future__ import annotations

from pathlib import Path


class EngineTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)
