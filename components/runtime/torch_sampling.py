"""Sampling where the logits are: per-row greedy, temperature and top-p as tensor ops, so a
CUDA graph can sample k steps in a row and only token ids cross to the host.

Each row draws from a counter-based stream (a hash of its key and its token index), not a
stateful generator: a row's n-th draw is the same whatever batch it is in, in whatever
turn, and a graph needs no generator state to capture. torch's own generators are one per
device (every row would share it) and Philox offsets cannot be set per row in a graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    # A 32-bit integer hash (Chris Wellons' lowbias32) in int64 lanes: products wrap in the
    # low 64 bits on every torch device and only the low 32 are kept.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _stream(keys: Tensor, counters: Tensor) -> Tensor:
    """Each row's 32-bit state for draw `counters[row]` of stream `keys[row]` (int64 lanes)."""
    low, high = keys & _MASK32, (keys >> 32) & _MASK32
    return _mix32(_mix32(low ^ _mix32(high)) ^ (counters & _MASK32))


def gumbel_noise(keys: Tensor, counters: Tensor, vocab: int) -> Tensor:
    """(rows, vocab) standard Gumbel noise, float32: a uniform per token of the row's draw,
    hashed from its stream state and the token id."""
    tokens = torch.arange(vocab, dtype=torch.long, device=keys.device)
    bits = _mix32(_stream(keys, counters).unsqueeze(1) ^ (tokens * 0x27D4EB2F & _MASK32))  # < 2**31: Triton indexes in int32
    return -torch.log(-torch.log(uniform_of(bits)))


def uniform_of(bits: Tensor) -> Tensor:
    """32 random bits → a float32 in (0, 1), never 0 or 1: the top 23 bits and a half, each
    exactly representable. With 24 bits the largest, (2**24 - 1 + 0.5) / 2**24, rounded to
    1.0, its noise to +inf: that token won whatever its logit (one draw in 2**24 per token,
    about one step in a hundred over a 152k vocabulary), and beside a grammar's -inf it made
    NaN, which argmax took: a forbidden token."""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample_rows(logits: Tensor, temperature: Tensor, top_p: Tensor, keys: Tensor, counters: Tensor) -> Tensor:
    """Each row's next token (int64): the argmax where its temperature is 0, else a draw
    from the nucleus (the most likely tokens whose probability before them is < top_p, as
    sampling.pick_next keeps) at its temperature, by the Gumbel-max trick. Gumbel-max
    rather than the inverse of the sorted CDF: a last-bit difference in the logits (another
    batch width runs other GEMM kernels) changes its draw only where two tokens' perturbed
    scores all but tie, whereas near-equal probabilities swap places in a sort."""
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    # The maximum comes off before the temperature divides (a tiny temperature: -inf, not NaN).
    scaled = (logits - logits.amax(-1, keepdim=True)) / scale
    probs = torch.softmax(scaled, dim=-1)
    ordered = probs.sort(-1, descending=True).values
    kept = ((ordered.cumsum(-1) - ordered) < top_p.unsqueeze(1)).sum(-1, keepdim=True)
    smallest_kept = ordered.gather(-1, kept - 1)
    scores = torch.where(probs >= smallest_kept, scaled + gumbel_noise(keys, counters, logits.shape[-1]), float("-inf"))
    return torch.where(greedy, logits.argmax(-1), scores.argmax(-1))


def top_logprobs(logits: Tensor, chosen: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-softmax of the raw logits (what runtime.logprobs reports): the chosen token's
    (rows,), and the `top` most likely tokens' ids and values (rows, top), most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, chosen.unsqueeze(1)).squeeze(1)
    values, ids = logprobs.topk(max(top, 1), dim=-1)
    return picked, ids, values


def forbid_disallowed(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """`logits[rows]` at -inf where a grammar forbids the token, in place: `bitmask` (len(rows),
    vocab / 32) int32, bit t of a row set where token t is allowed (llguidance's layout).
    Eager ops, not llguidance.torch's version of this, which is decorated with torch.compile
    and on a CPU device would compile C++ at its first call."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    forbidden = bits.flatten(1)[:, : logits.shape[-1]] == 0
    logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
