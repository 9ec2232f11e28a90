"""`kiln bench` machinery on a tiny shape (speed itself is measured by `kiln bench`, not here)."""

import json
from pathlib import Path

import pytest

from benchmarks import generation as bm

TINY = bm.TINY


def test_rows_are_medians_per_token_and_speed_ups_against_the_baseline():
    samples = {"hf-eager-fp32": [300.0, 100.0, 200.0], "kiln-ort-int8": [60.0, 40.0, 50.0]}
    rows = {row.name: row for row in bm.rows_from_samples(samples, new_tokens=10, baseline="hf-eager-fp32")}
    assert (rows["hf-eager-fp32"].median_ms, rows["hf-eager-fp32"].ms_per_token, rows["hf-eager-fp32"].speedup_vs_hf) == (200.0, 20.0, 1.0)
    assert (rows["kiln-ort-int8"].median_ms, rows["kiln-ort-int8"].ms_per_token, rows["kiln-ort-int8"].speedup_vs_hf) == (50.0, 5.0, 4.0)


def test_the_json_holds_the_setup_and_every_run(tmp_path):
    rows = bm.rows_from_samples({"hf-eager-fp32": [10.0, 12.0]}, new_tokens=4, baseline="hf-eager-fp32")
    bm.write_json(rows, bm.BenchSetup(runs=2), tmp_path / "bench.json")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["setup"]["batch"] == 1 and saved["setup"]["runs"] == 2
    assert saved["rows"] == [{"name": "hf-eager-fp32", "median_ms": 11.0, "ms_per_token": 2.75, "speedup_vs_hf": 1.0, "batch": 1, "runs_ms": [10.0, 12.0]}]
    # `kiln bench --device cuda`: rows of batch 1 and 16 in one file, each saying its batch.
    bm.write_json(rows * 2, bm.BenchSetup(runs=2), tmp_path / "cuda.json", batches=[1, 16])
    saved = json.loads((tmp_path / "cuda.json").read_text())
    assert "batch" not in saved["setup"] and [row["batch"] for row in saved["rows"]] == [1, 16]


def test_hugging_faces_model_is_left_out_naming_both_sizes_where_it_does_not_fit_beside_the_engines(tmp_path, monkeypatch):
    """An 8B model's fp32 PyTorch model (32 GB) does not fit beside its engine on 24 GB: the
    bench times the engines (and llama.cpp) without it and says why, where it used to refuse
    the whole bench; the model it builds is saved as its shape is published (bf16 at 8B)."""
    from components.model_dir import stored_dtype
    from components.model_fit import parameter_count, side_by_side_memory

    monkeypatch.setitem(bm.PUBLISHED_DTYPE, "tiny", "bfloat16")
    model_dir = bm.benchmark_model_dir(tmp_path / "model", TINY)
    assert stored_dtype(model_dir) == "bfloat16"
    needed = side_by_side_memory(parameter_count(model_dir), "int4")
    assert bm.hf_left_out(model_dir, "int4", needed) is None
    reason = bm.hf_left_out(model_dir, "int4", needed - 1)
    assert reason.startswith("hf-eager-fp32 left out: Hugging Face's fp32 model beside the int4 engine needs about 2.0 GiB, and this machine has 2.0 GiB")

    monkeypatch.setattr(bm, "hf_left_out", lambda *args: reason)
    measured = bm.benchmark_rows(tmp_path / "work", ["int4"], bm.BenchSetup(runs=1, warmup=0, new_tokens=4, calibration_prompts=2), "tiny")
    assert measured.left_out == (reason,)
    assert [row.name for row in measured.rows][0] == "kiln-ort-int4" and all(row.speedup_vs_hf is None for row in measured.rows)
    bm.write_json(measured.rows, bm.BenchSetup(), tmp_path / "bench.json", left_out=measured.left_out)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["left_out"] == [reason] and {row["speedup_vs_hf"] for row in saved["rows"]} == {None}


def test_the_benchmark_engines_are_what_the_pipeline_builds(tmp_path):
    from components.engine_dir import load_engine_dir

    setup = bm.BenchSetup(calibration_prompts=2)
    _, engines = bm.benchmark_engines(tmp_path, ["int8"], setup, TINY)
    manifest = load_engine_dir(engines["int8"]).manifest
    assert manifest.precision == "int8" and manifest.backend == "onnxruntime"


@pytest.mark.parametrize(
    ("stream", "tokens"),
    [
        (b'data: {"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}}\n\ndata: [DONE]\n\n', 16),
        (b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}\n\ndata: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":32,"total_tokens":35}}\n\ndata: [DONE]\n\n', 32),
        (b'data: {"id":"x","choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n', 0),
    ],
    ids=["kiln-spaced-usage-in-the-last-chunk", "compact-usage-chunk-of-its-own", "no-usage"],
)
def test_the_serving_load_reads_the_usage_of_any_openai_server_s_stream(stream, tokens):
    """`kiln bench serving` counted every request of a server writing compact JSON as failed:
    it matched the bytes `"usage": `. It parses the stream's last events."""
    from benchmarks.serving_load import _completion_tokens

    assert _completion_tokens(stream) == tokens


class ClosingAfterEachStream:
    """An OpenAI-style server that, as llama-server does, says keep-alive and still closes
    the connection after every streamed answer (a pooled client's next write then fails)."""

    def __init__(self, new_tokens: int) -> None:
        import http.server
        import threading

        tokens = new_tokens

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # /v1/models
                body = json.dumps({"data": [{"id": "peer"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                chunks = [{"choices": [{"text": "x"}]}] * tokens + [{"choices": [], "usage": {"completion_tokens": tokens}}]
                body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "keep-alive")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_serving_bench_counts_a_server_that_closes_each_connection_fairly():
    """Every client opens a connection per request, for kiln's rows and the others alike:
    reusing a connection such a server closed failed half of llama-server's requests."""
    from benchmarks.serving_load import ServingBenchSetup, url_rounds

    peer = ClosingAfterEachStream(new_tokens=4)
    try:
        [row] = url_rounds([peer.url], vocab=100, setup=ServingBenchSetup(clients=4, seconds=1.0, prompt_tokens=4, new_tokens=4))
    finally:
        peer.server.shutdown()
    assert row.failed == 0 and row.requests > 8


def test_the_serving_bench_drives_every_server_once_a_round_so_a_slow_spell_falls_on_all(monkeypatch, engine_dir, tmp_path):
    """kiln's rows and the --openai-url servers' alternate round by round (they ran all of kiln's
    rounds first, so a shared machine's slow spell could fall on one server only)."""
    from typer.testing import CliRunner

    from benchmarks import serving_load as bs
    from flows.cli import app

    order: list[str] = []

    def rows(name: str, rounds: int) -> list[bs.ServingRow]:
        order.extend([name] * rounds)
        return [bs.ServingRow("as served", name, 1.0, 1.0, 1.0, 1.0, 1.0, 1, 0) for _ in range(rounds)]

    monkeypatch.setattr(bs, "serving_rounds", lambda engines, setup, params, on_row: rows("kiln", setup.rounds))
    monkeypatch.setattr(bs, "url_rounds", lambda urls, vocab, setup, on_row: [r for url in urls for r in rows(url, setup.rounds)])
    args = ["bench", "serving", "--engine", str(engine_dir.path), "--openai-url", "http://peer-a", "--openai-url", "http://peer-b", "--rounds", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert order == ["kiln", "http://peer-a", "http://peer-b"] * 3


def test_the_gpu_floor_counts_the_weights_a_step_reads_and_each_rows_cache():
    """Every weight is read once a step but the tables only looked up (GPT-2's positions, the
    token embeddings where a separate lm_head is the output layer); fp8's e4m3 projections
    read half of bf16's bytes; each row adds its cache up to its mean length."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.generation import BenchRow, BenchSetup, TINY
    from benchmarks.generation_cuda import floor_row
    from components.read_floor import program_read_bytes
    from components.runtime.static_kv import static_model_from_hf

    llama = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}
    for tied in (True, False):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", tie_word_embeddings=tied, **llama))
        bf16, fp8 = (static_model_from_hf(hf, dtype=torch.bfloat16, weights=w) for w in ("dense", "fp8"))
        embed = 300 * 64 * 2
        every = sum(p.numel() * 2 for p in bf16.parameters())
        assert program_read_bytes(bf16) == (every if tied else every - embed)
        projections = sum(getattr(bf16, n).numel() for n in ("w_qkv", "w_o", "w_gate_up", "w_down"))
        scales = sum(getattr(fp8, n).numel() * 4 for n in ("s_qkv", "s_o", "s_gate_up", "s_down"))
        assert program_read_bytes(fp8) == program_read_bytes(bf16) - projections + scales
    gpt2 = static_model_from_hf(AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **{k: v for k, v in TINY.items() if k != "family"})))
    assert program_read_bytes(gpt2) == sum(p.numel() * 4 for p in gpt2.parameters()) - gpt2.wpe.numel() * 4

    class Engine:  # what floor_row reads of a loaded engine
        manifest = type("Manifest", (), {"kv_bytes_per_token": 1000})()
        runner = type("Runner", (), {"model": gpt2})()

    setup = BenchSetup(prompt_tokens=32, new_tokens=128)
    rows = [BenchRow("hf-static-compile-fp16", 100.0, 100 / 128, 1.0, ()), BenchRow("kiln-torch-cuda-fp16", 50.0, 50 / 128, 2.0, ())]
    row = floor_row(rows, "hf-static-compile-fp16", "fp16", Engine(), 16, 1e12, setup)
    step = program_read_bytes(gpt2) + 16 * 1000 * (32 + 64)
    assert row.median_ms == pytest.approx(128 * step / 1e12 * 1000) and row.speedup_vs_hf == pytest.approx(100.0 / row.median_ms)
    assert row.name == f"fp16 floor: {step / 1e6:.1f} MB/step @ 1.00 TB/s, kiln {50.0 / row.median_ms:.2f}x"


def test_the_bandwidth_copy_outgrows_the_last_level_cache(tmp_path):
    """A copy that fits the cache measures the cache: on a Xeon with 300 MiB of L3 the
    floor came out 1.5 times too fast with 256 MiB buffers."""
    from components import read_floor

    for level, size in enumerate(["48K", "2048K", "307200K"]):
        (tmp_path / f"index{level}").mkdir()
        (tmp_path / f"index{level}" / "size").write_text(size + "\n")
    assert read_floor.last_level_cache_bytes(tmp_path) == 300 << 20
    assert read_floor.last_level_cache_bytes(tmp_path / "absent") == 0
    assert read_floor.copy_buffer_mib(300 << 20, 24 << 30) == 1200
    assert read_floor.copy_buffer_mib(0, 24 << 30) == 256
    assert read_floor.copy_buffer_mib(1 << 30, 8 << 30) == 512  # not half the memory


def test_the_cpu_floor_reads_every_weight_but_the_looked_up_tables_at_the_measured_bandwidth(tmp_path):
    """An engine's floor: the bytes of its graph's initializers that a step multiplies by
    (not the embedding tables Gather looks a row up in), at a copy's bandwidth; int8's
    weights are about a quarter of fp32's."""
    import onnx

    from components.engine_dir import load_engine_dir
    from components.read_floor import memory_bandwidth, onnx_read_bytes

    setup = bm.BenchSetup(calibration_prompts=2)
    _, engines = bm.benchmark_engines(tmp_path, ["fp32", "int8"], setup, TINY)
    fp32 = load_engine_dir(engines["fp32"])
    graph = onnx.load(str(fp32.engine_file)).graph
    sizes = {t.name: onnx.numpy_helper.to_array(t).nbytes for t in graph.initializer}
    gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
    tables = {name for name in gathered if name in sizes and all(n.op_type == "Gather" for n in graph.node if name in n.input)}
    assert tables and onnx_read_bytes(fp32.engine_file) == sum(sizes.values()) - sum(sizes[t] for t in tables)
    int8 = onnx_read_bytes(load_engine_dir(engines["int8"]).engine_file)
    assert int8 < 0.5 * onnx_read_bytes(fp32.engine_file)
    assert 1e8 < memory_bandwidth(mib=50, repeats=2) < 1e13


def test_the_multi_turn_bench_holds_whole_conversations_and_reads_what_the_prefix_cache_gave(engine_dir):
    """kiln serve with its cache off then on, under conversations sharing a system prompt:
    every turn answered, each client's turns whole conversations, and the cached prompt
    tokens (from the usage) only where the cache is on."""
    from benchmarks.multi_turn import CACHE_OFF, CACHE_ON, Conversations, multi_turn_rows
    from benchmarks.serving_load import ServingBenchSetup

    setup = ServingBenchSetup(clients=2, seconds=0.5, prompt_tokens=4, new_tokens=4)
    talk = Conversations(system_tokens=32, turns=3, cache_mib=16)  # the test engine's profile holds 128 tokens
    off, on = multi_turn_rows({"tiny": engine_dir.path}, [], setup, talk, Path(__file__).parents[1] / "params.yaml")
    assert (off.name, on.name) == (CACHE_OFF, CACHE_ON)
    for row in (off, on):
        assert row.failed == 0 and row.turns >= 6 and row.turns % 3 == 0 and row.longest_prompt > 32
    assert off.cached_tokens == 0 and off.prefilled_tokens == off.prompt_tokens
    assert on.cached_tokens >= 32 * on.turns // 2 and on.cached_tokens % 16 == 0 and 0 < on.hit_rate < 1
