"""The retrain-and-rebuild flow under Prefect's test harness, on a temporary MLflow store."""

import re
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from components.config import GateParams, LatencyGateParams, QualityGateParams
from components.data import dvc_md5
from components.errors import GateFailed
from flows.pipeline import retrain_and_rebuild
from registry import CHALLENGER, CHAMPION, promote, registry_target, resolve_alias

from .conftest import int8_registers, make_project, new_project_store, tiny_params, with_trained_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def harness():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def flow_project(tmp_path_factory, tiny_model, exported):
    """A project holding the session's trained model and its ONNX: the flows here start at
    the engine build (the deleted-outputs test makes one retrain)."""
    root = with_trained_model(make_project(tmp_path_factory.mktemp("flow")), tiny_model, exported)
    new_project_store(root)
    return root


def task_states(flow_state) -> dict[str, str]:
    """Each task of a finished flow run and the name of its final state, from Prefect's API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def test_the_flow_registers_a_challenger_then_reuses_every_stage(flow_project):
    params = tiny_params(flow_project)
    first = retrain_and_rebuild(params, flow_project)
    assert first.challenger is first.outcomes[0]
    registration = first.challenger.registration
    assert registration.created
    assert first.challenger.report.passed
    assert first.aliases == {CHALLENGER: registration.version}

    info = resolve_alias(registry_target(params.registry, flow_project), CHALLENGER)
    assert info.tags["data_md5"] == dvc_md5(flow_project / "data.dvc")
    assert info.version == registration.version
    assert info.tags["engine_sha256"] == first.challenger.engine.sha256
    assert info.tags["gates.passed"] == "true"
    assert info.tags["params_sha256"] == params.digest()
    assert float(info.tags["gates.quality.top1_agreement"]) == 1.0
    assert {"backend", "precision", "target", "calibration_digest", "git_commit", "gates.latency.p95_ms"} <= set(info.tags)
    assert info.tags["gates.latency.threads"] == str(params.serving.threads)  # timed as served, and saying so

    second_state = retrain_and_rebuild(params, flow_project, return_state=True)
    second = second_state.result()
    assert not second.challenger.registration.created
    assert second.challenger.registration.version == registration.version
    # Reused from Prefect's cache, not recomputed and found on disk.
    states = task_states(second_state)
    assert {name: states[name] for name in ("train-model", "export-onnx", "build-engine", "gate-engine")} == dict.fromkeys(
        ("train-model", "export-onnx", "build-engine", "gate-engine"), "Cached"
    )
    # The sample came back through the registry with its seed: the same text both times.
    assert second.sample == first.sample and len(first.sample) > len(params.sample.prompt)


def test_a_failed_gate_registers_without_alias_and_raises_with_the_numbers(flow_project):
    slow = GateParams(
        quality=QualityGateParams(sequences=8, sequence_length=32),
        latency=LatencyGateParams(prompt_tokens=8, new_tokens=8, warmup=1, runs=3, max_p95_ms=1e-6, max_p95_over_floor=None),
    )
    params = tiny_params(flow_project, gates=slow).model_copy(
        update={"registry": tiny_params(flow_project).registry.model_copy(update={"model_name": "kiln-too-slow"})}
    )
    with pytest.raises(GateFailed, match=r"gates failed for fp32 \(version 1\): latency: p95_ms .* \(limit <= 1e-06\)"):
        retrain_and_rebuild(params, flow_project)
    from components.errors import RegistryError

    with pytest.raises(RegistryError):
        resolve_alias(registry_target(params.registry, flow_project), CHALLENGER)


def test_a_triggered_rebuild_whose_gate_fails_ends_failed_with_the_numbers_and_no_traceback(flow_project, caplog):
    """The rebuild deployment's flow, as `kiln deploy` runs it: a failed gate is its outcome,
    said once in the run's final state, not three tracebacks on the deploy terminal."""
    import logging

    import yaml

    from flows.deployments import rebuild

    params = tiny_params(flow_project).model_dump(mode="json")
    params["gates"]["latency"] |= {"max_p95_ms": 1e-6, "max_p95_over_floor": None}
    params["registry"]["model_name"] = "kiln-rebuilt-too-slow"
    (flow_project / "strict.yaml").write_text(yaml.safe_dump(params))
    with caplog.at_level(logging.INFO):
        state = rebuild(project=str(flow_project), params_file="strict.yaml", return_state=True)
    assert state.is_failed() and re.fullmatch(r"gates failed for fp32 \(version 1\): latency: p95_ms \S+ \(limit <= 1e-06\)", state.message)
    assert not [r for r in caplog.records if r.exc_info or r.exc_text], "a traceback was logged"
    assert sum("gates failed for fp32" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("scheme", ["auto", "qdq"])
def test_fp32_and_int8_are_each_registered_and_challenger_goes_to_the_fastest_that_passed(flow_project, scheme):
    """int8 as ONNX Runtime gets it by default (8-bit weight blocks: nothing calibrated) and
    as Q/DQ (TensorRT's form, run here): a Q/DQ version names its calibration set, logged
    as the run's input; a blocks version names none, and no set is curated for it."""
    from mlflow import MlflowClient

    from components.config import Int8Params, PrecisionParams

    base = tiny_params(flow_project)
    params = base.model_copy(
        update={
            "precision": PrecisionParams(build=["fp32", "int8"], int8=Int8Params(scheme=scheme)),
            "gates": int8_registers(base.gates),
            "registry": base.registry.model_copy(update={"model_name": f"kiln-two-precisions-{scheme}"}),
        }
    )
    result = retrain_and_rebuild(params, flow_project)
    assert [o.precision for o in result.outcomes] == ["fp32", "int8"]
    assert all(o.registration.created and o.report.passed for o in result.outcomes)
    fastest = min(result.outcomes, key=lambda o: o.report.gate("latency").measured["p50_ms"])
    assert result.challenger is fastest

    target = registry_target(params.registry, flow_project)
    assert resolve_alias(target, CHALLENGER).version == fastest.registration.version
    client = MlflowClient(target.tracking_uri)
    int8 = next(o for o in result.outcomes if o.precision == "int8")
    tags = client.get_model_version(params.registry.model_name, int8.registration.version).tags
    run = client.get_run(int8.registration.run_id)
    contexts = {d.dataset.name: {t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    artifacts = {a.path for a in client.list_artifacts(int8.registration.run_id, "calibration")}
    assert tags["precision"] == "int8"
    if scheme == "qdq":
        assert tags["calibration_digest"] == result.calibration.digest
        assert contexts == {"corpus": {"training"}, "calibration": {"calibration"}}
        assert "calibration/lengths.png" in artifacts
    else:
        assert result.calibration is None and tags["calibration_digest"] == "none"
        assert contexts == {"corpus": {"training"}} and not artifacts


def test_stage_outputs_deleted_behind_the_cache_are_rebuilt_not_reused(flow_project):
    """Deleting `.kiln/stages/*` (by hand, or a killed `--fresh`) used to leave Prefect's cache
    pointing at nothing: every stage `Cached`, then a FileNotFoundError."""
    import shutil

    params = tiny_params(flow_project)
    first = retrain_and_rebuild(params, flow_project)
    stages = flow_project / ".kiln" / "stages"
    for folder in stages.iterdir():
        shutil.rmtree(folder)

    second = retrain_and_rebuild(params, flow_project)
    assert second.challenger.report.passed
    assert second.model.path.is_dir() and second.model.sha256 == first.model.sha256  # seeded training, rebuilt
    assert second.challenger.engine.path.is_dir() and second.challenger.engine.is_intact()


def test_a_changed_byte_in_a_cached_stage_output_is_noticed_and_the_stage_rebuilt(flow_project):
    params = tiny_params(flow_project)
    first = retrain_and_rebuild(params, flow_project)
    engine_file = first.challenger.engine.engine_file
    engine_file.write_bytes(engine_file.read_bytes() + b"tampered")

    second = retrain_and_rebuild(params, flow_project)
    assert second.challenger.engine.is_intact()
    assert second.challenger.engine.sha256 == first.challenger.engine.sha256


def test_a_sample_prompt_longer_than_the_profile_is_refused_before_anything_is_registered(flow_project):
    from mlflow import MlflowClient

    from components.config import SampleParams
    from components.errors import ConfigError

    base = tiny_params(flow_project)
    params = base.model_copy(
        update={
            "sample": SampleParams(prompt="the list type " * 60, max_tokens=8),
            "registry": base.registry.model_copy(update={"model_name": "kiln-long-prompt"}),
        }
    )
    with pytest.raises(ConfigError, match=r"sample\.prompt is \d+ tokens; build\.profiles\.prompt admits 1\.\.96"):
        retrain_and_rebuild(params, flow_project)
    client = MlflowClient(registry_target(params.registry, flow_project).tracking_uri)
    assert client.search_model_versions("name='kiln-long-prompt'") == []


def test_fp32_passing_and_int8_failing_registers_both_aliases_fp32_and_raises_for_int8(flow_project):
    from components.config import PrecisionParams, QualityLimits

    base = tiny_params(flow_project)
    impossible = base.gates.quality.limits | {"int8": QualityLimits(min_top1_agreement=1.0, max_ppl_increase_pct=0.0)}
    params = base.model_copy(
        update={
            "precision": PrecisionParams(build=["fp32", "int8"]),
            "gates": base.gates.model_copy(update={"quality": base.gates.quality.model_copy(update={"limits": impossible})}),
            "registry": base.registry.model_copy(update={"model_name": "kiln-int8-fails"}),
        }
    )
    # Failed, or inconclusive where int8 matches the model on every sampled token: either
    # blocks the alias, and the message names the gate.
    with pytest.raises(GateFailed, match=r"gates (failed|inconclusive) for int8 \(version 2\): quality: ") as failed:
        retrain_and_rebuild(params, flow_project)
    result = failed.value.report
    fp32, int8 = result.outcomes
    assert fp32.report.passed and not int8.report.passed and int8.report.verdict in ("failed", "inconclusive")
    assert result.challenger is fp32
    assert result.aliases == {CHALLENGER: fp32.registration.version}
    tags = resolve_alias(registry_target(params.registry, flow_project), CHALLENGER).tags
    assert tags["precision"] == "fp32"


def test_a_failing_engine_leaves_the_older_challenger_where_it_was(flow_project):
    from components.config import PrecisionParams, QualityLimits

    base = tiny_params(flow_project)
    registry = base.registry.model_copy(update={"model_name": "kiln-keeps-challenger"})
    good = retrain_and_rebuild(base.model_copy(update={"registry": registry}), flow_project)
    impossible = base.gates.quality.limits | {"int8": QualityLimits(min_top1_agreement=1.0, max_ppl_increase_pct=0.0)}
    failing = base.model_copy(
        update={
            "registry": registry,
            "precision": PrecisionParams(build=["int8"]),
            "gates": base.gates.model_copy(update={"quality": base.gates.quality.model_copy(update={"limits": impossible})}),
        }
    )
    with pytest.raises(GateFailed) as failed:
        retrain_and_rebuild(failing, flow_project)
    assert failed.value.report.outcomes[0].registration.created
    assert failed.value.report.aliases == {CHALLENGER: good.challenger.registration.version}
    assert resolve_alias(registry_target(registry, flow_project), CHALLENGER).version == good.challenger.registration.version


def test_torch_cuda_builds_each_precision_from_the_model_with_no_onnx_export_and_samples_its_challenger(flow_project, monkeypatch):
    """A run whose engines torch-cuda builds (here on the CPU, as on a GPU: the build and
    the backend check are pointed at the CPU) exports no ONNX (an 8B model's is 32 GB),
    builds one engine per precision, records no ONNX in their lineage, and samples the
    challenger at params' temperature."""
    import functools

    from components.build import torch_cuda
    from components.config import QualityLimits
    from components.runtime import availability

    monkeypatch.setattr(availability, "torch_cuda_ready", lambda: (True, ""))
    monkeypatch.setattr(torch_cuda, "torch_engine_from_model", functools.partial(torch_cuda.torch_engine_from_model, device="cpu"))
    base = tiny_params(flow_project)
    limits = base.gates.quality.limits | {"bf16": QualityLimits(min_top1_agreement=0.9, max_ppl_increase_pct=2.0)}  # the tiny model's thin margins
    params = base.model_copy(
        update={
            "registry": base.registry.model_copy(update={"model_name": "kiln-torch"}),
            "precision": base.precision.model_copy(update={"build": ["fp32", "bf16"]}),
            "build": base.build.model_copy(update={"backend": "torch-cuda"}),
            "gates": base.gates.model_copy(update={"quality": base.gates.quality.model_copy(update={"limits": limits})}),
        }
    )
    state = retrain_and_rebuild(params, flow_project, return_state=True)
    result = state.result()
    assert "export-onnx" not in task_states(state)
    engines = {o.precision: o.engine for o in result.outcomes}
    assert {p: e.manifest.precision for p, e in engines.items()} == {"fp32": "fp32", "bf16": "bf16"}
    assert engines["fp32"].sha256 != engines["bf16"].sha256 and {e.manifest.backend for e in engines.values()} == {"torch-cuda"}
    assert {e.manifest.lineage.onnx_sha256 for e in engines.values()} == {"none"}
    assert {o.registration.version for o in result.outcomes} == {"1", "2"}
    assert params.sample.temperature > 0 and len(result.sample) > len(params.sample.prompt)
    from flows import render
    from registry import version_lineage

    with render.console.capture() as shown:
        render.lineage(version_lineage(registry_target(params.registry, flow_project), result.outcomes[1].registration.version))
    assert "ONNX" not in shown.get() and "engine sha256" in shown.get()  # `kiln lineage`: model → engine


def test_the_version_page_explains_itself_and_a_new_engine_is_set_beside_the_champion(flow_project):
    """The MLflow UI renders a version's description: the gates with their limits, the
    champion of the moment, the lineage and a link to the run. A second engine (the same
    model built with a wider batch profile) is compared with the first once it is champion."""
    from mlflow import MlflowClient

    from components.config import BuildParams, ProfileParams, ShapeRange

    base = tiny_params(flow_project)
    params = base.model_copy(update={"registry": base.registry.model_copy(update={"model_name": "kiln-pages"})})
    first = retrain_and_rebuild(params, flow_project)
    target = registry_target(params.registry, flow_project)
    client = MlflowClient(target.tracking_uri)
    page = client.get_model_version("kiln-pages", first.challenger.registration.version).description
    assert "gates passed" in page and "| quality | top1_agreement | 1 | [1, 1] | >= 0.99 | pass |" in page
    version_tags = client.get_model_version("kiln-pages", first.challenger.registration.version).tags
    assert "trained with reproducible (AVX2, 1 thread) kernels" in page and version_tags["training_kernels"] == "reproducible (AVX2, 1 thread)"
    assert version_tags["gates.verdict"] == "passed" and float(version_tags["gates.quality.top1_agreement_low"]) == 1.0
    measured_on = version_tags["gates.measured_on"]
    assert "cores" in measured_on and f"Measured on {measured_on}." in page
    assert "No champion when this version was registered." in page
    assert f"data version `{dvc_md5(flow_project / 'data.dvc')}`" in page
    assert f"engine `{first.challenger.engine.sha256[:16]}`" in page and f"params sha256 `{params.digest()[:16]}`" in page
    run = client.get_run(first.challenger.registration.run_id)
    assert f"(#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/artifacts)" in page
    # Training is a run of its own, which the engine's version points to.
    training = client.get_run(client.get_model_version("kiln-pages", first.challenger.registration.version).tags["training_run_id"])
    assert training.data.tags["kiln.model_sha256"] == first.model.sha256 and training.info.status == "FINISHED"
    assert training.data.params["model.training.steps"] == "300" and training.data.metrics["train.eval_perplexity"] > 1
    assert len(client.get_metric_history(training.info.run_id, "train.loss")) == len(first.model.loss_curve)
    assert [a.path for a in client.list_artifacts(training.info.run_id, "plots")] == ["plots/loss.png"]
    assert f"([training run](#/experiments/{training.info.experiment_id}/runs/{training.info.run_id}))" in page
    assert run.data.tags["kiln.training_run_id"] == training.info.run_id  # the engine's run points to it too

    promote(target, CHAMPION, version=first.challenger.registration.version)
    # Same model, wider batch profile: a new engine of equal quality. The latency budget is
    # lifted: timing noise on a shared CI machine is not what this test is about.
    lenient = params.gates.model_copy(update={"champion": params.gates.champion.model_copy(update={"max_p50_increase_pct": 1e6})})
    wider = params.model_copy(update={"gates": lenient, "build": BuildParams(profiles=ProfileParams(
        batch=ShapeRange(min=1, opt=1, max=4), prompt=ShapeRange(min=1, opt=32, max=96), context=ShapeRange(min=2, opt=64, max=128)))})  # fmt: skip
    second = retrain_and_rebuild(wider, flow_project)
    registered = second.challenger.registration
    assert registered.created and registered.version != first.challenger.registration.version
    assert version_tags_of(client, registered.version)["training_run_id"] == training.info.run_id  # one model, one training run
    champion_gate = second.challenger.against_champion
    assert champion_gate.passed and champion_gate.measured["nll_increase_vs_champion_pct"] == 0
    assert version_tags_of(client, registered.version)["gates.champion.passed"] == "true"
    version = client.get_model_version("kiln-pages", registered.version)
    assert version.tags["gates.champion.champion_version"] == first.challenger.registration.version
    assert version.tags["gates.champion.rouge_l_drop_vs_champion_pct"] == "0" and version.tags["gates.passed"] == "true"
    page = version.description
    assert f"### Beside the champion (version {first.challenger.registration.version}, at registration)" in page
    assert "| quality.top1_agreement | 1 | 1 | +0 (+0.0%) |" in page
    assert f"### Against the champion (version {first.challenger.registration.version}, measured in this run): may become `challenger`" in page
    assert "| champion | nll_increase_vs_champion_pct | 0 | [0, 0] | <= 1 | pass |" in page  # the same engine file: no spread
    # The run keeps every gate's report, those measured in the run included.
    report = Path(client.download_artifacts(registered.run_id, "gates/report.md", str(flow_project / "downloaded"))).read_text()
    assert "| champion | rouge_l_drop_vs_champion_pct |" in report and "| serving | concurrent.request_p99_ms |" in report and "| text | rouge_l |" in report


def version_tags_of(client, version: str) -> dict[str, str]:
    return client.get_model_version("kiln-pages", version).tags


def test_the_log_filter_drops_the_tracebacks_of_kiln_errors_and_failed_runs_only():
    """A deployment's flow-run process logs FailedRun after any failed run (its message is
    the state's, logged the line before); a bug's traceback must still be printed."""
    import logging
    import sys

    from prefect.exceptions import FailedRun

    from flows.logs import NoKilnTracebacks

    def record_of(error: Exception) -> logging.LogRecord:
        try:
            raise error
        except Exception:
            return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())

    kept = {type(e).__name__: NoKilnTracebacks().filter(r) and r.exc_info is not None for e in (GateFailed("gates failed", None), FailedRun("gates failed"), KeyError("bug")) for r in [record_of(e)]}
    assert kept == {"GateFailed": False, "FailedRun": False, "KeyError": True}
