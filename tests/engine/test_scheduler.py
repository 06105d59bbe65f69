"""The scheduler is a pure decision: driven here with hand-made requests, no model."""

from __future__ import annotations

from neuron_lmi.engine.request import Request, Status
from neuron_lmi.engine.scheduler import RecomputeOnJoin, Scheduler
from neuron_lmi.engine.stops import StopMatcher
from neuron_lmi.engine.types import SamplingParams


def req(name: str, n_prompt: int) -> Request:
    return Request(
        request_id=name,
        prompt_ids=list(range(n_prompt)),
        params=SamplingParams(),
        detokenizer=None,  # type: ignore[arg-type]
        stops=StopMatcher(()),
        generator=None,
    )


def test_new_requests_fill_free_rows_fcfs_while_running_ones_decode():
    sched = Scheduler(max_prefill_tokens=1000)
    a, b, c = req("a", 10), req("b", 10), req("c", 10)
    for r in (a, b, c):
        sched.add(r)
    first = sched.schedule(free_rows=2)
    assert first.prefill == [a, b] and first.decode == []
    assert a.status is Status.RUNNING and list(sched.waiting) == [c]
    second = sched.schedule(free_rows=0)
    assert second.prefill == [] and second.decode == [a, b]
    sched.remove(a)
    third = sched.schedule(free_rows=1)
    assert third.prefill == [c] and third.decode == [b]


def test_prefill_token_budget_limits_admissions_but_never_starves():
    sched = Scheduler(max_prefill_tokens=100)
    big, small1, small2 = req("big", 300), req("s1", 60), req("s2", 60)
    for r in (big, small1, small2):
        sched.add(r)
    out = sched.schedule(free_rows=8)
    assert out.prefill == [big]  # over budget alone, but admitted so it cannot starve
    out = sched.schedule(free_rows=8)
    assert out.prefill == [small1]  # the second would exceed the budget
    assert sched.schedule(free_rows=8).prefill == [small2]


def test_recompute_policy_re_encodes_running_rows_when_someone_joins():
    sched = Scheduler(max_prefill_tokens=1000, policy=RecomputeOnJoin())
    a, b = req("a", 5), req("b", 5)
    sched.add(a)
    sched.schedule(free_rows=4)
    sched.add(b)
    out = sched.schedule(free_rows=3)
    assert out.prefill == [b] and out.recompute == [a] and out.decode == []
    assert sched.schedule(free_rows=3).decode == [a, b]


def test_remove_from_waiting_and_has_work():
    sched = Scheduler(max_prefill_tokens=10)
    a = req("a", 3)
    sched.add(a)
    assert sched.has_work()
    sched.remove(a)
    assert not sched.has_work()
    assert sched.schedule(free_rows=1).empty
