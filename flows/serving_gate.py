"""The serving gate: `serving.measure` for each scenario of `gates.serving`, as one gate
whose measures are `<scenario>.<measure>` and whose budgets are `max_<scenario>.<measure>`.

It lives with the flows because it joins a stage's report (components) with the server's
scheduler (serving), which do not import each other."""

from __future__ import annotations

from components.config import GateParams
from components.engine_dir import EngineDir
from components.gates import GateResult, scenario_budgets, token_windows
from components.runtime import open_engine
from components.runtime.tokenizer import EngineTokenizer
from serving.measure import measure_scenario


def serving_gate(engine_dir: EngineDir, eval_texts: list[str], params: GateParams, threads: int | None) -> GateResult:
    """`threads`: ONNX Runtime's, as the server runs the engine (`serving.threads`)."""
    tokenizer = EngineTokenizer(engine_dir.path)
    measured: dict[str, float] = {}
    thresholds: dict[str, float] = {}
    budget_texts: dict[str, str] = {}
    for scenario in params.serving.scenarios:
        prompts = token_windows(tokenizer, eval_texts, scenario.clients * scenario.requests, scenario.prompt_tokens).tolist()
        engine = open_engine(engine_dir, threads=threads)  # the scheduler closes it when it stops
        conditions = engine.runtime_settings()
        budgets = scenario_budgets(engine, prompts[0], scenario)
        numbers = measure_scenario(engine, tokenizer, prompts, scenario.clients, scenario.requests, scenario.new_tokens)
        measured |= {f"{scenario.name}.{name}": value for name, value in numbers.items()}
        measured |= {f"{scenario.name}.{name.split('_')[0]}_floor_ms": value for name, value in budgets.floors.items()}
        thresholds |= {f"max_{scenario.name}.{budget}": limit for budget, limit in budgets.limits.items()}
        budget_texts[f"{scenario.name}.budget"] = budgets.text
    passed = all(measured[key.removeprefix("max_")] <= limit for key, limit in thresholds.items())
    return GateResult("serving", passed, measured, thresholds, conditions=conditions | budget_texts | {"process": "the server's scheduler, without HTTP"})
