"""The layout's promises: dependencies point one way, heavy imports stay where they are used."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kiln"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def files_of(room: str) -> list[Path]:
    return sorted((PACKAGE / room).rglob("*.py"))


@pytest.mark.parametrize("path", files_of("components"), ids=lambda p: p.name)
def test_components_import_neither_prefect_mlflow_nor_fastapi(path):
    assert not top_level(imported_modules(path)) & {"prefect", "mlflow", "fastapi"}
    assert not {m for m in imported_modules(path) if m.startswith(("kiln.flows", "kiln.registry"))}


def test_only_the_registry_imports_mlflow():
    importers = {p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py") if "mlflow" in top_level(imported_modules(p))}
    assert importers == {"registry"}


def test_the_registry_does_not_depend_on_flows():
    for path in files_of("registry"):
        assert not {m for m in imported_modules(path) if m.startswith("kiln.flows")}


def loaded_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_heavy_module():
    loaded = loaded_after("import kiln.flows.cli")
    assert not loaded & {"torch", "transformers", "onnxruntime", "mlflow", "prefect", "tensorrt", "datasets"}


def test_importing_the_registry_and_engines_does_not_load_torch():
    loaded = loaded_after("import kiln.registry, kiln.components.engines, kiln.components.engine_dir")
    assert "torch" not in loaded and "mlflow" not in loaded


def test_importing_kiln_creates_no_files(tmp_path):
    code = "import kiln.flows.cli, kiln.registry, kiln.components.gates, kiln.components.data"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True)
    assert list(tmp_path.iterdir()) == []
