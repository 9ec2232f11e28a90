"""The ONNX Runtime engine: its directory contract and generation over the KV cache."""

import json
import shutil

import numpy as np
import pytest
import torch

from components.engine_dir import load_engine_dir
from components.errors import EngineError, ShapeOutOfProfile
from components.files import file_sha256
from components.runtime import load_engine
from components.runtime.engine import DecodeState, left_pad
from components.runtime.sampling import Sampling, pick_each
from components.runtime.tokenizer import EngineTokenizer

from .conftest import EosAfter


def test_engine_json_records_identity_profiles_and_lineage(engine_dir, tiny_model, exported, data_version):
    manifest = json.loads((engine_dir.path / "engine.json").read_text())
    assert manifest["backend"] == "onnxruntime" and manifest["target"] == "cpu" and manifest["precision"] == "fp32"
    assert manifest["engine_sha256"] == file_sha256(engine_dir.path / "model.onnx")
    assert manifest["lineage"]["source_model_sha256"] == tiny_model.sha256
    assert manifest["lineage"]["data_md5"] == data_version.md5
    assert manifest["profiles"]["context"]["past"]["max"] == 0
    assert manifest["profiles"]["generation"]["sequence"] == {"min": 1, "opt": 1, "max": 1}
    assert manifest["parity"]["prefill_max_abs_diff"] == exported.parity.prefill_max_abs_diff
    assert {"tokenizer.json", "model.onnx", "engine.json"} <= {p.name for p in engine_dir.path.iterdir()}


def test_greedy_generation_matches_pytorch_greedy(engine, reference, engine_dir):
    tokenizer = EngineTokenizer(engine_dir.path)
    prompt = tokenizer.encode("The list type")
    ours = engine.generate([prompt], Sampling(max_new_tokens=12, stop_at_eos=False))[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


def test_a_left_padded_batch_generates_what_each_prompt_does_alone(engine, engine_dir):
    tokenizer = EngineTokenizer(engine_dir.path)
    prompts = [tokenizer.encode("The list type"), tokenizer.encode("A function that returns the value of")]
    greedy = Sampling(max_new_tokens=6, stop_at_eos=False)
    together = engine.generate(prompts, greedy)
    assert together == [engine.generate([p], greedy)[0] for p in prompts]


@pytest.mark.parametrize("first", ["long", "short"])
def test_a_row_that_joins_or_leaves_a_running_batch_decodes_as_it_would_alone(engine, engine_dir, first):
    """Continuous batching's cache surgery: a prompt joins a batch that has decoded for a
    while (either side the shorter), then the other leaves; each gets its greedy tokens."""
    tokenizer = EngineTokenizer(engine_dir.path)
    prompts = {"long": tokenizer.encode("A function that returns the value of"), "short": tokenizer.encode("The")}
    second = "short" if first == "long" else "long"
    eos = engine.manifest.eos_token_id
    got: dict[str, list[int]] = {first: [], second: []}

    def prefilled(name: str) -> tuple[np.ndarray, DecodeState]:
        logits, state = engine.prefill(*left_pad([prompts[name]], eos))
        return logits[:, -1].argmax(-1), state

    def step(state: DecodeState, next_ids: np.ndarray, names: list[str]) -> tuple[np.ndarray, DecodeState]:
        for name, token in zip(names, next_ids.tolist(), strict=True):
            got[name].append(token)
        logits, state = engine.decode(state, next_ids)
        return logits.argmax(-1), state

    next_ids, state = prefilled(first)
    for _ in range(2):
        next_ids, state = step(state, next_ids, [first])
    joining_ids, joining = prefilled(second)
    next_ids, state = np.concatenate([next_ids, joining_ids]), state.joined(joining)
    for _ in range(3):
        next_ids, state = step(state, next_ids, [first, second])
    got[first].append(int(next_ids[0]))
    next_ids, state = next_ids[[1]], state.rows([1])
    assert state.past_length == len(prompts[second]) + 3  # the columns only `first` attended to are gone
    for _ in range(2):
        next_ids, state = step(state, next_ids, [second])
    got[second].append(int(next_ids[0]))
    greedy = Sampling(max_new_tokens=6, stop_at_eos=False)
    assert got == {name: engine.generate([prompt], greedy)[0] for name, prompt in prompts.items()}


def test_a_row_put_into_a_finished_rows_slot_decodes_as_it_would_alone(engine, engine_dir):
    """The scheduler's slot reuse: a short prompt written in place over a finished row of a
    wider batch gets the logits it gets alone, step after step, and the other row its own."""
    tokenizer = EngineTokenizer(engine_dir.path)
    prompts = [tokenizer.encode("A function that returns the value of"), tokenizer.encode("The list of")]
    eos = engine.manifest.eos_token_id
    logits, state = engine.prefill(*left_pad(prompts, eos))
    next_ids = logits[:, -1].argmax(-1)
    for _ in range(3):  # the batch grows wider than the newcomer's prompt
        logits, state = engine.decode(state, next_ids)
        next_ids = logits.argmax(-1)
    kept_logits, kept = engine.prefill(*left_pad(prompts[:1], eos))  # row 0 alone, for comparison
    kept_ids = kept_logits[:, -1].argmax(-1)
    for _ in range(3):
        kept_logits, kept = engine.decode(kept, kept_ids)
        kept_ids = kept_logits.argmax(-1)
    alone_logits, alone = engine.prefill(*left_pad([tokenizer.encode("The")], eos))
    state.put(1, alone, 0)  # row 1 finished; the newcomer takes its slot
    alone_ids = alone_logits[:, -1].argmax(-1)
    next_ids[1] = alone_ids[0]
    for _ in range(4):
        logits, state = engine.decode(state, next_ids)
        alone_logits, alone = engine.decode(alone, alone_ids)
        kept_logits, kept = engine.decode(kept, kept_ids)
        np.testing.assert_allclose(logits[1], alone_logits[0], atol=1e-4)
        np.testing.assert_allclose(logits[0], kept_logits[0], atol=1e-4)
        next_ids, alone_ids, kept_ids = logits.argmax(-1), alone_logits.argmax(-1), kept_logits.argmax(-1)
    assert state.past_length > alone.past_length  # the newcomer sat right-aligned in a wider cache


def test_sampling_is_reproducible_for_a_seed(engine, engine_dir):
    prompt = [EngineTokenizer(engine_dir.path).encode("The")]
    sampled = [engine.generate(prompt, Sampling(max_new_tokens=16, temperature=1.5, seed=s, stop_at_eos=False))[0] for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    assert sampled[0] != sampled[2]


def test_a_row_that_cannot_be_sampled_is_named_and_the_other_rows_keep_their_tokens():
    logits = np.array([[0.0, 3.0, 1.0], [np.nan, 1.0, 2.0], [2.0, 0.0, 1.0]], np.float32)
    samplings = [Sampling(), Sampling(temperature=1.0, seed=0), Sampling(temperature=0.7, seed=0)]
    picked, failed = pick_each(logits, samplings, [None, np.random.default_rng(0), np.random.default_rng(0)])
    assert list(failed) == [1] and "NaN" in failed[1]
    assert picked[0] == 1 and picked[2] in (0, 1, 2)


@pytest.mark.parametrize(
    ("settings", "named"),
    [({"seed": -1}, "seed"), ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_a_sampling_that_could_not_draw_is_refused_when_made_naming_the_setting(settings, named):
    with pytest.raises(ValueError, match=named):
        Sampling(**settings)


def test_top_p_near_zero_is_greedy(engine, engine_dir):
    prompt = [EngineTokenizer(engine_dir.path).encode("The list")]
    nucleus = engine.generate(prompt, Sampling(max_new_tokens=8, temperature=1.0, top_p=1e-9, seed=3, stop_at_eos=False))
    assert nucleus == engine.generate(prompt, Sampling(max_new_tokens=8, stop_at_eos=False))


def test_a_prompt_longer_than_the_profile_is_refused_with_the_limit(engine):
    limit = engine.manifest.profiles["context"].sequence.max
    with pytest.raises(ShapeOutOfProfile, match=rf"prompt of {limit + 1} tokens .*\(1\.\.{limit} tokens\)"):
        engine.generate([[1] * (limit + 1)], Sampling(max_new_tokens=1))


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(engine):
    context = engine.manifest.profiles["generation"].past.max + 1
    with pytest.raises(ShapeOutOfProfile, match=f"allows {context}"):
        engine.generate([[1] * 10], Sampling(max_new_tokens=context))


def test_a_corrupt_engine_file_is_refused_before_loading(tmp_path, engine_dir):
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir.path, copy)
    data = bytearray((copy / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="is corrupt: sha256"):
        load_engine(copy)


def test_an_engine_directory_holds_exactly_the_chat_template_it_was_built_with(tmp_path, engine_dir):
    """What the server renders chats with is what engine.json records (and the version's tag
    records that): an added, edited or removed template is refused like a corrupt engine."""
    copy = shutil.copytree(engine_dir.path, tmp_path / "engine")
    template = copy / "chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(EngineError, match="engine.json does not record"):
        load_engine_dir(copy)
    manifest = json.loads((copy / "engine.json").read_text()) | {"chat_template_sha256": file_sha256(template)}
    (copy / "engine.json").write_text(json.dumps(manifest))
    assert load_engine_dir(copy).manifest.chat_template_sha256 == file_sha256(template)
    template.write_text("{{ messages[0]['content'] }}")
    with pytest.raises(EngineError, match="chat_template.jinja has sha256"):
        load_engine_dir(copy)
    template.unlink()
    with pytest.raises(EngineError, match="lacks chat_template.jinja"):
        load_engine_dir(copy)


def test_a_folder_without_engine_json_is_not_an_engine(tmp_path):
    with pytest.raises(EngineError, match="no engine.json"):
        load_engine_dir(tmp_path)


def test_a_malformed_engine_json_is_named(tmp_path, engine_dir):
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir.path, copy)
    (copy / "engine.json").write_text('{"backend": "onnxruntime"}')
    with pytest.raises(EngineError, match="not a valid engine manifest"):
        load_engine_dir(copy)


def test_scored_and_prefilled_logits_match_pytorch(engine, reference):
    """Scoring (the gates) gets every position's logits; a prefill (generation) computes
    the last position's only, and they are the same numbers."""
    ids = np.arange(1, 17, dtype=np.int64).reshape(2, 8)
    scored = engine.score(ids, np.ones_like(ids))
    prefilled, _ = engine.prefill(ids, np.ones_like(ids))
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(scored - expected).max() < 1e-4
    assert prefilled.shape == (2, 1, expected.shape[-1])
    assert np.abs(prefilled[:, 0] - expected[:, -1]).max() < 1e-4


def test_an_engine_exported_before_logits_positions_still_generates_and_scores_alike(tmp_path, engine, engine_dir):
    """Engines already in a registry have no `logits_positions` input and compute every
    position's logits: the runtime feeds them without it and keeps the last position."""
    import onnx
    from onnx import helper

    model = onnx.load(str(engine_dir.engine_file))
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "logits_positions"))
    every_position = [  # what the older graph computed: logits at 0 .. sequence - 1
        helper.make_node("Shape", ["input_ids"], ["old_shape"], start=1, end=2),
        helper.make_node("Squeeze", ["old_shape"], ["old_length"]),
        helper.make_node("Constant", [], ["old_zero"], value=helper.make_tensor("z", onnx.TensorProto.INT64, [], [0])),
        helper.make_node("Constant", [], ["old_one"], value=helper.make_tensor("o", onnx.TensorProto.INT64, [], [1])),
        helper.make_node("Range", ["old_zero", "old_length", "old_one"], ["logits_positions"]),
    ]
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(every_position + nodes)
    old = tmp_path / "old-engine"
    shutil.copytree(engine_dir.path, old)
    onnx.save(model, str(old / engine_dir.manifest.engine_file))
    manifest = json.loads((old / "engine.json").read_text())
    manifest["inputs"].remove("logits_positions")
    manifest["engine_sha256"] = file_sha256(old / engine_dir.manifest.engine_file)
    (old / "engine.json").write_text(json.dumps(manifest))
    older = load_engine(old)
    assert not older.manifest.takes_logits_positions
    ids, mask = left_pad([[5, 6, 7, 8, 9], [1, 2, 3]], engine.manifest.eos_token_id)
    assert older.prefill(ids, mask)[0].shape == engine.prefill(ids, mask)[0].shape == (2, 1, engine.manifest.vocab_size)
    np.testing.assert_allclose(older.score(ids, mask), engine.score(ids, mask), atol=1e-5)
    greedy = Sampling(max_new_tokens=8, stop_at_eos=False)
    assert older.generate([[5, 6, 7, 8, 9], [1, 2, 3]], greedy) == engine.generate([[5, 6, 7, 8, 9], [1, 2, 3]], greedy)


def test_a_batch_larger_than_the_profile_is_refused_with_the_limit(engine):
    limit = engine.manifest.profiles["context"].batch.max
    with pytest.raises(ShapeOutOfProfile, match=rf"batch {limit + 1} is outside the engine's profile \(1\.\.{limit}\)"):
        engine.generate([[1, 2, 3]] * (limit + 1), Sampling(max_new_tokens=1))


def test_generation_stops_at_eos_and_leaves_it_out_unless_told_not_to(engine):
    prompt = [[5, 17, 42, 8]]
    stopped = EosAfter(engine, after=3).generate(prompt, Sampling(max_new_tokens=10))[0]
    assert len(stopped) == 3  # the prefill and two decode steps gave tokens; the fourth call gave EOS
    assert engine.manifest.eos_token_id not in stopped
    kept = EosAfter(engine, after=3).generate(prompt, Sampling(max_new_tokens=10, stop_at_eos=False))[0]
    assert len(kept) == 10 and kept[3:] == [engine.manifest.eos_token_id] * 7


def test_an_engine_of_another_format_version_is_refused_naming_both(tmp_path, engine_dir):
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir.path, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest["format_version"] = 2
    (copy / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="engine format 2, this kiln reads 1"):
        load_engine_dir(copy)


def test_a_closed_engine_releases_its_session(engine_dir):
    with load_engine(engine_dir.path) as engine:
        assert engine.generate([[1, 2]], Sampling(max_new_tokens=2, stop_at_eos=False))
    assert engine.session is None


@pytest.fixture(scope="module")
def gqa_engine(tmp_path_factory):
    """A tiny Llama's engine, whose attention is ONNX Runtime's GroupQueryAttention."""
    from components.runtime import load_engine

    from .test_structured import LLAMA_TEMPLATE, llama_tokenizer, tool_engine

    with load_engine(tool_engine(tmp_path_factory.mktemp("gqa"), "llama", llama_tokenizer(), LLAMA_TEMPLATE)) as engine:
        yield engine


@pytest.mark.parametrize("which", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("cached", [1, 16, 39])
def test_a_prefill_continued_after_a_cached_prefix_gives_the_whole_prefills_logits_and_cache(engine, gqa_engine, which, cached):
    """What a prefix cache hit prefills: the prompt's uncached suffix after the cache of its
    prefix, at the positions after it, equals prefilling the whole prompt (the next token's
    logits, and every layer's keys and values), on plain attention and on GroupQueryAttention."""
    subject = engine if which == "gpt2" else gqa_engine
    prompt = np.random.default_rng(cached).integers(3, subject.manifest.vocab_size - 8, size=40).tolist()
    whole, whole_state = subject.prefill(np.array([prompt]), np.ones((1, 40), np.int64))
    _, prefix = subject.prefill(np.array([prompt[:cached]]), np.ones((1, cached), np.int64))
    continued, state = subject.extend(prefix, prompt[cached:])
    np.testing.assert_allclose(continued[:, -1], whole[:, -1], atol=1e-5, rtol=0)
    assert state.past_length == 40 and state.last_position.tolist() == [[39]]
    for ours, theirs in zip(state.cache, whole_state.cache, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    with pytest.raises(ShapeOutOfProfile, match="one row"):
        subject.extend(prefix.joined(prefix), prompt[cached:])
