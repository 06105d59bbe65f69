"""The vLLM backend's metrics: vLLM's scheduler stats for ``EngineStats``, and vLLM's own
Prometheus series (``vllm:*``) served beside the server's. Nothing here imports vLLM until an engine
was built (``stat_logger_class`` is called by the backend when it creates one)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class SchedulerSnapshot:
    """vLLM's latest scheduler stats, written by its stat logger after each step."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


class VllmMetricsCollector:
    """vLLM's own Prometheus series (``vllm:*``, from its stat logger) at each scrape, so /metrics
    shows them beside ours. Reads nothing until vLLM is imported (an engine was built)."""

    def describe(self) -> Iterable[Any]:
        return ()

    def collect(self) -> Iterable[Any]:
        if "vllm" not in sys.modules:
            return
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        for metric in get_prometheus_registry().collect():
            if metric.name.startswith("vllm:"):
                yield metric


def stat_logger_class(snapshot: SchedulerSnapshot) -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
            if scheduler_stats is not None:
                snapshot.running = scheduler_stats.num_running_reqs
                snapshot.waiting = scheduler_stats.num_waiting_reqs
                snapshot.kv_cache_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return SnapshotStatLogger
