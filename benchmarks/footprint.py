"""What `kiln bench` builds and serves costs: each stage's time and peak memory (export,
precision, engine), kept beside the cached outputs so a rerun that reuses them still prints
what building them took, and the engine process as `kiln serve` runs it (load, warm-up, the
bench's generation), measured afresh in its own process every run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from components.resources import Usage, measured


@dataclass(frozen=True)
class StageCost:
    stage: str
    seconds: float
    peak_bytes: int

    @classmethod
    def of(cls, stage: str, usage: Usage) -> StageCost:
        return cls(stage, usage.seconds, usage.peak_bytes)


class CostLog:
    """Stage costs by the output directory they made, in `path` (JSON): recorded only when
    the stage made a new directory, so a cache hit's seconds never pass for a build's; and
    each engine's chain of stages, to print them with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        saved = json.loads(path.read_text()) if path.is_file() else {}
        self._costs: dict[str, dict] = saved.get("costs", {})
        self._chains: dict[str, list[str]] = saved.get("chains", {})

    @contextmanager
    def building(self, stage: str, out_root: Path) -> Iterator[Callable[[Usage], None]]:
        """Yields `record(usage)`; the usage is kept under each directory `out_root` gained."""
        before = self._entries(out_root)
        usages: list[Usage] = []
        yield usages.append
        for made in self._entries(out_root) - before:
            self._costs[made] = asdict(StageCost.of(stage, usages[-1]))
        self._save()

    @contextmanager
    def measure(self, stage: str, out_root: Path) -> Iterator[Usage]:
        """`building` for a stage run in this process: times it and records it."""
        with self.building(stage, out_root) as record:
            with measured() as usage:
                yield usage
            record(usage)

    def chain(self, engine: Path, outputs: list[Path]) -> None:
        """The stages' outputs that `engine` was built through, in order (itself last)."""
        self._chains[self._key(engine)] = [self._key(_folder(o)) for o in [*outputs, engine]]
        self._save()

    def costs_of(self, engine: Path) -> list[StageCost]:
        """What each stage behind `engine` cost, where it was measured when built (an earlier
        kiln built without measuring)."""
        keys = dict.fromkeys(self._chains.get(self._key(engine), [self._key(engine)]))  # fp32's graph is the export
        return [StageCost(**self._costs[key]) for key in keys if key in self._costs]

    def _save(self) -> None:
        self.path.write_text(json.dumps({"costs": self._costs, "chains": self._chains}, indent=2) + "\n")


    def _key(self, output: Path) -> str:
        """Relative to the log, so that the bench's folder can move."""
        return os.path.relpath(output, self.path.parent)

    def _entries(self, folder: Path) -> set[str]:
        return {self._key(p) for p in folder.iterdir()} if folder.is_dir() else set()


def _folder(output: Path) -> Path:
    return output if output.is_dir() else output.parent


def serving_cost(engine_path: Path, prompt: list[int], new_tokens: int, threads: int | None = None) -> StageCost:
    """The engine process as `kiln serve` runs it, in a fresh process: keep freed memory,
    load, warm up and prepare to serve (`serving.loader.load_warm`'s steps), then the bench's
    generation; its peak resident memory over all of it."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(_serve_once, engine_path, prompt, new_tokens, threads).result()


def _serve_once(engine_path: Path, prompt: list[int], new_tokens: int, threads: int | None) -> StageCost:
    from components.runtime import load_engine
    from components.runtime.onnxruntime import keep_freed_memory
    from components.runtime.sampling import Sampling

    keep_freed_memory()
    with measured() as usage:
        engine = load_engine(engine_path, threads=threads)
        engine.generate([[engine.manifest.eos_token_id]], Sampling(max_new_tokens=2, stop_at_eos=False))
        engine.prepare_to_serve()
        engine.generate([prompt], Sampling(max_new_tokens=new_tokens, stop_at_eos=False))
        engine.close()
    return StageCost.of("serve", usage)
