"""The recompute-on-join baseline of ``bench/continuous_batching.py``, a ``Scheduler`` subclass driven
with hand-made requests and a real row table."""

from __future__ import annotations

from bench.continuous_batching import RecomputeOnJoin
from cache_api import RowTable
from neuron_lmi.runners.base import BatchKind, RunnerCapabilities
from tests.engine.test_scheduler import req


def test_recompute_re_encodes_running_rows_when_someone_joins() -> None:
    rows = RowTable(4, 64)
    sched = RecomputeOnJoin(1000, rows=rows, capabilities=RunnerCapabilities())
    a, b = req("a", 5), req("b", 5)
    sched.add(a)
    sched.next_step()
    rows.set_length(a.row, 5)  # what the runner's forward leaves
    a.output_ids.append(7)
    sched.add(b)
    plan = sched.next_step()
    kinds = [(batch.kind, requests) for batch, requests in plan.batches]
    assert kinds == [(BatchKind.PREFILL, [b]), (BatchKind.PREFILL, [a])]  # a is encoded again, not decoded
    again = plan.batches[1][0]
    assert again.starts == (0,) and again.chunks == ((0, 1, 2, 3, 4, 7),) and again.samples == (True,)
    b.output_ids.append(7)
    rows.set_length(b.row, 5)
    rows.set_length(a.row, 6)
    a.output_ids.append(7)
    steady = sched.next_step()  # nobody joins: both decode
    assert [(batch.kind, requests) for batch, requests in steady.batches] == [(BatchKind.DECODE, [a, b])]
