"""Prometheus metrics for one app: its own ``CollectorRegistry``, never the process-global one.

Request counts and latencies are recorded as requests run; engine occupancy (queue length, KV rows)
is read from ``engine.stats()`` at scrape time, so a scrape always shows the engine's current state.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_lmi.engine.protocol import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Gauges read from EngineStats: metric name -> (help, attribute).
STAT_GAUGES: dict[str, tuple[str, str]] = {
    "neuron_lmi_kv_rows_used": ("KV-cache rows held by running requests", "rows_used"),
    "neuron_lmi_kv_rows_total": ("KV-cache rows the engine can hold", "rows_total"),
    "neuron_lmi_queue_length": ("requests waiting for a KV row", "waiting"),
    "neuron_lmi_running_requests": ("requests in the rolling batch", "running"),
    "neuron_lmi_kv_positions_used": ("KV positions holding tokens across all rows", "positions_used"),
}
# Gauges read from EngineStats.extra (what an engine measures itself; absent keys are skipped).
# Means over the last 256 decode steps; "full" steps decoded at least 90% of the KV rows.
EXTRA_GAUGES: dict[str, tuple[str, str]] = {
    "neuron_lmi_engine_steps": ("engine steps run since start", "steps"),
    "neuron_lmi_engine_host_ms_per_step": (
        "wall time per decode step beside the model's forward (scheduling, sampling, events)",
        "host_ms_per_step",
    ),
    "neuron_lmi_engine_host_cpu_ms_per_step": (
        "CPU time of the engine loop per decode step beside the model's forward",
        "host_cpu_ms_per_step",
    ),
    "neuron_lmi_engine_model_ms_per_step": ("model forward time per decode step", "model_ms_per_step"),
    "neuron_lmi_engine_decode_batch": ("rows decoded per decode step", "decode_batch"),
    "neuron_lmi_engine_host_ms_per_full_step": (
        "wall time per full-batch decode step beside the model's forward",
        "host_ms_per_full_step",
    ),
    "neuron_lmi_engine_host_cpu_ms_per_full_step": (
        "CPU time of the engine loop per full-batch decode step beside the model's forward",
        "host_cpu_ms_per_full_step",
    ),
    "neuron_lmi_engine_model_ms_per_full_step": (
        "model forward time per full-batch decode step",
        "model_ms_per_full_step",
    ),
}


# Counters read from EngineStats.extra, under vLLM's names (vllm/v1/spec_decode/metrics.py), so a
# dashboard built on vLLM's speculative-decoding series reads ours: metric -> (help, key).
SPEC_DECODE_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", "spec_decode_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", "spec_decode_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", "spec_decode_num_accepted_tokens"),
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PER_POSITION_KEY = "spec_decode_num_accepted_tokens_per_pos."  # + the draft position, from 0


def spec_decode_metrics(extra: dict[str, float]) -> Iterable[Metric]:
    """vLLM's spec_decode counters from an engine that speculates (none where it does not)."""
    for name, (doc, key) in SPEC_DECODE_COUNTERS.items():
        if key in extra:
            yield CounterMetricFamily(name, doc, value=extra[key])
    positions = {
        k.removeprefix(PER_POSITION_KEY): v for k, v in extra.items() if k.startswith(PER_POSITION_KEY)
    }
    if positions:
        family = CounterMetricFamily(PER_POSITION, "Accepted tokens per draft position.", labels=["position"])
        for position, value in sorted(positions.items(), key=lambda kv: int(kv[0])):
            family.add_metric([position], value)
        yield family


class EngineStatsCollector(Collector):
    """Turns one ``engine.stats()`` snapshot into gauges at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def describe(self) -> Iterable[Metric]:
        for name, (doc, _) in STAT_GAUGES.items():
            yield GaugeMetricFamily(name, doc)
        yield GaugeMetricFamily("neuron_lmi_engine_alive", "1 while the engine loop runs")

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.stats()
        for name, (doc, attr) in STAT_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(getattr(stats, attr)))
        for name, (doc, key) in EXTRA_GAUGES.items():
            if key in stats.extra:
                yield GaugeMetricFamily(name, doc, value=float(stats.extra[key]))
        yield from spec_decode_metrics(stats.extra)
        yield GaugeMetricFamily(
            "neuron_lmi_engine_alive", "1 while the engine loop runs", value=float(stats.alive)
        )


class ServerMetrics:
    """All metrics of one app. Thread-safe as prometheus-client's primitives are."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "neuron_lmi_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "neuron_lmi_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "neuron_lmi_inter_token_latency_seconds", "time between tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "neuron_lmi_e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("neuron_lmi_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("neuron_lmi_generation_tokens", "tokens generated", registry=r)
        self.aborted = Counter("neuron_lmi_aborted_requests", "requests aborted before finishing", registry=r)
        r.register(EngineStatsCollector(engine))
        # A backend with its own Prometheus series (vLLM's vllm:*) serves them beside ours.
        for collector in engine.prometheus_collectors():
            r.register(collector)
