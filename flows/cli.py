"""The `kiln` command line (Typer): parse arguments, call one flow or component, render.
Heavy modules load inside the verbs, so `kiln --help` and importing this module stay fast
and torch-free.

Exit codes: 0 success, 1 a gate failed, 2 unusable input (bad params, missing or corrupt
files, unreachable registry).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from components.errors import GateFailed, KilnError
from flows import render


def _flags_without_placeholder(params: list[Any]) -> list[Any]:
    """`params` with each flag's value placeholder emptied: typer 0.29's rich help prints a
    flag's type (`<bool>`) as if it took a value; an empty metavar prints nothing."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
    return params


def _respelled(args: Sequence[str], renamed: Mapping[str, str]) -> list[str]:
    """`args` with each deprecated option spelling (`--to x`, `--to=x`) replaced by the current
    one, warning on stderr; what follows `--` is arguments, left as it is."""
    out: list[str] = []
    for index, arg in enumerate(args):
        if arg == "--":
            return out + list(args[index:])
        name, equals, value = arg.partition("=")
        if name in renamed:
            render.err_console.print(f"[yellow]warning:[/] {name} is deprecated and goes in the next release: use {renamed[name]}", highlight=False, soft_wrap=True)
            arg = renamed[name] + equals + value
        out.append(arg)
    return out


class KilnCommand(TyperCommand):
    """A verb: flags shown without a value placeholder, and the old spellings of renamed
    options still taken (with a warning) for one release."""

    renamed: ClassVar[Mapping[str, str]] = {}  # deprecated spelling → the current one

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _flags_without_placeholder(super().get_params(ctx))

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _respelled(args, self.renamed))


class KilnGroup(TyperGroup):
    """A group of verbs (kiln itself, kiln bench, ...): flags shown without a value placeholder."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _flags_without_placeholder(super().get_params(ctx))


def _renaming(renamed: Mapping[str, str]) -> type[KilnCommand]:
    """A KilnCommand that still takes the deprecated spellings `renamed` maps to current ones."""
    return type("KilnCommand", (KilnCommand,), {"renamed": dict(renamed)})


app = typer.Typer(cls=KilnGroup, add_completion=False, no_args_is_help=True, help="kiln: train → export → build → gate → register → serve.")

DEFAULT_PARAMS = Path("params.yaml")
ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="the params file")]


def _print_version(requested: bool) -> None:
    if requested:
        from importlib.metadata import version

        typer.echo(f"kiln {version('kiln')}")
        raise typer.Exit()


@app.callback()
def kiln_options(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version, help="print kiln's version and exit")] = False,
) -> None:
    # Only --version lives here: each verb takes its own options.
    pass


def _prepare_environment(root: Path) -> None:
    from flows.environment import prepare_environment

    prepare_environment(root)


def _load(params_file: Path):
    from components.config import load_params

    return load_params(params_file)


def _fail(err: KilnError) -> None:
    render.error(err)
    raise typer.Exit(1 if isinstance(err, GateFailed) else 2)


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """Every failure ends as one line: a KilnError's message (exit 1 for a gate, else 2), or
    for anything kiln did not foresee its type and message (exit 2), with the traceback
    kept in a file rather than spilled on the terminal."""
    try:
        yield
    except typer.Exit:
        raise
    except KilnError as err:
        _fail(err)
    except Exception as err:  # a library failure or a bug: still one line, traceback kept
        _fail(KilnError(f"unexpected {type(err).__name__}: {err} (traceback in {_save_traceback()})"))


def _save_traceback() -> Path:
    import tempfile
    import traceback

    log = Path(tempfile.gettempdir()) / f"kiln-error-{os.getpid()}.txt"
    log.write_text(traceback.format_exc())
    return log


@app.command(cls=KilnCommand)
def run(
    params_file: ParamsOption = DEFAULT_PARAMS,
    fresh: Annotated[bool, typer.Option(help="delete cached stage outputs and rebuild every stage")] = False,
) -> None:
    """Retrain and rebuild: data → train → export → build → gates → register."""
    _run_pipeline(params_file, model_dir=None, fresh=fresh)


@app.command(cls=KilnCommand)
def build(
    params_file: ParamsOption = DEFAULT_PARAMS,
    model: Annotated[Path | None, typer.Option(help="model directory (default: model.pretrained)")] = None,
    fresh: Annotated[bool, typer.Option(help="delete cached stage outputs and rebuild every stage")] = False,
) -> None:
    """The same flow from an existing model, without training."""
    _run_pipeline(params_file, model_dir=model, fresh=fresh, from_model=True)


def _run_pipeline(params_file: Path, model_dir: Path | None, fresh: bool, from_model: bool = False) -> None:
    """`from_model`: skip training, using `model_dir` or else params' model.pretrained."""
    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        result = _pipeline(root, params_file, model_dir, fresh, from_model)
    render.pipeline_result(result)


def _pipeline(root: Path, params_file: Path, model_dir: Path | None, fresh: bool, from_model: bool):
    """The flow's result; a failed gate prints the table, then fails with the numbers."""
    from registry import preflight, registry_target

    from components.model_fit import fit_for_run

    params = _load(params_file)
    if from_model:
        model_dir = _model_to_build(model_dir, params)
    params, notes = fit_for_run(params, params_file, root, model_dir)  # before the data stage and training
    for note in notes:
        render.note(note)
    preflight(registry_target(params.registry, root), registering=True)  # before Prefect's server starts (seconds)
    if fresh:
        import shutil

        from components.workspace import Workspace

        shutil.rmtree(Workspace(root).state / "stages", ignore_errors=True)
        os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    # Imported only now: Prefect reads PREFECT_TASKS_REFRESH_CACHE when the tasks are defined.
    from flows.logs import hide_kiln_tracebacks, show_stage_notes
    from flows.pipeline import retrain_and_rebuild

    hide_kiln_tracebacks()
    show_stage_notes()
    try:
        return retrain_and_rebuild(params, root, model_dir)
    except GateFailed as err:
        render.pipeline_result(err.report)
        raise


def _model_to_build(model_dir: Path | None, params) -> Path:
    """The model directory `kiln build` starts from."""
    if model_dir is None and not params.model.pretrained:
        raise KilnError("kiln build needs a model: pass --model DIR or set model.pretrained in params.yaml")
    from components.model_dir import pretrained_directory

    return model_dir.resolve() if model_dir else pretrained_directory(params.model.pretrained)


@app.command(cls=KilnCommand)
def gate(
    engine_dir: Annotated[Path, typer.Argument(help="engine directory (with engine.json)")],
    params_file: ParamsOption = DEFAULT_PARAMS,
    reference: Annotated[Path | None, typer.Option(help="reference model directory (default: from the engine's lineage)")] = None,
    data: Annotated[Path | None, typer.Option(help="data directory holding eval.parquet (default: data.path)")] = None,
) -> None:
    """Gate one engine directory; prints the report; exit 1 when a gate fails. Without a
    params.yaml here (and no --params), the default limits."""
    _prepare_environment(Path.cwd())
    with _one_line_errors():
        from components.config import Params
        from components.gates import gate_against_lineage

        params = Params() if params_file == DEFAULT_PARAMS and not params_file.is_file() else _load(params_file)
        report, warning = gate_against_lineage(engine_dir, params.gates, data or Path(params.data.path), params.serving.threads, reference)
    if warning:
        render.note(warning)
    render.gate_report(report)
    if not report.passed:
        _fail(GateFailed("; ".join(report.failures()), report))
    render.console.print("[bold green]all gates passed[/]")


@app.command(cls=_renaming({"--to": "--alias", "--from": "--from-alias"}))
def promote(
    params_file: ParamsOption = DEFAULT_PARAMS,
    alias: Annotated[str, typer.Option(help="alias to set")] = "champion",
    from_alias: Annotated[str, typer.Option(help="alias whose version to take")] = "challenger",
    version: Annotated[str | None, typer.Option(help="a version number instead of --from-alias")] = None,
    force: Annotated[bool, typer.Option(help="promote a version whose gates failed (needs --reason; recorded on the version)")] = False,
    reason: Annotated[str, typer.Option(help="why: recorded with who and when")] = "",
    canary: Annotated[bool, typer.Option(help="on the fleet: through canary's traffic steps first, checked on live Prometheus; champion moves only if every step passes")] = False,
) -> None:
    """Move an alias (default: champion to the current challenger); the move is recorded."""
    from flows.environment import person
    from registry import promote as promote_version
    from registry import tags

    if canary:
        return _promote_canary(params_file, alias, from_alias, version, force)
    with _one_line_errors():
        target = _registry(params_file)
        info = promote_version(target, alias, from_alias, version, by=person(), reason=reason, force=force)
    forced = " [yellow](gates failed: forced, reason recorded)[/]" if info.tags.get(tags.GATES_PASSED) != tags.TRUE else ""
    render.console.print(f"{info.name}@{alias} → version {info.version}{forced}")


def _promote_canary(params_file: Path, alias: str, from_alias: str, version: str | None, force: bool) -> None:
    from flows.canary import CanaryRun, canary_promotion
    from flows.environment import person
    from registry import CHAMPION, alias_version, registry_target
    from serving.canary import PROMOTED

    if force or alias != CHAMPION:
        _fail(KilnError(f"--canary promotes to {CHAMPION} a version that passed its gates: leave out --force and --alias"))
    root = Path.cwd()
    with _one_line_errors():
        _prepare_environment(root)
        params = _load(params_file)
        target = registry_target(params.registry, root)
        named = version or getattr(alias_version(target, from_alias), "version", None)
        if named is None:
            raise KilnError(f"{target.model_name}@{from_alias} names no version: pass --version N")
        outcome = canary_promotion(params, CanaryRun(root, named, person(), params.serving.fleet.address))
    for step in outcome.steps:
        render.console.print(f"  step {step.step}: {step.weight} % → {'passed' if step.passed else '; '.join(step.failures)}")
    render.console.print(f"version {outcome.version}: {outcome.outcome} ({outcome.reason})")
    if outcome.outcome != PROMOTED:
        raise typer.Exit(1)


@app.command(cls=KilnCommand)
def rollback(
    params_file: ParamsOption = DEFAULT_PARAMS,
    alias: Annotated[str, typer.Option(help="alias to move back")] = "champion",
    reason: Annotated[str, typer.Option(help="why: recorded with who and when")] = "",
) -> None:
    """Move an alias back to the version it named before (a recorded move of its own)."""
    from flows.environment import person
    from registry import rollback as roll_back

    with _one_line_errors():
        info, replaced = roll_back(_registry(params_file), by=person(), alias=alias, reason=reason)
    render.console.print(f"{info.name}@{alias} → version {info.version} (was {replaced})")


@app.command(cls=KilnCommand)
def lineage(
    version: Annotated[str, typer.Argument(help="registered version number")],
    params_file: ParamsOption = DEFAULT_PARAMS,
) -> None:
    """The chain from data version to aliases for one registered version."""
    from registry import version_lineage

    with _one_line_errors():
        found = version_lineage(_registry(params_file), version)
    render.lineage(found)


def _registry(params_file: Path):
    """The project's registry, with kiln's environment set (no MLflow download bars)."""
    from registry import registry_target

    _prepare_environment(Path.cwd())
    return registry_target(_load(params_file).registry, Path.cwd())


@app.command(cls=KilnCommand)
def serve(
    params_file: ParamsOption = DEFAULT_PARAMS,
    alias: Annotated[str | None, typer.Option(help="alias to serve and follow (default: serving.alias, champion)")] = None,
    host: Annotated[str | None, typer.Option(help="address to bind (default: serving.host, 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default: serving.port, 8000)")] = None,
    engine: Annotated[Path | None, typer.Option(help="serve this local engine directory instead (no registry, no gates: for development)")] = None,
    max_batch: Annotated[int | None, typer.Option(help="cap on sequences per decode step (default: the engine's profile)", min=1)] = None,
    prefix_cache_mib: Annotated[int | None, typer.Option(help="memory for prompts' KV caches, reused by prompts that begin alike; 0: none (default: serving.prefix_cache_mib)", min=0)] = None,
) -> None:
    """Serve models:/<name>@<alias> over an OpenAI-compatible API; follows the alias."""
    from flows.serving import serve_alias

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        serve_alias(root, _load(params_file), alias, host, port, engine, max_batch, prefix_cache_mib)


fleet_app = typer.Typer(cls=KilnGroup, add_completion=False, no_args_is_help=True, help="kiln serve as replicas on a Ray cluster, HAProxy in front.")
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("start", cls=KilnCommand)
def fleet_start(
    nodes: Annotated[int, typer.Option(min=1, help="Ray nodes on this machine: a head and nodes - 1 workers")] = 2,
    cpus_per_node: Annotated[int, typer.Option(min=1, help="CPUs each node offers its replicas")] = 1,
    port: Annotated[int, typer.Option(help="the head's port (the cluster's address)")] = 6379,
) -> None:
    """A Ray cluster on this machine, for a fleet without more machines (elsewhere: `ray start` on each)."""
    from flows.fleet import start_local_cluster

    with _one_line_errors():
        address = start_local_cluster(nodes, cpus_per_node, port)
    render.console.print(f"Ray cluster of {nodes} nodes at {address}: `kiln fleet deploy` serves on it")


@fleet_app.command("deploy", cls=KilnCommand)
def fleet_deploy(
    params_file: ParamsOption = DEFAULT_PARAMS,
    alias: Annotated[str | None, typer.Option(help="alias every replica serves and follows (default: serving.alias)")] = None,
    engine: Annotated[Path | None, typer.Option(help="serve this local engine directory instead (for development)")] = None,
    address: Annotated[str | None, typer.Option(help="the Ray cluster (default: serving.fleet.address)")] = None,
) -> None:
    """Replicas of kiln serve on the Ray cluster (serving.fleet), returning once each serves; writes HAProxy's configuration for its nodes."""
    from flows.fleet import deploy_fleet

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        deployed = deploy_fleet(root, _load(params_file), alias, engine, address)
    render.console.print(f"serving on {len(deployed.proxies)} node proxies: {', '.join(deployed.proxies)}")
    render.console.print(f"HAProxy in front of them: haproxy -f {deployed.haproxy_config}")
    render.console.print(f"Prometheus scraping every replica: prometheus --config.file={deployed.prometheus_config}")


@fleet_app.command("stop", cls=KilnCommand)
def fleet_stop(address: Annotated[str, typer.Option(help="the Ray cluster")] = "auto") -> None:
    """The fleet's replicas drained and stopped, then the Ray processes of this machine."""
    from flows.fleet import stop_fleet

    with _one_line_errors():
        stop_fleet(address)


bench_app = typer.Typer(
    cls=KilnGroup,
    add_completion=False,
    subcommand_metavar="[serving [OPTIONS]]",
    help="""Benchmarks, printed side by side (and written as JSON): `kiln bench` alone times the engines, `kiln bench serving` the server.

`kiln bench` alone: Hugging Face generate vs kiln's engines, on a model of --shape with random weights (the options below). """
    """`kiln bench serving`: the server under concurrent clients (its options: kiln bench serving --help).""",
)
app.add_typer(bench_app, name="bench")

# benchmarks.generation.SHAPES' names (a test holds them equal): --help lists them without
# importing the benchmarks, which only the bench verbs load.
Workload = Literal["random", "multi-turn"]
BenchShape = Literal["gpt2-small", "smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "qwen2.5-7b", "tiny"]


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
    runs: Annotated[int, typer.Option(help="timed generations per row")] = 5,
    precisions: Annotated[str | None, typer.Option(help="comma-separated kiln engines to time: on the CPU fp32, fp16, int8, int4 or int8-qdq (TensorRT's int8 form, on ONNX Runtime), default fp32,int8,int4; on CUDA the torch-cuda precisions, default the shape's own dtype")] = None,
    work: Annotated[Path, typer.Option(help="where the benchmark model and engines are kept")] = Path(".kiln/bench"),
    shape: Annotated[BenchShape, typer.Option(help="gpt2-small (124M), smollm2-135m (a Llama: 30 layers, 3 KV heads), qwen2.5-0.5b, llama3.2-1b, llama3.2-3b, llama3.1-8b, qwen2.5-7b (their configs, random weights) or tiny (a quick check that it runs)")] = "gpt2-small",
    device: Annotated[Literal["cpu", "cuda"], typer.Option(help="cpu: HF eager fp32 vs ONNX Runtime engines; cuda: HF static cache + torch.compile (and eager at batch 1) vs torch-cuda engines, batch 1, 16 and 64, with each precision's weight-read floor")] = "cpu",
    batches: Annotated[str, typer.Option(help="--device cuda: comma-separated batch sizes to time")] = "1,16,64",
    peer: Annotated[Literal["llama.cpp"] | None, typer.Option(help="also time llama-bench on the same model as GGUF (int8 beside Q8_0, int4 beside Q4_0), interleaved")] = None,
    llama_cpp: Annotated[Path | None, typer.Option(help="llama.cpp checkout or build folder for --peer (default: $KILN_LLAMA_CPP, else PATH)")] = None,
) -> None:
    """Side-by-side generation benchmark: HF generate vs kiln engines, on a model of --shape
    with random weights (`kiln bench serving` times the server instead)."""
    if ctx.invoked_subcommand is not None:
        return
    _prepare_environment(Path.cwd())
    from benchmarks import generation as bm  # only bench verbs load benchmarks, and only when run

    setup = bm.BenchSetup(runs=runs)
    if device == "cuda":
        if peer is not None:
            _fail(KilnError("--peer llama.cpp times the CPU: leave out --device cuda"))
        return _bench_cuda(work, setup, shape, _cuda_precisions(precisions), _batches(batches), json_path)
    engines = _bench_precisions(precisions or "fp32,int8,int4")
    peer_bench = _bench_peer(peer, llama_cpp, engines, setup, work / shape / "gguf")
    with _one_line_errors():
        measured = bm.benchmark_rows(work, engines, setup, shape, peer_bench.candidates if peer_bench else None)
    render.bench_rows(measured.rows, setup, shape, left_out=measured.left_out)
    render.stage_costs(measured.costs, shape)
    if peer_bench is not None:
        render.peer_rows(peer_bench.rows(measured.rows), setup, shape)
    if json_path is not None:
        bm.write_json(measured.rows, setup, json_path, costs=measured.costs, left_out=measured.left_out)
        render.console.print(f"rows written to {json_path}")


def _bench_precisions(text: str) -> list[str]:
    """--precisions' names, each one the bench builds; else exit 2 naming those, before any work."""
    from benchmarks.generation import ORT_PRECISIONS, VARIANTS

    known = [*ORT_PRECISIONS, *VARIANTS]
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names or [text]:
        if name not in known:
            _fail(KilnError(f"--precisions: {name!r} is not one of {', '.join(known)}"))
    return names


def _cuda_precisions(text: str | None) -> tuple[str, ...] | None:
    """--precisions for --device cuda: torch-cuda's precisions (None: the shape's dtype); else exit 2."""
    from components.config import TORCH_CUDA_PRECISIONS

    names = tuple(name.strip() for name in (text or "").split(",") if name.strip())
    for name in names:
        if name not in TORCH_CUDA_PRECISIONS:
            _fail(KilnError(f"--precisions: {name!r} is not one the torch-cuda backend builds ({', '.join(TORCH_CUDA_PRECISIONS)})"))
    return names or None


def _bench_peer(name: str | None, llama_cpp: Path | None, precisions: list[str], setup, cache: Path):
    """The --peer's candidates, or None; its tools are looked for before any work (exit 2)."""
    if name is None:
        return None
    from benchmarks.llama_cpp_peer import LlamaCppPeer, find_llama_cpp

    with _one_line_errors():
        return LlamaCppPeer(find_llama_cpp(llama_cpp), precisions, setup, cache)


def _batches(text: str) -> tuple[int, ...]:
    """--batches as sizes; else exit 2 naming what was wrong."""
    try:
        sizes = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        _fail(KilnError(f"--batches: {text!r} is not a comma-separated list of batch sizes (1 or more)"))
    return sizes


def _bench_cuda(work: Path, setup, shape: str, precisions: tuple[str, ...] | None, batches: tuple[int, ...], json_path: Path | None) -> None:
    from benchmarks import generation as bm
    from benchmarks.generation_cuda import cuda_rows

    results = []
    with _one_line_errors():
        for result in cuda_rows(work, setup, shape, batches, precisions):
            render.bench_rows(result.rows, setup, shape, result.batch)
            results.append(result)
    if json_path is not None:
        bm.write_json([row for result in results for row in result.rows], setup, json_path, batches=[r.batch for r in results for _ in r.rows])
        render.console.print(f"rows written to {json_path}")


@bench_app.command("serving", cls=_renaming({"--url": "--openai-url", "--triton": "--triton-url"}))
def bench_serving(
    params_file: ParamsOption = DEFAULT_PARAMS,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
    engine: Annotated[list[Path] | None, typer.Option(help="engine directory to serve (repeatable; default: the champion, else the challenger)")] = None,
    gpt2_small: Annotated[bool, typer.Option("--gpt2-small", help="add the GPT-2-small-shaped int8 engine of `kiln bench`")] = False,
    clients: Annotated[int, typer.Option(min=1, max=256, help="concurrent clients")] = 16,
    seconds: Annotated[float, typer.Option(min=1, max=600, help="how long each row drives its server")] = 10.0,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="prompt length of each request, in tokens")] = 32,
    new_tokens: Annotated[int, typer.Option(min=1, help="tokens each request generates")] = 32,
    rounds: Annotated[int, typer.Option(min=1, max=20, help="both modes once per round, interleaved; rows are medians")] = 1,
    openai_url: Annotated[list[str] | None, typer.Option(help="also drive the running OpenAI-compatible server at this URL (llama-server, vLLM, ...; repeatable)")] = None,
    vocab: Annotated[int | None, typer.Option(min=2, help="prompt token ids are drawn below this (default: the engine's vocabulary)")] = None,
    triton_url: Annotated[list[str] | None, typer.Option(help="also drive the model (kiln export triton's) of the running Triton server at this URL, through generate_stream")] = None,
    constrained: Annotated[bool, typer.Option(help="also the batching server's clients asking for JSON of a schema (structured outputs): what a grammar costs")] = False,
    workload: Annotated[Workload, typer.Option(help="random: prompts of random tokens, batching vs one at a time; multi-turn: conversations sharing a system prompt, the prefix cache off vs on")] = "random",
    system_tokens: Annotated[int, typer.Option(min=0, help="multi-turn: tokens of the system prompt every conversation begins with")] = 512,
    turns: Annotated[int, typer.Option(min=1, help="multi-turn: turns of each conversation (each a new user message of --prompt-tokens and a reply of --new-tokens)")] = 8,
    shape: Annotated[BenchShape | None, typer.Option(help="add an int8 engine of this shape (random weights, as `kiln bench --shape`) with a 2,048-token profile")] = None,
) -> None:
    """The server under concurrent clients: continuous batching vs one request at a time,
    beside the engine's own generate; with --openai-url or --triton-url, other servers driven by the same clients."""
    root = Path.cwd()
    _prepare_environment(root)
    from benchmarks import serving_load as bs

    setup = bs.ServingBenchSetup(clients=clients, seconds=seconds, prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds, constrained=constrained)
    done = lambda row: render.console.print(f"  {row.engine}: {row.name} done ({row.tokens_per_s:,.0f} tokens/s)")  # noqa: E731
    with _one_line_errors():
        engines = {} if openai_url and not (engine or gpt2_small or shape) else _serving_bench_engines(root, params_file, engine or [], gpt2_small, shape)
        if workload == "multi-turn":
            _bench_conversations(engines, openai_url or [], setup, system_tokens, turns, params_file.resolve(), json_path, done)
            return
        tokenizer_dir = next(iter(engines.values()), None)
        if triton_url and tokenizer_dir is None:
            raise KilnError("--triton-url beside --openai-url needs --engine DIR: its tokenizer turns the prompts into the text Triton takes")
        peers_vocab = _prompt_vocab(vocab, engines) if openai_url or triton_url else 0
        one, every_round = replace(setup, rounds=1), []
        for _ in range(setup.rounds):  # every server once a round: a shared machine's slow spell falls on all of them
            every_round += bs.serving_rounds(engines, one, params_file.resolve(), on_row=done)
            every_round += bs.url_rounds(openai_url or [], peers_vocab, one, on_row=done)
            every_round += bs.triton_rounds(triton_url, tokenizer_dir, peers_vocab, one, on_row=done) if triton_url else []
    rows = bs.median_rows(every_round)
    render.serving_rows(rows, setup, every_round)
    if json_path is not None:
        bs.write_json(rows, setup, json_path, every_round)
        render.console.print(f"rows written to {json_path}")


def _prompt_vocab(vocab: int | None, engines: dict[str, Path]) -> int:
    """The bound of the prompts' token ids for --openai-url and --triton-url: --vocab, else the engine's vocabulary."""
    if vocab is not None:
        return vocab
    if not engines:
        raise KilnError("--openai-url needs --vocab (or --engine DIR of the model that server serves): prompts are random token ids below it")
    from components.engine_dir import load_engine_dir

    return min(load_engine_dir(path).manifest.vocab_size for path in engines.values())


def _bench_conversations(engines: dict[str, Path], urls: list[str], setup, system_tokens: int, turns: int, params_file: Path, json_path: Path | None, done) -> None:
    from benchmarks import multi_turn as mt

    talk = mt.Conversations(system_tokens=system_tokens, turns=turns)
    rounds = mt.multi_turn_rows(engines, urls, setup, talk, params_file, on_row=done)
    rows = mt.median_rows(rounds)
    render.multi_turn_rows(rows, setup, talk)
    if json_path is not None:
        mt.write_json(rows, rounds, setup, talk, json_path)
        render.console.print(f"rows written to {json_path}")


def _serving_bench_engines(root: Path, params_file: Path, engines: list[Path], gpt2_small: bool, shape: str | None = None) -> dict[str, Path]:
    found = {path.name: path.resolve() for path in engines}
    if shape is not None:
        from benchmarks import generation as bm

        found[f"{shape} int8"] = bm.benchmark_engines(Path(f".kiln/bench/{shape}-2k"), ["int8"], bm.BenchSetup(), bm.SHAPES[shape], context=2048)[1]["int8"]
    if not found:
        from benchmarks.serving_load import promoted_engine

        label, path = promoted_engine(root, _load(params_file))
        found[label] = path
    if gpt2_small:
        from benchmarks import generation as bm

        found["gpt2-small int8"] = bm.benchmark_engines(Path(".kiln/bench/gpt2-small"), ["int8"], bm.BenchSetup())[1]["int8"]
    return found


@app.command(cls=_renaming({"--prometheus": "--prometheus-url"}))
def monitoring(
    params_file: ParamsOption = DEFAULT_PARAMS,
    render_png: Annotated[Path | None, typer.Option("--render", help="instead: draw the dashboard's panels from a Prometheus's data into this PNG")] = None,
    prometheus_url: Annotated[str, typer.Option(help="the Prometheus --render asks (kiln up --monitoring's by default)")] = "http://127.0.0.1:9090",
    minutes: Annotated[float, typer.Option(min=1, help="how far back --render draws")] = 15.0,
) -> None:
    """Write the Grafana dashboard (deploy/grafana/kiln-serve.json) and the Prometheus rules
    (deploy/prometheus/rules.yml, budgets from the params) for kiln serve; with --render,
    draw the dashboard's panels from a running Prometheus instead."""
    from flows.monitoring import dashboard, write

    with _one_line_errors():
        if render_png is not None:
            from flows.dashboard_render import render as draw

            found = draw(dashboard(), prometheus_url.rstrip("/"), render_png, minutes)
            empty = sorted(title for title, count in found.items() if count == 0)
            render.console.print(f"wrote {render_png} ({len(found) - len(empty)} of {len(found)} panels with data{'; none: ' + ', '.join(empty) if empty else ''})")
            return
        for path in write(_load(params_file), Path.cwd()):
            render.console.print(f"wrote {path}")


@app.command(cls=KilnCommand)
def doctor(params_file: ParamsOption = DEFAULT_PARAMS) -> None:
    """Which backends this machine can build and run, and why not; and whether the params'
    build.backend is one of them (outside a project, the machine alone)."""
    from components.runtime.availability import backend_statuses

    statuses = backend_statuses()
    render.backend_statuses(statuses)
    if params_file == DEFAULT_PARAMS and not params_file.is_file():
        return
    with _one_line_errors():
        requested = _load(params_file).build.backend
    render.console.print(f"{params_file}: build.backend {requested} → {_backend_verdict(requested, statuses)}", highlight=False)


def _backend_verdict(requested: str, statuses) -> str:
    """Whether this machine builds with `requested` (auto: which backends it may pick here)."""
    building = [status.backend for status in statuses if status.can_build]
    if requested == "auto":
        if len(building) < 2:
            return f"builds with {building[0]} here" if building else "[red]no backend builds here[/]"
        return f"picks among {', '.join(building)} here, by precision"
    return "builds here" if requested in building else "[red]does not build here[/] (see its row)"


@app.command(cls=KilnCommand)
def up(
    params_file: ParamsOption = DEFAULT_PARAMS,
    mlflow_port: Annotated[int, typer.Option(help="port of the MLflow server (its UI and API)")] = 5000,
    prefect_port: Annotated[int, typer.Option(help="port of the Prefect server (its UI and API)")] = 4200,
    serve_port: Annotated[int | None, typer.Option(help="the port `kiln serve` will listen on, where the MLflow UI's alias changes are sent (default: serving.port)")] = None,
    monitoring: Annotated[bool, typer.Option(help="also start Prometheus (Debian's `prometheus`), scraping kiln serve with kiln's rules")] = False,
    prometheus_port: Annotated[int, typer.Option(help="port of Prometheus, with --monitoring")] = 9090,
) -> None:
    """Local MLflow server (the embedded SQLite store and artifacts) and Prefect server, for the UIs."""
    from flows.servers import serve_uis

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        serve_uis(root, _load(params_file), mlflow_port, prefect_port, serve_port, prometheus_port if monitoring else None)


@app.command(cls=KilnCommand)
def deploy(
    params_file: ParamsOption = DEFAULT_PARAMS,
    prefect_url: Annotated[str | None, typer.Option(help="Prefect API (default: PREFECT_API_URL, else kiln up's http://127.0.0.1:4200/api)")] = None,
    mlflow_url: Annotated[str | None, typer.Option(help="MLflow server that delivers alias webhooks (default: registry.tracking_uri if a server, else kiln up's http://127.0.0.1:5000)")] = None,
    pool: Annotated[bool, typer.Option("--pool", help="register them on the work pool of params' pool section, for `kiln worker`s, instead of running them here")] = False,
) -> None:
    """Serve the Prefect deployments: rebuild on a schedule and on data changes, verify-promotion on alias changes."""
    from flows.deploy import DeploySettings, serve_deployments

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        params = _load(params_file)
        settings = DeploySettings(
            prefect_api_url=prefect_url or os.environ.get("PREFECT_API_URL") or "http://127.0.0.1:4200/api",
            mlflow_url=mlflow_url or _mlflow_server(params.registry.tracking_uri),
        )
        serve_deployments(root, str(params_file), params, settings, pool=pool)


@app.command(cls=KilnCommand)
def worker(
    target: Annotated[str, typer.Argument(help="build target of params' pool.targets that this machine builds")],
    params_file: ParamsOption = DEFAULT_PARAMS,
    prefect_url: Annotated[str | None, typer.Option(help="Prefect API (default: PREFECT_API_URL, else http://127.0.0.1:4200/api)")] = None,
) -> None:
    """A Prefect process worker for one build target of the pool (see kiln deploy --pool)."""
    from flows.deploy import run_worker

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors():
        run_worker(root, _load(params_file), target, prefect_url or os.environ.get("PREFECT_API_URL") or "http://127.0.0.1:4200/api")


def _mlflow_server(tracking_uri: str | None) -> str:
    return tracking_uri if tracking_uri and tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"


data_app = typer.Typer(cls=KilnGroup, add_completion=False, no_args_is_help=True, help="The versioned corpus.")
app.add_typer(data_app, name="data")


@data_app.command("add", cls=KilnCommand)
def data_add(
    paths: Annotated[list[Path], typer.Argument(help="text files to add to the corpus")],
    params_file: ParamsOption = DEFAULT_PARAMS,
) -> None:
    """Add text files to the corpus (data.source.glob), version it with DVC (add + push), announce the change to Prefect."""
    from flows.data_changes import add_data, announce_data_change, changing_data
    from flows.events import EventNotDelivered

    root = Path.cwd()
    _prepare_environment(root)
    with _one_line_errors(), changing_data(root):
        params = _load(params_file)
        written, change = add_data(root, params, paths)
        render.console.print(f"added {len(written)} file(s) to the corpus" + (f": {', '.join(p.name for p in written)}" if written else " (all were there)"))
        if change is None:
            render.console.print("data version unchanged")
            return
        render.console.print(f"data version {change.md5} (was {change.previous or 'none'})" + (", pushed to the DVC remote" if params.data.dvc_push else ""))
        try:
            event = announce_data_change(root, params, change)
        except EventNotDelivered as err:
            render.note(f"{err}; `kiln deploy` notices the new data.dvc when it runs")
            return
        render.console.print(f"announced kiln.data.changed (event {event})")


export_app = typer.Typer(cls=KilnGroup, add_completion=False, no_args_is_help=True, help="A registered version for another server.")
app.add_typer(export_app, name="export")


@export_app.command("triton", cls=KilnCommand)
def export_triton(
    repository: Annotated[Path, typer.Argument(help="the Triton model repository to write into (made if absent)")],
    params_file: ParamsOption = DEFAULT_PARAMS,
    alias: Annotated[str | None, typer.Option(help="the alias whose version to export (default: serving.alias, champion)")] = None,
    version: Annotated[str | None, typer.Option(help="a version number instead of an alias")] = None,
    instances: Annotated[int, typer.Option(min=1, help="model instances Triton runs (each holds the engine)")] = 1,
) -> None:
    """Write a version as a Triton model repository (<model>/config.pbtxt, <model>/<version>/
    with model.py and the engine), pulled with every check kiln serve makes."""
    from flows.triton_export import export_version
    from registry import get_version, resolve_alias

    with _one_line_errors():
        params = _load(params_file)
        target = _registry(params_file)
        info = get_version(target, version) if version else resolve_alias(target, alias or params.serving.alias)
        exported = export_version(target, info, repository, params.serving.threads, params.serving.max_waiting, instances)
        render.console.print(f"wrote {exported.path} ({exported.model} version {exported.version}); the model folder holds versions {', '.join(exported.versions)}")
        render.console.print(f"serve it: tritonserver --model-repository={repository}   (here: make triton-env, then .triton-venv/bin/python -m flows.triton_server --model-repository={repository})")


keys_app = typer.Typer(cls=KilnGroup, add_completion=False, no_args_is_help=True, help="The keys engines are signed with and verified against.")
app.add_typer(keys_app, name="keys")


@keys_app.command("init", cls=KilnCommand)
def keys_init(
    params_file: ParamsOption = DEFAULT_PARAMS,
    if_missing: Annotated[bool, typer.Option(help="do nothing where the key exists (make run)")] = False,
) -> None:
    """Make this machine's P-256 signing key (KILN_SIGNING_KEY, registry.signing_key, or
    ~/.config/kiln/signing-key.pem; mode 0600) and its public half beside it (.pub)."""
    from registry.signing import create_key, fingerprint
    from registry.target import signing_key_path

    with _one_line_errors():
        key = signing_key_path(_load(params_file).registry)
        if if_missing and key.exists():
            return
        public = create_key(key)
        render.console.print(f"signing key {key} (fingerprint {fingerprint(public.read_bytes())[:16]}…); public key {public}")
        render.console.print("machines that only verify (a server, a colleague): copy the .pub into the project and list it in registry.trusted_keys")


@keys_app.command("show", cls=KilnCommand)
def keys_show(params_file: ParamsOption = DEFAULT_PARAMS) -> None:
    """This machine's signing key and the public keys the project trusts, by fingerprint."""
    from registry.signing import trusted_fingerprints

    with _one_line_errors():
        signing = _registry(params_file).signing
        render.console.print(f"signing key: {signing.key}" + ("" if signing.key.is_file() else " (missing: `kiln keys init` makes it)"))
        for found, path in trusted_fingerprints(signing).items():
            render.console.print(f"trusted: {found[:16]}…  {path}")
        render.console.print(f"signatures required: {str(signing.required).lower()}")


@keys_app.command("sign-existing", cls=KilnCommand)
def keys_sign_existing(params_file: ParamsOption = DEFAULT_PARAMS) -> None:
    """Sign the versions registered before signing whose every file is byte-identical to an
    engine this project built (.kiln/stages/engines); the others are left for a rebuild."""
    from components.workspace import Workspace
    from flows.keys import sign_existing

    with _one_line_errors():
        outcomes = sign_existing(_registry(params_file), Workspace(Path.cwd()).stage_dir("engines"))
        for outcome in outcomes:
            render.console.print(f"version {outcome.version}: {outcome.result} — {outcome.detail}", highlight=False)
        if not outcomes:
            render.console.print("no versions registered")


def main() -> None:
    # A TERM (a supervisor, `timeout`, Ctrl-C's cousin) unwinds like an exception, so a
    # registration in progress is rolled back instead of left half-done.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a long-running kiln
    # (deploy, serve, worker) is waiting, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
