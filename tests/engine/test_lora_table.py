"""The engine's adapter table alone: slots evicted least recently used among idle ones, host copies
bounded by max_cpu_loras, names refused at once on unregister while holders finish."""

from __future__ import annotations

import pytest

from neuron_lmi.engine.lora import AdapterTable
from neuron_lmi.engine.types import InvalidRequestError, UnknownAdapterError


class Reads:
    """The table's loader: an adapter's "weights" are its (name, path); every read is counted."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def __call__(self, name: str, path: str) -> tuple[str, str]:
        if path == "broken":
            raise ValueError(f"adapter {name!r}: rank 99 exceeds max_lora_rank=16")
        self.count[name] = self.count.get(name, 0) + 1
        return (name, path)


def table(max_loras: int, max_cpu_loras: int, names: str = "abc") -> tuple[AdapterTable, Reads]:
    reads = Reads()
    t = AdapterTable(max_loras, max_cpu_loras, reads)
    for name in names:
        t.register(name, f"/adapters/{name}")
    return t, reads


def test_least_recently_used_idle_slot_is_evicted() -> None:
    t, _ = table(2, 3)
    a, b, c = (t.hold(n) for n in "abc")
    slot_a, slot_b = t.pin(a), t.pin(b)
    assert {slot_a, slot_b} == {0, 1}
    assert t.take_writes() == [(slot_a, ("a", "/adapters/a")), (slot_b, ("b", "/adapters/b"))]
    assert t.pin(c) is None  # both slots pinned: c waits
    t.unpin(slot_a)
    t.unpin(slot_b)
    assert t.pin(b) == slot_b and t.take_writes() == []  # resident: no write, and now most recent
    t.unpin(slot_b)
    assert t.pin(c) == slot_a  # a was used least recently
    assert t.resident() == {slot_a: "c", slot_b: "b"}
    assert t.take_writes() == [(slot_a, ("c", "/adapters/c"))]


def test_host_copies_are_bounded_and_read_again() -> None:
    t, reads = table(1, 1)
    assert reads.count == {"a": 1, "b": 1, "c": 1}  # read at registration (checked then)
    slot = t.pin(t.hold("a"))  # its host copy was dropped for b's and c's: read again
    assert slot == 0 and reads.count["a"] == 2
    t.unpin(slot)
    t.pin(t.hold("c"))
    assert reads.count["c"] == 2


def test_unregister_refuses_at_once_and_frees_after_the_last_holder() -> None:
    t, _ = table(2, 2, "ab")
    held = t.hold("a")
    slot = t.pin(held)
    t.unregister("a")
    with pytest.raises(UnknownAdapterError):
        t.hold("a")
    assert t.resident() == {slot: "a"}  # still running
    t.unpin(slot)
    t.release(held)
    assert t.resident() == {}
    t.register("a", "/elsewhere/a")  # the name is free again, under a new id
    assert t.hold("a") != held
    with pytest.raises(UnknownAdapterError):
        t.unregister("zzz")


def test_registration_refusals_name_the_field() -> None:
    t, _ = table(1, 1, "a")
    with pytest.raises(InvalidRequestError, match="already loaded") as exc:
        t.register("a", "/adapters/a")
    assert exc.value.field == "lora_name"
    with pytest.raises(InvalidRequestError, match="rank 99") as exc:
        t.register("x", "broken")
    assert exc.value.field == "lora_path"
    with pytest.raises(ValueError, match="max_cpu_loras"):
        AdapterTable(2, 1, Reads())
