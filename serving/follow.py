"""Following an alias: what is served is what `models:/<name>@<alias>` names, verified.

A moved alias is pulled and verified, then loaded and warmed in an engine process of its
own (serving.engine_process), off the request path (in the caller's thread: the poller's
or the webhook's); it is swapped in with one assignment; the old engine process stops
taking requests, finishes those it holds and only then exits. A version the loader
refuses is never served: the old one keeps serving, and the refusal is logged and
counted. An engine process that dies is started again on the same version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components.engine_dir import EngineManifest
from components.errors import KilnError, RegistryError, VersionRefused
from components.runtime.grammar import built_in_background
from components.runtime.tokenizer import EngineTokenizer
from registry import VersionInfo, tags
from serving.chat import ChatTemplate, ChatTemplateError, chat_template_for
from serving.engine_client import EngineClient
from serving.engine_process import EngineProcess, RuntimeOptions
from serving.loader import PulledVersion
from serving.scheduler import Limits, Turn, ignore_turn
from serving.structured import GrammarContext
from serving.tools import FORMATS, ToolFormat, format_of_template
from serving.sources import EngineSource

log = logging.getLogger("kiln.serving")


UNSIGNED = "unsigned"  # kiln_served_engine_info's signing_key for a version served without a signature


class NothingToServe(KilnError):
    """The alias names no version, or only one the loader refuses."""


def kv_memory_text(manifest: EngineManifest, max_batch: int | None, prefix_cache_bytes: int = 0) -> str:
    """What the KV cache of the running batch can take at most, and the prompts a prefix
    cache's budget holds: a service's memory plan."""
    limits = Limits.of(manifest, max_batch)
    most = manifest.kv_bytes_per_token * limits.max_batch * limits.max_total
    sequences = f"{limits.max_batch} sequence{'' if limits.max_batch == 1 else 's'}"
    text = f"KV cache: {manifest.kv_bytes_per_token / 1024:.1f} KiB a token a sequence; {sequences} × {limits.max_total} tokens take {_size(most)} at most"
    if prefix_cache_bytes:
        text += f"; the prefix cache's {_size(prefix_cache_bytes)} hold {prefix_cache_bytes // manifest.kv_bytes_per_token:,} prompt tokens"
    return text


def _size(count: int) -> str:
    return f"{count / (1 << 30):.2f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class ChatDefaults:
    """For versions whose own files say nothing: serving.chat_template (a file) and
    serving.tool_format (the call format of a template that writes no known markers)."""

    template: Path | None = None
    tool_format: str | None = None


@dataclass
class ServedEngine:
    pulled: PulledVersion
    scheduler: EngineClient  # the seam: nothing past start_engine knows the engine runs in a process
    tokenizer: EngineTokenizer
    load_seconds: float
    created: int  # Unix seconds, for OpenAI's `created`
    chat_template: ChatTemplate | None = None  # the version's own, else serving.chat_template's
    tool_format: ToolFormat | None = None  # what its template teaches, else serving.tool_format's
    grammar: GrammarContext | None = None  # what requests' grammars are checked against

    @property
    def model(self) -> str:
        return self.pulled.info.name

    @property
    def version(self) -> str:
        return self.pulled.info.version

    @property
    def facts(self) -> dict[str, str]:
        """What the registry and engine.json say this engine is, under the registry's tag names."""
        manifest = self.pulled.engine_dir.manifest
        return {
            "model": self.model,
            "version": self.version,
            tags.PRECISION: manifest.precision,
            tags.BACKEND: manifest.backend,
            tags.ENGINE_SHA256: self.pulled.engine_dir.sha256,
            tags.SIGNING_KEY: self.pulled.signed_by or UNSIGNED,
        }


def start_engine(
    pulled: PulledVersion, options: RuntimeOptions, observe: Callable[[Turn], None], on_lost: Callable[[], None], chat: ChatDefaults = ChatDefaults()
) -> ServedEngine:
    """Load a pulled version in an engine process, through the runtime the gates used, and
    warm it; VersionRefused when it cannot serve (its chat template does not compile, too)."""
    started = time.perf_counter()
    try:
        template = chat_template_for(pulled.engine_dir.path, chat.template)
    except ChatTemplateError as err:
        raise VersionRefused(f"{pulled.label} is refused: {err}") from None
    process = EngineProcess(pulled, options, observe=observe, on_lost=on_lost)
    manifest = pulled.engine_dir.manifest
    tool_format = (format_of_template(template.source) if template else None) or (FORMATS[chat.tool_format] if chat.tool_format else None)
    grammar = GrammarContext(pulled.engine_dir.path, manifest.vocab_size, tuple(sorted(manifest.stop_ids)))
    built_in_background(lambda: grammar.tokenizer)  # requests check their grammars with it on the event loop
    return ServedEngine(pulled, process, EngineTokenizer(pulled.engine_dir.path), time.perf_counter() - started, int(time.time()), template, tool_format, grammar)



class AliasFollower:
    """Holds the served engine and moves it when the alias moves. `follow` is blocking and
    safe to call from several threads (one swap at a time)."""

    def __init__(
        self, source: EngineSource, options: RuntimeOptions, on_event: Callable[[str, ServedEngine | None, float], None], chat: ChatDefaults = ChatDefaults()
    ) -> None:
        self.source, self.options = source, options
        self.chat = chat  # for versions without a template (or tool format) of their own
        self.current: ServedEngine | None = None
        self._on_event = on_event  # (result, served, seconds): the app's metrics
        self._observe: Callable[[Turn], None] = ignore_turn
        self._lock = threading.Lock()
        self._refused: set[str] = set()
        self._closed = False  # after `close`, nothing is loaded again

    def observe_batches(self, observe: Callable[[Turn], None]) -> None:
        self._observe = observe

    def follow(self, retry_refused: bool = False) -> str:
        """Serve what the alias names now. Returns what happened: `swapped`, `unchanged`,
        `refused` (the alias names a version the loader refuses) or `unresolved` (the alias
        is gone or the registry unreachable); with nothing served yet, raises NothingToServe."""
        with self._lock:
            if self._closed:
                return "unchanged"
            try:
                info = self.source.resolve()
            except RegistryError as err:
                return self._unresolved(err)
            serving = self.current is not None and self.current.scheduler.alive  # a dead engine process is loaded again
            if serving and info.version == self.current.version:
                return "unchanged"
            if serving and info.version in self._refused and not retry_refused:
                return "unchanged"
            return self._swap_to(info)

    def _swap_to(self, info: VersionInfo) -> str:
        try:
            started = time.perf_counter()
            new = start_engine(self.source.pull(info), self.options, self._observe, on_lost=self._reload, chat=self.chat)
        except Exception as err:  # VersionRefused, the registry failing mid-pull, or a runtime's own error: never served
            self._refused.add(info.version)
            self._on_event("refused", self.current, time.perf_counter() - started)
            if self.current is None:
                raise NothingToServe(f"{self.source.describe()} names version {info.version}, which cannot be served: {err}") from err
            log.error("keeping version %s: %s", self.current.version, err)
            return "refused"
        old, self.current = self.current, new
        self._refused.discard(info.version)
        self._on_event("swapped", new, new.load_seconds)
        was = f", swapped in for version {old.version}" if old is not None else ""
        log.info("serving %s version %s (%s %s), loaded in %.2f s%s", new.model, new.version, new.facts[tags.BACKEND], new.facts[tags.PRECISION], new.load_seconds, was)
        log.info("%s", kv_memory_text(new.pulled.engine_dir.manifest, self.options.max_batch, self.options.prefix_cache_bytes))
        if new.pulled.signed_by is None and self.source.alias is not None:  # from the registry (not a local directory), unsigned
            log.warning("version %s is UNSIGNED: served only because registry.require_signature is false (`kiln keys sign-existing` signs it)", new.version)
        if old is not None:
            threading.Thread(target=self._retire, args=(old,), name="kiln-retire", daemon=True).start()
        return "swapped"

    def _reload(self) -> None:
        """The engine process died: load the alias's version again, off the reader's thread."""
        threading.Thread(target=self.follow, kwargs={"retry_refused": True}, name="kiln-reload", daemon=True).start()

    def _retire(self, old: ServedEngine) -> None:
        old.scheduler.close()  # finishes the requests it holds, then frees the engine
        self.source.forget({self.current.version} if self.current else set())

    def _unresolved(self, err: RegistryError) -> str:
        if self.current is None:
            raise NothingToServe(
                f"{self.source.describe()} names no version yet ({err}). Promote one: `kiln promote` "
                f"(challenger → {self.source.alias}), or set the alias on a version in the MLflow UI."
                if self.source.alias
                else str(err)
            ) from err
        log.warning("%s does not resolve; keeping version %s: %s", self.source.describe(), self.current.version, err)
        return "unresolved"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self.current is not None:
                self.current.scheduler.close()
                self.current = None
