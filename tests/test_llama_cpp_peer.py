"""`kiln bench --peer llama.cpp`: without llama.cpp, one line saying what is missing and how
to build it; with it (KILN_LLAMA_CPP or PATH), a real conversion of tiny models."""

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import generation as bm
from benchmarks import llama_cpp_peer as peer
from components.errors import BackendUnavailable
from components.files import directory_sha256

KILN = str(Path(sys.executable).parent / "kiln")
TINY_LLAMA = {
    "family": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256, "tie_word_embeddings": True,
}  # fmt: skip


def _llama_cpp_or_skip() -> peer.LlamaCpp:
    try:
        return peer.find_llama_cpp()
    except BackendUnavailable as err:
        pytest.skip(str(err))


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_without_llama_cpp_the_reason_names_what_is_missing_and_how_to_build_it(tmp_path):
    with pytest.raises(BackendUnavailable) as missing:
        peer.find_llama_cpp(environ={"PATH": str(tmp_path)})
    message = str(missing.value)
    assert "llama-bench, llama-quantize, convert_hf_to_gguf.py not found on PATH (KILN_LLAMA_CPP is not set)" in message
    assert "cmake --build build" in message and "--llama-cpp DIR" in message


def test_a_llama_cpp_tool_killed_by_a_signal_says_which_and_what_an_illegal_instruction_means(tmp_path):
    """A native llama.cpp build dies with SIGILL and no output where a virtual machine lists
    AMX without granting it: the error names the signal and the rebuild, not an empty tail."""
    from components.errors import KilnError

    with pytest.raises(KilnError, match=r"llama-bench was killed by SIGILL: it was built for instructions .* -DGGML_NATIVE=OFF"):
        peer._check(["sh", "-c", "kill -ILL $$"], "llama-bench")
    with pytest.raises(KilnError, match=r"llama-quantize was killed by SIGKILL$"):
        peer._check(["sh", "-c", "kill -KILL $$"], "llama-quantize")


def test_a_folder_given_is_searched_alone_not_path(tmp_path, monkeypatch):
    _touch(tmp_path / "on-path" / "llama-bench")
    monkeypatch.setenv("PATH", str(tmp_path / "on-path"))
    with pytest.raises(BackendUnavailable, match=f"llama-bench, llama-quantize, convert_hf_to_gguf.py not found in {tmp_path / 'empty'}"):
        peer.find_llama_cpp(tmp_path / "empty")


def test_the_tools_are_found_from_a_checkout_or_its_build_folder(tmp_path):
    source = tmp_path / "llama.cpp"
    converter = _touch(source / "convert_hf_to_gguf.py")
    bench, quantize = _touch(source / "build" / "bin" / "llama-bench"), _touch(source / "build" / "bin" / "llama-quantize")
    expected = peer.LlamaCpp(bench, quantize, converter)
    assert peer.find_llama_cpp(source) == expected
    assert peer.find_llama_cpp(environ={peer.ENV: str(source / "build")}) == expected
    # A build folder elsewhere finds its source through CMake's cache.
    elsewhere = tmp_path / "out"
    _touch(elsewhere / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={source}\n")
    for tool in ("llama-bench", "llama-quantize"):
        _touch(elsewhere / "bin" / tool)
    assert peer.find_llama_cpp(elsewhere).converter == converter


def test_kiln_bench_peer_without_llama_cpp_is_one_line_and_exit_2_before_any_work(tmp_path):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != peer.ENV}
    result = subprocess.run(
        [KILN, "bench", "--shape", "tiny", "--peer", "llama.cpp", "--llama-cpp", str(tmp_path / "none"), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "llama.cpp peer unavailable: llama-bench" in result.stderr and "cmake" in result.stderr
    assert not (tmp_path / "work").exists()


def test_llama_bench_s_json_gives_prefill_decode_and_the_whole_generation():
    setup = bm.BenchSetup(prompt_tokens=32, new_tokens=128)
    tests = [(32, 0, 20e6), (0, 128, 640e6), (32, 128, 700e6)]
    output = json.dumps([{"n_prompt": p, "n_gen": n, "avg_ns": ns, "n_threads": 2} for p, n, ns in tests])
    assert peer.parse_llama_bench(output, setup) == peer.LlamaBenchRun(prefill_ms=20.0, decode_ms_per_token=5.0, generate_ms=700.0, threads=2)
    command = peer.llama_bench_command(peer.LlamaCpp(Path("b"), Path("q"), Path("c")), Path("m.gguf"), setup)
    assert command[command.index("-pg") + 1] == "32,128" and command[command.index("-r") + 1] == "1"


def test_a_self_timed_candidate_gives_its_own_ms_and_is_not_warmed_up():
    calls = []
    samples = bm.time_interleaved({"other": bm.SelfTimed(lambda: calls.append(1) or 7.5)}, bm.BenchSetup(runs=3, warmup=2))
    assert samples == {"other": [7.5, 7.5, 7.5]} and len(calls) == 3


def test_each_kiln_precision_is_paired_with_its_ggml_type():
    tools = peer.LlamaCpp(Path("b"), Path("q"), Path("c"))
    bench = peer.LlamaCppPeer(tools, ["fp32", "int8", "int4"], bm.BenchSetup(), Path("cache"))
    bench.runs = {"Q8_0": [peer.LlamaBenchRun(10.0, 2.0, 300.0, 2), peer.LlamaBenchRun(30.0, 4.0, 320.0, 2)]}
    rows = bm.rows_from_samples(
        {"hf-eager-fp32": [1000.0], "kiln-ort-fp32": [800.0], "kiln-ort-int8": [640.0], "llama.cpp-Q8_0": [320.0]}, new_tokens=128, baseline="hf-eager-fp32"
    )
    (row,) = bench.rows(rows)  # fp32 and int4 have no llama.cpp row here
    assert (row.precision, row.ggml_type, row.kiln_ms_per_token, row.peer_ms_per_token) == ("int8", "Q8_0", 5.0, 2.5)
    assert (row.kiln_over_peer, row.peer_prefill_ms, row.peer_decode_ms_per_token) == (2.0, 20.0, 3.0)


def test_the_gguf_is_converted_in_the_checkpoints_dtype_and_that_copy_dropped_once_no_row_reads_it(tmp_path, monkeypatch):
    """An 8B bf16 checkpoint converted in f32 took 32 GB of disk, and kept after quantizing
    another 16: converted as saved (bf16), quantized, and the conversion deleted where no row
    times it; each type already made is reused without converting again."""
    made = []

    def write(kind: str, out: Path, *what) -> None:
        made.append((kind, *what))
        out.write_bytes(b"GGUF")

    monkeypatch.setattr(peer, "convert", lambda tools, model_dir, outtype, out: write("convert", out, outtype))
    monkeypatch.setattr(peer, "quantize", lambda tools, base, ggml_type, out: write("quantize", out, base.name, ggml_type))
    model_dir = tmp_path / "model"
    _touch(model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    tools, cache = peer.LlamaCpp(Path("b"), Path("q"), Path("c")), tmp_path / "gguf"

    models = peer.gguf_models(tools, model_dir, ["Q4_0", "Q8_0"], cache)
    assert made == [("convert", "bf16"), ("quantize", "BF16.gguf", "Q4_0"), ("quantize", "BF16.gguf", "Q8_0")]
    assert sorted(p.name for p in models["Q4_0"].parent.iterdir()) == ["Q4_0.gguf", "Q8_0.gguf"]  # the bf16 conversion is gone
    assert peer.gguf_models(tools, model_dir, ["Q4_0"], cache) == {"Q4_0": models["Q4_0"]} and len(made) == 3  # cached
    assert peer.gguf_models(tools, model_dir, ["BF16", "F32"], cache).keys() == {"BF16", "F32"}  # a timed conversion is kept
    assert made[3:] == [("convert", "bf16"), ("quantize", "BF16.gguf", "F32")] and (models["Q4_0"].parent / "BF16.gguf").is_file()


@pytest.mark.parametrize("shape", [bm.TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_a_tiny_model_converts_quantizes_and_runs_in_llama_bench(tmp_path, shape):
    tools = _llama_cpp_or_skip()
    model_dir = bm.benchmark_model_dir(tmp_path / "model", shape)
    q8 = peer.gguf_model(tools, model_dir, "Q8_0", tmp_path / "gguf")
    assert q8.read_bytes()[:4] == b"GGUF" and q8.parent.name == directory_sha256(model_dir)[:16]
    assert peer.gguf_model(tools, model_dir, "Q8_0", tmp_path / "gguf").stat().st_mtime_ns == q8.stat().st_mtime_ns  # cached
    setup = bm.BenchSetup(prompt_tokens=8, new_tokens=8)
    run = peer.parse_llama_bench(peer._check(peer.llama_bench_command(tools, q8, setup), "llama-bench"), setup)
    assert run.prefill_ms > 0 and run.decode_ms_per_token > 0 and run.generate_ms > 0
