"""The recompute-on-join baseline of ``bench/continuous_batching.py``, a ``JoinPolicy`` driven through
the real scheduler with hand-made requests."""

from __future__ import annotations

from bench.continuous_batching import RecomputeOnJoin
from neuron_lmi.engine.scheduler import Scheduler
from tests.engine.test_scheduler import req


def test_recompute_policy_re_encodes_running_rows_when_someone_joins():
    sched = Scheduler(max_prefill_tokens=1000, policy=RecomputeOnJoin())
    a, b = req("a", 5), req("b", 5)
    sched.add(a)
    sched.schedule(free_rows=4)
    sched.add(b)
    out = sched.schedule(free_rows=3)
    assert out.prefill == [b] and out.recompute == [a] and out.decode == []
    assert sched.schedule(free_rows=3).decode == [a, b]
