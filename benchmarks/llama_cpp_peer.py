"""llama.cpp as the peer of `kiln bench --peer llama.cpp`: the bench's model converted to
GGUF, quantized to the type that matches each kiln precision (int8 → Q8_0, int4 → Q4_0),
and timed by llama.cpp's own `llama-bench` between kiln's runs, so one invocation prints
both and the ratio can be reproduced by anyone with a llama.cpp build.

llama.cpp is never a dependency: without its tools the peer is unavailable, with a reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.generation import BenchRow, BenchSetup, SelfTimed
from components.errors import BackendUnavailable, KilnError

ENV = "KILN_LLAMA_CPP"
# The GGML type beside each kiln precision: the same bits per weight, blockwise scales.
GGML_TYPES = {"fp32": "F32", "fp16": "F16", "int8": "Q8_0", "int4": "Q4_0"}
SOURCE_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # a checkpoint's dtype as GGML names it
BUILD_HINT = (
    "build llama.cpp (cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && "
    f"cmake --build build -j2 --target llama-bench llama-quantize) and pass --llama-cpp DIR or set {ENV}=DIR"
)
CONVERTER = "convert_hf_to_gguf.py"
# A native build on a virtual machine whose CPU lists AMX without granting its tile state
# dies in ggml's AMX kernels before printing anything (seen on a 2-core Xeon).
KILLED_HINTS = {
    signal.SIGILL: (
        ": it was built for instructions this CPU does not run (on a virtual machine, often AMX); rebuild it with "
        "-DGGML_NATIVE=OFF and the instruction sets to use named (-DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON ...)"
    )
}


@dataclass(frozen=True)
class LlamaCpp:
    bench: Path
    quantize: Path
    converter: Path


def find_llama_cpp(explicit: Path | None = None, environ: Mapping[str, str] = os.environ) -> LlamaCpp:
    """The tools from `explicit` (a llama.cpp checkout or its build folder), else from
    $KILN_LLAMA_CPP, else from PATH; BackendUnavailable names what is missing and how to build it."""
    root = explicit or (Path(environ[ENV]) if environ.get(ENV) else None)
    folders, path = (_tool_folders(root), None) if root else ([], environ.get("PATH", ""))
    bench = _find("llama-bench", folders, path)
    quantize = _find("llama-quantize", folders, path)
    converter = _find(CONVERTER, _converter_folders(root) if root else [], path)
    if bench is None or quantize is None or converter is None:
        missing = [name for name, path in (("llama-bench", bench), ("llama-quantize", quantize), (CONVERTER, converter)) if path is None]
        where = f"in {root}" if root else f"on PATH ({ENV} is not set)"
        raise BackendUnavailable(f"llama.cpp peer unavailable: {', '.join(missing)} not found {where}; {BUILD_HINT}")
    return LlamaCpp(bench, quantize, converter)


def _tool_folders(root: Path) -> list[Path]:
    return [root / "bin", root / "build" / "bin", root]


def _converter_folders(root: Path) -> list[Path]:
    """The converter lives in the source tree: `root` itself, or above a build folder."""
    return [root, root.parent, *_cmake_source(root)]


def _cmake_source(build: Path) -> list[Path]:
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        return []
    lines = cache.read_text(errors="replace").splitlines()
    return [Path(line.split("=", 1)[1]) for line in lines if line.startswith("CMAKE_HOME_DIRECTORY:")]


def _find(name: str, folders: list[Path], path: str | None) -> Path | None:
    """`name` in the first of `folders` that has it, else on `path` (a PATH value; None: not searched)."""
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    found = shutil.which(name, path=path) if path is not None else None
    return Path(found) if found else None


def gguf_model(tools: LlamaCpp, model_dir: Path, ggml_type: str, cache: Path) -> Path:
    """`model_dir` as a GGUF file of `ggml_type`, cached under `cache` by the model's sha256:
    converted in the dtype its weights were saved in, then quantized to `ggml_type`."""
    return _gguf_in(tools, model_dir, ggml_type, _gguf_folder(model_dir, cache), source_type(model_dir))


def gguf_models(tools: LlamaCpp, model_dir: Path, ggml_types: list[str], cache: Path) -> dict[str, Path]:
    """`gguf_model` of each type; the conversion they were quantized from is deleted where
    none of them is it (an 8B model's is 16 GB of disk the bench would not read). The model
    is hashed once for all of them: at 8B that is 16 GB read."""
    folder, source = _gguf_folder(model_dir, cache), source_type(model_dir)
    models = {t: _gguf_in(tools, model_dir, t, folder, source) for t in ggml_types}
    if folder / f"{source}.gguf" not in models.values():
        (folder / f"{source}.gguf").unlink(missing_ok=True)
    return models


def _gguf_in(tools: LlamaCpp, model_dir: Path, ggml_type: str, folder: Path, source: str) -> Path:
    """`ggml_type`'s GGUF in `folder`, made from the conversion of type `source` unless present."""
    target = folder / f"{ggml_type}.gguf"
    if target.is_file():
        return target
    base = _cached(folder / f"{source}.gguf", lambda out: convert(tools, model_dir, source.lower(), out))
    return base if ggml_type == source else _cached(target, lambda out: quantize(tools, base, ggml_type, out))


def source_type(model_dir: Path) -> str:
    """The GGML type of the model's weights as saved: converted so, each quantized type
    starts from the same numbers as kiln's export (which reads them in fp32, exactly)."""
    from components.model_dir import stored_dtype

    return SOURCE_TYPES[stored_dtype(model_dir)]


def _gguf_folder(model_dir: Path, cache: Path) -> Path:
    from components.files import directory_sha256

    return cache / directory_sha256(model_dir)[:16]


def _cached(target: Path, make: Callable[[Path], None]) -> Path:
    """`target`, made unless present; written beside it first so a crash leaves no half file."""
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
        make(partial)
        os.replace(partial, target)
    return target


def convert(tools: LlamaCpp, model_dir: Path, outtype: str, out: Path) -> None:
    """The converter's GGUF of `model_dir` with its weights in `outtype` (f32, bf16, f16)."""
    command = [sys.executable, "-m", "benchmarks.llama_cpp_peer", "convert", str(tools.converter), str(model_dir)]
    _check([*command, "--outtype", outtype, "--outfile", str(out)], "convert_hf_to_gguf.py")


def quantize(tools: LlamaCpp, base: Path, ggml_type: str, out: Path) -> None:
    _check([str(tools.quantize), str(base), str(out), ggml_type], "llama-quantize")


def _check(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode < 0:
        raise KilnError(f"{what} was killed by {signal.Signals(-done.returncode).name}{KILLED_HINTS.get(-done.returncode, '')}")
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise KilnError(f"{what} failed (exit {done.returncode}): {tail}")
    return done.stdout


@dataclass(frozen=True)
class LlamaBenchRun:
    """One llama-bench call: the three tests of one repetition."""

    prefill_ms: float  # the prompt alone (pp)
    decode_ms_per_token: float  # new tokens alone, from an empty context (tg)
    generate_ms: float  # the prompt, then the new tokens: the work of a kiln row (pg)
    threads: int


def llama_bench_command(tools: LlamaCpp, model: Path, setup: BenchSetup) -> list[str]:
    """One repetition a call (kiln's rounds interleave the calls; llama-bench warms up itself).
    Threads are llama-bench's default, one per physical core, as ONNX Runtime's."""
    p, n = setup.prompt_tokens, setup.new_tokens
    return [str(tools.bench), "-m", str(model), "-p", str(p), "-n", str(n), "-pg", f"{p},{n}", "-r", "1", "-o", "json"]


def parse_llama_bench(output: str, setup: BenchSetup) -> LlamaBenchRun:
    results = json.loads(output)
    tests = {(test["n_prompt"], test["n_gen"]): test["avg_ns"] / 1e6 for test in results}
    p, n = setup.prompt_tokens, setup.new_tokens
    return LlamaBenchRun(tests[(p, 0)], tests[(0, n)] / n, tests[(p, n)], threads=results[0]["n_threads"])


@dataclass
class LlamaCppPeer:
    """The peer's candidates for `time_interleaved`, and what their calls measured."""

    tools: LlamaCpp
    precisions: list[str]
    setup: BenchSetup
    cache: Path
    runs: dict[str, list[LlamaBenchRun]] = field(default_factory=dict)

    def candidates(self, model_dir: Path) -> dict[str, SelfTimed]:
        types = sorted({GGML_TYPES[p] for p in self.precisions if p in GGML_TYPES})
        return {peer_name(t): self._runner(t, model) for t, model in gguf_models(self.tools, model_dir, types, self.cache).items()}

    def _runner(self, ggml_type: str, model: Path) -> SelfTimed:
        runs = self.runs.setdefault(ggml_type, [])
        command = llama_bench_command(self.tools, model, self.setup)

        def run() -> float:
            runs.append(parse_llama_bench(_check(command, "llama-bench"), self.setup))
            return runs[-1].generate_ms  # llama-bench's own timing, without process start and load

        return SelfTimed(run)

    def rows(self, kiln_rows: list[BenchRow]) -> list[PeerRow]:
        """Each kiln precision beside its GGML type."""
        by_name = {row.name: row for row in kiln_rows}
        return [
            peer_row(p, by_name[f"kiln-ort-{p}"], by_name[peer_name(GGML_TYPES[p])], self.runs[GGML_TYPES[p]])
            for p in self.precisions
            if f"kiln-ort-{p}" in by_name and peer_name(GGML_TYPES.get(p, "")) in by_name
        ]


@dataclass(frozen=True)
class PeerRow:
    precision: str
    ggml_type: str
    kiln_ms_per_token: float
    peer_ms_per_token: float
    peer_prefill_ms: float
    peer_decode_ms_per_token: float
    peer_threads: int

    @property
    def kiln_over_peer(self) -> float:
        """Above 1: llama.cpp is faster."""
        return self.kiln_ms_per_token / self.peer_ms_per_token


def peer_name(ggml_type: str) -> str:
    return f"llama.cpp-{ggml_type}"


def peer_row(precision: str, kiln: BenchRow, peer: BenchRow, runs: list[LlamaBenchRun]) -> PeerRow:
    prefill = statistics.median(r.prefill_ms for r in runs)
    decode = statistics.median(r.decode_ms_per_token for r in runs)
    return PeerRow(precision, GGML_TYPES[precision], kiln.ms_per_token, peer.ms_per_token, prefill, decode, runs[0].threads)


def _convert_main(converter: Path, argv: list[str]) -> None:
    """llama.cpp's converter, run as its own script with `_patch_converter`'s fixes."""
    import runpy

    source = converter.parent
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    sys.argv = [str(converter), *argv]
    try:
        from conversion import base, gpt2  # the converter's own package, beside it
    except ImportError:
        pass  # an older, single-file converter: run as it is
    else:
        _patch_converter(base.TextModel, gpt2.GPT2Model)
    runpy.run_path(str(converter), run_name="__main__")


def _patch_converter(text_model: type, gpt2_model: type) -> None:
    """Three gaps between the converter and a kiln model directory: transformers 5 no
    longer writes GPT-2's `n_ctx` (it is `n_positions`); a kiln tokenizer is GPT-2's
    byte-level BPE with its own merges, whose ids hash to no pre-tokenizer the converter
    knows; without sentencepiece, the Llama path fails before it tries tokenizer.json."""
    known_pre, sentencepiece, gpt2_parameters = text_model.get_vocab_base_pre, text_model._set_vocab_sentencepiece, gpt2_model.set_gguf_parameters

    def vocab_pre(self, tokenizer) -> str:
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            pre = json.loads((self.dir_model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
            if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
                return "gpt-2"  # GPT-2's regex and byte mapping: only the merges differ
            raise

    def vocab_sentencepiece(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(self.dir_model / "tokenizer.model")  # as with sentencepiece installed
        return sentencepiece(self, *args, **kwargs)

    def parameters(self) -> None:
        self.hparams.setdefault("n_ctx", self.hparams["n_positions"])
        gpt2_parameters(self)

    text_model.get_vocab_base_pre = vocab_pre
    text_model._set_vocab_sentencepiece = vocab_sentencepiece
    gpt2_model.set_gguf_parameters = parameters


if __name__ == "__main__" and sys.argv[1:2] == ["convert"]:
    _convert_main(Path(sys.argv[2]), sys.argv[3:])
