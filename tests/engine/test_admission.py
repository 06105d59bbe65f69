"""``Admission``: the one validator every engine front shares (ids, limits, duplicate id, overload)."""

from __future__ import annotations

import pytest

from neuron_lmi.engine.admission import Admission, AdmissionLimits, Capacity, check_accepting
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
)

LIMITS = AdmissionLimits(n_positions=16, vocab_size=100, max_batch_size=4, max_queue_size=2)


def admission(limits: AdmissionLimits = LIMITS) -> Admission:
    return Admission(lambda text: [ord(c) % 100 for c in text], limits)


def test_a_valid_request_carries_its_ids_and_an_id() -> None:
    valid = admission().admit("abc", SamplingParams(max_new_tokens=4), None, set())
    assert valid.prompt_ids == [97, 98, 99] and len(valid.request_id) == 32
    assert admission().admit([1, 2], SamplingParams(max_new_tokens=4), "r1", set()).request_id == "r1"


@pytest.mark.parametrize(
    ("prompt", "params", "in_flight", "field", "message"),
    [
        ("", SamplingParams(max_new_tokens=4), set(), "inputs", "must not be empty"),
        ([], SamplingParams(max_new_tokens=4), set(), "inputs", "must not be empty"),
        (
            [1, 100],
            SamplingParams(max_new_tokens=4),
            set(),
            "inputs",
            r"100 is outside the vocabulary \[0, 100\)",
        ),
        ([1, 2.0], SamplingParams(max_new_tokens=4), set(), "inputs", "token id 2.0 is not an integer"),
        (
            [1] * 10,
            SamplingParams(max_new_tokens=7),
            set(),
            "inputs",
            "plus max_new_tokens=7 exceeds n_positions=16",
        ),
        ([1], SamplingParams(max_new_tokens=4), {"r1"}, "request_id", "'r1' is already in flight"),
        ([1], SamplingParams(max_new_tokens=16), set(), "max_new_tokens", ""),
    ],
)
def test_each_refusal_names_its_field(
    prompt: object, params: SamplingParams, in_flight: set[str], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        admission().admit(prompt, params, "r1", in_flight)  # type: ignore[arg-type]
    assert info.value.field == field


def test_capacity_one_formula_for_every_front() -> None:
    """A request waits for a row only while fewer than max_queue_size wait beyond the free rows."""
    gate = admission()
    gate.check_capacity(Capacity(waiting=1, free_rows=0))
    gate.check_capacity(Capacity(waiting=3, free_rows=2))
    with pytest.raises(EngineOverloadedError, match=r"2 requests are already waiting for a KV row \(0 free"):
        gate.check_capacity(Capacity(waiting=2, free_rows=0))
    # A front that only counts open requests: the first max_batch_size hold rows.
    assert Capacity.of_in_flight(3, 4) == Capacity(0, 1)
    gate.check_capacity(Capacity.of_in_flight(5, 4))
    with pytest.raises(EngineOverloadedError):
        gate.check_capacity(Capacity.of_in_flight(6, 4))
    with pytest.raises(EngineOverloadedError):
        gate.admit([1], SamplingParams(max_new_tokens=2), None, set(), Capacity.of_in_flight(6, 4))


def test_liveness() -> None:
    check_accepting(True, False)
    with pytest.raises(EngineDeadError, match="the vLLM engine is not running"):
        check_accepting(False, False, "the vLLM engine")
    with pytest.raises(EngineOverloadedError, match="shutting down") as info:
        check_accepting(True, True)
    assert info.value.retry_after_s == 5.0
