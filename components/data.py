"""The data stage: a corpus source → cleaned, deduplicated train / eval / calibration splits,
saved as Parquet with a manifest and versioned by DVC (`data.dvc`)."""

from __future__ import annotations

import ast
import glob
import json
import logging
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from components.config import (
    CorpusSource,
    CPythonDocsSource,
    DataParams,
    HFDatasetSource,
    TextFilesSource,
    section_digest,
)
from components.errors import DataError
from components.files import file_sha256, text_sha256

SPLITS = ("train", "eval", "calibration")
_log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DataVersion:
    """A data directory and its DVC version (`outs[0].md5` of data.dvc)."""

    path: Path
    md5: str

    @property
    def content_digest(self) -> str:
        return self.md5

    def split_path(self, split: str) -> Path:
        return split_path(self.path, split)

    def texts(self, split: str) -> list[str]:
        return split_texts(self.path, split)

    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())


def split_path(data_dir: Path, split: str) -> Path:
    return data_dir / f"{split}.parquet"


def split_texts(data_dir: Path, split: str) -> list[str]:
    """The passages of one split of a data directory; DataError if the split is not there."""
    import pyarrow.parquet as pq

    path = split_path(data_dir, split)
    if not path.is_file():
        raise DataError(f"no {split} split at {path}")
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


# ---------------------------------------------------------------- sources


def documents_from_source(source: CorpusSource, root: Path) -> Iterator[str]:
    """Raw documents of a corpus source, in a deterministic order."""
    if isinstance(source, CPythonDocsSource):
        yield from _cpython_documents()
    elif isinstance(source, TextFilesSource):
        yield from _text_file_documents(root, source.glob)
    elif isinstance(source, HFDatasetSource):
        yield from _hf_documents(source)


def _cpython_documents() -> Iterator[str]:
    """pydoc's topic pages and every stdlib docstring: ~2 MB of English prose, no download."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if parts[0] in {"site-packages", "test", "idlelib", "lib2to3"} or "tests" in parts:
            continue
        yield from _docstrings(path)


def _docstrings(path: Path) -> Iterator[str]:
    # ast, not import: importing the whole stdlib would run its module-level code.
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if doc := ast.get_docstring(node):
                yield doc


def _text_file_documents(root: Path, pattern: str) -> Iterator[str]:
    paths = sorted(glob.glob(str(root / pattern), recursive=True))
    if not paths:
        raise DataError(f"data.source.glob {pattern!r} matched no files under {root}")
    for path in paths:
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read corpus file {path}: {err}") from err


def _hf_documents(source: HFDatasetSource) -> Iterator[str]:
    import datasets

    try:
        dataset = datasets.load_dataset(source.name, split=source.split)
    except Exception as err:  # datasets raises many unrelated types for "not reachable"
        raise DataError(f"cannot load dataset {source.name!r} split {source.split!r}: {err}") from err
    if source.text_field not in dataset.column_names:
        raise DataError(
            f"dataset {source.name!r} has no field {source.text_field!r}; fields: {dataset.column_names}"
        )
    yield from dataset[source.text_field]


# ---------------------------------------------------------------- cleaning and splitting


def clean_documents(documents: Iterable[str], min_chars: int, max_chars: int) -> list[str]:
    """Normalised, length-bounded, exact-deduplicated passages, in first-seen order.

    Long documents are cut at paragraph boundaries into passages of at most max_chars.
    """
    seen: set[str] = set()
    passages = []
    for document in documents:
        for passage in _passages(_normalise(document), max_chars):
            key = text_sha256(passage.lower())
            if len(passage) >= min_chars and key not in seen:
                seen.add(key)
                passages.append(passage)
    return passages


def _normalise(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _passages(text: str, max_chars: int) -> Iterator[str]:
    current = ""
    for paragraph in text.split("\n\n"):
        paragraph = paragraph[:max_chars]
        if current and len(current) + 2 + len(paragraph) > max_chars:
            yield current
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        yield current


def split_of(passage: str, eval_fraction: float, calibration_fraction: float) -> str:
    """The split a passage belongs to, from its hash: stable when the corpus grows."""
    position = int(text_sha256(passage)[:8], 16) / 0x1_0000_0000
    if position < eval_fraction:
        return "eval"
    if position < eval_fraction + calibration_fraction:
        return "calibration"
    return "train"


def splits_from_passages(passages: list[str], params: DataParams) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {name: [] for name in SPLITS}
    for passage in passages:
        splits[split_of(passage, params.split.eval_fraction, params.split.calibration_fraction)].append(passage)
    empty = [name for name, rows in splits.items() if not rows]
    if empty:
        raise DataError(
            f"the corpus has {len(passages)} passages, too few to fill the {', '.join(empty)} split(s)"
        )
    return splits


# ---------------------------------------------------------------- writing and versioning


def write_splits(splits: dict[str, list[str]], data_dir: Path, source: CorpusSource, params_sha256: str) -> None:
    """Parquet per split (a datasets.DatasetDict) and a manifest without timestamps, so the
    same corpus always hashes to the same DVC version."""
    import datasets

    datasets.disable_progress_bars()  # one "Creating parquet" bar per split says nothing
    data_dir.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.iterdir():
        if stale.is_file():
            stale.unlink()
    dataset = datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": rows}) for name, rows in splits.items()})
    manifest = {"source": source.model_dump(mode="json"), "params_sha256": params_sha256, "splits": {}}
    for name, split in dataset.items():
        path = data_dir / f"{name}.parquet"
        split.to_parquet(str(path))
        rows = splits[name]
        manifest["splits"][name] = {"rows": len(rows), "chars": sum(map(len, rows)), "sha256": file_sha256(path)}
    (data_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def dvc_md5(dvc_file: Path) -> str:
    """The data version: `outs[0].md5` of a .dvc file."""
    try:
        return yaml.safe_load(dvc_file.read_text())["outs"][0]["md5"]
    except (OSError, KeyError, IndexError, TypeError, yaml.YAMLError) as err:
        raise DataError(f"{dvc_file} does not record a data version (outs[0].md5): {err}") from err


def _dvc_repo(root: Path):
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    # dvc logs "To track the changes with git, run: ..." at INFO; kiln leaves git to people.
    logging.getLogger("dvc").setLevel(logging.WARNING)

    try:
        return Repo(str(root))
    except NotDvcRepoError as err:
        raise DataError(f"{root} is not a DVC repository (run `dvc init` there)") from err


def _manifest_matches(data_dir: Path, params_sha256: str) -> bool:
    try:
        manifest = json.loads((data_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("params_sha256") == params_sha256 and all(
        (data_dir / f"{name}.parquet").is_file() for name in SPLITS
    )


def _tracked_and_clean(repo, dvc_file: Path) -> bool:
    from dvc.exceptions import DvcException

    if not dvc_file.is_file():
        return False
    try:
        return not repo.status(targets=[str(dvc_file)])
    except DvcException:
        return False


def _try_pull(repo, dvc_file: Path) -> None:
    """Fetch the version data.dvc names, if the cache or remote has it. When neither has it
    (a fresh clone, a new remote) the caller rebuilds from the source and checks the md5."""
    from dvc.exceptions import DvcException

    logging.getLogger("dvc_data").setLevel(logging.ERROR)  # "missing cache files" is expected here
    try:
        repo.pull(targets=[str(dvc_file)])
    except DvcException as err:
        _log.warning("data version in %s is not in the DVC cache or remote (%s); rebuilding it from the source", dvc_file.name, str(err).splitlines()[0])


def data_version_from_source(params: DataParams, root: Path) -> DataVersion:
    """The versioned data for these params: reused when data/ already matches, pulled from
    the DVC remote when data.dvc names it, otherwise built from the source and `dvc add`ed."""
    data_dir = root / params.path
    dvc_file = data_dir.with_suffix(".dvc")
    params_sha256 = section_digest(params)
    repo = _dvc_repo(root)
    try:
        if not (_manifest_matches(data_dir, params_sha256) and _tracked_and_clean(repo, dvc_file)):
            if dvc_file.is_file():
                _try_pull(repo, dvc_file)
            if not (_manifest_matches(data_dir, params_sha256) and _tracked_and_clean(repo, dvc_file)):
                _build_and_track(repo, params, root, params_sha256)
        if params.dvc_push:
            _push(repo, dvc_file)
    finally:
        repo.close()
    return DataVersion(path=data_dir, md5=dvc_md5(dvc_file))


def _build_and_track(repo, params: DataParams, root: Path, params_sha256: str) -> None:
    from dvc.exceptions import DvcException

    data_dir = root / params.path
    passages = clean_documents(documents_from_source(params.source, root), params.min_chars, params.max_chars)
    write_splits(splits_from_passages(passages, params), data_dir, params.source, params_sha256)
    try:
        repo.add(str(data_dir))
    except DvcException as err:
        raise DataError(f"dvc could not version {data_dir}: {err}") from err


def _push(repo, dvc_file: Path) -> None:
    from dvc.exceptions import DvcException

    try:
        repo.push(targets=[str(dvc_file)])
    except DvcException as err:
        raise DataError(f"dvc push of {dvc_file.name} failed: {err}") from err
