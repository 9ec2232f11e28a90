"""The server's Prometheus metrics (base units: `_seconds`, `_total`), in a registry of the
app's own so two apps in one process (tests, a swap) never collide in the global one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from registry.tags import GATES_PASSED, PRECISION
from serving.prefix_cache import PrefixCounts
from serving.scheduler import Turn
from serving.series import DECODED_ROWS, GENERATED_TOKENS, PROMPT_TOKENS, QUEUE_DEPTH, RUNNING_BATCH

# Request times on a 2-core CPU run from milliseconds (one token) to seconds (a long stream).
REQUEST_OUTCOMES = ("ok", "cancelled", "bad_request", "unauthorized", "rejected_busy", "error")
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds
        self.gpu = GpuCollector.if_present()
        if self.gpu is not None:
            self.registry.register(self.gpu)
        r = self.registry
        self.request_duration = Histogram(
            "kiln_request_duration_seconds", "Whole completion requests, arrival to last byte.", registry=r, buckets=_REQUEST_BUCKETS
        )
        self.time_to_first_token = Histogram(
            "kiln_time_to_first_token_seconds", "Arrival to the first generated token.", registry=r, buckets=_REQUEST_BUCKETS
        )
        self.time_per_output_token = Histogram(
            "kiln_time_per_output_token_seconds", "Mean gap between a request's tokens after the first.", registry=r, buckets=_TOKEN_BUCKETS
        )
        self.generated_tokens = Counter(*GENERATED_TOKENS, registry=r)
        self.prompt_tokens = Counter(*PROMPT_TOKENS, registry=r)
        self.requests = Counter("kiln_requests_total", "Completion requests by outcome.", ["outcome"], registry=r)
        # Each outcome's series from 0 at start: a rate or increase over a window needs two
        # samples, and a series born at its first request has none before it.
        for outcome in REQUEST_OUTCOMES:
            self.requests.labels(outcome)
        self.queue_depth = Gauge(*QUEUE_DEPTH, registry=r)
        self.running_batch = Gauge(*RUNNING_BATCH, registry=r)
        # Batching at work: decoded rows over decode steps is the mean batch a step served.
        self.decode_steps = Counter("kiln_decode_steps_total", "Decode steps run (one per turn with a running batch).", registry=r)
        self.decoded_rows = Counter(*DECODED_ROWS, registry=r)
        # Constrained decoding: mask seconds over masked tokens is the mask's time per token.
        self.constrained_requests = Counter(
            "kiln_constrained_requests_total", "Requests whose output a grammar constrains, by what it is.", ["kind"], registry=r
        )
        self.grammar_mask_seconds = Counter("kiln_grammar_mask_seconds_total", "Time the engine spent filling grammars' token masks.", registry=r)
        self.grammar_masked_tokens = Counter("kiln_grammar_masked_tokens_total", "Tokens picked under a grammar's mask.", registry=r)
        # The prefix cache, in the spellings of vLLM's: cached over queried tokens is its hit rate.
        self.prefix_queries = Counter("kiln_prefix_cache_queries_total", "Prompts looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("kiln_prefix_cache_hits_total", "Prompts that began with blocks the prefix cache held.", registry=r)
        self.prefix_queried_tokens = Counter("kiln_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cached_tokens = Counter(
            "kiln_prefix_cache_cached_tokens_total", "Prompt tokens whose KV the prefix cache gave (not prefilled).", registry=r
        )
        self.prefix_evictions = Counter("kiln_prefix_cache_evictions_total", "Blocks the prefix cache dropped for room.", registry=r)
        self.prefix_bytes = Gauge("kiln_prefix_cache_bytes", "Memory the prefix cache holds.", registry=r)
        self.prefix_blocks = Gauge("kiln_prefix_cache_blocks", "Blocks the prefix cache holds.", registry=r)
        self.engine_load = Histogram(
            "kiln_engine_load_seconds", "Pull, verify, load and warm-up of an engine.", registry=r, buckets=_REQUEST_BUCKETS
        )
        self.swaps = Counter("kiln_engine_swaps_total", "Alias changes acted on, by result.", ["result"], registry=r)
        self.webhooks = Counter("kiln_webhook_deliveries_total", "MLflow webhook deliveries by result.", ["result"], registry=r)
        self.served = Info("kiln_served_engine", "The registered version being served.", registry=r)
        self.ready = Gauge("kiln_ready", "1 while a warm engine serves requests.", registry=r)

    def watch_registry(self, versions: Callable[[], dict[str, tuple[dict[str, str], float]]]) -> None:
        """The registry's versions as `kiln_registry_*` (see RegistryCollector)."""
        self.registry.register(RegistryCollector(versions))

    def watch_engine_process(self, pid: Callable[[], int | None]) -> None:
        """The served engine's own process (serving.engine_process): its memory and CPU as
        `kiln_engine_process_*`, read from /proc at scrape time (nothing while none runs),
        and its GPU memory where there is a GPU."""
        ProcessCollector(namespace="kiln_engine", pid=lambda: pid() or "none", registry=self.registry)
        if self.gpu is not None:
            self.gpu.engine_pid = pid

    def observe_batch(self, turn: Turn) -> None:
        self.running_batch.set(turn.running)
        self.queue_depth.set(turn.waiting)
        if turn.decoded:
            self.decode_steps.inc()
            self.decoded_rows.inc(turn.decoded)
        if turn.masked_rows:
            self.grammar_mask_seconds.inc(turn.mask_seconds)
            self.grammar_masked_tokens.inc(turn.masked_rows)
        if turn.prefix is not None:
            self._observe_prefix(turn.prefix)

    def _observe_prefix(self, counts: PrefixCounts) -> None:
        self.prefix_queries.inc(counts.queries)
        self.prefix_hits.inc(counts.hits)
        self.prefix_queried_tokens.inc(counts.queried_tokens)
        self.prefix_cached_tokens.inc(counts.cached_tokens)
        self.prefix_evictions.inc(counts.evictions)
        self.prefix_bytes.set(counts.bytes)
        self.prefix_blocks.set(counts.blocks)


class GpuCollector(Collector):
    """Per GPU, through NVML (nvidia-ml-py) at scrape time: utilisation, memory used and
    total, and the memory the engine process itself holds there. Registered only where NVML
    starts (a machine with an NVIDIA driver): elsewhere the series are absent, not zero."""

    def __init__(self, nvml, engine_pid: Callable[[], int | None] = lambda: None) -> None:
        self._nvml = nvml
        self.engine_pid = engine_pid

    @classmethod
    def if_present(cls) -> GpuCollector | None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver library, no device, no permission: no GPU to report
            return None
        return cls(pynvml)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("kiln_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample period.", labels=["gpu"]),
            GaugeMetricFamily("kiln_gpu_memory_used_bytes", "GPU memory in use, every process.", labels=["gpu"]),
            GaugeMetricFamily("kiln_gpu_memory_total_bytes", "GPU memory.", labels=["gpu"]),
            GaugeMetricFamily("kiln_gpu_engine_process_memory_used_bytes", "GPU memory the engine process holds.", labels=["gpu"]),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The families without samples (the registry's name check; the metrics reference)."""
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nvml, pid = self._nvml, self.engine_pid()
        utilisation, used, total, engine = self._families()
        for index in range(nvml.nvmlDeviceGetCount()):
            gpu, handle = str(index), nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            used.add_metric([gpu], memory.used)
            total.add_metric([gpu], memory.total)
            try:
                utilisation.add_metric([gpu], nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            except nvml.NVMLError:  # not supported (a MIG slice): that series stays absent
                pass
            held = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if pid and p.pid == pid and p.usedGpuMemory is not None]
            if held:
                engine.add_metric([gpu], sum(held))
        yield from (utilisation, used, total, engine)


class RegistryCollector(Collector):
    """The pipeline as the registry records it, for the dashboard's pipeline row: versions
    by precision and gate result (a rebuild adds one) and when the last was registered.
    Read at scrape time, at most once per `min_interval_s`; a registry that cannot be read
    leaves the series out for that scrape (and says so in the log)."""

    def __init__(self, versions: Callable[[], dict[str, tuple[dict[str, str], float]]], min_interval_s: float = 10.0) -> None:
        self._versions = versions
        self._min_interval_s = min_interval_s
        self._last: tuple[float, dict[str, tuple[dict[str, str], float]]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        versions = self._read()
        if versions is None:
            return
        counted = GaugeMetricFamily("kiln_registry_versions", "Registered engine versions of the served model.", labels=["precision", "gates_passed"])
        groups: dict[tuple[str, str], int] = {}
        for tags, _ in versions.values():
            key = (tags.get(PRECISION, "unknown"), tags.get(GATES_PASSED, "false"))
            groups[key] = groups.get(key, 0) + 1
        for key, count in sorted(groups.items()):
            counted.add_metric(list(key), count)
        yield counted
        if versions:
            last = GaugeMetricFamily("kiln_registry_last_registered_timestamp_seconds", "When the newest version was registered.")
            last.add_metric([], max(created for _, created in versions.values()))
            yield last

    def _read(self) -> dict[str, tuple[dict[str, str], float]] | None:
        now = time.monotonic()
        if self._last is None or now - self._last[0] >= self._min_interval_s:
            try:
                self._last = (now, self._versions())
            except Exception as err:  # a scrape must answer whatever the registry does
                logging.getLogger(__name__).warning("registry metrics left out: %s", err)
                return None
        return self._last[1]
