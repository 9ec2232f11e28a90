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
    cache.store(prompt, lambda: row_cache(11))
    hit = cache.lookup(prompt + [7, 8])
    assert hit.tokens == 8 and hit.cache[0].shape == (1, 2, 8, 4) and hit.cache[0][0, 0, :, 0].tolist() == list(range(8))
    assert cache.lookup(prompt[:8]).tokens == 4  # the whole prompt cached: one token is left to prefill
    assert cache.lookup(prompt[:4]) is None
    assert cache.totals.queries == 3 and cache.totals.hits == 2 and cache.totals.cached_tokens == 12 and cache.totals.queried_tokens == 13 + 8 + 4


def test_prompts_differing_in_the_last_token_of_a_block_never_share_it():
    cache = PrefixCache(1 << 20, block=4)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9], lambda: row_cache(9))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 99, 9, 10]).tokens == 4
    assert cache.lookup([1, 2, 3, 99, 5, 6, 7, 8, 9]) is None


def test_a_hit_is_its_own_copy_and_never_writes_into_what_the_cache_holds():
    cache = PrefixCache(1 << 20, block=4)
    cache.store([5, 6, 7, 8, 9], lambda: row_cache(5))
    first = cache.lookup([5, 6, 7, 8, 0])
    assert first.cache[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    first.cache[0][:] = -1.0
    assert cache.lookup([5, 6, 7, 8, 0]).cache[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_prompt_whose_blocks_are_all_held_is_stored_without_reading_the_engines_cache():
    """A busy server's stores mostly find every block held (the bench's prompts after their
    first round, a conversation's earlier turns): the engine's views are not even made."""
    cache, reads = PrefixCache(1 << 20, block=4), []

    def kv(tokens: int):
        return lambda: reads.append(tokens) or row_cache(tokens)

    cache.store(list(range(9)), kv(9))
    cache.store(list(range(8)), kv(8))  # its two blocks are held
    cache.store(list(range(11)), kv(11))  # a partial block: nothing new either
    assert reads == [9]
    cache.store(list(range(12)), kv(12))
    assert reads == [9, 12] and cache.read().blocks == 3


def test_what_a_left_padded_row_gives_the_cache_is_its_own_positions(engine):
    """A batch's rows are left-padded: a row's prompt is its last positions."""
    from components.runtime.engine import DecodeState

    values = np.broadcast_to(np.arange(7, dtype=np.float32)[None, None, :, None], (2, 2, 7, 4)).copy()
    mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], np.int64)
    state = DecodeState([values, values + 100], mask, np.array([[4], [6]], np.int64))
    keys, vals = engine.kv_of(state, 0, 4)
    assert keys.shape == (1, 2, 4, 4) and keys[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0] and vals[0, 1, 0, 0] == 102.0
    assert engine.kv_of(state, 1, 3)[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]


def test_the_least_recently_used_prompts_leave_when_the_budget_is_spent():
    size = sum(part.nbytes for part in row_cache(4))  # one block of one prompt
    cache = PrefixCache(2 * size, block=4)
    cache.store([1, 1, 1, 1, 9], lambda: row_cache(5))
    cache.store([2, 2, 2, 2, 9], lambda: row_cache(5))
    assert cache.lookup([1, 1, 1, 1, 0]) is not None  # 1 is now the more recently used
    cache.store([3, 3, 3, 3, 9], lambda: row_cache(5))
    assert cache.bytes <= 2 * size and cache.totals.evictions == 1
    assert cache.lookup([2, 2, 2, 2, 0]) is None and cache.lookup([1, 1, 1, 1, 0]) is not None


def test_a_conversations_turns_share_the_blocks_they_begin_with():
    """The next turn's prompt (this one's prompt and reply) adds only its new blocks."""
    cache = PrefixCache(1 << 20, block=4)
    block = sum(part.nbytes for part in row_cache(4))
    cache.store(list(range(9)), lambda: row_cache(9))
    assert cache.bytes == 2 * block
    cache.store(list(range(14)), lambda: row_cache(14))
    assert cache.bytes == 3 * block and cache.read().blocks == 3
    hit = cache.lookup(list(range(14)) + [99])
    assert hit.tokens == 12 and hit.cache[1][0, 1, :, 3].tolist() == list(range(12))


def test_eviction_takes_the_ends_of_prompts_before_the_blocks_others_begin_with():
    block = sum(part.nbytes for part in row_cache(4))
    cache = PrefixCache(3 * block, block=4)
    cache.store([1, 1, 1, 1, 2, 2, 2, 2, 9], lambda: row_cache(9))
    cache.store([1, 1, 1, 1, 3, 3, 3, 3, 9], lambda: row_cache(9))  # shares the first block
    cache.store([4, 4, 4, 4, 9], lambda: row_cache(5))  # room for it: the least recently used end goes
    assert cache.bytes == 3 * block and cache.totals.evictions == 1
    assert cache.lookup([1, 1, 1, 1, 2, 2, 2, 2, 0]).tokens == 4  # its end was dropped, not the shared beginning
    assert cache.lookup([1, 1, 1, 1, 3, 3, 3, 3, 0]).tokens == 8
    assert cache.lookup([4, 4, 4, 4, 0]).tokens == 4


def test_a_budget_too_small_for_a_block_holds_nothing_and_the_counts_are_read_once():
    cache = PrefixCache(10, block=4)
    cache.store([1, 2, 3, 4, 5], lambda: row_cache(5))
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is None and cache.bytes == 0
    counts = cache.read()
    assert (counts.queries, counts.hits, counts.queried_tokens, counts.bytes, counts.blocks) == (1, 0, 6, 0, 0)
    assert cache.read().queries == 0


def test_a_conversations_next_turn_prefills_only_what_is_new_and_answers_as_without_the_cache(engine_dir):
    """The scheduler on the ONNX Runtime engine: the second request begins with the first's
    prompt, so its first whole blocks come from the cache, and the last begins with the
    second's prompt and reply, which its finished turn left there; greedy and seeded answers
    and their log probabilities are those of the engine without a cache."""
    check_conversation(engine_dir.path, engine_dir.path)


LONG_TURNS = ("The list type is a mutable sequence. A tuple is an immutable sequence of values. ", "Which one do you use for keys of a dict?")
SHORT_TURNS = ("A tuple is an immutable sequence. ", "Which is for keys?")  # for tokenizers of a few hundred tokens


def check_conversation(engine_path, tokenizer_path, turns: tuple[str, str] = LONG_TURNS) -> None:
    """A conversation's turns through the scheduler with a prefix cache and without: the
    cached tokens each turn reused, and the same answers (the torch-cuda tests call it too)."""
    from components.runtime import load_engine
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(tokenizer_path)
    first = tokenizer.encode(turns[0])
    second = first + tokenizer.encode(turns[1])
    cache = PrefixCache(16 << 20)

    def answers(prefix_cache: PrefixCache | None) -> list[Sequence]:
        done = threading.Semaphore(0)
        with load_engine(engine_path) as own:
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
    from .test_serving import metrics_of

    system = "You answer questions about the built-in types in one sentence. "
    settings = ServerSettings(poll_interval_s=0, runtime=RuntimeOptions(prefix_cache_bytes=16 << 20))
    with LiveServer(create_app(LocalSource(engine_dir.path), settings)) as live:
        model = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        asked = [client.completions.create(model=model, prompt=system + question, max_tokens=6, temperature=0) for question in ("What is a list?", "What is a dict?")]
        metrics = metrics_of(live)
    reused = asked[1].usage.prompt_tokens_details.cached_tokens
    assert asked[0].usage.prompt_tokens_details is None
    assert reused >= 16 and reused % 16 == 0
    assert metrics["kiln_prefix_cache_queries_total"] == 2 and metrics["kiln_prefix_cache_hits_total"] == 1
    assert metrics["kiln_prefix_cache_queried_tokens_total"] == sum(a.usage.prompt_tokens for a in asked)
    assert metrics["kiln_prefix_cache_cached_tokens_total"] == reused
    assert metrics["kiln_prefix_cache_bytes"] > 0 and metrics["kiln_prefix_cache_blocks"] >= reused // 16


def test_a_burst_that_shares_an_uncached_beginning_computes_it_once_and_answers_as_without_the_cache(engine_dir):
    """Three prompts arriving together that begin alike: the first is prefilled, the others
    wait for it and take its blocks, prefilled after them together; a prompt asking for its
    own log probabilities does not."""
    from components.runtime import load_engine
    from components.runtime.tokenizer import EngineTokenizer
    from serving.scheduler import Finished, Scheduler, Sequence

    tokenizer = EngineTokenizer(engine_dir.path)
    system = tokenizer.encode("You answer questions about the built-in types of Python in one plain sentence, with an example of each, and nothing else. ")
    prompts = [system + tokenizer.encode(question) for question in ("What is a list?", "What is a dict?", "What is a set?", "What is a str?")]
    shared = len(system) // 16 * 16
    assert shared >= 16 and all(2 * shared >= len(p) for p in prompts)

    def answers(prefix_cache: PrefixCache | None) -> list[Sequence]:
        done = threading.Semaphore(0)
        samplings = [Sampling(max_new_tokens=6, logprobs=1)] * 3 + [Sampling(max_new_tokens=6, prompt_logprobs=1)]
        asked = [Sequence(p, s, lambda e: done.release() if isinstance(e, Finished) else None) for p, s in zip(prompts, samplings, strict=True)]
        with load_engine(engine_dir.path) as own:
            each = own.prefill_after_each
            own.prefill_after_each = lambda hits: (hits_prefilled.append(len(hits)), each(hits))[1]
            scheduler = Scheduler(own, tokenizer, max_waiting=4, prefix_cache=prefix_cache)
            scheduler.submit(asked)  # one burst: admitted in the same turn
            assert all(done.acquire(timeout=60) for _ in asked)
            assert scheduler.close(timeout=10)
        return asked

    hits_prefilled: list[int] = []
    cache = PrefixCache(16 << 20)
    cached, plain = answers(cache), answers(None)
    assert [s.cached_tokens for s in cached] == [0, shared, shared, 0]
    assert hits_prefilled == [2]  # the hits together (torch-cuda: one pass of its prefill graphs), not one call each
    assert (cache.totals.queries, cache.totals.hits) == (3, 2)  # the scored prompt is never looked up
    for ours, theirs in zip(cached, plain, strict=True):
        assert ours.generated == theirs.generated
        np.testing.assert_allclose([lp.logprob for lp in ours.logprobs], [lp.logprob for lp in theirs.logprobs], atol=1e-4)
