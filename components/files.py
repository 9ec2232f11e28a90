"""Files of the stages: content hashes (the identities that caching, lineage and the
registry key on) and atomic output directories (a crash never leaves half a stage)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_CHUNK = 1 << 20
_PARTIAL = ".partial-"


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


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so that a reader sees the old content or the new, never half."""
    partial = path.with_name(f".{path.name}{_PARTIAL}{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """A scratch directory beside `target` that becomes `target` only if the block succeeds.

    The scratch folder's name carries this process's id, so a later process can tell the
    leftovers of a killed one (`remove_abandoned_scratch`) from a build still running.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}{_PARTIAL}{os.getpid()}-"
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=prefix) as scratch:
        staging = Path(scratch) / "out"
        staging.mkdir()
        yield staging
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


def remove_abandoned_scratch(directory: Path) -> list[Path]:
    """Delete the scratch folders in `directory` whose process is gone (killed mid-stage);
    returns what was removed."""
    removed = []
    for scratch in directory.glob(f".*{_PARTIAL}*"):
        owner = scratch.name.rpartition(_PARTIAL)[2].partition("-")[0]
        if owner.isdigit() and not process_alive(int(owner)):
            shutil.rmtree(scratch, ignore_errors=True)
            removed.append(scratch)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (a recycled id reads as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def stage_output(target: Path, complete_marker: str, build: Callable[[Path], None]) -> Path:
    """The stage output folder `target`, built unless it is already complete.

    Complete means `complete_marker`, the file the stage writes last, is there. `build`
    fills a scratch folder beside `target`, renamed into place only when `build` returns,
    so an interrupted stage never leaves half an output under the final name; the scratch
    left by a killed process is removed here, the next time the stage runs.
    """
    if target.parent.is_dir():
        remove_abandoned_scratch(target.parent)
    if not (target / complete_marker).is_file():
        with atomic_directory(target) as staging:
            build(staging)
    return target


@contextmanager
def exclusive_lock(lock_file: Path) -> Iterator[None]:
    """An advisory lock on `lock_file` across every process of this machine; re-entrant
    within a process (flock on a second descriptor of the same file would wait for itself)."""
    if lock_file in _held_locks:
        _held_locks[lock_file] += 1
        try:
            yield
        finally:
            _held_locks[lock_file] -= 1
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _held_locks[lock_file] = 1
        try:
            yield
        finally:
            del _held_locks[lock_file]
            fcntl.flock(handle, fcntl.LOCK_UN)


_held_locks: dict[Path, int] = {}
