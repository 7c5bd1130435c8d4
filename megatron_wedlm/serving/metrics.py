"""``GET /metrics``: the engine's counters in Prometheus' text format, read at scrape time from
:class:`~.engine.EngineStats` (rates also as gauges over the last 10 s).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine import ServingEngine


class _EngineCollector(Collector):
    def __init__(self, engine: ServingEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        running, waiting = self.engine.load()
        requests = CounterMetricFamily("wedlm_requests", "Requests by how they ended (refused: 429, queue full)",
                                       labels=["status"])
        for status, count in stats.requests.items():
            requests.add_metric([status], count)
        yield requests
        yield GaugeMetricFamily("wedlm_queue_depth", "Requests waiting for a row", value=waiting)
        yield GaugeMetricFamily("wedlm_running_rows", "Rows being decoded", value=running)
        yield CounterMetricFamily("wedlm_generated_tokens", "Tokens generated", value=stats.tokens)
        yield CounterMetricFamily("wedlm_forwards", "Batch forwards", value=stats.forwards)
        yield CounterMetricFamily("wedlm_row_forwards", "Forwards summed over the rows of each", value=stats.row_forwards)
        yield GaugeMetricFamily("wedlm_tokens_per_second", "Tokens generated per second over the last 10 s",
                                value=self.engine.tokens_per_second())
        yield GaugeMetricFamily("wedlm_tokens_per_forward", "Tokens committed per row forward since the start",
                                value=stats.tokens / stats.row_forwards if stats.row_forwards else 0.0)
        cache = self.engine.prefix_cache
        if cache is not None:  # --no-prefix-cache: no series
            yield CounterMetricFamily("wedlm_prefix_cache_prompt_tokens", "Prompt tokens of the requests started",
                                      value=cache.stats.prompt_tokens)
            yield CounterMetricFamily("wedlm_prefix_cache_hit_tokens",
                                      "Prompt tokens whose keys/values came from the prefix cache",
                                      value=cache.stats.hit_tokens)
            yield GaugeMetricFamily("wedlm_prefix_cache_hit_rate",
                                    "Cached prompt tokens / prompt tokens since the start", value=cache.stats.hit_rate)
            yield GaugeMetricFamily("wedlm_prefix_cache_blocks", f"Blocks of {cache.block_size} prompt tokens held",
                                    value=len(cache))
            yield GaugeMetricFamily("wedlm_prefix_cache_bytes", "Bytes of keys/values held", value=cache.bytes)
            yield GaugeMetricFamily("wedlm_prefix_cache_capacity_bytes",
                                    "The bound on the bytes held (--prefix-cache-gib)", value=cache.max_bytes)
            yield CounterMetricFamily("wedlm_prefix_cache_evictions", "Blocks evicted to stay within the bound",
                                      value=cache.stats.evictions)


def metrics_registry(engine: ServingEngine) -> CollectorRegistry:
    """A registry of ``engine``'s figures, read at each scrape (``generate_latest(registry)``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return registry
