"""Token log probabilities (computed in the engine process) in the two shapes OpenAI's API
gives them: the completions API's parallel lists and the chat API's list of tokens."""

from __future__ import annotations

from collections.abc import Sequence

from components.runtime.logprobs import TokenLogprob
from components.runtime.tokenizer import EngineTokenizer
from serving.schemas import CompletionLogprobs, TokenLogprobs, TopLogprob


def completion_logprobs(tokenizer: EngineTokenizer, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None], offset: int = 0) -> CompletionLogprobs:
    """`tokens` with their log probabilities (None: a prompt's first token); `offset` is where
    the first token's text begins in the text these tokens continue (a stream's earlier chunks)."""
    texts = [tokenizer.token_text(token) for token in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[None if entry is None else entry.logprob for entry in logprobs],
        top_logprobs=[None if entry is None else _top_dict(tokenizer, text, entry) for text, entry in zip(texts, logprobs, strict=True)],
        text_offset=offsets,
    )


def _top_dict(tokenizer: EngineTokenizer, chosen: str, entry: TokenLogprob) -> dict[str, float]:
    """The alternatives, most likely first, and the chosen token (as vLLM and OpenAI's
    legacy API give it: up to logprobs + 1 entries). Two ids of the same text keep the
    likelier one's entry."""
    top: dict[str, float] = {}
    for token, logprob in entry.top:
        top.setdefault(tokenizer.token_text(token), logprob)
    top.setdefault(chosen, entry.logprob)
    return top


def chat_logprobs(tokenizer: EngineTokenizer, tokens: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobs]:
    """The chat API's `logprobs.content`: each token with its bytes and `top_logprobs` alternatives."""
    return [
        TokenLogprobs(**_described(tokenizer, token, entry.logprob).model_dump(), top_logprobs=[_described(tokenizer, t, lp) for t, lp in entry.top])
        for token, entry in zip(tokens, logprobs, strict=True)
    ]


def _described(tokenizer: EngineTokenizer, token: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_text(token)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
