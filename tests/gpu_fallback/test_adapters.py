"""``VllmAdapters`` over stand-ins for vLLM's ``add_lora``/``remove_lora``: checks before vLLM sees an
adapter, fresh ids per registration, and an adapter in use removed from vLLM only when its last
request ends."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from gpu_fallback.adapters import VllmAdapters
from neuron_lmi.engine.types import InvalidRequestError, UnknownAdapterError


class FakeVllm:
    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}
        self.refuse = False

    async def add(self, request) -> bool:
        if self.refuse:
            raise RuntimeError("LoRA rank 64 is greater than max_lora_rank 16")
        self.loaded[request.lora_int_id] = request.lora_name
        return True

    async def remove(self, lora_id: int) -> bool:
        del self.loaded[lora_id]
        return True


def check(name: str, path: str) -> None:
    if "bad" in path:
        raise ValueError(f"adapter {name!r}: rank 32 exceeds max_lora_rank=16")


@pytest.fixture()
def table():
    vllm = FakeVllm()
    make = lambda name, i, path: NS(lora_name=name, lora_int_id=i, lora_path=path)  # noqa: E731
    return VllmAdapters(check, make, vllm.add, vllm.remove), vllm


async def test_register_checks_then_loads(table) -> None:
    adapters, vllm = table
    await adapters.register("a", "/a")
    assert adapters.names() == {"a": "/a"} and "a" in adapters.served and vllm.loaded == {1: "a"}
    with pytest.raises(InvalidRequestError, match="already loaded") as info:
        await adapters.register("a", "/other")
    assert info.value.field == "lora_name"
    with pytest.raises(InvalidRequestError, match="'b': rank 32") as info:
        await adapters.register("b", "/bad")
    assert info.value.field == "lora_path" and vllm.loaded == {1: "a"}
    vllm.refuse = True
    with pytest.raises(InvalidRequestError, match="'c': vLLM refused it"):
        await adapters.register("c", "/c")
    assert "c" not in adapters.served


async def test_an_adapter_in_use_leaves_vllm_after_its_last_request(table) -> None:
    adapters, vllm = table
    await adapters.register("a", "/a")
    first, second = adapters.hold("a"), adapters.hold("a")
    assert first.lora_int_id == 1
    await adapters.unregister("a")
    assert "a" not in adapters.served and vllm.loaded == {1: "a"}  # refused now, still running
    with pytest.raises(UnknownAdapterError):
        adapters.hold("a")
    await adapters.register("a", "/a2")  # a new registration: a new id, never the old weights
    assert adapters.hold("a").lora_int_id == 2
    await adapters.release(first)
    assert 1 in vllm.loaded
    await adapters.release(second)
    assert vllm.loaded == {2: "a"}
    with pytest.raises(UnknownAdapterError):
        await adapters.unregister("nope")
