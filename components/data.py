"""The data stage: a corpus source → cleaned, deduplicated train / eval / calibration splits,
saved as Parquet with a manifest and versioned by DVC (`data.dvc`)."""

from __future__ import annotations

import ast
import fnmatch
import glob
import json
import logging
import re
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from components.config import CorpusSource, CPythonDocsSource, DataParams, HFDatasetSource, TextFilesSource, section_digest
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
        if source.glob:  # the files added to the docs, after them: none at first
            yield from _text_file_documents(root, source.glob, required=False)
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


def _text_file_documents(root: Path, pattern: str, required: bool = True) -> Iterator[str]:
    for path in corpus_files(root, pattern, required):
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read corpus file {path}: {err}") from err


def corpus_files(root: Path, pattern: str, required: bool = True) -> list[Path]:
    """The text files a corpus holds, in a deterministic order; `required`: none is a DataError."""
    paths = sorted(Path(p) for p in glob.glob(str(root / pattern), recursive=True) if Path(p).is_file())
    if not paths and required:
        raise DataError(f"data.source.glob {pattern!r} matched no files under {root}")
    return paths


def files_glob(source: CorpusSource) -> str | None:
    """The glob of a corpus's own text files: a text-files corpus's, or the files added to
    the Python docs; None for a dataset (or docs with `glob: null`)."""
    return source.glob if isinstance(source, TextFilesSource | CPythonDocsSource) else None


def source_digest(source: CorpusSource, root: Path) -> str | None:
    """sha256 over a corpus's text files (each file's path and content), so that a grown or
    edited corpus is a new data version even though params.yaml did not change. None where
    there are none to hash (the Python docs alone, a dataset: their content kiln cannot
    hash cheaply)."""
    pattern = files_glob(source)
    if pattern is None:
        return None
    files = corpus_files(root, pattern, required=isinstance(source, TextFilesSource))
    if not files:
        return None
    return text_sha256("\n".join(f"{path.relative_to(root).as_posix()} {file_sha256(path)}" for path in files))


def corpus_folder(source: TextFilesSource | CPythonDocsSource, root: Path) -> Path:
    """Where `kiln data add` puts new files: the glob's folder part (`corpus/**/*.txt` →
    corpus/). Only a glob whose folders are fixed or `**` names one folder to add to."""
    *folders, _ = Path(source.glob).parts
    if any(glob.has_magic(part) and part != "**" for part in folders):
        raise DataError(f"kiln data add cannot choose a folder for data.source.glob {source.glob!r}: use fixed folders or **, e.g. corpus/**/*.txt")
    return root.joinpath(*[part for part in folders if part != "**"])


def add_to_corpus(paths: list[Path], source: CorpusSource, root: Path) -> list[Path]:
    """Copy text files into the corpus's text files (a text-files corpus, or the files added
    to the Python docs); returns the files written (a file already there with the same
    content is skipped). Refuses a dataset source, a file that
    is not UTF-8 text, a name taken by other content, and a name the glob would not match."""
    if files_glob(source) is None:
        raise DataError(f"kiln data add grows a corpus of text files; data.source is {source.kind!r} with none "
                        "(set data.source.glob, e.g. \"corpus/**/*.txt\", in params.yaml)")  # fmt: skip
    folder, pattern = corpus_folder(source, root), Path(source.glob).name
    planned: list[tuple[Path, Path]] = []
    for path in paths:
        try:
            path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot add {path}: not a readable UTF-8 text file ({err})") from err
        if not fnmatch.fnmatch(path.name, pattern):
            raise DataError(f"{path.name} does not match {pattern!r} of data.source.glob {source.glob!r}: the corpus would not read it")
        destination = folder / path.name
        if destination.is_file() and file_sha256(destination) != file_sha256(path):
            raise DataError(f"{destination} already exists with other content; rename {path.name} to add it")
        if not destination.is_file():
            planned.append((path, destination))
    folder.mkdir(parents=True, exist_ok=True)
    for path, destination in planned:
        shutil.copyfile(path, destination)
    return [destination for _, destination in planned]


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


def write_splits(splits: dict[str, list[str]], data_dir: Path, source: CorpusSource, recipe: dict[str, str]) -> None:
    """Parquet per split (a datasets.DatasetDict) and a manifest without timestamps, so the
    same corpus always hashes to the same DVC version."""
    import datasets

    datasets.disable_progress_bars()  # one "Creating parquet" bar per split says nothing
    data_dir.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.iterdir():
        if stale.is_file():
            stale.unlink()
    dataset = datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": rows}) for name, rows in splits.items()})
    manifest = {"source": source.model_dump(mode="json"), **recipe, "splits": {}}
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

    _undo_dvc_console_wrappers()
    # dvc logs "To track the changes with git, run: ..." at INFO; kiln leaves git to people.
    logging.getLogger("dvc").setLevel(logging.WARNING)

    try:
        return Repo(str(root))
    except NotDvcRepoError as err:
        raise DataError(f"{root} is not a DVC repository (run `dvc init` there)") from err


def _undo_dvc_console_wrappers() -> None:
    """`import dvc` sets DVC up as a command-line program: its `colorama.init()` replaces this
    process's sys.stdout and sys.stderr with ANSI-stripping wrappers, for good. kiln uses DVC
    as a library, and those wrappers leak: whatever takes hold of sys.stderr afterwards keeps
    one, e.g. absl's log handler (imported with the text gate's ROUGE metric), which closes
    its stream on the next logging reconfiguration (uvicorn's, Prefect's) when that stream is
    not sys.stderr itself, and closing the wrapper closes the real stderr under it. Put the
    streams back right after the import (a no-op once they are back)."""
    import colorama
    from colorama.ansitowin32 import StreamWrapper

    if isinstance(sys.stdout, StreamWrapper) or isinstance(sys.stderr, StreamWrapper):
        colorama.deinit()


def data_recipe(params: DataParams, root: Path) -> dict[str, str]:
    """What a data version is made from, as its manifest records it: the data params and,
    for a text-files corpus, the files' digest."""
    recipe = {"params_sha256": section_digest(params)}
    if (digest := source_digest(params.source, root)) is not None:
        recipe["source_sha256"] = digest
    return recipe


def _manifest_matches(data_dir: Path, recipe: dict[str, str]) -> bool:
    try:
        manifest = json.loads((data_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all(manifest.get(key) == value for key, value in recipe.items()) and all(
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
    (a fresh clone, a new remote) the caller rebuilds it from the source and checks the md5."""
    from dvc.exceptions import DvcException

    logging.getLogger("dvc_data").setLevel(logging.ERROR)  # "missing cache files" is expected here
    try:
        repo.pull(targets=[str(dvc_file)])
    except DvcException:
        # DVC's own words ("Checkout failed for following targets:" and an empty list) read
        # like an error on the expected path of a fresh clone.
        _log.info(
            "%s names data version %s, which neither the DVC cache nor the remote holds yet (as on a fresh clone): "
            "building it from the source and checking that it matches",
            dvc_file.name, dvc_md5(dvc_file)[:12],
        )  # fmt: skip


def _check_rebuilt(dvc_file: Path, expected: str) -> None:
    """After a rebuild: say whether it is the version data.dvc named before."""
    rebuilt = dvc_md5(dvc_file)
    if rebuilt == expected:
        _log.info("rebuilt data version %s from the source: the one %s names", rebuilt[:12], dvc_file.name)
        return
    _log.warning(
        "the data rebuilt from the source is version %s, not %s as %s named: the source or params.yaml's data section "
        "changed since it was written; %s now names the rebuilt version (commit it to keep the two together)",
        rebuilt[:12], expected[:12], dvc_file.name, dvc_file.name,
    )  # fmt: skip


def data_version_from_source(params: DataParams, root: Path) -> DataVersion:
    """The versioned data for these params: reused when data/ already matches, pulled from
    the DVC remote when data.dvc names it, otherwise built from the source and `dvc add`ed.

    data.dvc is the truth a run follows (a checkout reproduces its data version), so a
    text-files corpus edited since is reported, not silently rebuilt: `kiln data add` (or
    `data_version_from_corpus`) makes the new version."""
    data_dir = root / params.path
    version = _versioned_data(params, root, {"params_sha256": section_digest(params)})
    try:
        corpus = source_digest(params.source, root)
    except DataError:  # the corpus is not here (the data came from the remote): nothing to compare
        corpus = None
    if corpus is not None and version.manifest().get("source_sha256") != corpus:
        _log.warning("the corpus %s changed since data version %s was made; `kiln data add` versions it", params.source.glob, version.md5[:12])
    return DataVersion(path=data_dir, md5=version.md5)


def data_version_from_corpus(params: DataParams, root: Path) -> DataVersion:
    """The data version of the corpus as it is now: rebuilt and `dvc add`ed when its files
    changed since data.dvc's version was made (what `kiln data add` runs)."""
    return _versioned_data(params, root, data_recipe(params, root))


def _versioned_data(params: DataParams, root: Path, recipe: dict[str, str]) -> DataVersion:
    data_dir = root / params.path
    dvc_file = data_dir.with_suffix(".dvc")
    repo = _dvc_repo(root)
    try:
        if not (_manifest_matches(data_dir, recipe) and _tracked_and_clean(repo, dvc_file)):
            named = dvc_md5(dvc_file) if dvc_file.is_file() else None
            if named is not None:
                _try_pull(repo, dvc_file)
            if not (_manifest_matches(data_dir, recipe) and _tracked_and_clean(repo, dvc_file)):
                _build_and_track(repo, params, root, data_recipe(params, root))
                if named is not None:
                    _check_rebuilt(dvc_file, named)
        if params.dvc_push:
            _push(repo, dvc_file)
    finally:
        repo.close()
    return DataVersion(path=data_dir, md5=dvc_md5(dvc_file))


def _build_and_track(repo, params: DataParams, root: Path, recipe: dict[str, str]) -> None:
    from dvc.exceptions import DvcException

    data_dir = root / params.path
    passages = clean_documents(documents_from_source(params.source, root), params.min_chars, params.max_chars)
    write_splits(splits_from_passages(passages, params), data_dir, params.source, recipe)
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
