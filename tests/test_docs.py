"""The documentation site: `mkdocs build --strict` passes (a broken link or an unknown page
fails it), and the reference pages, generated from the code at build time, cover every CLI
verb, every params.yaml key, every registry tag and every metric."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = str(Path(sys.executable).parent / "mkdocs")


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("kiln_docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pages()


def test_the_site_builds_in_strict_mode(tmp_path):
    built = subprocess.run([MKDOCS, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert "kiln keys sign-existing" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def build_a_changed_copy(tmp_path: Path, change) -> subprocess.CompletedProcess:
    """The site built --strict from a copy of docs/ that `change(docs)` edited."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    change(docs)
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}").replace("  - docs/hooks/reference.py", f"  - {docs}/hooks/reference.py")
    (tmp_path / "mkdocs.yml").write_text(config)
    return subprocess.run([MKDOCS, "build", "--strict", "-d", str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})  # fmt: skip


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """What the check above is worth: the same build with one page linking nowhere fails."""
    built = build_a_changed_copy(tmp_path, lambda docs: (docs / "concepts.md").write_text((docs / "concepts.md").read_text() + "\n[gone](no-such-page.md)\n"))
    assert built.returncode != 0 and "no-such-page.md" in built.stderr


def test_a_stale_reference_page_fails_the_build_naming_the_command_that_remakes_it(tmp_path):
    def stale(docs: Path) -> None:
        page = docs / "reference" / "params.md"
        page.write_text(page.read_text().replace("| `serving.max_waiting` | int | `64` |", "| `serving.max_waiting` | int | `32` |"))

    built = build_a_changed_copy(tmp_path, stale)
    assert built.returncode != 0 and "stale reference pages docs/reference/params.md" in built.stderr
    assert "python docs/hooks/reference.py" in built.stderr


def test_every_cli_verb_has_its_section_in_the_cli_reference(reference):
    import typer

    from flows.cli import app

    def verbs(group, path):
        for name, command in group.commands.items():
            yield f"{path} {name}"
            if hasattr(command, "commands"):
                yield from verbs(command, f"{path} {name}")

    page = reference["reference/cli.md"]
    missing = [verb for verb in verbs(typer.main.get_command(app), "kiln") if f"## `{verb}`" not in page]
    assert not missing and len(list(verbs(typer.main.get_command(app), "kiln"))) > 15, missing


def test_every_params_key_is_in_the_params_reference_with_its_default(reference):
    from components.config import Params

    def keys(model, prefix=""):
        """Every key, a mapping's entries as `.<precision>` / `.<name>`, a list's as `[]`."""
        from typing import Literal, get_args, get_origin

        from pydantic import BaseModel

        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            yield key
            annotation = field.annotation
            if get_origin(annotation) is dict:
                key, annotation = key + (".<precision>" if get_origin(get_args(annotation)[0]) is Literal else ".<name>"), get_args(annotation)[1]
            elif get_origin(annotation) is list:
                key, annotation = key + "[]", get_args(annotation)[0]
            inner = [annotation, *(a for u in get_args(annotation) for a in (u, *get_args(u)))]
            for candidate in dict.fromkeys(c for c in inner if isinstance(c, type) and issubclass(c, BaseModel)):
                yield from keys(candidate, f"{key}.")

    page = reference["reference/params.md"]
    found = list(keys(Params))
    assert len(found) > 100 and not [k for k in found if f"| `{k}` |" not in page]
    assert "| `serving.max_waiting` | int | `64` | Sequences that may wait beyond the running batch" in page
    undescribed = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| `") and line.rstrip().endswith("|  |")]
    assert not undescribed, f"params keys without a description (a docstring under the field): {undescribed}"


def test_every_registry_tag_is_in_the_tags_reference(reference):
    from registry import tags

    names = [value for name, value in vars(tags).items() if name.isupper() and isinstance(value, str)]
    page = reference["reference/registry-tags.md"]
    assert len(names) > 30 and not [n for n in names if f"`{n}`" not in page]


def test_every_tag_of_the_tags_reference_says_what_it_means_in_tag_names(reference):
    """Each row has a meaning (a comment beside the constant in registry/tags.py), names
    other tags by their tag names rather than registry/tags.py's Python constants, and the
    kinds of tags the page's introduction promises each have their section."""
    from registry import tags

    page = reference["reference/registry-tags.md"]
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 30
    assert not [row for row in rows if not re.split(r"(?<!\\)\|", row)[2].strip()], "tags without a meaning"
    constants = [name for name in vars(tags) if name.isupper() and len(name) > 5]
    assert not [row for row in rows for name in constants if re.search(rf"\b{name}\b", row)], "a Python constant where a tag name belongs"
    headings = [line.removeprefix("## ") for line in page.splitlines() if line.startswith("## ")]
    for kind in ("version tags", "registered-model tags", "run tags"):
        assert kind in page.split("\n## ")[0] and any(h.startswith(kind) for h in headings), kind


def test_every_metric_kiln_serve_exports_is_in_the_metrics_reference(reference):
    from serving.metrics import GpuCollector, ServerMetrics

    metrics = ServerMetrics()
    metrics.watch_engine_process(os.getpid)
    exported = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    exported |= {family.name for family in GpuCollector(nvml=None).describe()}
    page = reference["reference/metrics.md"]
    missing = [name for name in exported if not any(f"`{name.removesuffix(s)}" in page for s in ("_bucket", "_sum", "_count", "_created", ""))]
    assert not missing, missing


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository():
    import re

    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert len(relative) > 15 and not [link for link in relative if not (ROOT / link).exists()]
