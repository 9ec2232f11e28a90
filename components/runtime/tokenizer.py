"""The engine directory's tokenizer through `tokenizers` alone (no transformers import)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class EngineTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer has, added ones included (a model's table may have more rows)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The text's tokens alone (a stretch of a token stream, as the gates cut them)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model expects to begin: with whatever the tokenizer's own
        post-processor adds (Llama's BOS; nothing for GPT-2), as transformers and vLLM
        encode a prompt."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (`<s>`), as logprobs name tokens; part
        of a character split over tokens is U+FFFD."""
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def stream_decoder(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """Text one token at a time, as `decode` would give it for the whole sequence:
        `tokenizers`' DecodeStream keeps the pending bytes of a character split over
        tokens (None until it is complete), at constant cost per token. Special tokens are
        left out unless asked for (a tool call's `[TOOL_CALLS]` is one)."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token: stream.step(self._tokenizer, token)
