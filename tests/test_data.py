"""The data stage: clean, deduplicate, split, save as Parquet, version with DVC."""

import subprocess

import pytest

from components.config import CPythonDocsSource, DataParams, TextFilesSource
from components.data import (
    DataVersion,
    clean_documents,
    data_version_from_corpus,
    data_version_from_source,
    documents_from_source,
    dvc_md5,
    split_of,
)
from components.errors import DataError

from .conftest import DVC


def test_cleaning_drops_short_passages_and_exact_duplicates_ignoring_case():
    docs = ["short", "A passage that is long enough to keep.", "a passage that is LONG enough to keep."]
    assert clean_documents(docs, min_chars=10, max_chars=1000) == ["A passage that is long enough to keep."]


def test_long_documents_are_cut_at_paragraph_boundaries():
    doc = "\n\n".join(f"paragraph {i} " + "x" * 50 for i in range(10))
    passages = clean_documents([doc], min_chars=1, max_chars=150)
    assert len(passages) > 1
    assert all(len(p) <= 150 for p in passages)
    assert all(p.startswith("paragraph") for p in passages)


def test_a_passage_always_lands_in_the_same_split():
    assert {split_of("some passage", 0.1, 0.1) for _ in range(5)} == {split_of("some passage", 0.1, 0.1)}


def test_the_default_corpus_is_cpython_docs_read_offline_then_the_files_added_to_it(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "note.txt").write_text("A note of my own about kiln, long enough to be a passage.")
    documents = list(documents_from_source(CPythonDocsSource(), root=tmp_path))
    assert documents[-1] == (tmp_path / "corpus" / "note.txt").read_text()
    assert sum(map(len, clean_documents(documents, 64, 4000))) > 1_500_000


def test_data_is_split_saved_and_versioned_by_dvc(project, data_version: DataVersion):
    manifest = data_version.manifest()
    assert set(manifest["splits"]) == {"train", "eval", "calibration"}
    assert all(split["rows"] > 0 for split in manifest["splits"].values())
    assert data_version.md5 == dvc_md5(project / "data.dvc")
    status = subprocess.run([DVC, "status"], cwd=project, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout
    pushed = subprocess.run([DVC, "status", "--cloud"], cwd=project, capture_output=True, text=True, check=True)
    assert "in sync" in pushed.stdout


def test_unchanged_data_keeps_its_version_and_files(project, params, data_version):
    before = data_version.split_path("train").stat().st_mtime_ns
    again = data_version_from_source(params.data, project)
    assert again.md5 == data_version.md5
    assert again.split_path("train").stat().st_mtime_ns == before


def test_deleted_data_is_pulled_back_from_the_remote(tmp_path):
    from .conftest import make_project, tiny_params

    root = make_project(tmp_path / "p")
    params = tiny_params(root).data
    first = data_version_from_source(params, root)
    for file in first.path.iterdir():
        file.unlink()
    assert data_version_from_source(params, root).md5 == first.md5
    assert first.split_path("eval").is_file()


def test_a_grown_corpus_keeps_every_passage_in_the_split_it_had(tmp_path):
    """A passage's split follows from its content: new files that sort before the old ones
    (every old passage moves to a later position) move no passage between splits, so the
    eval split never leaks into training as the corpus grows."""
    from .conftest import make_project, tiny_params

    root = make_project(tmp_path / "p")
    params = tiny_params(root).data
    before = data_version_from_source(params, root)
    for index, text in enumerate(before.texts("train")[:12]):  # new passages, written before the rest
        (root / "corpus" / f"0000-new-{index}.txt").write_text(f"A new note number {index}. " + text[::-1])
    after = data_version_from_corpus(params, root)  # what `kiln data add` versions
    assert after.md5 != before.md5
    for split in ("train", "eval", "calibration"):
        assert set(before.texts(split)) <= set(after.texts(split)), split


def test_the_split_of_passages_depends_on_nothing_but_their_text():
    from components.data import splits_from_passages

    passages = [f"passage number {i}: " + "words " * (i % 7) for i in range(300)]
    params = DataParams(split={"eval_fraction": 0.1, "calibration_fraction": 0.2})
    forward = splits_from_passages(passages, params)
    shuffled = splits_from_passages(passages[::-1][:150] + ["another passage"] * 3 + passages[::-1][150:], params)
    for name, rows in forward.items():
        assert set(rows) == set(shuffled[name]) - {"another passage"}, name
    assert 10 < len(forward["eval"]) < 50 and 35 < len(forward["calibration"]) < 90  # the fractions hold


def test_kiln_data_add_grows_the_default_corpus_of_python_docs(tmp_path):
    """The default params take added text files after the Python docs: the README's
    walk-through (`kiln data add notes/*.txt`) works without switching corpus first."""
    from components.data import add_to_corpus, source_digest

    source = CPythonDocsSource()
    assert source_digest(source, tmp_path) is None  # the docs alone: the data version of a fresh clone
    note = tmp_path / "note.txt"
    note.write_text("A note of my own about kiln, long enough to be a passage.")
    assert add_to_corpus([note], source, tmp_path) == [tmp_path / "corpus" / "note.txt"]
    assert source_digest(source, tmp_path) is not None  # a new data version
    with pytest.raises(DataError, match="data.source is 'cpython-docs' with none"):
        add_to_corpus([note], CPythonDocsSource(glob=None), tmp_path)


def test_a_glob_that_matches_nothing_is_a_data_error(project):
    params = DataParams(source=TextFilesSource(kind="text-files", glob="nowhere/*.txt"))
    with pytest.raises(DataError, match="matched no files"):
        data_version_from_source(params, project)


def test_a_folder_that_is_not_a_dvc_repository_is_named(tmp_path):
    with pytest.raises(DataError, match="not a DVC repository"):
        data_version_from_source(DataParams(), tmp_path)


def test_a_hugging_face_dataset_source_reads_a_local_dataset_folder(tmp_path):
    import datasets

    from components.config import HFDatasetSource

    folder = tmp_path / "hub-like"
    folder.mkdir()
    rows = [f"passage number {i} about the data model and its many methods" for i in range(5)]
    datasets.Dataset.from_dict({"body": rows}).to_parquet(str(folder / "train.parquet"))
    source = HFDatasetSource(kind="hf-dataset", name=str(folder), split="train", text_field="body")
    assert list(documents_from_source(source, tmp_path)) == rows


def test_a_missing_text_field_names_the_fields_there_are(tmp_path):
    import datasets

    from components.config import HFDatasetSource

    folder = tmp_path / "hub-like"
    folder.mkdir()
    datasets.Dataset.from_dict({"body": ["x"]}).to_parquet(str(folder / "train.parquet"))
    source = HFDatasetSource(kind="hf-dataset", name=str(folder), text_field="text")
    with pytest.raises(DataError, match=r"no field 'text'; fields: \['body'\]"):
        list(documents_from_source(source, tmp_path))


def test_a_lost_data_folder_and_cache_come_back_from_the_dvc_remote_not_from_the_source(tmp_path):
    """The corpus is gone too, so rebuilding from the source would fail: only a real pull
    from the remote can bring this data version back."""
    import shutil

    from .conftest import make_project, tiny_params

    root = make_project(tmp_path / "p")
    params = tiny_params(root).data
    first = data_version_from_source(params, root)
    train = first.texts("train")
    for gone in (root / "data", root / ".dvc" / "cache", root / "corpus"):
        shutil.rmtree(gone)

    again = data_version_from_source(params, root)
    assert again.md5 == first.md5
    assert again.texts("train") == train


def test_a_fresh_clone_is_told_plainly_that_its_data_is_built_from_the_source_and_matches_data_dvc(tmp_path, caplog):
    """A fresh clone has data.dvc but no cache and nothing in a remote yet: the expected path,
    said as such (not DVC's "Checkout failed for following targets:" and an empty list, as a
    warning), then whether the rebuilt version is the one data.dvc names."""
    import logging
    import shutil

    from .conftest import make_project, tiny_params

    root = make_project(tmp_path / "p")
    params = tiny_params(root).data
    first = data_version_from_source(params, root)
    for gone in (root / "data", root / ".dvc" / "cache", root / "dvc-remote"):
        shutil.rmtree(gone, ignore_errors=True)
    with caplog.at_level(logging.INFO, logger="components.data"):
        again = data_version_from_source(params, root)
    assert again.md5 == first.md5
    said = [r.getMessage() for r in caplog.records if r.name == "components.data"]
    assert any("neither the DVC cache nor the remote holds yet (as on a fresh clone)" in m and first.md5[:12] in m for m in said), said
    assert any(f"rebuilt data version {first.md5[:12]} from the source: the one data.dvc names" in m for m in said), said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "components.data"]
    assert not any("Checkout failed" in r.getMessage() for r in caplog.records)

    caplog.clear()  # data.dvc naming a version the source no longer makes: a warning naming both
    shutil.rmtree(root / "data")
    shutil.rmtree(root / ".dvc" / "cache")
    stale = "0" * 32 + ".dir"
    (root / "data.dvc").write_text((root / "data.dvc").read_text().replace(first.md5, stale))
    with caplog.at_level(logging.INFO, logger="components.data"):
        assert data_version_from_source(params, root).md5 == first.md5
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "components.data"]
    assert len(warned) == 1 and f"not {stale[:12]} as data.dvc named" in warned[0] and first.md5[:12] in warned[0]


def test_the_split_of_a_passage_is_the_same_in_every_process():
    """Python's hash() differs per process (PYTHONHASHSEED): the split must not use it."""
    import sys

    code = "from components.data import split_of; print([split_of(f'passage {i}', 0.1, 0.25) for i in range(200)])"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1
    splits = eval(outputs.pop())  # noqa: S307  (our own subprocess's list literal)
    assert {"train", "eval", "calibration"} == set(splits)


def test_the_data_stage_leaves_the_process_standard_streams_as_they_were(tmp_path):
    """`import dvc` swaps sys.stdout and sys.stderr for colorama wrappers. Whatever held one
    outlived the swap-back of its caller (pytest's capture, click's CliRunner,
    contextlib.redirect_stderr): absl's log handler, imported with the text gate's ROUGE,
    closed the wrapper, and the stream under it, at the next logging set-up (uvicorn's,
    Prefect's), so every later write there failed (a CI run lost a test worker to it). In a
    fresh interpreter, where DVC has not been imported yet."""
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from components.config import DataParams\n"
        "from components.data import data_version_from_source\n"
        "out, err = sys.stdout, sys.stderr\n"
        "try:\n"
        f"    data_version_from_source(DataParams(), Path({str(tmp_path)!r}))\n"
        "except Exception as failure:\n"
        "    print(type(failure).__name__)\n"
        "print(sys.stdout is out, sys.stderr is err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["DataError", "True", "True"]  # DVC was reached: the folder is no DVC repository


def test_a_machine_without_dvc_skips_the_tests_that_need_a_project_saying_why(tmp_path, monkeypatch):
    """The lent GPU machine's image has no dvc: its GPU tests that need a project skip there
    with the reason instead of erroring in fixture setup."""
    from . import conftest

    monkeypatch.setattr(conftest, "DVC", str(tmp_path / "no-dvc-here"))
    with pytest.raises(pytest.skip.Exception, match="dvc is not installed beside .*: the test needs a DVC project"):
        conftest.make_project(tmp_path / "p")
    assert not (tmp_path / "p").exists()
