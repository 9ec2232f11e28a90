"""`kiln bench` machinery on a tiny shape (speed itself is measured by `kiln bench`, not here)."""

import json

from flows import bench as bm

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 300, "n_positions": 256}


def test_the_benchmark_times_hf_and_kiln_engines_and_writes_the_json_rows(tmp_path):
    setup = bm.BenchSetup(new_tokens=8, runs=2, warmup=1, calibration_prompts=4)
    model_dir, engines = bm.benchmark_engines(tmp_path / "work", ["fp32", "int8"], setup, TINY)
    prompt = bm.random_prompts(1, setup.prompt_tokens, TINY["vocab_size"], 0)[0]
    candidates = {"hf-eager-fp32": bm.hf_generate_fn(model_dir, prompt, setup.new_tokens)}
    candidates |= {f"kiln-ort-{p}": bm.engine_generate_fn(path, prompt, setup.new_tokens) for p, path in engines.items()}
    rows = bm.rows_from_samples(bm.time_interleaved(candidates, setup), setup.new_tokens, "hf-eager-fp32")
    bm.write_json(rows, setup, tmp_path / "bench.json")

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["hf-eager-fp32", "kiln-ort-fp32", "kiln-ort-int8"]
    for row in saved["rows"]:
        assert {"name", "median_ms", "ms_per_token", "speedup_vs_hf"} <= set(row)
        assert row["ms_per_token"] == row["median_ms"] / setup.new_tokens
        assert len(row["runs_ms"]) == setup.runs
    assert saved["rows"][0]["speedup_vs_hf"] == 1.0


def test_the_benchmark_engines_are_what_the_pipeline_builds(tmp_path):
    from components.engine_dir import load_engine_dir

    setup = bm.BenchSetup(calibration_prompts=2)
    _, engines = bm.benchmark_engines(tmp_path, ["int8"], setup, TINY)
    manifest = load_engine_dir(engines["int8"]).manifest
    assert manifest.precision == "int8" and manifest.backend == "onnxruntime"
