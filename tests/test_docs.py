"""The documentation site: `mkdocs build --strict` passes (a broken link or an unknown page
fails it), and the reference pages, generated from the code at build time, cover every CLI
verb, every params.yaml key, every registry tag and every metric."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
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


# ---------------------------------------------------------------- what the pages point at and quote

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def _page(path: Path) -> str:
    """A page without its fenced code blocks (commands and program output, not prose)."""
    return re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """The ids MkDocs gives a page's headings (Python-Markdown's toc slugs), and {#id}s."""
    from markdown.extensions.toc import slugify

    ids = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _page(path), flags=re.M):
        ids |= set(re.findall(r"\{#([\w-]+)\}", heading))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"\{[^}]*\}\s*$", "", heading)).replace("`", "")
        ids.add(slugify(text, "-"))
    return ids


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links of `text` (a page at `page`) whose file is not in the repository, or
    whose #anchor is not a heading of the Markdown page it names."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`\n]+`", "", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if file != ROOT and ROOT not in file.parents or not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    return broken


# What a citation of a repository path is, in a page's prose (fenced code blocks are left
# out: they are commands and output). An inline code span, cut at `::` (a test's name), is
# one when it has no space, no `<`, `>`, `*`, `$` or `://` (patterns, commands, URLs) and
# does not start with `/`, `~` or `-` (absolute paths, a home folder, options), and either
#   - has a folder part (`components/evidence.py`, `deploy/grafana/`): it must exist from
#     the repository's root, unless it starts with one of RUNTIME_OUTPUTS, the folders a run,
#     `make` or the reader makes (none is in a fresh clone);
#   - or is a bare file name with one of SOURCE_SUFFIXES (`params.yaml`, `DESIGN.md`): a
#     file of that name must exist somewhere in the repository, unless it is one of
#     RUNTIME_FILES, the files a run writes (`report.md`, Triton's `model.py`).
# Engine and model files (`engine.json`, `model.onnx`, `config.json`) carry other suffixes
# and are not citations of the repository.
RUNTIME_OUTPUTS = (".kiln/", "mlruns/", "data/", "models/", "corpus/", "notes/", "artifacts/", ".venv/", ".triton-venv/", "site/")
RUNTIME_FILES = {"report.md", "model.py"}
SOURCE_SUFFIXES = (".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".dvc", ".cfg", ".sh")


def _repository_file_names() -> set[str]:
    names = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("mlruns", "data", "models", "site", "mutants") and not d.endswith(".egg-info")]
        names |= set(files)
    return names


def broken_citations(text: str, file_names: set[str]) -> list[str]:
    """The repository paths `text` cites in backticks that name nothing in the repository,
    then the bare file names with SOURCE_SUFFIXES its prose names outside backticks and
    links (`see DESIGN.md`), by the same rule."""
    prose = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    broken = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        cited = span.split("::")[0]
        if re.search(r"[\s<>*$]|://", cited) or cited.startswith(("/", "~", "-")):
            continue
        if "/" in cited:
            if not cited.startswith(RUNTIME_OUTPUTS) and not (ROOT / cited).exists():
                broken.append(span)
        elif cited.endswith(SOURCE_SUFFIXES) and cited not in RUNTIME_FILES and cited not in file_names:
            broken.append(span)
    words = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`\n]+`", "", prose))
    for name in re.findall(r"(?<![\w/.-])([\w-]+(?:%s))\b(?![\w/])" % "|".join(re.escape(s) for s in SOURCE_SUFFIXES), words):
        if name not in RUNTIME_FILES and name not in file_names:
            broken.append(name)
    return broken


def test_every_relative_link_of_the_readme_and_the_docs_names_a_file_and_heading_of_the_repository():
    """README.md is not part of the MkDocs site, so its links and anchors are checked only
    here; the site's pages are checked here too (and by the strict build)."""
    broken = {str(page.relative_to(ROOT)): found for page in PAGES if (found := broken_links(page, page.read_text()))}
    assert not broken, broken
    readme = ROOT / "README.md"
    assert len(re.findall(r"\]\((?!https?:)", readme.read_text())) > 15
    planted = "[gone](docs/no-such-page.md), [no heading](docs/concepts.md#no-such-heading), [fine](docs/concepts.md#what-a-gate-measures)"
    assert broken_links(readme, planted) == ["docs/no-such-page.md", "docs/concepts.md#no-such-heading"]


def test_every_file_the_readme_and_the_docs_cite_is_in_the_repository():
    """`components/evidence.py`, `tests/test_faults.py`, `deploy/grafana/kiln-serve.json`:
    each path a page cites names a file or folder of the repository (the rule, and what it
    leaves out as a run's outputs, above broken_citations)."""
    names = _repository_file_names()
    broken = {str(page.relative_to(ROOT)): found for page in PAGES if (found := broken_citations(page.read_text(), names))}
    assert not broken, broken
    planted = "`components/no_such_stage.py`, `DESIGN.md`, `tests/test_faults.py::test_x`, `.kiln/stages/`, `engine.json`, `report.md`, `gates.<gate>.<m>`; see FACTS.md, params.yaml"
    assert broken_citations(planted, names) == ["components/no_such_stage.py", "DESIGN.md", "FACTS.md"]


# Figures quoted in more than one place: each name, the regexes that find a quote of it
# (matched on a page with its whitespace collapsed; each unnamed group a number, a named
# group `machine` part of the figure's name: figures of other machines are other figures),
# and how a quote's text becomes a value. The README's sample `make run` output is where
# the default model's current figures live; a page that quotes one must quote the same
# value. Figures of other models, shapes, precisions or GPUs do not match these phrases.
@dataclass(frozen=True)
class _Quoted:
    """A quoted number, and half its last digit's step: 0.982 and 80.53 agree with 0.9821
    and 80.535 as quoted, not with 0.9916."""

    value: float
    half_step: float

    def agrees(self, other: _Quoted) -> bool:
        return abs(self.value - other.value) <= max(self.half_step, other.half_step) + 1e-12


@dataclass(frozen=True)
class _Duration:
    """Seconds, or a range of them ('4–7 minutes'): two ranges agree when they are the same,
    a time and a range when the time lies in the range."""

    low: float
    high: float

    def agrees(self, other: _Duration) -> bool:
        if self.low < self.high and other.low < other.high:
            return (self.low, self.high) == (other.low, other.high)
        return max(self.low, other.low) <= min(self.high, other.high) + 1.0


def _number(text: str) -> _Quoted:
    """A number as quoted; a percentage as a fraction ('98.3 %' is 0.983)."""
    text = text.strip()
    scale = 0.01 if text.endswith("%") else 1.0
    digits = text.rstrip(" %")
    return _Quoted(float(digits) * scale, 0.5 * 10.0 ** -len(digits.partition(".")[2]) * scale)


def _duration(text: str) -> _Duration | str:
    """'4–7 minutes', 'about 4-5 minutes', '3 min 40 s', '183 s'; anything else as it reads."""
    text = re.sub(r"^(about|around|roughly) ", "", text.strip())
    if found := re.fullmatch(r"(\d+) ?[–-] ?(\d+) ?(?:minutes|min)", text):
        return _Duration(float(found[1]) * 60, float(found[2]) * 60)
    if found := re.fullmatch(r"(\d+) ?(?:minutes?|min)(?: (\d+) ?s)?", text):
        return _Duration(*(float(found[1]) * 60 + float(found[2] or 0),) * 2)
    if found := re.fullmatch(r"(\d+) ?s", text):
        return _Duration(*(float(found[1]),) * 2)
    return text


TOP1 = r"(\d+(?:\.\d+)? ?%|[01]\.\d+)"
DURATION = r"(\d+ ?(?:[–-] ?\d+ ?minutes|minutes|min(?: \d+ s)?|s))"
MACHINE = r"(?P<machine>Intel Xeon|AMD EPYC|Xeon Sapphire Rapids)"
FIGURES: dict[str, tuple] = {
    "top-1 agreement of the default model's int8 engine": (_number, [
        r"│ int8 +│ ([01]\.\d+) │[^`]{0,400}?kiln-gpt2 version",  # the table `make run` prints of the default model (README's sample output)
        rf"default (?:GPT-2|model)(?:'s)? int8 engine\b[^.\n]{{0,60}}?\btop-1(?: agreement)?[^\d\n]{{0,12}}?{TOP1}",
        rf"int8 engine of the default (?:GPT-2|model)\b[^.\n]{{0,60}}?\btop-1(?: agreement)?[^\d\n]{{0,12}}?{TOP1}",
        rf"\btop-1(?: agreement)? (?:of )?{TOP1} (?:for|of|on|from) the default (?:GPT-2|model)(?:'s)? int8 engine",
    ]),
    "eval perplexity of the default model": (_number, [
        r"model eval perplexity (\d+\.\d+)",  # `make run`'s summary line
        r"GPT-2 reaches (?:eval perplexity )?(\d+\.\d+)",
        r"default (?:GPT-2|model)(?:'s)?[^.\n]{0,30}?\beval perplexity (?:of |is |\*\*)?(\d+\.\d+)",
        r"[Tt]he eval perplexity is (\d+\.\d+) in every mode",
    ]),
    "training time of the default model on 2 cores": (_duration, [
        r"trains a small GPT-2 \((?:about )?([^():,]*?) on 2 (?:CPU )?cores\)",
        r"steps: 1200 # (?:about )?([^#]*?) on 2 (?:CPU )?cores",
        r"trained model \(default params, \d+ steps, ([^)]*)\)",
        rf"[Tt]raining (?:the default model|a small GPT-2) (?:takes|took) (?:about )?{DURATION}",
    ]),
    "`make run` time on a 2-core {machine}": (_duration, [
        rf"(?:about )?{DURATION}(?: in all)? on a 2-core {MACHINE}\b",
    ]),
    "time of `make test`": (_duration, [
        rf"`make test`[^.\n]{{0,60}}?\b(?:takes|took|in) (?:about )?{DURATION}",
    ]),
    "training time that reproducible training adds": (_number, [
        r"held to AVX2, about (\d+ ?%) slower",
        r"held kernels cost about (\d+ ?%)",
        r"reproducible[^.\n]{0,40}?about (\d+ ?%) slower",
    ]),
    "int8 quality limits (top-1 agreement, perplexity increase)": (_number, [
        r"int8: \{min_top1_agreement: ([\d.]+), max_ppl_increase_pct: ([\d.]+)\}",  # params.yaml
        r"int8: top-1 agreement ≥ ([\d.]+), perplexity ≤ \+([\d.]+) ?%",
        r"\bint8(?:'s)? (?:quality )?limits (?:are )?([\d.]+) and \+([\d.]+) ?%",
    ]),
    "disk `.venv` takes (GB)": (_number, [
        r"`\.venv`[^.\n]{0,40}?\b(\d+(?:\.\d+)?) ?GB",
        r"\b(\d+(?:\.\d+)?) ?GB of disk for `\.venv`",
    ]),
    "largest model that builds on the CPU (billions of parameters)": (_number, [
        r"[Uu]p to about (\d+(?:\.\d+)?) ?B parameters on the CPU",
        r"[Mm]odels over about (\d+(?:\.\d+)?) ?B parameters do not build",
        r"fp32 weights pass that \(about (\d+(?:\.\d+)?) ?B parameters\)",
    ]),
    "memory the default model needs (GB)": (_number, [
        r"\b(\d+(?:\.\d+)?) ?GB of memory for the default model",
        r"default model needs (?:about )?(\d+(?:\.\d+)?) ?GB of memory",
    ]),
}


def figure_quotes(texts: dict[str, str]) -> dict[str, list[tuple[str, str, tuple]]]:
    """Per figure, each quote found: (where, the text quoted, its values)."""
    found: dict[str, list] = {}
    for name, (value_of, patterns) in FIGURES.items():
        for where, text in texts.items():
            flat = " ".join(text.split())
            for pattern in map(re.compile, patterns):
                named = set(pattern.groupindex.values())
                for match in pattern.finditer(flat):
                    quoted = [g for i, g in enumerate(match.groups(), 1) if i not in named and g is not None]
                    figure = name.format(**match.groupdict())
                    found.setdefault(figure, []).append((where, " ".join(quoted), tuple(value_of(g) for g in quoted)))
    return found


def _agree(a: tuple, b: tuple) -> bool:
    """Two quotes of a figure agree, number by number."""
    return len(a) == len(b) and all(x.agrees(y) if type(x) is type(y) and hasattr(x, "agrees") else x == y for x, y in zip(a, b, strict=True))


def disagreements(texts: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """The figures whose quotes do not all agree, with every quote of each."""
    return {
        name: [(where, quoted) for where, quoted, _ in quotes]
        for name, quotes in figure_quotes(texts).items()
        if any(not _agree(a, b) for i, (_, _, a) in enumerate(quotes) for _, _, b in quotes[i + 1 :])
    }


def _quoting_texts() -> dict[str, str]:
    texts = {str(page.relative_to(ROOT)): page.read_text() for page in PAGES}
    return texts | {"params.yaml": (ROOT / "params.yaml").read_text()}


def test_a_figure_quoted_in_several_places_has_one_value():
    """What it guards: a figure the docs quote in more than one place (the default model's
    int8 top-1 agreement and eval perplexity, its training time on 2 cores, `make run`'s and
    `make test`'s times, what reproducible training costs, the int8 limits, the size of
    `.venv`, the memory the default model needs, the largest model that builds) says the
    same thing wherever it is quoted, in README.md, docs/**/*.md and params.yaml (its
    comments and the limits' values). A page that wants such a figure links to where it is;
    if it quotes it, the quote must match. Figures of other models, shapes, precisions,
    machines or GPUs are not these phrases and are not compared (FIGURES, above)."""
    texts = _quoting_texts()
    quotes = figure_quotes(texts)
    assert len(quotes.get("top-1 agreement of the default model's int8 engine", [])) >= 1  # README's sample output
    assert len(quotes.get("int8 quality limits (top-1 agreement, perplexity increase)", [])) >= 2
    assert not disagreements(texts), disagreements(texts)


def test_the_figure_check_finds_a_planted_disagreement_and_not_other_figures():
    texts = _quoting_texts()
    planted = texts | {"docs/concepts.md": texts["docs/concepts.md"] + "\nThe default model's int8 engine measures top-1 0.975 on any CPU.\n"}
    assert "top-1 agreement of the default model's int8 engine" in disagreements(planted)
    planted = texts | {"docs/serving.md": texts["docs/serving.md"] + "\nTraining the default model takes about 12 minutes on 2 cores, the README 4-5.\n"}
    planted["params.yaml"] = planted["params.yaml"].replace("steps: 1200", "steps: 1200  # about 4-5 minutes on 2 CPU cores")
    assert "training time of the default model on 2 cores" in disagreements(planted)
    planted = texts | {"docs/getting-started.md": texts["docs/getting-started.md"] + "\n`make run` takes 9 min 10 s on a 2-core AMD EPYC.\n"}
    planted["README.md"] = planted["README.md"] + "\nfrom a fresh clone, 4–7 minutes on a 2-core AMD EPYC.\n"
    assert "`make run` time on a 2-core AMD EPYC" in disagreements(planted)
    others = {
        "a.md": "The int4 engine of the default model measures top-1 0.940. The tiny Llama's int8 engine: top-1 0.9836. "
        "│ int8      │ 0.9916 │ and 98.3 % per look over three looks; fp16 top-1 agreement 99.95 %.",
        "b.md": "int8 engine of the default model vs PyTorch | top-1 agreement 99.16 %. A Llama reaches eval perplexity 59.6.",
    }
    assert not disagreements(others), disagreements(others)
