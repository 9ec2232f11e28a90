"""The layout's promises (docs/development.md): dependencies point one way, each library stays in its
room, heavy imports stay where they are used, benchmarking has one home that nothing
imports, the registry's tag names are spelled in one module, and the HTTP side knows the
engine only through its seam. Imports inside functions count too."""

import ast
import importlib.metadata
import inspect
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The installed top-level packages: the four rooms of the product and benchmarks/, which may
# import any of them and which none of them imports (but `kiln bench`'s verbs).
ROOMS = ("flows", "components", "registry", "serving", "benchmarks")
PRODUCT = ("flows", "components", "registry", "serving")
# What the registry and the serving side may use of components: contracts, not stages.
CONTRACTS = {"components.engine_dir", "components.errors", "components.files"}


def _imported_by(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module}
    return set()


def imported_modules(path: Path) -> set[str]:
    return {name for node in ast.walk(ast.parse(path.read_text())) for name in _imported_by(node)}


def tops(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def files_of(room: str) -> list[Path]:
    return sorted((REPO / room).rglob("*.py"))


def ours(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m.split(".")[0] in ROOMS}


def importers_of(library: str) -> set[str]:
    return {p.relative_to(REPO).parts[0] for room in ROOMS for p in files_of(room) if library in {m.split(".")[0] for m in imported_modules(p)}}


def test_every_room_is_a_top_level_package():
    assert all((REPO / room / "__init__.py").is_file() for room in ROOMS)
    assert not (REPO / "kiln").exists()


@pytest.mark.parametrize("path", files_of("components"), ids=lambda p: str(p.relative_to(REPO)))
def test_components_import_no_other_room(path):
    assert {m.split(".")[0] for m in ours(path)} <= {"components"}


@pytest.mark.parametrize("path", files_of("components/runtime"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_runtime_imports_no_stage(path):
    allowed = CONTRACTS | {"components.runtime"}
    assert {m for m in ours(path) if not m.startswith("components.runtime.")} <= allowed


@pytest.mark.parametrize("path", files_of("registry"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_registry_uses_only_contracts_of_components(path):
    assert {m for m in ours(path) if not m.startswith("registry")} <= CONTRACTS


@pytest.mark.parametrize("path", files_of("serving"), ids=lambda p: str(p.relative_to(REPO)))
def test_serving_uses_the_registry_and_the_runtime_never_a_stage(path):
    foreign = {m for m in ours(path) if not m.startswith(("serving", "registry", "components.runtime"))}
    assert foreign <= CONTRACTS


@pytest.mark.parametrize(("library", "room"), [("prefect", "flows"), ("mlflow", "registry"), ("fastapi", "serving")])
def test_each_service_library_is_imported_in_its_room_only(library, room):
    assert importers_of(library) <= {room}


def test_no_other_installed_distribution_provides_our_top_level_names():
    providers = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        tops = set((dist.read_text("top_level.txt") or "").split())
        tops |= {Path(f.parts[0]).stem for f in dist.files or () if len(f.parts) > 1 and f.parts[0] in ROOMS}
        for room in tops & set(ROOMS):
            providers.setdefault(room, set()).add(name)
    assert {room: names - {"kiln"} for room, names in providers.items() if names - {"kiln"}} == {}


def loaded_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_heavy_module():
    loaded = loaded_after("import flows.cli")
    assert not loaded & {"torch", "transformers", "onnxruntime", "mlflow", "prefect", "tensorrt", "datasets"}


@pytest.mark.parametrize("module", ["registry", "serving", "serving.loader", "components.runtime", "components.engine_dir"])
def test_importing_the_serving_side_loads_no_torch_transformers_or_tensorrt(module):
    assert not loaded_after(f"import {module}") & {"torch", "transformers", "tensorrt"}


@pytest.mark.parametrize("path", [REPO / "components/runtime/tensorrt.py", REPO / "components/build/tensorrt.py"], ids=lambda p: p.name)
def test_the_tensorrt_path_needs_no_torch(path):
    # The project pins CPU torch: TensorRT's buffers and streams come from Polygraphy's CUDA wrappers.
    assert "torch" not in {m.split(".")[0] for m in imported_modules(path)}


def benchmark_modules() -> list[str]:
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in files_of("benchmarks"))


def test_importing_kiln_creates_no_files(tmp_path):
    # Every benchmark module too, from a folder outside the checkout: each imports through the
    # installed package (the prototype's scripts once imported each other by file name).
    code = f"import importlib, flows.cli, registry, serving.loader, components.gates, components.data; [importlib.import_module(m) for m in {benchmark_modules()!r}]"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- benchmarks: one home, imported by no room


def module_level_imports(source: str) -> set[str]:
    """What importing the module imports: everything but the imports inside its functions."""
    tree = ast.parse(source)
    in_functions = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) for node in ast.walk(fn)}
    return {name for node in ast.walk(tree) if id(node) not in in_functions for name in _imported_by(node)}


def functions_importing(source: str, package: str) -> set[str]:
    functions = [fn for fn in ast.walk(ast.parse(source)) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)]
    return {fn.name for fn in functions if package in tops({name for node in ast.walk(fn) for name in _imported_by(node)})}


def test_no_room_imports_benchmarks_but_the_cli():
    importers = {p.relative_to(REPO).as_posix() for room in PRODUCT for p in files_of(room) if "benchmarks" in tops(imported_modules(p))}
    assert importers <= {"flows/cli.py"}


def test_the_cli_imports_benchmarks_only_inside_its_bench_verbs():
    source = (REPO / "flows/cli.py").read_text()
    assert "benchmarks" not in tops(module_level_imports(source))  # `kiln --help` and the other verbs load none of it
    importers = functions_importing(source, "benchmarks")
    assert importers and all("bench" in name for name in importers)


def test_no_benchmark_module_is_named_like_a_package_it_imports():
    # `python benchmarks/serving_ceiling.py` puts benchmarks/ first on sys.path: a serving.py
    # there would hide the serving package from every script beside it.
    assert {p.stem for p in files_of("benchmarks")} & set(ROOMS) == set()


def test_the_benchmark_import_rules_see_a_planted_import():
    assert "benchmarks" in tops(module_level_imports("from benchmarks import generation\n"))
    assert functions_importing("def serve():\n    import benchmarks.serving_load\n", "benchmarks") == {"serve"}


# What benchmark code is made of: a load generator, timing loops, summary statistics.
BENCHMARK_MARKS = {"aiohttp", "statistics", "timeit"}


def benchmark_marks(source: str) -> set[str]:
    tree = ast.parse(source)
    marks = tops({name for node in ast.walk(tree) for name in _imported_by(node)}) & BENCHMARK_MARKS
    timed = any(getattr(node, "attr", getattr(node, "id", None)) == "perf_counter" for node in ast.walk(tree))
    return marks | ({"perf_counter"} if timed else set())


@pytest.mark.parametrize("path", files_of("flows"), ids=lambda p: str(p.relative_to(REPO)))
def test_flows_hold_no_benchmark_code(path):
    # flows/ wires Prefect and the CLI; what measures speed lives in benchmarks/ (and the gates
    # in components/ and serving/). render.py only prints the rows.
    assert not path.stem.startswith("bench")
    assert benchmark_marks(path.read_text()) == set()


def test_the_benchmark_code_rule_sees_a_planted_timing_loop():
    assert benchmark_marks("import time\nstart = time.perf_counter()\n") == {"perf_counter"}
    assert benchmark_marks("import aiohttp, statistics\n") == {"aiohttp", "statistics"}


# ---------------------------------------------------------------- the registry's tag names: spelled in registry/tags.py only

TAGS_MODULE = REPO / "registry/tags.py"
MOVE_TAG = re.compile(r"[\w-]*\.moves\.\d*")  # `<alias>.moves.0001`, or a piece of an f-string building one


def tag_spellings() -> tuple[set[str], tuple[str, ...], set[str]]:
    """registry.tags' names: those spelled nowhere else, the prefixes of the tag families,
    and the names that are also ordinary words (a column, a params field), which count only
    where a tag is read or written."""
    from registry import tags

    names = {value for name, value in vars(tags).items() if name.isupper() and isinstance(value, str)} - {tags.TRUE, tags.FALSE}
    prefixes = {name for name in names if name.endswith(".")}
    words = {name for name in names - prefixes if name.isalpha()}
    return names - prefixes - words, tuple(prefixes), words


ABOUT_TAGS = re.compile(r"(^|[^a-z])tag", re.IGNORECASE)  # tags, tag_version, versions_tagged; not stage_dir


def _about_tags(node: ast.AST) -> bool:
    return ABOUT_TAGS.search(ast.unparse(node)) is not None


def _tag_name_positions(tree: ast.AST):
    """Where a tag's name is written: `tags.get(NAME)`, `tags[NAME]`, `tag(NAME)`, and the
    keys of a dict of tags (one keyed by registry.tags, or handed to or named for tags)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _about_tags(node.value):
            yield node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and _about_tags(node.func.value):
            yield from node.args[:1]
        elif isinstance(node, ast.Call) and _about_tags(node.func):
            for arg in node.args:
                yield from arg.keys if isinstance(arg, ast.Dict) else [arg]
        elif isinstance(node, ast.Dict) and any(key is not None and _about_tags(key) for key in node.keys):
            yield from node.keys
        elif isinstance(node, ast.Assign | ast.keyword) and isinstance(node.value, ast.Dict):
            named = node.arg or "" if isinstance(node, ast.keyword) else " ".join(ast.unparse(t) for t in node.targets)
            if ABOUT_TAGS.search(named):
                yield from node.value.keys


def tag_name_literals(source: str) -> set[str]:
    exact, prefixes, words = tag_spellings()
    tree = ast.parse(source)
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    found = {s for s in strings if s in exact or s.startswith(prefixes) or MOVE_TAG.fullmatch(s)}
    return found | {node.value for node in _tag_name_positions(tree) if isinstance(node, ast.Constant) and node.value in words}


# The product's rooms that may import the registry. components/ may not, and the names it
# writes (the engine manifest's fields, the gate numbers' `gates.<gate>.<measure>`) are its
# own contracts; benchmarks/ is no product (it reads engine.json's fields by name).
@pytest.mark.parametrize(
    "path", [p for room in ("flows", "registry", "serving") for p in files_of(room) if p != TAGS_MODULE], ids=lambda p: str(p.relative_to(REPO))
)
def test_registry_tag_names_are_spelled_only_in_registry_tags(path):
    assert tag_name_literals(path.read_text()) == set()


@pytest.mark.parametrize(
    "planted",
    [
        'forced = info.tags.get("gates.passed") != "true"',
        'info.tags["target"]',
        'versions_tagged(target, {"precision": "int8", "data_md5": md5})',
        'tags = {tags.ENGINE_SHA256: sha, "backend": manifest.backend}',
        'name = f"verification.{check}"',
        'key = f"{alias}.moves.{number:04d}"',
        'query = "kiln.model_sha256"',
    ],
)
def test_a_tag_name_spelled_outside_registry_tags_is_found(planted):
    assert tag_name_literals(planted) != set()


def test_words_that_are_also_tag_names_count_only_where_a_tag_is_named():
    assert tag_name_literals('table.add_column("precision"); params.model_copy(update={"backend": "onnxruntime", "target": "cpu"})') == set()


def test_the_gate_numbers_components_name_are_the_registry_tag_family():
    from components.gates import GateReport, GateResult
    from registry import tags

    report = GateReport((GateResult("latency", True, {"p50_ms": 1.0}, {}),))
    assert list(report.flat_numbers()) == [tags.gate_number("latency", "p50_ms")]


# ---------------------------------------------------------------- serving: the HTTP side knows the engine as an EngineClient

HTTP_SIDE = [REPO / "serving" / name for name in ("app.py", "handlers.py", "follow.py")]


def attributes_asked_of(source: str, holder: str) -> set[str]:
    """The attributes read on `<anything>.<holder>`: what the code asks of that object."""
    tree = ast.parse(source)
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == holder}


def protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def places_naming(source: str, name: str) -> set[str]:
    """The functions that mention `name` (and `<module>` for mentions outside any function:
    imports aside, an annotation or a call at module or class level)."""
    tree = ast.parse(source)
    functions = [fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(node): fn.name for fn in functions for node in ast.walk(fn)}  # the innermost wins: ast.walk goes outside in
    return {inside.get(id(node), "<module>") for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == name}


def differing_members(cls: type, protocol: type) -> set[str]:
    """The protocol's members that `cls` lacks or declares otherwise: a method with other
    parameters, a property that is not one, a data attribute neither on the class nor set
    on `self` in its code."""
    set_on_self = {
        node.attr for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls))))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }  # fmt: skip

    def shape(function) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    differing = set()
    for name in protocol_members(protocol):
        declared, actual = inspect.getattr_static(protocol, name, None), inspect.getattr_static(cls, name, None)
        if declared is None:
            ok = actual is not None or name in set_on_self
        elif isinstance(declared, property):
            ok = isinstance(actual, property)
        else:
            ok = callable(actual) and shape(actual) == shape(declared)
        if not ok:
            differing.add(name)
    return differing


def test_the_http_side_asks_of_the_engine_exactly_what_engine_client_declares():
    from serving.engine_client import EngineClient

    asked = set().union(*(attributes_asked_of(path.read_text(), "scheduler") for path in HTTP_SIDE))
    assert asked == protocol_members(EngineClient)


def test_the_http_side_names_the_engine_process_only_where_it_starts_one():
    import typing

    from serving.engine_client import EngineClient
    from serving.follow import ServedEngine

    assert typing.get_type_hints(ServedEngine)["scheduler"] is EngineClient
    named = {path.name: places_naming(path.read_text(), "EngineProcess") for path in HTTP_SIDE}
    assert named == {"app.py": set(), "handlers.py": set(), "follow.py": {"start_engine"}}


def test_the_engine_process_is_an_engine_client():
    from serving.engine_client import EngineClient
    from serving.engine_process import EngineProcess

    assert differing_members(EngineProcess, EngineClient) == set()


def test_the_seam_rules_see_a_planted_violation():
    from serving.engine_client import EngineClient

    class NoPid:
        max_waiting = 1
        limits = "the engine's"

        def submit(self, sequences): ...

        def close(self, timeout=None): ...

        @property
        def alive(self): ...

    assert differing_members(NoPid, EngineClient) == {"pid"}
    assert attributes_asked_of("served.scheduler._live.clear()", "scheduler") == {"_live"}
    assert places_naming("class ServedEngine:\n    scheduler: EngineProcess\n", "EngineProcess") == {"<module>"}


# ---------------------------------------------------------------- every params key does something


# Keys read under a name the code builds: flows/serving_gate.py checks each budget of a
# scenario as getattr(scenario, f"max_{budget}").
READ_BY_BUILT_NAME = {("ServingScenario", "max_ttft_p95_ms"), ("ServingScenario", "max_tpot_p95_ms"), ("ServingScenario", "max_request_p99_ms")}
# Sections a package reads through a Protocol of its own (the registry depends on no config module).
READ_THROUGH_PROTOCOL = {"RegistrySettings": "RegistryParams"}


def params_fields(model: type, parent: str = "params", prefix: str = "") -> Iterator[tuple[str, type, str, str]]:
    """(key path, section class, field, the attribute its section is reached by) for every key."""
    import typing

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", model, name, parent
        for arg in [field.annotation, *typing.get_args(field.annotation)]:
            for section in [arg, *typing.get_args(arg)]:
                if isinstance(section, type) and issubclass(section, BaseModel):
                    yield from params_fields(section, name, f"{prefix}{name}.")


def attribute_reads(tree: ast.AST) -> set[tuple[str, str]]:
    """(what the object was reached by, attribute) for each attribute read: `params.build.x`
    gives ("build", "x"); `config = params.serving; config.x` and `for s in p.scenarios: s.x`
    follow the name to where it came from; an annotated parameter `p: LatencyGateParams` or
    name `p: LatencyGateParams | None = ...` gives ("LatencyGateParams", "x")."""
    found = set()
    for scope in ast.walk(tree):
        if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
            continue
        origin: dict[str, str] = {}
        if not isinstance(scope, ast.Module):
            origin |= {a.arg: ast.unparse(a.annotation) for a in [*scope.args.args, *scope.args.kwonlyargs] if a.annotation is not None}
        for node in ast.walk(scope):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # `s: TrainingParams = ...`
                origin[node.target.id] = ast.unparse(node.annotation).split(" | ")[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = node.value.value if isinstance(node.value, ast.Subscript) else node.value  # `row = p.targets[name]`
                if isinstance(value, ast.Attribute):
                    origin[node.targets[0].id] = value.attr
            if isinstance(node, ast.For | ast.comprehension):
                iterated = node.iter.func.value if isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Attribute) else node.iter  # `.items()`
                names = [node.target] if isinstance(node.target, ast.Name) else [t for t in getattr(node.target, "elts", []) if isinstance(t, ast.Name)]
                if isinstance(iterated, ast.Attribute):
                    origin |= {name.id: iterated.attr for name in names}
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                found.add((node.value.attr, node.attr))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                found.add((origin.get(node.value.id, node.value.id), node.attr))
    return found


def unread_params_keys(params_model: type) -> set[str]:
    """Keys of params.yaml that no code of kiln reads (a knob that does nothing)."""
    reads = set().union(*(attribute_reads(ast.parse(path.read_text())) for package in PRODUCT for path in (REPO / package).rglob("*.py")))
    reads |= {(READ_THROUGH_PROTOCOL[via], name) for via, name in reads if via in READ_THROUGH_PROTOCOL}
    return {
        path for path, section, name, parent in params_fields(params_model)
        if not {(parent, name), ("self", name), *((c.__name__, name) for c in section.__mro__)} & (reads | READ_BY_BUILT_NAME)
    }  # fmt: skip


def test_every_params_key_is_read_by_some_code():
    from components.config import Params

    assert unread_params_keys(Params) == set()


def test_the_unread_params_check_sees_a_planted_key():
    from pydantic import create_model

    from components.config import BuildParams, Params

    planted_build = create_model("PlantedBuild", __base__=BuildParams, threads=(int | None, None))
    planted = create_model("PlantedParams", __base__=Params, build=(planted_build, planted_build()))
    assert unread_params_keys(planted) == {"build.threads"}
