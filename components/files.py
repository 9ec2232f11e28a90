"""Files of the stages: content hashes (the identities that caching, lineage and the
registry key on) and atomic output directories (a crash never leaves half a stage)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def directory_sha256(path: Path) -> str:
    """sha256 over every file's relative path and content, in sorted order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """A scratch directory beside `target` that becomes `target` only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.partial-") as scratch:
        staging = Path(scratch) / "out"
        staging.mkdir()
        yield staging
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


def stage_output(target: Path, complete_marker: str, build: Callable[[Path], None]) -> Path:
    """The stage output folder `target`, built unless it is already complete.

    Complete means `complete_marker`, the file the stage writes last, is there. `build`
    fills a scratch folder beside `target`, renamed into place only when `build` returns,
    so an interrupted stage never leaves half an output under the final name.
    """
    if not (target / complete_marker).is_file():
        with atomic_directory(target) as staging:
            build(staging)
    return target
