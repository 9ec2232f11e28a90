"""Prefect cache keys come from content and stage versions, never from names."""

import re
from pathlib import Path

import pytest

from components.config import ExportParams
from components.model_dir import TrainedModel
from flows.caching import content_key, stage_version

GOLDEN_EXPORT_KEY = "822d4ae737b1ccdfe0cfa3ff21b15e684206e747d6198303d5de9cc33619311d"  # export.parity_layers joined ExportParams: the export runs once again


def model(sha256: str, where: str = "/models/a") -> TrainedModel:
    return TrainedModel(path=Path(where), sha256=sha256)


def test_the_same_content_under_another_name_hits_and_other_content_under_the_same_name_misses():
    params = ExportParams()
    key = content_key("export-onnx", "1", {"model": model("aa"), "params": params})
    assert content_key("export-onnx", "1", {"model": model("aa", "/elsewhere"), "params": params}) == key
    assert content_key("export-onnx", "1", {"model": model("bb"), "params": params}) != key


def test_settings_count_by_value_and_output_locations_by_where_they_point(tmp_path):
    base = {"params": ExportParams(), "out": tmp_path / "onnx"}
    key = content_key("export-onnx", "1", base)
    assert content_key("export-onnx", "1", base | {"params": ExportParams(opset=18)}) == key  # the default, spelled out
    assert content_key("export-onnx", "1", base | {"params": ExportParams(opset=19)}) != key
    assert content_key("export-onnx", "1", base | {"out": tmp_path / "other"}) != key
    assert content_key("export-onnx", "1", base | {"out": tmp_path / "x" / ".." / "onnx"}) == key


def test_a_stage_version_bump_or_another_task_misses():
    key = content_key("train-model", "1", {"steps": 3, "names": ["a", "b"], "seed": None, "lr": 0.5, "fresh": True})
    assert content_key("train-model", "2", {"steps": 3, "names": ["a", "b"], "seed": None, "lr": 0.5, "fresh": True}) != key
    assert content_key("export-onnx", "1", {"steps": 3, "names": ["a", "b"], "seed": None, "lr": 0.5, "fresh": True}) != key
    assert content_key("train-model", "1", {"steps": 3, "names": ["a", "c"], "seed": None, "lr": 0.5, "fresh": True}) != key


def test_each_precision_the_fp32_export_stands_in_for_is_its_own_engine_stage():
    """The fp32 export stands in for the graph of several precisions (fp32's, and those no
    graph stage makes): keyed on that graph alone, a bf16 and an fp8 engine stage were one
    (`kiln build` once built bf16 and registered it as both)."""
    from components.export import ExportedOnnx
    from components.precision import model_stand_in

    export = ExportedOnnx(path=Path("/onnx/model.onnx"), sha256="ab" * 32, opset=18, layout=None, parity=None)
    keys = {p: content_key("build-engine", "1", {"graph": model_stand_in(export, p)}) for p in ("fp32", "fp16", "bf16", "fp8", "int4")}
    assert len(set(keys.values())) == len(keys)
    assert content_key("build-engine", "1", {"graph": model_stand_in(export, "bf16")}) == keys["bf16"]


def test_a_value_without_content_identity_is_refused_not_hashed_by_accident():
    with pytest.raises(TypeError, match="cannot derive a content cache key from object"):
        content_key("t", "1", {"thing": object()})


def test_every_cached_stage_declares_its_version_and_one_without_is_refused():
    from components.build import engine_from_onnx
    from components.calibrate import calibration_set_from_pool
    from components.export import onnx_from_model
    from components.gates import gated_engine
    from components.precision import precision_onnx
    from components.train import model_from_data

    stages = (model_from_data, onnx_from_model, calibration_set_from_pool, precision_onnx, engine_from_onnx, gated_engine)
    assert all(stage_version(stage).isdigit() for stage in stages)
    with pytest.raises(TypeError, match="declares no STAGE_VERSION"):
        stage_version(test_a_stage_version_bump_or_another_task_misses)


def test_cache_keys_are_stable_across_releases_unless_a_stage_version_changes():
    # A change of key format silently re-runs every stage of every project (training too):
    # this pins it. Change the literal only together with a deliberate re-run.
    key = content_key("export-onnx", "1", {"model": model("aa"), "params": ExportParams(), "out": Path("/p/onnx"), "n": [1, "x", None]})
    assert key == GOLDEN_EXPORT_KEY


def test_a_sections_key_ignores_the_order_its_mappings_were_written_in():
    from components.config import QualityGateParams, QualityLimits

    fp32, int8 = QualityLimits(min_top1_agreement=0.99, max_ppl_increase_pct=1.0), QualityLimits(min_top1_agreement=0.97, max_ppl_increase_pct=2.0)
    written = content_key("gate-engine", "1", {"params": QualityGateParams(limits={"fp32": fp32, "int8": int8})})
    reordered = content_key("gate-engine", "1", {"params": QualityGateParams(limits={"int8": int8, "fp32": fp32})})
    assert written == reordered


def test_a_section_holding_paths_and_dates_has_a_key_from_its_json_form(tmp_path):
    """Any pydantic section hashes by its JSON form, so a field that JSON cannot hold as such
    (a path, a date) still gives a key, and equal values give equal keys."""
    from datetime import date

    from pydantic import BaseModel

    class Section(BaseModel):
        where: Path
        since: date

    key = content_key("stage", "1", {"params": Section(where=tmp_path, since=date(2026, 12, 1))})
    assert key == content_key("stage", "1", {"params": Section(where=str(tmp_path), since="2026-12-01")})
    assert key != content_key("stage", "1", {"params": Section(where=tmp_path / "x", since=date(2026, 12, 1))})


def test_a_stages_peak_memory_is_its_own_not_the_stage_befores():
    import numpy as np

    from components.resources import measured

    with measured() as big:
        block = np.ones(256 << 20, np.uint8)  # 256 MiB, every page written
        del block
    with measured() as small:
        pass
    if small.since_start:
        pytest.skip("this kernel keeps no resettable peak (/proc/self/clear_refs)")
    assert big.peak_bytes - small.peak_bytes >= 200 << 20
    assert re.match(r"\d+ s, peak memory \d+\.\d GiB", big.text()), big.text()  # 256 MiB written in 0.76 s on a busy 2-core machine
    held = np.ones(1100 << 20, np.uint8)  # what an earlier stage of the same process kept
    with measured() as later:
        pass
    assert later.start_bytes >= held.nbytes and "GiB held when it began" in later.text()


def test_memory_a_stage_freed_goes_back_to_the_system_before_the_next_one():
    """glibc keeps small freed blocks in the heap; a flow's later stages started gigabytes
    above what was still in use. Many blocks under glibc's mmap threshold, freed, then
    released: the resident size falls back."""
    import ctypes.util

    from components.resources import _status_bytes, release_freed_memory

    if ctypes.util.find_library("c") is None or _status_bytes("RssAnon:") == 0:
        pytest.skip("not glibc on Linux: nothing to release, nothing to read")
    before = _status_bytes("RssAnon:")
    blocks = [bytearray(64 << 10) for _ in range(8192)]  # 512 MiB in 64 KiB blocks: heap, not mmap
    kept = bytearray(64 << 10)  # allocated last, still in use: glibc cannot trim the heap's top itself
    del blocks
    held = _status_bytes("RssAnon:")
    release_freed_memory()
    assert held - before > 400 << 20 and _status_bytes("RssAnon:") - before < 100 << 20 and len(kept)
