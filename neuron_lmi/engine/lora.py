"""The engine's LoRA adapters: which are registered, which sit in the runner's slots, and who uses them.

    registered  name -> an adapter directory, read and checked once at registration
    host copies the adapters' weights in host memory, at most ``max_cpu_loras`` (least recently used
                dropped first; a dropped one is read from disk again when next needed)
    slots       the runner's ``max_loras`` slots; a running request pins its adapter's slot, and an
                adapter moves into a slot (``pin``) evicting the least recently used idle one

Each registration gets a fresh id: a request holds its adapter by id (``hold``/``release``), the
prefix index keys rows by it, so a name unloaded and registered again from another directory never
shares a row or a slot with the old one. Unregistering forgets the name at once (new requests are
refused) while the requests that hold it run to their end; the last one frees it.

The table never touches the runner: ``pin`` queues the slot writes it needs, and the engine applies
them (``take_writes``: ``runner.set_adapter``) before the step's batches run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from neuron_lmi.engine.types import InvalidRequestError, UnknownAdapterError

AdapterLoader = Callable[[str, str], Any]  # (name, path) -> the runner's adapter; raises ValueError


@dataclass(slots=True, eq=False)
class _Entry:
    id: int
    name: str
    path: str
    weights: Any = None  # the host copy, or None (read again from ``path`` when needed)
    slot: int | None = None
    users: int = 0  # requests that hold it, waiting or running
    registered: bool = True


class AdapterTable:
    """Adapters by name and id, their host copies and the runner's slots.

    Invariants: a slot holds at most one adapter, and its adapter is never replaced while a
    running request pins it; an adapter's entry lives while it is registered or held; at most
    ``max_cpu_loras`` host copies are kept (``max_loras`` <= ``max_cpu_loras``).
    """

    def __init__(self, max_loras: int, max_cpu_loras: int, load: AdapterLoader) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load = load
        self._names: dict[str, int] = {}
        self._entries: dict[int, _Entry] = {}
        # Slot -> the id of the adapter in it; least recently used first.
        self._slots: OrderedDict[int, int | None] = OrderedDict((s, None) for s in range(max_loras))
        self._pins = [0] * max_loras
        self._host: OrderedDict[int, None] = OrderedDict()  # ids with a host copy, least recent first
        self._writes: list[tuple[int, Any]] = []
        self._next_id = 1

    # -- registration ---------------------------------------------------------------------------
    @property
    def served(self) -> Container[str]:
        """The registered names, a live view (what admission checks a request's adapter against)."""
        return self._names.keys()

    def names(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        return {name: self._entries[i].path for name, i in self._names.items()}

    def register(self, name: str, path: str) -> None:
        """Read and check the adapter now (raises ``InvalidRequestError`` naming it and why)."""
        if not name:
            raise InvalidRequestError("an adapter needs a name", "lora_name")
        if name in self._names:
            raise InvalidRequestError(f"adapter {name!r} is already loaded", "lora_name")
        try:
            weights = self._load(name, path)
        except ValueError as exc:  # AdapterError and its kin: the adapter is at fault
            raise InvalidRequestError(str(exc), "lora_path") from None
        except OSError as exc:
            raise InvalidRequestError(f"adapter {name!r}: {exc}", "lora_path") from None
        entry = _Entry(self._next_id, name, path, weights)
        self._next_id += 1
        self._entries[entry.id] = entry
        self._names[name] = entry.id
        self._keep_host(entry)

    def unregister(self, name: str) -> None:
        """Forget ``name``: refused from now on, freed once no request holds it."""
        adapter_id = self._names.pop(name, None)
        if adapter_id is None:
            raise UnknownAdapterError(name)
        entry = self._entries[adapter_id]
        entry.registered = False
        self._drop_if_unused(entry)

    # -- requests --------------------------------------------------------------------------------
    def hold(self, name: str) -> int:
        """A request for ``name`` enters the engine: its adapter's id (``UnknownAdapterError`` if none)."""
        adapter_id = self._names.get(name)
        if adapter_id is None:
            raise UnknownAdapterError(name)
        self._entries[adapter_id].users += 1
        return adapter_id

    def release(self, adapter_id: int) -> None:
        entry = self._entries.get(adapter_id)
        if entry is None:
            return
        entry.users -= 1
        self._drop_if_unused(entry)

    def pin(self, adapter_id: int) -> int | None:
        """The slot a request about to run uses, moving the adapter in (evicting the least recently
        used idle slot) where needed; None when every slot is pinned by other adapters (the request
        waits). Reading a dropped host copy again may raise (the adapter's directory is gone)."""
        entry = self._entries[adapter_id]
        if entry.slot is None:
            free = self._free_slot()
            if free is None:
                return None
            weights = entry.weights if entry.weights is not None else self._load(entry.name, entry.path)
            entry.weights = weights
            self._keep_host(entry)
            old = self._slots[free]
            if old is not None and old in self._entries:
                self._entries[old].slot = None
            self._slots[free] = entry.id
            entry.slot = free
            self._writes.append((free, weights))
        self._slots.move_to_end(entry.slot)
        if entry.id in self._host:
            self._host.move_to_end(entry.id)
        self._pins[entry.slot] += 1
        return entry.slot

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1

    def take_writes(self) -> list[tuple[int, Any]]:
        """The slot writes ``pin`` decided since the last call, in order: (slot, weights)."""
        writes, self._writes = self._writes, []
        return writes

    def resident(self) -> dict[int, str]:
        """Slot -> the adapter in it (for tests and stats)."""
        slots = self._slots.items()
        return {s: self._entries[i].name for s, i in slots if i is not None and i in self._entries}

    # -- bookkeeping -----------------------------------------------------------------------------
    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request pins; None if all are."""
        idle = None
        for slot, held in self._slots.items():
            if held is None:
                return slot
            if idle is None and self._pins[slot] == 0:
                idle = slot
        return idle

    def _keep_host(self, entry: _Entry) -> None:
        self._host[entry.id] = None
        self._host.move_to_end(entry.id)
        while len(self._host) > self.max_cpu_loras:
            oldest, _ = self._host.popitem(last=False)
            self._entries[oldest].weights = None  # read from disk again if it is needed

    def _drop_if_unused(self, entry: _Entry) -> None:
        if entry.registered or entry.users > 0:
            return
        del self._entries[entry.id]
        self._host.pop(entry.id, None)
        if entry.slot is not None:
            self._slots[entry.slot] = None
            self._slots.move_to_end(entry.slot, last=False)  # a free slot is taken first
