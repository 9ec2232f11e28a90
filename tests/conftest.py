"""Shared fixtures: a tiny project (corpus, DVC repo with a local remote), a tiny GPT-2
trained in the session, its ONNX export and engine, and a temporary MLflow store.

Everything runs on the CPU with no network. Environment variables are set before any test
module imports prefect or transformers, so nothing is written to the user's home.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flows.environment import kiln_environment  # noqa: E402  (light: no prefect, no torch)

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="kiln-tests-"))
os.environ.update(kiln_environment(_SESSION_HOME))
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach the Hub, even where it is reachable
# Two xdist workers share two cores: torch's second thread only contends with the other
# worker (a tiny model's training step: 13 ms on one thread, 74 ms on two under that load).
# Subprocesses (`kiln run` and the servers) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_DATASETS_OFFLINE"] = "1"
(_SESSION_HOME / "prefect").mkdir(parents=True, exist_ok=True)

from registry.records import Signing  # noqa: E402
from registry.signing import KEY_ENV, create_key  # noqa: E402

# The session's signing key, as `kiln keys init` makes one: `kiln` subprocesses sign and
# trust it through KILN_SIGNING_KEY; registry targets built by tests carry it as SIGNING.
_SIGNING_KEY = _SESSION_HOME / "keys" / "signing-key.pem"
try:
    _TRUSTED = (create_key(_SIGNING_KEY),)
except ImportError:  # the lent GPU machine's image: cryptography without its cffi backend
    _TRUSTED = ()  # no test that signs runs there (they need a DVC project, which skips first)
SIGNING = Signing(_SIGNING_KEY, _TRUSTED, required=True)
os.environ[KEY_ENV] = str(_SIGNING_KEY)

import pytest  # noqa: E402

from components.config import (  # noqa: E402
    ArchitectureParams,
    BuildParams,
    DataParams,
    GateParams,
    LatencyGateParams,
    ModelParams,
    Params,
    PrecisionParams,
    ProfileParams,
    QualityGateParams,
    QualityLimits,
    RegistryParams,
    SampleParams,
    ShapeRange,
    SplitParams,
    TextFilesSource,
    TextGateParams,
    TokenizerParams,
    TrainingParams,
)
from components.runtime.engine import Engine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEAR_DUPLICATE_PASSAGES, NEAR_DUPLICATE_VARIANTS = 16, 4
DVC = str(Path(sys.executable).parent / "dvc")


def tiny_params(root: Path, **overrides) -> Params:
    """Params for a tiny model on the tiny corpus: seconds, not minutes."""
    sections = dict(
        data=DataParams(
            source=TextFilesSource(kind="text-files", glob="corpus/*.txt"),
            min_chars=32,
            max_chars=400,
            split=SplitParams(eval_fraction=0.1, calibration_fraction=0.25),
        ),
        model=ModelParams(
            tokenizer=TokenizerParams(vocab_size=400),
            architecture=ArchitectureParams(n_layer=2, n_head=2, n_embd=32, n_positions=128),
            # Kernels held to AVX2: the suite's model is the same bytes on every x86-64 CPU.
            training=TrainingParams(steps=300, batch_size=8, block_size=32, learning_rate=5e-3, warmup_steps=20, eval_batches=4, threads=1, reproducible=True),
        ),
        gates=GateParams(
            quality=QualityGateParams(sequences=8, max_sequences=32, sequence_length=32),
            text=TextGateParams(sequences=8, max_sequences=8, prompt_tokens=8, new_tokens=16),
            latency=LatencyGateParams(prompt_tokens=8, new_tokens=8, warmup=1, runs=3, max_p95_ms=5000),
        ),
        registry=RegistryParams(tracking_uri=f"sqlite:///{root / 'mlruns' / 'mlflow.db'}", model_name="kiln-tiny"),
        sample=SampleParams(prompt="The list", max_tokens=8),
        precision=PrecisionParams(build=["fp32"]),
        # The tiny model's context is 128 positions: the profiles stay inside it.
        build=BuildParams(profiles=ProfileParams(prompt=ShapeRange(min=1, opt=32, max=96), context=ShapeRange(min=2, opt=64, max=128))),
    )
    sections.update(overrides)
    return Params(**sections)


def int8_registers(gates: GateParams) -> GateParams:
    """Gates whose int8 limits leave room (top-1 ≥ 0.90, perplexity ≤ +5 %) for the tests of
    what happens to an int8 engine that passed: registration, aliases, the pool. On the 8
    windows of the tiny eval split, the product's 0.97 sits a token or two under int8's
    interval, which another CPU's kernels can flip; tests/test_precision.py holds the
    product's limits on four times the positions."""
    room = QualityLimits(min_top1_agreement=0.90, max_ppl_increase_pct=5.0)
    return gates.model_copy(update={"quality": gates.quality.model_copy(update={"limits": gates.quality.limits | {"int8": room}})})


def write_corpus(directory: Path) -> None:
    """A small corpus from CPython's bundled pydoc topics (offline, real English prose), cut
    into short passages (data.max_chars in tiny_params) so each split holds dozens, plus
    near duplicates: short passages written in a few variants that differ in their last
    word, which the calibration stage must keep only once."""
    from pydoc_data.topics import topics

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)[:60]
    for name in names:
        (directory / f"{name}.txt").write_text(topics[name])
    for index, name in enumerate(names[:NEAR_DUPLICATE_PASSAGES]):
        words = " ".join(topics[name].split())[:350].split(" ")[:-1]
        for variant in range(NEAR_DUPLICATE_VARIANTS):
            (directory / f"near-duplicate-{index}-{variant}.txt").write_text(" ".join(words + [f"variant{variant}"]))


# `make test` hands whole files to its workers in collection order (--dist loadfile,
# --no-loadscope-reorder), the next file to whichever worker is nearly done: longest first
# (what each file took in a whole `make test` on a 2-core Intel Xeon, in seconds), so that
# the run ends on files of a few seconds instead of one worker waiting out the other's long
# file. The files not named take under 5 s each; test_triton.py skips here (no Triton
# environment) but serves a real tritonserver in CI, so it is not among the last.
LONGEST_FIRST = (
    "test_cli.py",  # 150
    "test_triggers.py",  # 121
    "test_families.py",  # 68
    "test_serving.py",  # 55
    "test_flow.py",  # 54
    "test_faults.py",  # 53
    "test_pool.py",  # 52
    "test_train.py",  # 36
    "test_own_model.py",  # 26
    "test_ui.py",  # 23
    "test_lm_eval.py",  # 20
    "test_torch_cuda.py",  # 18
    "test_triton.py",
    "test_benchmark.py",  # 15
    "test_monitoring.py",  # 14
    "test_data.py",  # 10
    "test_precision.py",  # 10
    "test_architecture.py",  # 8
    "test_external_data.py",  # 5
)


def pytest_configure(config: pytest.Config) -> None:
    # absl (imported with the text gate's ROUGE metric) logs through a handler that keeps
    # sys.stderr as it was at import: in a test, the capture's file of that moment. On a
    # later logging set-up (uvicorn's, Prefect's) made while sys.stderr is another stream
    # (click's CliRunner, capsys), absl closes the file it kept, and the worker's capture
    # fails in every test after it. Bind it to the process's own stderr, which it never closes.
    import absl.logging

    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def assert_names_no_folder_of_this_machine(path: Path) -> None:
    """An engine file's sha256 is its registry identity: it must not hold this checkout's,
    this virtualenv's or its packages' folders (exporters write stack traces with them)."""
    import sysconfig

    import components

    data = path.read_bytes()
    for folder in (Path(components.__file__).resolve().parents[1], Path(sys.prefix), Path(sysconfig.get_paths()["purelib"]).resolve()):
        assert str(folder).encode() not in data, f"{path.name} names {folder}"


def make_project(root: Path) -> Path:
    """A project folder: corpus, a DVC repo (no git) with a local remote. Where `dvc` is not
    installed (the lent GPU machine's image) the tests that need a project skip, saying so."""
    if not Path(DVC).is_file():
        pytest.skip(f"dvc is not installed beside {sys.executable}: the test needs a DVC project")
    root.mkdir(parents=True, exist_ok=True)
    write_corpus(root / "corpus")
    subprocess.run([DVC, "init", "--no-scm", "-q"], cwd=root, check=True)
    subprocess.run([DVC, "remote", "add", "-d", "local", str(root / "dvc-remote")], cwd=root, check=True)
    return root


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Path:
    """The session's project. With KILN_TEST_CACHE set (`make mutants`, which runs the tests
    hundreds of times) it persists there, so the stages find the tiny model, its ONNX and
    engines from the last session instead of rebuilding them; `make test` starts clean."""
    cached = os.environ.get("KILN_TEST_CACHE")
    if cached and (Path(cached) / "project" / ".dvc").is_dir():
        return Path(cached) / "project"
    return make_project(Path(cached) / "project" if cached else tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="session")
def params(project) -> Params:
    return tiny_params(project)


@pytest.fixture(scope="session")
def data_version(project, params):
    from components.data import data_version_from_source

    return data_version_from_source(params.data, project)


@pytest.fixture(scope="session")
def built_once(tmp_path_factory) -> Path:
    """Stage outputs that `make test`'s two workers build once between them (see
    `once_for_all_workers`): a folder both see, beside their own temporary folders."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"


def once_for_all_workers(built: Path, out_root: Path, build):
    """`build(out_root)` (a stage writing `out_root/<content key>`) run by the first worker only.

    Stage outputs are found by a name made of their inputs' content, so an output another
    worker built, copied into this worker's `out_root` under the same name, is found
    complete and reused: the stage returns without building (training is seeded, so the
    copy is byte for byte what this worker would build). The lock makes the second worker
    wait for the first instead of building the same thing beside it.
    """
    from components.files import exclusive_lock

    published = built / out_root.name
    with exclusive_lock(built / f"{out_root.name}.lock"):
        for done in published.glob("*"):
            if not (out_root / done.name).exists():
                shutil.copytree(done, out_root / done.name)
        result = build(out_root)
        if not (published / result.output_dir.name).exists():
            shutil.copytree(result.output_dir, published / result.output_dir.name)
    return result


@pytest.fixture(scope="session")
def tiny_model(project, params, data_version, built_once):
    from components.train import model_from_data

    return once_for_all_workers(built_once, project / "models", lambda out_root: model_from_data(data_version, params.model, out_root))


@pytest.fixture(scope="session")
def exported(project, params, tiny_model, built_once):
    from components.export import onnx_from_model

    return once_for_all_workers(built_once, project / "onnx", lambda out_root: onnx_from_model(tiny_model, params.export, out_root))


def with_trained_model(root: Path, model, onnx) -> Path:
    """A project given the session's trained model and its ONNX export where its own stages
    put theirs (`.kiln/stages/`, under the same content-made names, for the same corpus and
    tiny_params' model): its pipeline reuses them, as in a project whose stage outputs
    survived, and starts work at the engine build. For the tests of what comes after
    training: a pool's dispatch, the flow's registration and caching. `kiln run` in
    test_cli, the triggers' rebuilds and the killed run still train their own."""
    from components.workspace import Workspace

    for output, stage in ((model, "models"), (onnx, "onnx")):
        shutil.copytree(output.output_dir, Workspace(root).stage_dir(stage) / output.output_dir.name)
    return root


@pytest.fixture(scope="session")
def calibration(project, params, tiny_model, data_version):
    from components.calibrate import calibration_set_from_pool

    return calibration_set_from_pool(data_version, tiny_model.path, params.build.profiles, params.calibration, project / "calibration")


@pytest.fixture(scope="session")
def int4_graph(project, exported, params):
    from components.precision import precision_onnx

    return precision_onnx(exported, "int4", None, params.precision, project / "precision")


def build_engine(project, params, tiny_model, exported, data_version, precision="fp32", calibration=None):
    from components.build import engine_from_onnx
    from components.precision import precision_onnx

    graph = precision_onnx(exported, precision, calibration, params.precision, project / "precision")
    return engine_from_onnx(graph, tiny_model, data_version, params.build, project / "engines", project)


@pytest.fixture(scope="session")
def engine_dir(project, params, tiny_model, exported, data_version):
    return build_engine(project, params, tiny_model, exported, data_version)


@pytest.fixture(scope="session")
def engine(engine_dir):
    from components.runtime import load_engine

    return load_engine(engine_dir.path)


@pytest.fixture(scope="session")
def reference(tiny_model):
    from components.model_dir import load_model

    return load_model(tiny_model.path)


@functools.cache
def _made_mlflow_database() -> Path:
    """An empty MLflow store with every table MLflow makes for a new SQLite file, made once
    per worker: those migrations take 3–4 s, and the suite opens dozens of new stores."""
    from mlflow import MlflowClient

    database = _SESSION_HOME / "empty-mlflow.db"
    client = MlflowClient(f"sqlite:///{database}")
    client.search_experiments()  # the tracking store's tables and its Default experiment
    client.search_registered_models()  # the registry's
    return database


def new_mlflow_store(database: Path) -> str:
    """The sqlite URI of a new, empty MLflow store at `database` (a copy of the one MLflow
    made above): what MLflow would make there, without its migrations each time."""
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_made_mlflow_database(), database)
    return f"sqlite:///{database}"


def new_project_store(root: Path) -> None:
    """A project's embedded store (tiny_params' registry.tracking_uri), made ahead."""
    new_mlflow_store(root / "mlruns" / "mlflow.db")


@pytest.fixture()
def registry_target(tmp_path):
    """A fresh MLflow store on temporary SQLite with local artifacts."""
    from registry import RegistryTarget

    return RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), "kiln-test", "kiln-test", tmp_path / "artifacts", SIGNING)


def engine_with_more_rows(engine_dir, destination: Path, extra_rows: int) -> Path:
    """A copy of an engine directory whose batch profile allows `extra_rows` more rows: the
    same engine file, yet another engine to the registry (its profiles differ)."""
    shutil.copytree(engine_dir.path, destination)
    manifest = json.loads((destination / "engine.json").read_text())
    for phase in manifest["profiles"].values():
        phase["batch"]["max"] += extra_rows
    (destination / "engine.json").write_text(json.dumps(manifest))
    return destination


class EosAfter(Engine):
    """The real engine, except that from decode step `after` on, its logits favour EOS (or
    `token`)."""

    def __init__(self, inner: Engine, after: int, token: int | None = None) -> None:
        super().__init__(inner.engine_dir)
        self.inner, self.after, self.calls = inner, after, 0
        self.token = self.manifest.eos_token_id if token is None else token

    def forward(self, input_ids, attention_mask, position_ids, cache, logits_positions=None):
        logits, present = self.inner.forward(input_ids, attention_mask, position_ids, cache, logits_positions)
        self.calls += 1
        if self.calls > self.after:
            logits = logits.copy()
            logits[..., self.token] = logits.max() + 10.0
        return logits, present
