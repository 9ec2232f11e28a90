"""The KV caches of prompts the engine process has prefilled, so that a request whose prompt
begins with one of them prefills only the rest (vLLM's automatic prefix caching and
llama.cpp's slot reuse do this for the same reason: a conversation sends its whole history
again on every turn).

Kept in whole blocks of `block` tokens, matched by exact token comparison, within a byte
budget, the least recently used dropped first. Entries and what a hit hands out are copies:
an engine that appends its cache in place writes after a cache's end, and a request must
never write into what the next one reuses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BLOCK = 16


@dataclass
class PrefixStats:
    queries: int = 0
    hits: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache was reused, over all hits
    evictions: int = 0


@dataclass(frozen=True)
class Hit:
    tokens: int  # the prompt's first `tokens` are cached
    cache: list[np.ndarray]  # (1, kv heads, tokens, head dim) per past tensor, the hit's own copy


class PrefixCache:
    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        self.max_bytes, self.block = max_bytes, block
        self.bytes = 0
        self.stats = PrefixStats()
        self._entries: OrderedDict[tuple[int, ...], list[np.ndarray]] = OrderedDict()
        self._ids: dict[tuple[int, ...], np.ndarray] = {}  # each key's tokens as an array, made once: lookups compare them on the engine's thread

    def lookup(self, prompt: list[int]) -> Hit | None:
        """The longest cached beginning of `prompt` in whole blocks, leaving at least one of
        its tokens to prefill (the first token's logits come from it)."""
        self.stats.queries += 1
        limit = (len(prompt) - 1) // self.block * self.block
        wanted = np.asarray(prompt[:limit])
        best, found = 0, None
        for key in self._entries:
            length = min(len(key), limit)
            if length <= best:
                continue
            same = self._ids[key][:length] == wanted[:length]
            common = (length if same.all() else int(np.argmin(same))) // self.block * self.block
            if common > best:
                best, found = common, key
        if found is None:
            return None
        self._entries.move_to_end(found)
        self.stats.hits += 1
        self.stats.cached_tokens += best
        return Hit(best, [part[:, :, :best].copy() for part in self._entries[found]])

    def store(self, prompt: list[int], cache: list[np.ndarray]) -> None:
        """Keep the cache of `prompt`'s whole blocks: `cache` holds one row whose last
        `len(prompt)` positions are the prompt's."""
        length = len(prompt) // self.block * self.block
        key = tuple(prompt[:length])
        if not length:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        start = cache[0].shape[2] - len(prompt)
        parts = [part[:, :, start : start + length].copy() for part in cache]
        size = sum(part.nbytes for part in parts)
        if size > self.max_bytes:
            return
        self._entries[key] = parts
        self._ids[key] = np.asarray(key)
        self.bytes += size
        while self.bytes > self.max_bytes:
            gone, dropped = self._entries.popitem(last=False)
            del self._ids[gone]
            self.bytes -= sum(part.nbytes for part in dropped)
            self.stats.evictions += 1
