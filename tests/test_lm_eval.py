"""EleutherAI's lm-evaluation-harness against `kiln serve`, as the field scores models.

lm-eval's `local-completions` model drives the served engine over HTTP (loglikelihoods
through `echo` + `logprobs`, generations through `stop`); its Hugging Face model runs the
same tasks on the source model. Two tasks written as local files from the project's
held-out text (no downloads): a multiple-choice one (which continuation follows) and a
`generate_until` one. The fp32 engine must score what Hugging Face scores; the int8
engine's differences are reported beside the quality gate's limit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from registry import CHAMPION, RegistryTarget, promote, register_engine
from serving.app import ServerSettings, create_app
from serving.engine_process import RuntimeOptions
from serving.sources import AliasSource

from .conftest import SIGNING, build_engine, new_mlflow_store
from .live_server import LiveServer
from .test_registry import record

MODEL = "kiln-lm-eval"
TASKS = ("kiln_choice", "kiln_continue")


def write_tasks(directory: Path, texts: list[str], docs: int = 24) -> Path:
    """Two lm-eval tasks over stretches of `texts`: pick the true continuation of a context
    among four (the others are other stretches' continuations), and continue a context."""
    words = [w for text in texts for w in text.split()]
    stretches = [(" ".join(words[i : i + 8]), " " + " ".join(words[i + 8 : i + 13])) for i in range(0, 40 * docs, 40)][:docs]
    rng = random.Random(0)
    choice_docs = []
    for index, (context, truth) in enumerate(stretches):
        others = rng.sample([c for j, (_, c) in enumerate(stretches) if j != index], 3)
        gold = rng.randrange(4)
        choice_docs.append({"context": context, "choices": others[:gold] + [truth] + others[gold:], "gold": gold})
    (directory / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in choice_docs))
    (directory / "continue.jsonl").write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in stretches[:12]))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (directory / "kiln_choice.yaml").write_text(
        f"task: kiln_choice\ndataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n{common}"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: gold\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (directory / "kiln_continue.yaml").write_text(
        f"task: kiln_continue\ndataset_kwargs:\n  data_files:\n    test: {directory / 'continue.jsonl'}\n{common}"
        "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0.0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return directory


def evaluate(model: str, model_args: dict, tasks_dir: Path) -> dict:
    """lm-eval's scores and per-document records for both tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True, batch_size=8, random_seed=0
    )


def loglikelihoods(result: dict) -> list[float]:
    return [resp[0][0] for sample in result["samples"]["kiln_choice"] for resp in sample["resps"]]


def generations(result: dict) -> list[str]:
    return [sample["resps"][0][0] for sample in result["samples"]["kiln_continue"]]


@pytest.fixture(scope="module")
def scores(tmp_path_factory, project, params, tiny_model, exported, data_version, engine_dir, calibration):
    """lm-eval's results on Hugging Face (the source model) and on the served fp32 and int8 engines."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # lm-eval and datasets: local files only
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    root = tmp_path_factory.mktemp("lm-eval")
    (root / "tasks").mkdir()
    tasks = write_tasks(root / "tasks", data_version.texts("eval"))
    int8 = build_engine(project, params, tiny_model, exported, data_version, "int8", calibration)
    target = RegistryTarget(new_mlflow_store(root / "mlflow.db"), MODEL, MODEL, root / "artifacts", SIGNING)
    versions = {precision: register_engine(target, e.path, e.sha256, record()).version for precision, e in (("fp32", engine_dir), ("int8", int8))}
    results = {"hf": evaluate("hf", {"pretrained": str(tiny_model.path), "dtype": "float32", "device": "cpu"}, tasks)}
    for precision, version in versions.items():
        promote(target, CHAMPION, version=version)
        settings = ServerSettings(poll_interval_s=0, max_tokens=64, runtime=RuntimeOptions(max_waiting=64))
        with LiveServer(create_app(AliasSource(target, CHAMPION, root / "cache"), settings)) as live:
            served = {"base_url": f"{live.url}/v1/completions", "model": MODEL, "tokenizer": str(engine_dir.path), "tokenizer_backend": "huggingface", "max_length": 96}
            results[precision] = evaluate("local-completions", served, tasks)
    print_table(results)  # shown with `pytest -s`: the table of the closing notes
    return results


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("model", "choice acc", "choice acc_norm", "continue exact_match", "max |Δ loglikelihood| vs HF", "generations = HF", title="lm-eval 0.4.13")
    for name, result in results.items():
        choice, cont = result["results"]["kiln_choice"], result["results"]["kiln_continue"]
        delta = max(abs(a - b) for a, b in zip(loglikelihoods(result), loglikelihoods(results["hf"]), strict=True))
        same = sum(a == b for a, b in zip(generations(result), generations(results["hf"]), strict=True))
        table.add_row(name, f"{choice['acc,none']:.4f}", f"{choice['acc_norm,none']:.4f}", f"{cont['exact_match,none']:.4f}", f"{delta:.2e}", f"{same}/{len(generations(result))}")
    Console(width=140).print(table)


@pytest.mark.slow
def test_lm_eval_scores_the_served_fp32_engine_as_it_scores_the_hugging_face_model(scores):
    hf, served = scores["hf"], scores["fp32"]
    for task, metrics in hf["results"].items():
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in metrics:
                assert served["results"][task][metric] == metrics[metric], (task, metric)
    assert loglikelihoods(served) == pytest.approx(loglikelihoods(hf), abs=1e-3)
    assert generations(served) == generations(hf)
    assert len(loglikelihoods(hf)) == 24 * 4 and any(generations(hf))


@pytest.mark.slow
def test_lm_eval_on_the_int8_engine_stays_within_the_quality_gates_spirit(scores, params):
    """The int8 engine may rank a close choice otherwise: its accuracy moves by at most
    what its allowed top-1 disagreement (1 - 0.97) could move over these 24 questions."""
    hf, int8 = scores["hf"]["results"]["kiln_choice"], scores["int8"]["results"]["kiln_choice"]
    allowed = 1 - params.gates.quality.limits["int8"].min_top1_agreement
    assert abs(int8["acc,none"] - hf["acc,none"]) <= max(allowed, 2 / 24)
    deltas = [abs(a - b) for a, b in zip(loglikelihoods(scores["int8"]), loglikelihoods(scores["hf"]), strict=True)]
    assert max(deltas) < 1.0  # a summed log probability of a few tokens, not a broken engine
