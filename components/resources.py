"""This machine's memory and what a stage takes of it: the budget a model is fitted to, and
each stage's peak, measured, so that sizes are planned from numbers rather than guessed."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30


def machine_memory() -> int:
    """Physical memory, or the cgroup's limit where a container sets a lower one."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    text = limit.read_text().strip() if limit.is_file() else "max"
    return min(physical, int(text)) if text.isdigit() else physical


@dataclass
class Usage:
    """What one stage took: wall time and this process's peak resident memory while it ran."""

    seconds: float = 0.0
    peak_bytes: int = 0
    since_start: bool = False  # the peak is the process's since it started (no per-stage reset here)
    start_bytes: int = 0  # resident when the stage began: what earlier stages left, part of the peak

    def text(self) -> str:
        held = f" ({self.start_bytes / GIB:.1f} GiB held when it began)" if self.start_bytes >= GIB else ""
        peak = f"peak memory {self.peak_bytes / GIB:.1f} GiB" + (" (of the process so far)" if self.since_start else held)
        minutes, seconds = divmod(round(self.seconds), 60)
        return f"{f'{minutes} min ' if minutes else ''}{seconds} s, {peak}"


@contextmanager
def measured() -> Iterator[Usage]:
    """Time the block and the process's peak resident memory within it: Linux resets the
    peak (VmHWM) on writing 5 to /proc/self/clear_refs; elsewhere the process's lifetime peak
    is all there is, and the usage says so."""
    usage = Usage(since_start=not _reset_peak(), start_bytes=_status_bytes("VmRSS:"))
    start = time.perf_counter()
    try:
        yield usage
    finally:
        usage.seconds = time.perf_counter() - start
        usage.peak_bytes = _peak_bytes()


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    return _status_bytes("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _status_bytes(key: str) -> int:
    """A size from /proc/self/status (Linux); 0 elsewhere."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(key)), 0)


def release_freed_memory() -> None:
    """Hand the memory a finished stage freed back to the OS (glibc's malloc_trim; elsewhere
    nothing). glibc keeps freed blocks below its mmap threshold in the heap: after a 1B
    model's export stage, 1.0 of the 1.5 GiB the process still held was such, and the next
    stages of the same flow started above it."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
