"""Graphs whose weights live beside them (`model.onnx.data`), as every graph past protobuf's
2 GB must: the tiny model saved so with the threshold lowered to 0 takes the same code paths
through export, precision, build, registry, loader and runtime as a 0.5B model does."""

import shutil

import numpy as np
import pytest

from components.config import ExportParams
from components.engine_dir import load_engine_dir
from components.errors import EngineError
from components.export import onnx_from_model
from components.onnx_files import data_file, has_external_data, onnx_files
from components.precision import precision_onnx
from components.runtime import open_engine
from components.runtime.sampling import Sampling
from registry import register_engine
from serving import loader

from .test_registry import record


@pytest.fixture(scope="module")
def exported_beside(tmp_path_factory, tiny_model, params):
    return onnx_from_model(tiny_model, params.export.model_copy(update={"external_data_above_mb": 0}), tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def engines_beside(tmp_path_factory, exported_beside, tiny_model, data_version, params):
    """fp32 and int8 (weight blocks) engines built from the graph with external weights."""
    from components.build import engine_from_onnx

    root = tmp_path_factory.mktemp("beside")
    built = {}
    for precision in ("fp32", "int8"):
        graph = precision_onnx(exported_beside, precision, None, params.precision, root / "precision")
        assert has_external_data(graph.onnx.path), f"{precision}: the precision stage wrote its weights into the graph"
        built[precision] = engine_from_onnx(graph, tiny_model, data_version, params.build, root / "engines", root)
    return built


def test_the_export_keeps_its_weights_beside_the_graph_and_its_identity_covers_them(exported_beside, exported):
    graph, weights = onnx_files(exported_beside.path)
    assert weights == data_file(graph) and weights.stat().st_size > graph.stat().st_size
    assert exported_beside.sha256 != exported.sha256 and exported_beside.is_intact()
    with weights.open("r+b") as handle:  # one weight byte changed: the cache must not reuse it
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 1]))
    try:
        assert not exported_beside.is_intact()
    finally:
        with weights.open("r+b") as handle:
            handle.write(first)


def test_an_engine_with_external_weights_generates_what_the_one_file_engine_does(engines_beside, engine_dir):
    beside = engines_beside["fp32"]
    assert beside.manifest.engine_data_file == "model.onnx.data" and engine_dir.manifest.engine_data_file is None
    prompts, sampling = [[3, 14, 15, 92, 65]], Sampling(max_new_tokens=12, temperature=0.0)
    ids = np.array(prompts, dtype=np.int64)
    with open_engine(beside) as external, open_engine(engine_dir) as inline:
        assert external.generate(prompts, sampling) == inline.generate(prompts, sampling)
        np.testing.assert_array_equal(external.score(ids, np.ones_like(ids)), inline.score(ids, np.ones_like(ids)))


def test_changed_external_weights_fail_the_engines_check_naming_both_files(engines_beside, tmp_path):
    copy = shutil.copytree(engines_beside["int8"].path, tmp_path / "engine")
    with (copy / "model.onnx.data").open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\0\0\0\0")
    with pytest.raises(EngineError, match=r"model\.onnx and .*model\.onnx\.data is corrupt"):
        load_engine_dir(copy)
    (copy / "model.onnx.data").unlink()
    with pytest.raises(EngineError, match=r"lacks model\.onnx\.data"):
        load_engine_dir(copy)


def test_an_engine_with_external_weights_is_registered_signed_and_pulled_verified(engines_beside, registry_target, tmp_path):
    engine = engines_beside["int8"]
    registration = register_engine(registry_target, engine.path, engine.sha256, record())
    pulled = loader.pull_version(registry_target, registration.version, tmp_path / "cache")
    assert pulled.engine_dir.sha256 == engine.sha256
    assert (pulled.engine_dir.path / "model.onnx.data").read_bytes() == (engine.path / "model.onnx.data").read_bytes()


def test_a_signed_pull_reads_the_engine_files_once_and_an_unsigned_one_hashes_them(engines_beside, registry_target, tmp_path, monkeypatch):
    from dataclasses import replace

    import components.engine_dir
    from registry.signing import SIGNATURE_FILE

    hashed = []
    real = components.engine_dir.files_sha256
    monkeypatch.setattr(components.engine_dir, "files_sha256", lambda paths: hashed.append([p.name for p in paths]) or real(paths))
    engine = engines_beside["fp32"]
    registration = register_engine(registry_target, engine.path, engine.sha256, record())
    pulled = loader.pull_version(registry_target, registration.version, tmp_path / "cache")
    assert hashed == []  # the signature's check read every byte; load_engine_dir did not read them again
    (pulled.engine_dir.path / SIGNATURE_FILE).unlink()  # a store from before signing, allowed while migrating
    migrating = replace(registry_target, signing=replace(registry_target.signing, required=False))
    loader.pull_version(migrating, registration.version, tmp_path / "cache")
    assert hashed == [["model.onnx", "model.onnx.data"]]  # no signature: the files are hashed against engine.json


def test_the_engine_stage_copies_weights_it_does_not_rewrite_from_disk_as_it_writes_them(exported_beside, tmp_path, monkeypatch, params):
    """A 1B int8 graph's engine stage peaked at 9.4 GiB loading every weight to rewrite a few
    nodes: the graph is rewritten without them, and when the engine is written every weight
    it did not pack side by side is still on disk, read as it is written."""
    import onnx_ir

    from components.build.onnxruntime import write_engine_file

    in_memory: list[int] = []
    save = onnx_ir.save

    def counting(model, *args, **kwargs):
        in_memory.append(sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None and not isinstance(v.const_value, onnx_ir.ExternalTensor)))
        return save(model, *args, **kwargs)

    monkeypatch.setattr(onnx_ir, "save", counting)
    graph = precision_onnx(exported_beside, "fp32", None, params.precision, tmp_path / "precision")  # nothing packed: every weight as exported
    write_engine_file(graph, tmp_path / "model.onnx")
    weights = data_file(exported_beside.path).stat().st_size
    assert len(in_memory) == 1 and in_memory[0] < weights / 20
    assert has_external_data(tmp_path / "model.onnx") and data_file(tmp_path / "model.onnx").stat().st_size >= weights * 0.9
