"""The layout's promises (DESIGN.md): dependencies point one way, each library stays in its
room, heavy imports stay where they are used. Imports inside functions count too."""

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("flows", "components", "registry", "serving")
# What the registry and the serving side may use of components: contracts, not stages.
CONTRACTS = {"components.engine_dir", "components.errors", "components.files"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


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


def test_importing_kiln_creates_no_files(tmp_path):
    code = "import flows.cli, registry, serving.loader, components.gates, components.data"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True)
    assert list(tmp_path.iterdir()) == []
