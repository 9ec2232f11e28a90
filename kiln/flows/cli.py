"""The `kiln` command line (Typer). Heavy modules load inside the verbs, so `kiln --help`
and importing this module stay fast and torch-free.

Exit codes: 0 success, 1 a gate failed, 2 unusable input (bad params, missing or corrupt
files, unreachable registry).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kiln.errors import GateFailed, KilnError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kiln: train → export → build → gate → register → serve.")
console = Console()
err_console = Console(stderr=True)

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="params file (default: params.yaml in the current folder)")]


def _prepare_environment(root: Path) -> None:
    from kiln.flows.environment import prepare_environment

    prepare_environment(root)


def _load(params_file: Path):
    from kiln.config import load_params

    return load_params(params_file)


def _fail(err: KilnError) -> None:
    err_console.print(f"[bold red]error:[/] {' '.join(str(err).split())}", highlight=False, soft_wrap=True)
    raise typer.Exit(1 if isinstance(err, GateFailed) else 2)


@app.command()
def run(
    params_file: ParamsOption = Path("params.yaml"),
    fresh: Annotated[bool, typer.Option(help="delete cached stage outputs and rebuild every stage")] = False,
) -> None:
    """Retrain and rebuild: data → train → export → build → gates → register."""
    _run_pipeline(params_file, model_dir=None, fresh=fresh)


@app.command()
def build(
    params_file: ParamsOption = Path("params.yaml"),
    model: Annotated[Path | None, typer.Option(help="model directory (default: model.pretrained)")] = None,
    fresh: Annotated[bool, typer.Option(help="delete cached stage outputs and rebuild every stage")] = False,
) -> None:
    """The same flow from an existing model, without training."""
    _run_pipeline(params_file, model_dir=model, fresh=fresh, from_model=True)


def _run_pipeline(params_file: Path, model_dir: Path | None, fresh: bool, from_model: bool = False) -> None:
    """`from_model`: skip training, using `model_dir` or else params' model.pretrained."""
    root = Path.cwd()
    _prepare_environment(root)
    try:
        params = _load(params_file)
        if from_model:
            model_dir = _model_to_build(model_dir, params)
        if fresh:
            import shutil

            from kiln.workspace import Workspace

            shutil.rmtree(Workspace(root).state / "stages", ignore_errors=True)
            os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
        from kiln.flows.pipeline import retrain_and_rebuild

        _hide_kiln_tracebacks()
        result = retrain_and_rebuild(params, root, model_dir)
    except GateFailed as err:
        _print_result(err.report)
        _fail(err)
    except KilnError as err:
        _fail(err)
    _print_result(result)


def _model_to_build(model_dir: Path | None, params) -> Path:
    from kiln.components.train import check_model_directory

    if model_dir is None and not params.model.pretrained:
        raise KilnError("kiln build needs a model: pass --model DIR or set model.pretrained in params.yaml")
    model_dir = (model_dir or Path(params.model.pretrained)).resolve()
    check_model_directory(model_dir)
    return model_dir


class _NoKilnTracebacks(logging.Filter):
    """A KilnError's message already says what was wrong; Prefect's console would add a
    traceback for the task and again for the flow."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], KilnError):
            record.exc_info = None
            record.exc_text = None
        return True


def _hide_kiln_tracebacks() -> None:
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoKilnTracebacks())


def _print_report(report) -> None:
    table = Table(title="gates", show_lines=False)
    for column in ("gate", "measure", "value", "limit"):
        table.add_column(column)
    from kiln.components.gates import limit_text

    for gate in report.gates:
        for measure, value in gate.measured.items():
            style = "" if gate.passed else "red"
            table.add_row(gate.name, measure, f"{value:.6g}", limit_text(measure, gate.thresholds), style=style)
    console.print(table)


def _print_result(result) -> None:
    backends = sorted({o.engine.manifest.backend for o in result.outcomes})
    table = Table(title=f"engines built in this run ({', '.join(backends)})")
    for column in ("precision", "top-1", "ppl Δ%", "p50 ms", "p95 ms", "gates", "version"):
        table.add_column(column, justify="left" if column in ("precision", "gates", "version") else "right")
    for outcome in result.outcomes:
        quality, latency = outcome.report.gate("quality").measured, outcome.report.gate("latency").measured
        reg = outcome.registration
        alias = " @challenger" if result.challenger is outcome else ""
        table.add_row(
            outcome.precision,
            f"{quality['top1_agreement']:.4f}",
            f"{quality['ppl_increase_pct']:+.3f}",
            f"{latency['p50_ms']:.1f}",
            f"{latency['p95_ms']:.1f}",
            "[green]passed[/]" if outcome.report.passed else "[red]FAILED[/]",
            f"{reg.version} {'new' if reg.created else 'unchanged'}{alias}",
        )
    console.print(table)
    for outcome in result.failed:
        console.print(f"[red]{outcome.precision} failed:[/] " + "; ".join(outcome.report.failures()))
    if result.challenger is not None:
        reg = result.challenger.registration
        state = "registered" if reg.created else "unchanged (same engine sha256 already registered)"
        console.print(f"[bold green]{reg.name} version {reg.version} @challenger[/] ({result.challenger.precision}) — {state}")
        console.print(f"  engine sha256 {result.challenger.engine.sha256[:16]}…  data {result.data.md5}")
    if result.model.eval_perplexity is not None:
        console.print(
            f"  model eval perplexity {result.model.eval_perplexity:.2f} (uniform guess {result.model.uniform_perplexity:.0f})"
        )
    console.print("  see it in the MLflow UI: [bold]kiln up[/] → http://127.0.0.1:5000")
    if result.sample is not None:
        console.print("[bold]sample completion[/] (challenger engine downloaded from the registry):")
        console.print(f"  {result.sample!r}", highlight=False)


@app.command()
def gate(
    engine_dir: Annotated[Path, typer.Argument(help="engine directory (with engine.json)")],
    params_file: Annotated[Path | None, typer.Option("--params", "-p", help="params file (default: params.yaml if present)")] = None,
    reference: Annotated[Path | None, typer.Option(help="reference model directory (default: from the engine's lineage)")] = None,
    data: Annotated[Path | None, typer.Option(help="data directory holding eval.parquet (default: data.path)")] = None,
) -> None:
    """Gate one engine directory; prints the report; exit 1 when a gate fails."""
    _prepare_environment(Path.cwd())
    try:
        report = _gate(engine_dir, params_file, reference, data)
    except KilnError as err:
        _fail(err)
    _print_report(report)
    if not report.passed:
        _fail(GateFailed("; ".join(report.failures()), report))
    console.print("[bold green]all gates passed[/]")


def _gate(engine_dir: Path, params_file: Path | None, reference: Path | None, data_dir: Path | None):
    from kiln.components.data import DataVersion
    from kiln.components.engine_dir import load_engine_dir
    from kiln.components.gates import gate_engine_dir
    from kiln.components.train import model_from_directory
    from kiln.config import Params

    if params_file is None:
        params = _load(Path("params.yaml")) if Path("params.yaml").is_file() else Params()
    else:
        params = _load(params_file)
    engine = load_engine_dir(engine_dir)
    model = model_from_directory(reference or Path(engine.manifest.lineage.source_model_path))
    if model.sha256 != engine.manifest.lineage.source_model_sha256:
        err_console.print(f"[yellow]note:[/] reference {model.path} is not the model this engine was built from")
    data = DataVersion(path=data_dir or Path(params.data.path), md5="")
    if not data.split_path("eval").is_file():
        raise KilnError(f"no eval split at {data.split_path('eval')}: pass --data DIR")
    return gate_engine_dir(engine.path, model.path, data.texts("eval"), params.gates)


@app.command()
def promote(
    params_file: ParamsOption = Path("params.yaml"),
    to_alias: Annotated[str, typer.Option("--to", help="alias to set")] = "champion",
    from_alias: Annotated[str, typer.Option("--from", help="alias whose version to take")] = "challenger",
    version: Annotated[str | None, typer.Option(help="a version number instead of --from")] = None,
) -> None:
    """Move an alias (default: champion to the current challenger)."""
    from kiln.flows.lineage import registry_target
    from kiln.registry import promote as promote_version
    from kiln.workspace import Workspace

    try:
        params = _load(params_file)
        info = promote_version(registry_target(params.registry, Workspace(Path.cwd())), to_alias, from_alias, version)
    except KilnError as err:
        _fail(err)
    console.print(f"{info.name}@{to_alias} → version {info.version}")


@app.command()
def bench(
    json_path: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
    runs: Annotated[int, typer.Option(help="timed generations per row")] = 5,
    precisions: Annotated[str, typer.Option(help="comma-separated kiln engines to time")] = "fp32,int8",
    work: Annotated[Path, typer.Option(help="where the benchmark model and engines are kept")] = Path(".kiln/bench"),
) -> None:
    """Side-by-side generation benchmark: HF generate vs kiln engines (GPT-2-small shape)."""
    _prepare_environment(Path.cwd())
    from kiln.components import benchmark as bm

    setup = bm.BenchSetup(runs=runs)
    try:
        model_dir, engines = bm.benchmark_engines(work, precisions.split(","), setup)
    except KilnError as err:
        _fail(err)
    prompt = bm.random_prompts(1, setup.prompt_tokens, bm.GPT2_SMALL["vocab_size"], setup.seed)[0]
    candidates = {"hf-eager-fp32": bm.hf_generate_fn(model_dir, prompt, setup.new_tokens)}
    candidates |= {f"kiln-ort-{p}": bm.engine_generate_fn(path, prompt, setup.new_tokens) for p, path in engines.items()}
    rows = bm.rows_from_samples(bm.time_interleaved(candidates, setup), setup.new_tokens, baseline="hf-eager-fp32")
    table = Table(title=f"generate {setup.new_tokens} tokens after {setup.prompt_tokens}, batch 1, GPT-2-small shape (124M)")
    for column in ("name", "median ms", "ms / token", "speed-up vs HF"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for row in rows:
        table.add_row(row.name, f"{row.median_ms:.0f}", f"{row.ms_per_token:.2f}", f"{row.speedup_vs_hf:.2f}×")
    console.print(table)
    if json_path is not None:
        bm.write_json(rows, setup, json_path)
        console.print(f"rows written to {json_path}")


@app.command()
def doctor() -> None:
    """Which backends this machine can build and run, and why not."""
    from kiln.components.engines.availability import backend_statuses

    table = Table(title="backends on this machine")
    for column in ("backend", "build", "run", "details"):
        table.add_column(column)
    for status in backend_statuses():
        table.add_row(status.backend, _yes_no(status.can_build), _yes_no(status.can_run), status.details)
    console.print(table)


def _yes_no(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


@app.command()
def up(
    params_file: ParamsOption = Path("params.yaml"),
    mlflow_port: int = 5000,
    prefect_port: int = 4200,
) -> None:
    """Local MLflow server (the embedded SQLite store and artifacts) and Prefect server, for the UIs."""
    from kiln.flows.servers import serve_uis

    root = Path.cwd()
    _prepare_environment(root)
    try:
        serve_uis(root, _load(params_file), mlflow_port, prefect_port)
    except KilnError as err:
        _fail(err)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
