"""A replica's Prometheus metrics under vLLM's names (kvlab.telemetry.names), one registry each.

Labels as vLLM v1: `model_name` and `engine` (the engine core index, "0"). Histogram buckets are
vLLM's, with a few finer low buckets added in front (a time-scaled simulator is fast), so
dashboards written for vLLM read them unchanged. Gauges are computed at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvlab.telemetry import names

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("length", "stop", "abort")
_M = TypeVar("_M", bound=MetricWrapperBase)

if TYPE_CHECKING:
    from kvlab.engine.sim.blockpool import BlockPool


class ReplicaMetrics:
    """The metrics of one replica. `bind` connects the scrape-time gauges to the engine state."""

    def __init__(self, model: str, block_size: int, num_blocks: int, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ("model_name", "engine")
        values = (model, engine)
        self._model = model
        reg = self.registry

        def child(metric: _M) -> _M:
            return metric.labels(*values)

        self._running = child(Gauge(names.VLLM_NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.",
                                    labels, registry=reg))
        self._waiting = child(Gauge(names.VLLM_NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.",
                                    labels, registry=reg))
        self._usage = child(Gauge(names.VLLM_KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.",
                                  labels, registry=reg))
        info = Gauge(names.VLLM_CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                     ("block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"), registry=reg)
        info.labels(str(block_size), str(num_blocks), "True", engine).set(1)
        self.prefix_queries = child(Counter(
            names.VLLM_PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
            labels, registry=reg))
        self.prefix_hits = child(Counter(
            names.VLLM_PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
            labels, registry=reg))
        self.external_queries = child(Counter(
            names.VLLM_EXTERNAL_PREFIX_CACHE_QUERIES,
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.", labels, registry=reg))
        self.external_hits = child(Counter(
            names.VLLM_EXTERNAL_PREFIX_CACHE_HITS,
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.", labels, registry=reg))
        self.preemptions = child(Counter(
            names.VLLM_NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.", labels, registry=reg))
        self.prompt_tokens = child(Counter(
            names.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.", labels, registry=reg))
        self.generation_tokens = child(Counter(
            names.VLLM_GENERATION_TOKENS, "Number of generation tokens processed.", labels, registry=reg))
        success = Counter(names.VLLM_REQUEST_SUCCESS, "Count of successfully processed requests.",
                          (*labels, "finished_reason"), registry=reg)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = child(Histogram(names.VLLM_TTFT, "Histogram of time to first token in seconds.",
                                    labels, registry=reg, buckets=TTFT_BUCKETS))
        self.itl = child(Histogram(names.VLLM_ITL, "Histogram of inter-token latency in seconds.",
                                   labels, registry=reg, buckets=ITL_BUCKETS))
        self.e2e = child(Histogram(names.VLLM_E2E, "Histogram of e2e request latency in seconds.",
                                   labels, registry=reg, buckets=REQUEST_BUCKETS))
        self.queue = child(Histogram(names.VLLM_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.",
                                     labels, registry=reg, buckets=REQUEST_BUCKETS))

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], usage: Callable[[], float]) -> None:
        self._running.set_function(running)
        self._waiting.set_function(waiting)
        self._usage.set_function(usage)

    def bind_retention(self, pool: BlockPool, engine: str) -> None:
        """Expose a typed pool's per-class figures (retention.py), read at scrape time."""
        self.registry.register(_RetentionCollector(pool, self._model, engine))

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape gets."""
        return generate_latest(self.registry)


class _RetentionCollector(Collector):
    def __init__(self, pool: BlockPool, model: str, engine: str) -> None:
        self.pool = pool
        self.values = [model, engine]

    def collect(self) -> Iterator[Metric]:
        from kvlab.engine.sim.retention import CLASS_NAMES

        typed = self.pool.typed
        if typed is None:
            return
        labels = ["model_name", "engine", "retention_class"]
        stats = typed.stats
        blocks = [0] * len(CLASS_NAMES)
        for block in self.pool.blocks:
            if block.key is not None:
                blocks[block.cls] += 1
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        families = (
            (gauge(names.KVLAB_SIM_KV_BLOCKS, "Cached KV blocks per retention class.", labels=labels), blocks),
            (counter(names.KVLAB_SIM_EVICTIONS, "Cached blocks evicted, per retention class.", labels=labels),
             stats.evictions),
            (counter(names.KVLAB_SIM_BLOCK_QUERIES, "Prompt blocks looked up, per retention class.", labels=labels),
             stats.queries),
            (counter(names.KVLAB_SIM_BLOCK_HITS, "Prompt blocks found cached, per retention class.", labels=labels),
             stats.hits))
        for family, counts in families:
            for name, n in zip(CLASS_NAMES, counts):
                family.add_metric([*self.values, name], n)
            yield family
        pinned = gauge(names.KVLAB_SIM_PINNED_USAGE, "Pinned KV blocks / all blocks.", labels=labels[:2])
        pinned.add_metric(self.values, typed.pinned / self.pool.num_blocks)
        yield pinned
        refused = counter(names.KVLAB_SIM_PINS_REFUSED, "Pins refused by the pinned-share bound.", labels=labels[:2])
        refused.add_metric(self.values, stats.pins_refused)
        yield refused
