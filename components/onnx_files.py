"""An ONNX graph on disk: one file, or the graph and its weights in `<name>.data` beside it.

protobuf caps one serialized message at 2 GB, so a graph whose weights pass that (a 0.5B
model in fp32) keeps them as external data; a graph made from one with external data keeps
its own there too, so one setting (`export.external_data_above_mb`) decides for a model's
every stage. The identity of a graph covers every file it is made of.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from components.files import file_sha256, text_sha256

if TYPE_CHECKING:
    import onnx
    import onnx_ir

DATA_SUFFIX = ".data"  # where torch's exporter puts a big graph's weights too: model.onnx.data
PROTOBUF_LIMIT_MB = 2047  # 2 GiB - 1 byte, in MiB rounded down: what one ONNX file may hold
_MIB = 1 << 20


def data_file(path: Path) -> Path:
    return path.with_name(path.name + DATA_SUFFIX)


def has_external_data(path: Path) -> bool:
    return data_file(path).is_file()


def onnx_files(path: Path) -> list[Path]:
    """The files a graph is made of: the graph, then its weights where they are external."""
    return [path, data_file(path)] if has_external_data(path) else [path]


def files_sha256(paths: list[Path]) -> str:
    """One file: its sha256. Several: the sha256 of their `sha256sum` listing (each file's
    sha256 and name, in order), so every byte of every file is covered."""
    if len(paths) == 1:
        return file_sha256(paths[0])
    return text_sha256("".join(f"{file_sha256(p)}  {p.name}\n" for p in paths))


def onnx_sha256(path: Path) -> str:
    return files_sha256(onnx_files(path))


def save_onnx(model: onnx.ModelProto, path: Path, external: bool = False, external_above_mb: int = PROTOBUF_LIMIT_MB) -> None:
    """Write `model` at `path`, its weights in `<name>.data` when `external` or when they pass
    `external_above_mb` (protobuf's limit by default)."""
    import onnx

    if external or model.ByteSize() > external_above_mb * _MIB:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_file(path).name, size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def save_ir(model: onnx_ir.Model, path: Path, external: bool = False, external_above_mb: int = PROTOBUF_LIMIT_MB) -> None:
    """`save_onnx` for an onnx_ir model, whose tensors may be read from disk or computed as
    they are written (components.weight_blocks): each one is in memory while it is written."""
    import onnx_ir

    weights = sum(value.const_value.nbytes for value in model.graph.initializers.values() if value.const_value is not None)
    if external or weights > external_above_mb * _MIB:
        written: list = []
        onnx_ir.save(model, str(path), external_data=data_file(path).name, size_threshold_bytes=1024, callback=lambda tensor, _: _release(written, tensor))
        _release(written, None)
    else:
        onnx_ir.save(model, str(path))


def _release(written: list, upcoming: onnx_ir.TensorProtocol | None) -> None:
    """The tensor written before `upcoming` unmapped (the writer calls back before each write):
    a source's external data read through mmap stays resident until released."""
    while written:
        release = getattr(written.pop(), "release", None)
        if release is not None:
            release()
    if upcoming is not None:
        written.append(upcoming)
