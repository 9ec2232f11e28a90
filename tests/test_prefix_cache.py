"""The prefix cache: a prompt beginning with one prefilled before prefills only the rest, in
whole blocks, with the same answers as without it, within its budget."""

from __future__ import annotations

import threading

import numpy as np

from components.runtime.sampling import Sampling
from serving.prefix_cache import PrefixCache


def row_cache(tokens: int, fill: float = 0.0) -> list[np.ndarray]:
    """A one-row cache of two tensors (1, 2 heads, tokens, 4), each position's values its index."""
    values = np.broadcast_to(np.arange(tokens, dtype=np.float32)[None, None, :, None] + fill, (1, 2, tokens, 4))
    return [values.copy(), values.copy()]


def test_a_hit_is_the_longest_cached_beginning_in_whole_blocks_leaving_a_token_to_prefill():
    cache = PrefixCache(1 << 20, block=4)
    prompt = list(range(100, 111))  # 11 tokens: blocks of 4 keep 8
    cache.store(prompt, row_cache(11))
    hit = cache.lookup(prompt + [7, 8])
    assert hit.tokens == 8 and hit.cache[0].shape == (1, 2, 8, 4) and hit.cache[0][0, 0, :, 0].tolist() == list(range(8))
    assert cache.lookup(prompt[:8]).tokens == 4  # the whole prompt cached: one token is left to prefill
    assert cache.lookup(prompt[:4]) is None
    assert cache.stats.queries == 3 and cache.stats.hits == 2 and cache.stats.cached_tokens == 12


def test_prompts_differing_in_the_last_token_of_a_block_never_share_it():
    cache = PrefixCache(1 << 20, block=4)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9], row_cache(9))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 99, 9, 10]).tokens == 4
    assert cache.lookup([1, 2, 3, 99, 5, 6, 7, 8, 9]) is None


def test_a_stored_cache_is_the_prompts_own_positions_and_no_hit_writes_into_it():
    """A batch's row is left-padded: its prompt is the last positions of the row."""
    cache = PrefixCache(1 << 20, block=4)
    cache.store([5, 6, 7, 8, 9], row_cache(7))  # 2 positions of padding, then the prompt
    first = cache.lookup([5, 6, 7, 8, 0])
    assert first.cache[0][0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    first.cache[0][:] = -1.0
    assert cache.lookup([5, 6, 7, 8, 0]).cache[0][0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]


def test_the_least_recently_used_prompts_leave_when_the_budget_is_spent():
    size = sum(part.nbytes for part in row_cache(4))  # one block of one prompt
    cache = PrefixCache(2 * size, block=4)
    cache.store([1, 1, 1, 1, 9], row_cache(5))
    cache.store([2, 2, 2, 2, 9], row_cache(5))
    assert cache.lookup([1, 1, 1, 1, 0]) is not None  # 1 is now the more recently used
    cache.store([3, 3, 3, 3, 9], row_cache(5))
    assert cache.bytes <= 2 * size and cache.stats.evictions == 1
    assert cache.lookup([2, 2, 2, 2, 0]) is None and cache.lookup([1, 1, 1, 1, 0]) is not None


def test_a_conversations_next_turn_prefills_only_what_is_new_and_answers_as_without_the_cache(engine_dir):
    """The scheduler on the ONNX Runtime engine: the second request begins with the first's
    prompt, so its first whole blocks come from the cache, and the last begins with the
    second's prompt and reply, which its finished turn left there; greedy and seeded answers
    and their log probabilities are those of the engine without a cache."""
    from components.runtime import load_engine
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    first = tokenizer.encode("The list type is a mutable sequence. A tuple is an immutable sequence of values. ")
    second = first + tokenizer.encode("Which one do you use for keys of a dict?")
    cache = PrefixCache(16 << 20)

    def answers(prefix_cache: PrefixCache | None) -> list[Sequence]:
        done = threading.Semaphore(0)
        with load_engine(engine_dir.path) as own:
            scheduler = Scheduler(own, tokenizer, max_waiting=4, prefix_cache=prefix_cache)
            asked = []
            turns = [(first, Sampling(max_new_tokens=8, logprobs=2)), (second, Sampling(max_new_tokens=16, logprobs=2, stop_at_eos=False)), (second, Sampling(max_new_tokens=8, temperature=0.9, seed=5))]
            for prompt, sampling in turns + [(None, Sampling(max_new_tokens=8))]:
                # the last turn: the second one's prompt and reply, then a new question
                prompt = prompt or second + asked[1].generated + tokenizer.encode(" And a set?")
                asked.append(Sequence(prompt, sampling, lambda e: done.release() if isinstance(e, Finished) else None))
                scheduler.submit([asked[-1]])
                assert done.acquire(timeout=60)
            assert scheduler.close(timeout=10)
        return asked

    cached, plain = answers(cache), answers(None)
    replied = len(second) + len(cached[1].generated) - 1  # the reply's last token was never fed
    assert [s.cached_tokens for s in cached] == [0, len(first) // 16 * 16, (len(second) - 1) // 16 * 16, replied // 16 * 16]
    assert replied // 16 * 16 > len(second) // 16 * 16  # the reply's own blocks, not only the prompt's
    assert [s.cached_tokens for s in plain] == [0, 0, 0, 0]
    for ours, theirs in zip(cached, plain, strict=True):
        assert ours.generated == theirs.generated
        np.testing.assert_allclose([lp.logprob for lp in ours.logprobs], [lp.logprob for lp in theirs.logprobs], atol=1e-4)


def test_the_openai_client_sees_the_cached_prompt_tokens_in_the_usage(engine_dir):
    import httpx
    from openai import OpenAI

    from serving.app import ServerSettings, create_app
    from serving.engine_process import RuntimeOptions
    from serving.sources import LocalSource

    from .live_server import LiveServer

    system = "You answer questions about the built-in types in one sentence. "
    settings = ServerSettings(poll_interval_s=0, runtime=RuntimeOptions(prefix_cache_bytes=16 << 20))
    with LiveServer(create_app(LocalSource(engine_dir.path), settings)) as live:
        model = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        asked = [client.completions.create(model=model, prompt=system + question, max_tokens=6, temperature=0) for question in ("What is a list?", "What is a dict?")]
    assert asked[0].usage.prompt_tokens_details is None
    assert asked[1].usage.prompt_tokens_details.cached_tokens >= 16 and asked[1].usage.prompt_tokens_details.cached_tokens % 16 == 0
