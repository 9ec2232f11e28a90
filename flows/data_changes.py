"""Data changes that start a rebuild: `kiln data add`, and data.dvc moved behind kiln's
back (a `git pull`, a `dvc checkout`), noticed by comparing data.dvc with the data version
of the last run.

Two small records under `.kiln/triggers/` make the comparison: the data version the last
run (of any kind: `kiln run`, a triggered rebuild) built from, and the last version
announced, so one change is announced once however it was noticed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from components.config import Params
from components.data import add_to_corpus, data_version_from_corpus, dvc_md5
from components.errors import DataError
from components.files import atomic_write_text, exclusive_lock
from components.workspace import Workspace
from flows.events import DATA_CHANGED, announce, data_resource

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataChange:
    md5: str
    previous: str | None
    how: str  # "kiln data add" | "data.dvc changed"

    def payload(self) -> dict[str, str | None]:
        return {"md5": self.md5, "previous": self.previous, "how": self.how}


def _record_path(root: Path, name: str) -> Path:
    return Workspace(root).state / "triggers" / f"{name}.json"


def _read_md5(root: Path, name: str) -> str | None:
    try:
        return json.loads(_record_path(root, name).read_text())["md5"]
    except (OSError, ValueError, KeyError):
        return None


def _write_md5(root: Path, name: str, md5: str) -> None:
    path = _record_path(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"md5": md5, "at": datetime.now(UTC).isoformat(timespec="seconds")}) + "\n")


def last_run_data(root: Path) -> str | None:
    """The data version the last run built from; None before any run."""
    return _read_md5(root, "last-run-data")


def record_run_data(root: Path, md5: str) -> None:
    _write_md5(root, "last-run-data", md5)


def announce_data_change(root: Path, params: Params, change: DataChange) -> str:
    """Emit the data-change event (raises EventNotDelivered when no server took it) and
    remember it, so the watcher does not announce the same version again."""
    event_id = announce(DATA_CHANGED, data_resource(params.registry.model_name), change.payload())
    _write_md5(root, "announced-data", change.md5)
    return event_id


def data_change_lock(root: Path) -> Path:
    return Workspace(root).state / "triggers" / "data-change.lock"


@contextmanager
def changing_data(root: Path) -> Iterator[None]:
    """Held by `kiln data add` from versioning the data to recording its announcement, and
    by the watcher while it compares: otherwise the watcher sees data.dvc move before the
    announcement is recorded and announces the same version again (two rebuilds for one
    change). Processes of the project take it in turn (an flock)."""
    with exclusive_lock(data_change_lock(root)):
        yield


def add_data(root: Path, params: Params, paths: list[Path]) -> tuple[list[Path], DataChange | None]:
    """`kiln data add`: copy the files into the corpus (data.source.glob), version the corpus with
    DVC (`dvc add`, and `dvc push` unless data.dvc_push is off); returns the files written
    and the change (None when the data version did not move)."""
    dvc_file = (root / params.data.path).with_suffix(".dvc")
    before = dvc_md5(dvc_file) if dvc_file.is_file() else None
    written = add_to_corpus(paths, params.data.source, root)
    after = data_version_from_corpus(params.data, root).md5
    return written, (DataChange(after, before, "kiln data add") if after != before else None)


def unseen_data_change(root: Path, params: Params) -> DataChange | None:
    """data.dvc names a version that is neither the last run's nor already announced."""
    dvc_file = (root / params.data.path).with_suffix(".dvc")
    last = last_run_data(root)
    if last is None or not dvc_file.is_file():
        return None  # no run to compare with: the first run is a person's or the schedule's
    try:
        current = dvc_md5(dvc_file)
    except DataError as err:
        _log.warning("%s", err)
        return None
    if current in (last, _read_md5(root, "announced-data")):
        return None
    return DataChange(current, last, "data.dvc changed")


class DataWatcher:
    """Compares data.dvc with the last run's data version every `interval_s` on a thread of
    its own, and hands each new version to `on_change` once."""

    def __init__(self, root: Path, params: Params, interval_s: float, on_change: Callable[[DataChange], None]) -> None:
        self.root, self.params, self.interval_s, self.on_change = root, params, interval_s, on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-data-watcher", daemon=True)

    def start(self) -> DataWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with changing_data(self.root):
                    if (change := unseen_data_change(self.root, self.params)) is not None:
                        self.on_change(change)
            except Exception:  # a failed check must not stop the watching; the next one retries
                _log.exception("checking %s.dvc failed", self.params.data.path)
