"""What the CLI shows people: rich tables for results, reports, benchmarks and backends.

Values in, text out: nothing here computes or decides.
"""

from __future__ import annotations

from rich.console import Console
from rich import box
from rich.table import Table

from components.errors import KilnError

console = Console()
err_console = Console(stderr=True)


def error(err: KilnError) -> None:
    err_console.print(f"[bold red]error:[/] {' '.join(str(err).split())}", highlight=False, soft_wrap=True)


def note(text: str) -> None:
    err_console.print(f"[yellow]note:[/] {text}", highlight=False, soft_wrap=True)


def gate_report(report) -> None:
    """Every measured number of every gate, with its interval and limit; a failed gate's rows
    in red, an inconclusive one's in yellow; the measures left out of a verdict, and why."""
    from components.gates import limit_text

    table = Table(title="gates", show_lines=False, caption=f"measured on {report.machine}" if report.machine else None)
    for column in ("gate", "measure", "value", "interval", "limit"):
        table.add_column(column)
    for gate in report.gates:
        style = {"passed": "", "inconclusive": "yellow"}.get(gate.verdict, "red")
        for measure, value in gate.measured.items():
            table.add_row(gate.name, measure, f"{value:.6g}", gate.interval_text(measure), limit_text(measure, gate.thresholds), style=style)
    console.print(table)
    for gate in report.gates:
        for measure, why in gate.excluded.items():
            note(f"{gate.name}: {measure} is left out of the verdict: {why}")


def _verdict_cell(verdict: str) -> str:
    return {"passed": "[green]passed[/]", "inconclusive": "[yellow]inconclusive[/]"}.get(verdict, "[red]FAILED[/]")


def pipeline_result(result) -> None:
    """The table `kiln run` ends with: one row per engine, then challenger, model and sample."""
    backends = sorted({o.engine.manifest.backend for o in result.outcomes})
    table = Table(title=f"engines built in this run ({', '.join(backends)})")
    for column in ("precision", "top-1", "ppl Δ%", "p50 ms", "p95 ms", "gates", "version"):
        table.add_column(column, justify="left" if column in ("precision", "gates", "version") else "right")
    for outcome in result.outcomes:
        quality, latency = outcome.report.gate("quality").measured, outcome.report.gate("latency").measured
        reg = outcome.registration
        alias = "".join(f" @{name}" for name, version in sorted(result.aliases.items()) if version == reg.version)
        table.add_row(
            outcome.precision,
            f"{quality['top1_agreement']:.4f}",
            f"{quality['ppl_increase_pct']:+.3f}",
            f"{latency['p50_ms']:.1f}",
            f"{latency['p95_ms']:.1f}",
            _verdict_cell(outcome.report.verdict),
            f"{reg.version} {'new' if reg.created else 'unchanged'}{alias}",
        )
    console.print(table)
    for outcome in result.failed:
        console.print(f"[red]{outcome.precision} {outcome.report.verdict}:[/] " + "; ".join(outcome.report.failures()))
    for outcome in (o for o in result.outcomes if o.record_disagrees):
        reg, record = outcome.registration, "passed" if outcome.registration.gates_passed else "failed"
        console.print(
            f"[yellow]{outcome.precision} is version {reg.version}, registered before when its gates {record}: that record stands "
            f"(kiln never rewrites a version's gates); delete the version to register this run's[/]"
        )
    from components.gates import GateReport

    for outcome in result.outcomes:
        compared = outcome.against_champion
        if compared is not None and not compared.passed:
            version = int(compared.measured["champion_version"])
            reasons = "; ".join(f.removeprefix("champion: ") for f in GateReport((compared,)).failures())
            console.print(f"[yellow]{outcome.precision} is not a challenger: worse than champion version {version}:[/] {reasons}")
    if result.challenger is not None:
        reg = result.challenger.registration
        state = "registered" if reg.created else "unchanged (same engine sha256 already registered)"
        console.print(f"[bold green]{reg.name} version {reg.version} @challenger[/] ({result.challenger.precision}) — {state}")
        console.print(f"  engine sha256 {result.challenger.engine.sha256[:16]}…  data {result.data.md5}")
        now = result.aliases.get("challenger")
        if now != reg.version:
            console.print(f"[yellow]  challenger is now version {now}: another run moved it after this one[/]")
    if result.model.eval_perplexity is not None:
        console.print(
            f"  model eval perplexity {result.model.eval_perplexity:.2f} (uniform guess {result.model.uniform_perplexity:.0f})"
        )
    console.print("  see it in the MLflow UI: [bold]kiln up[/] → http://127.0.0.1:5000")
    if result.sample is not None:
        console.print("[bold]sample completion[/] (challenger engine downloaded from the registry):")
        console.print(f"  {result.sample!r}", highlight=False)


def bench_rows(rows, setup, shape: str, batch: int = 1, left_out: tuple[str, ...] = ()) -> None:
    """The rows, each with its speed-up over Hugging Face's ("—" where HF was `left_out`, the reasons in the caption)."""
    table = Table(title=f"generate {setup.new_tokens} tokens after {setup.prompt_tokens}, batch {batch}, {shape} shape", caption="; ".join(left_out) or None)
    for column in ("name", "median ms", "ms / token", "tokens / s", "speed-up vs HF"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for row in rows:
        tokens_per_s = batch * setup.new_tokens / (row.median_ms / 1000)
        speedup = "—" if row.speedup_vs_hf is None else f"{row.speedup_vs_hf:.2f}×"
        table.add_row(row.name, f"{row.median_ms:.1f}", f"{row.ms_per_token:.3f}", f"{tokens_per_s:,.0f}", speedup)
    console.print(table)


def stage_costs(costs, shape: str) -> None:
    """Each build stage's time and peak memory (as measured when it was built; a cached
    stage keeps its numbers), and each engine process as `kiln serve` runs it."""
    table = Table(
        title=f"what each stage took, {shape} shape",
        caption="peak: the process's resident memory at its highest; serve: load, warm-up and the bench's generation in a process of its own",
    )
    for column in ("stage", "time", "peak memory"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for cost in costs:
        table.add_row(cost.stage, f"{cost.seconds:.1f} s", f"{cost.peak_bytes / 2**30:.2f} GiB")
    console.print(table)


def peer_rows(rows, setup, shape: str) -> None:
    """kiln beside llama.cpp, precision by precision, per token of the same work (fits 80 columns)."""
    threads = ", ".join(sorted({str(row.peer_threads) for row in rows}))
    table = Table(
        title=f"kiln vs llama.cpp, {setup.prompt_tokens} + {setup.new_tokens} tokens, batch 1, {shape} shape",
        caption=f"ms/token: a whole generation's median over {setup.new_tokens}; ratio: kiln ÷ llama.cpp (above 1: llama.cpp is faster); "
        f"pp, tg: llama-bench's prompt of {setup.prompt_tokens} alone and new tokens alone; llama.cpp on {threads} threads",
    )
    for column in ("kiln", "ms/token", "llama.cpp", "ms/token", "ratio", f"pp{setup.prompt_tokens} ms", "tg ms/token"):
        table.add_column(column, justify="left" if column in ("kiln", "llama.cpp") else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.precision, f"{row.kiln_ms_per_token:.3f}", row.ggml_type, f"{row.peer_ms_per_token:.3f}", f"{row.kiln_over_peer:.2f}×",
            f"{row.peer_prefill_ms:.1f}", f"{row.peer_decode_ms_per_token:.3f}",
        )  # fmt: skip
    console.print(table)


def serving_rows(rows, setup, every_round) -> None:
    """One table per engine (its name in the title, so the rows fit an 80-column terminal or
    CI log); the ratio is tokens/s against that engine's one-at-a-time row, and "of gen"
    against its own `generate` of the same work with no server. With several
    rounds the rows are medians, and the caption gives each round's own ratio."""
    for engine in dict.fromkeys(row.engine for row in rows):
        mine = [row for row in rows if row.engine == engine]
        baseline = next((row.tokens_per_s for row in mine if row.name == "one-at-a-time"), float("nan"))
        ceiling = next((row.tokens_per_s for row in mine if row.name == "engine generate"), float("nan"))
        requests = ", ".join(f"{row.name} {row.requests} requests ({row.failed} failed)" for row in mine)
        rounds = f"medians of {setup.rounds} rounds (ratio by round: {_round_ratios(every_round, engine)}); " if setup.rounds > 1 else ""
        table = Table(
            title=f"kiln serve {engine}: {setup.clients} clients, {setup.prompt_tokens} + {setup.new_tokens} tokens, {setup.seconds:.0f} s per row",
            caption=f"{rounds}{requests}; latencies of whole requests (engine generate: of its whole batch); TTFT: median time to first token; "
            "TPOT: median time per output token after the first",
            box=box.SIMPLE_HEAD, padding=0,  # no column rules, one space between: nine columns fit 80
        )
        for column in ("mode", "req/s", "tok/s", "ratio", "of gen", "p50 ms", "p99 ms", "TTFT ms", "TPOT ms"):
            table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
        for row in mine:
            table.add_row(
                row.name, f"{row.requests_per_s:.1f}", f"{row.tokens_per_s:.0f}", _or_dash(row.tokens_per_s / baseline, "{:.2f}×"),
                _or_dash(row.tokens_per_s / ceiling, "{:.0%}"), f"{row.p50_ms:.1f}", f"{row.p99_ms:.1f}", _or_dash(row.ttft_p50_ms, "{:.1f}"),
                _or_dash(row.tpot_p50_ms, "{:.1f}"),
            )  # fmt: skip
        console.print(table)


def multi_turn_rows(rows, setup, talk) -> None:
    """One table of conversations: each row's time to first token and tokens/s, the
    ratios against the same engine with its prefix cache off, and the prompt tokens it
    prefilled (the rest its cache gave)."""
    context = max(row.longest_prompt for row in rows)
    table = Table(
        title=f"multi-turn: {setup.clients} conversations at once, a {talk.system_tokens}-token system prompt, {talk.turns} turns of "
        f"{setup.prompt_tokens} + {setup.new_tokens} tokens (contexts up to {context} tokens), {setup.seconds:.0f} s per row",
        caption=f"{f'medians of {setup.rounds} rounds (turns and tokens: sums); ' if setup.rounds > 1 else ''}"
        "TTFT: time to first token over every turn; ×: the cache-off row's TTFT p50 over this row's, this row's tokens/s over the cache-off row's; "
        "prefilled: prompt tokens computed, the rest reused (hit rate)",
        box=box.SIMPLE_HEAD, padding=0,
    )  # fmt: skip
    for column in ("server", "turns", "tok/s", "×", "TTFT p50", "p99 ms", "×", "prefilled", "hits"):
        table.add_column(column, justify="left" if column == "server" else "right", no_wrap=True)
    off = next((row for row in rows if row.name == "prefix cache off"), None)
    for row in rows:
        label = row.engine if row.name == "as served" else f"kiln, {row.name}"
        table.add_row(
            label, str(row.turns), f"{row.tokens_per_s:.0f}", _or_dash(row.tokens_per_s / off.tokens_per_s if off else float("nan"), "{:.2f}"),
            f"{row.ttft_p50_ms:.0f}", f"{row.ttft_p99_ms:.0f}", _or_dash(off.ttft_p50_ms / row.ttft_p50_ms if off else float("nan"), "{:.2f}"),
            f"{row.prefilled_tokens:,}", _or_dash(row.hit_rate, "{:.0%}"),
        )  # fmt: skip
    console.print(table)


def _or_dash(value: float, form: str) -> str:
    """`value` in `form`, or a dash where it is not a number (no such row to divide by)."""
    return "—" if value != value else form.format(value)


def _round_ratios(every_round, engine: str) -> str:
    """Continuous batching over one-at-a-time, round by round (the rows alternate)."""
    mine = [row for row in every_round if row.engine == engine]
    one = [row.tokens_per_s for row in mine if row.name == "one-at-a-time"]
    batched = [row.tokens_per_s for row in mine if row.name == "continuous-batching"]
    return ", ".join(f"{b / o:.2f}×" for o, b in zip(one, batched, strict=True))


def backend_statuses(statuses) -> None:
    table = Table(title="backends on this machine")
    for column in ("backend", "build", "run", "details"):
        table.add_column(column)
    for status in statuses:
        table.add_row(status.backend, _yes_no(status.can_build), _yes_no(status.can_run), status.details)
    console.print(table)


def _yes_no(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[red]no[/]"


def lineage(lineage) -> None:
    """`kiln lineage`: the chain from the data version to the aliases, as a tree."""
    from rich.tree import Tree

    from flows.lineage import recorded_gates_table
    from registry import tags

    info, tag = lineage.info, lineage.tag
    aliases = " ".join(f"@{a}" for a in info.aliases) or "no alias"
    root = Tree(f"[bold]{info.name} version {info.version}[/] · {aliases}")
    data = root.add(f"data version [cyan]{tag(tags.DATA_MD5)}[/]")
    model = data.add(f"model sha256 {tag(tags.SOURCE_MODEL_SHA256)[:12]}")
    perplexity = lineage.run_metrics.get("train.eval_perplexity")
    if perplexity is not None:
        model.add(f"eval perplexity {perplexity:.2f}")
    built_from = model  # torch-cuda's engines are built from the model itself: no ONNX between
    if tag(tags.ONNX_SHA256) != "none":
        onnx = model.add(f"ONNX sha256 {tag(tags.ONNX_SHA256)[:12]}")
        built_from = onnx.add(f"{tag(tags.PRECISION)} ONNX sha256 {tag(tags.PRECISION_ONNX_SHA256)[:12]} · calibration {tag(tags.CALIBRATION_DIGEST)[:12]}")
    engine = built_from.add(
        f"engine sha256 [cyan]{tag(tags.ENGINE_SHA256)[:12]}[/] · {tag(tags.BACKEND)} {tag(tags.BACKEND_VERSION)} · {tag(tags.TARGET)} · profiles {tag(tags.PROFILES_SHA256)[:12]}"
    )
    passed = info.tags.get(tags.GATES_PASSED) == tags.TRUE
    engine.add(f"gates {_verdict_cell(info.tags.get(tags.GATES_VERDICT) or ('passed' if passed else 'failed'))} (below)")
    if info.tags.get(tags.FORCED_REASON):
        engine.add(f"[yellow]promotion forced[/] by {tag(tags.FORCED_BY)} at {tag(tags.FORCED_AT)}: {tag(tags.FORCED_REASON)}")
    built = root.add(f"built from git {tag(tags.GIT_COMMIT)[:12]} with params sha256 {tag(tags.PARAMS_SHA256)[:12]} · run {info.run_id}")
    for move in lineage.moves:
        verb = "became" if move.version == info.version else "stopped being"
        built.add(f"{move.at} {verb} @{move.alias} (by {move.by}{': ' + move.reason if move.reason else ''})")
    console.print(root)
    console.print(recorded_gates_table(info.tags, lineage.run_metrics))  # the terminal's whole width, not a tree's indent


def deployments(served, listeners: list[str], prefect_api_url: str, where: str) -> None:
    table = Table(title=f"kiln deploy → {prefect_api_url}, run by {where}", title_justify="left")
    table.add_column("deployment")
    table.add_column("starts on")
    for deployment in served:
        table.add_row(deployment.name, deployment.starts_on)
    console.print(table)
    for listener in listeners:
        console.print(f"  {listener}")
    console.print("Ctrl-C (or SIGTERM) stops it.")
