"""The KV caches of prompts the engine process has prefilled, so that a request whose prompt
begins with one of them prefills only the rest (vLLM's automatic prefix caching and
llama.cpp's slot reuse do this for the same reason: a conversation sends its whole history
again on every turn).

Kept as a tree of blocks of `block` tokens: a block is found by its parent and its own
tokens, compared exactly, so a conversation's turns share the blocks they begin with
(each held once) and two prompts share nothing after the first block where they differ.
Within a byte budget, accounted before a block is copied, the least recently used blocks
without children leave first. Blocks and what a hit hands out are copies: an engine that
appends its cache in place writes after a cache's end, and a request must never write into
what the next one reuses. The parts are numpy arrays (ONNX Runtime's host cache) or torch
tensors on the engine's device (torch-cuda's slots): the cache then lives beside them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import numpy as np

BLOCK = 16


@dataclass
class PrefixCounts:
    """What the cache did since its owner last read it, and what it holds now."""

    queries: int = 0  # prompts looked up
    hits: int = 0  # prompts that began with cached blocks
    queried_tokens: int = 0  # tokens of the prompts looked up
    cached_tokens: int = 0  # prompt tokens whose cache was reused, over all hits
    evictions: int = 0  # blocks dropped for room
    bytes: int = 0  # held now
    blocks: int = 0  # held now


@dataclass(frozen=True)
class Hit:
    tokens: int  # the prompt's first `tokens` are cached
    cache: list[np.ndarray]  # the parts of the engine's `kv_of`, tokens on axis 2: the hit's own copy


@dataclass(eq=False)
class _Block:
    serial: int  # names it as a parent in its children's keys
    key: tuple[int, tuple[int, ...]]  # (the parent's serial, 0 for the first block; its tokens)
    parent: _Block | None
    parts: list[np.ndarray]  # the parts of the engine's `kv_of`, `block` tokens each on axis 2
    children: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(part.nbytes for part in self.parts)


class PrefixCache:
    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        self.max_bytes, self.block = max_bytes, block
        self.bytes = 0
        self.totals = PrefixCounts()  # since the cache was made
        self._read = PrefixCounts()  # the totals when `read` was last called
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # least recently used first
        self._serials = count(1)

    def lookup(self, prompt: list[int]) -> Hit | None:
        """The longest cached beginning of `prompt` in whole blocks, leaving at least one of
        its tokens to prefill (the first token's logits come from it)."""
        self.totals.queries += 1
        self.totals.queried_tokens += len(prompt)
        path = self._path(prompt, (len(prompt) - 1) // self.block)
        if not path:
            return None
        self._touch(path)
        tokens = len(path) * self.block
        self.totals.hits += 1
        self.totals.cached_tokens += tokens
        return Hit(tokens, [_joined([b.parts[i] for b in path]) for i in range(len(path[0].parts))])

    def store(self, prompt: list[int], kv: Callable[[], list[np.ndarray]]) -> None:
        """Keep the cache of `prompt`'s whole blocks that are not held yet: `kv` gives one row
        of the prompt's positions (an engine's `kv_of`), called only where a block is new
        (most stores of a busy server find every block held: on a GPU, its views cost more
        host time than the step)."""
        whole = len(prompt) // self.block
        path = self._path(prompt, whole)
        self._touch(path)
        parent = path[-1] if path else None
        cache = kv() if len(path) < whole else []
        for index in range(len(path), whole):
            at = index * self.block
            size = sum(part[:, :, at : at + self.block].nbytes for part in cache)
            if not self._make_room(size, keep=parent):
                break
            key = (parent.serial if parent else 0, tuple(prompt[index * self.block : (index + 1) * self.block]))
            block = _Block(next(self._serials), key, parent, [_copied(part[:, :, at : at + self.block]) for part in cache])
            self._blocks[key] = block
            self.bytes += block.nbytes
            if parent is not None:
                parent.children += 1
            path.append(block)
            parent = block
        self._touch(path)

    def read(self) -> PrefixCounts:
        """The counts since the last read, and the bytes and blocks held now."""
        totals, before = self.totals, self._read
        self._read = PrefixCounts(totals.queries, totals.hits, totals.queried_tokens, totals.cached_tokens, totals.evictions)
        return PrefixCounts(
            totals.queries - before.queries,
            totals.hits - before.hits,
            totals.queried_tokens - before.queried_tokens,
            totals.cached_tokens - before.cached_tokens,
            totals.evictions - before.evictions,
            self.bytes,
            len(self._blocks),
        )

    def _path(self, prompt: list[int], blocks: int) -> list[_Block]:
        """The cached blocks `prompt` begins with, at most `blocks` of them."""
        path, parent = [], 0
        for index in range(blocks):
            found = self._blocks.get((parent, tuple(prompt[index * self.block : (index + 1) * self.block])))
            if found is None:
                break
            path.append(found)
            parent = found.serial
        return path

    def _touch(self, path: list[_Block]) -> None:
        """Most recently used, the first block last: a parent is then always more recent than
        its children, and the least recently used block has none."""
        for block in reversed(path):
            self._blocks.move_to_end(block.key)

    def _make_room(self, size: int, keep: _Block | None) -> bool:
        """Drop least recently used childless blocks (never `keep` or its ancestors) until
        `size` more bytes fit the budget; False where they cannot."""
        if self.bytes + size <= self.max_bytes:
            return True
        if size > self.max_bytes:
            return False
        kept = set()
        while keep is not None:
            kept.add(keep.serial)
            keep = keep.parent
        while self.bytes + size > self.max_bytes:
            victim = next((b for b in self._blocks.values() if not b.children and b.serial not in kept), None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            self.bytes -= victim.nbytes
            self.totals.evictions += 1
            if victim.parent is not None:
                victim.parent.children -= 1
        return True


def _copied(part):
    """A block's own copy of a stretch of an engine's cache (numpy or torch)."""
    return part.copy() if isinstance(part, np.ndarray) else part.clone()


def _joined(parts: list):
    """Blocks end to end along the token axis, in a new array (numpy or torch)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    import torch

    return torch.cat(parts, dim=2)
