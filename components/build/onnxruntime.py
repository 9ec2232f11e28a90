"""Building for ONNX Runtime: the precision ONNX, rewritten for ONNX Runtime's kernels
(attention and a Llama's rotary fused: components.build.ort_attention, ort_rotary; linear
layers without 2-D views, those reading one tensor packed: ort_linear; RMSNorm as one node:
ort_norms), is the engine file, packaged as an engine directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from components.build.ort_attention import fuse_attention
from components.build.ort_linear import pack_shared_inputs, read_unflattened
from components.build.ort_norms import fuse_rms_norms
from components.build.packaging import BackendBuild, engine_folder, package_engine
from components.config import BuildParams, section_digest
from components.engine_dir import EngineDir, Lineage
from components.onnx_files import has_external_data, save_ir
from components.precision import PrecisionOnnx

if TYPE_CHECKING:
    import onnx

BACKEND = "onnxruntime"
ENGINE_FILE = "model.onnx"

log = logging.getLogger(__name__)


def ort_engine_from_onnx(
    graph: PrecisionOnnx, tokenizer_dir: Path, lineage: Lineage, params: BuildParams, out_root: Path
) -> EngineDir:
    """An ONNX Runtime engine directory: the precision ONNX, rewritten, is the engine file."""
    import onnxruntime as ort

    build = BackendBuild(BACKEND, ort.__version__, "cpu", ENGINE_FILE)
    target = engine_folder(out_root, build, graph.precision, section_digest(params.profiles)[:8], graph.onnx.sha256[:12])
    return package_engine(target, lambda path: write_engine_file(graph, path), build, graph, tokenizer_dir, lineage, params.profiles)


def write_engine_file(graph: PrecisionOnnx, path: Path) -> dict[str, bool]:
    """The engine file at `path`; whether its cache is appended in place (for the manifest).
    A graph whose attention does not match the export's pattern keeps the export's attention.
    The graph is rewritten without its external weights, which are copied to the engine's
    one at a time as it is written (a 1B int8 graph's stage peaked at 9.4 GiB loading them)."""
    import onnx
    import onnx_ir as ir
    from onnx_ir.external_data import set_base_dir

    layout, source = graph.onnx.layout, graph.onnx.path
    model = onnx.load(str(source), load_external_data=False)
    model, in_place = ort_engine_graph(model, layout.num_heads, layout.num_kv_heads, str(source.parent))
    if not in_place:
        log.warning("%s: attention not fused (its pattern differs from the export's); the cache grows by copies", source)
    engine = ir.from_proto(model)
    set_base_dir(engine.graph, source.parent)  # the weights still read from the precision graph's files
    save_ir(engine, path, external=has_external_data(source))
    return {"kv_in_place": in_place}


def ort_engine_graph(model: onnx.ModelProto, num_heads: int, kv_heads: int, base_dir: str = "") -> tuple[onnx.ModelProto, bool]:
    """A precision graph rewritten for ONNX Runtime's kernels; whether attention was fused.
    `base_dir`: where its external weights are, for a graph loaded without them."""
    fused = fuse_attention(model, num_heads, kv_heads, base_dir)
    read_unflattened(model, base_dir)
    pack_shared_inputs(model, base_dir)
    model, _ = fuse_rms_norms(model)
    return model, bool(fused)
