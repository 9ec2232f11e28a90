"""The calibration set: stratified by the build's prompt profile, deduplicated, seeded."""


from components.calibrate import (
    buckets_from_profile,
    calibration_set_from_pool,
    drop_near_duplicates,
    stratified_prompts,
)
from components.config import CalibrationParams, ShapeRange


def test_buckets_follow_the_prompt_profile_with_an_edge_at_opt():
    buckets = buckets_from_profile(ShapeRange(min=1, opt=32, max=128), 4)
    assert buckets[0].low == 1 and buckets[-1].high == 128
    assert any(b.high == 32 for b in buckets)
    assert all(a.high + 1 == b.low for a, b in zip(buckets, buckets[1:]))


def test_near_duplicates_are_removed_and_the_first_kept():
    base = " ".join(f"word{i}" for i in range(80))
    edited = base.replace("word40", "changed")  # one word of 80: Jaccard of 5-shingles ~0.88
    texts = [base, edited, "an entirely different passage about parsing python source files into trees"]
    kept, dropped = drop_near_duplicates(texts, threshold=0.8, seed=0)
    assert kept == [0, 2] and dropped == 1


def test_every_bucket_gets_its_share_when_the_pool_allows():
    encoded = [list(range(n)) for n in (5, 10, 20, 40, 60, 90, 120, 130, 3, 8, 25, 70)]
    buckets = buckets_from_profile(ShapeRange(min=1, opt=32, max=128), 4)
    chosen = stratified_prompts(list(range(len(encoded))), encoded, buckets, samples=8, seed=0)
    counts = {b.name: sum(1 for c in chosen if c[1] == b.name) for b in buckets}
    assert set(counts.values()) == {2}
    for _, bucket_name, prompt in chosen:
        low, high = map(int, bucket_name.split("-"))
        assert low <= len(prompt) <= high


def test_the_set_is_deterministic_for_a_seed_and_changes_with_it(tmp_path, data_version, tiny_model, params):
    make = lambda seed, where: calibration_set_from_pool(  # noqa: E731
        data_version, tiny_model.path, params.build.profiles, CalibrationParams(samples=16, seed=seed), tmp_path / where
    )
    first, again, other = make(0, "a"), make(0, "b"), make(1, "c")
    assert first.digest == again.digest and first.prompts == again.prompts
    assert set(other.prompts) != set(first.prompts)  # another seed chooses other prompts


def test_the_curated_set_spans_every_bucket_drops_near_duplicates_and_feeds_decode_steps(calibration, exported, params):
    from components.precision import CalibrationFeeds

    manifest = calibration.manifest()
    assert manifest["near_duplicates_removed"] >= 1  # the test corpus plants near duplicates
    assert manifest["samples"] >= 64
    assert all(count >= 12 for count in manifest["buckets"].values()), manifest["buckets"]
    assert len(set(calibration.prompts)) == len(calibration.prompts)

    feeds = CalibrationFeeds(exported, calibration)
    steps = params.calibration.decode_steps
    assert steps > 0 and len(feeds) == len(calibration.prompts) * (steps + 1)
    prompt = len(calibration.prompts[0])
    chain = [feeds.get_next() for _ in range(steps + 1)]
    past = exported.layout.past_names[0]
    assert [feed[past].shape[2] for feed in chain] == [0] + [prompt + step for step in range(steps)]
    assert [feed["input_ids"].shape[1] for feed in chain] == [prompt] + [1] * steps
