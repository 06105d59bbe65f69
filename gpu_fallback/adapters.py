"""The vLLM backend's LoRA adapters: which names are served, under which vLLM ids, and who uses them.

    registered  name -> (a fresh int id, the adapter directory), checked once at registration
                (``models.lora.check_adapter``, the CPU engine's checks) and then handed to vLLM
                (``AsyncLLM.add_lora``), so a bad adapter is a 400 naming it before vLLM sees it
    in use      each request holds its adapter's ``LoRARequest(name, id, path)`` while it runs

vLLM keeps the resident adapters itself: ``max_loras`` in its compute slots and ``max_cpu_loras``
in its host cache, least recently used evicted first and read again from the path a request's
``LoRARequest`` carries; its scheduler keeps a step's distinct adapters within ``max_loras``, so a
request waits while every slot is taken, as on the CPU engine's ``engine.lora.AdapterTable``. What
this table adds is the CPU engine's in-use rule: unregistering forgets the name at once (new
requests get a 404) while the requests holding it run to their end, and only the last one to
finish removes it from vLLM (``remove_lora``). A name registered again gets a new id, so vLLM
never serves a request the old adapter's weights under the new name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_lmi.backends.lora import LoraSettings
from neuron_lmi.engine.types import InvalidRequestError, UnknownAdapterError
from neuron_lmi.models.args import model_args_from_config
from neuron_lmi.models.lora import ATTENTION_PROJECTIONS, PROJECTIONS, adaptable_modules, check_adapter

log = logging.getLogger(__name__)

# (name, path) -> None; raises ValueError (``AdapterError``) naming the adapter and why.
AdapterCheck = Callable[[str, str], None]
# (name, int id, path) -> vLLM's ``LoRARequest``.
RequestFactory = Callable[[str, int, str], Any]


@dataclass(slots=True, eq=False)
class _Entry:
    id: int
    name: str
    path: str
    request: Any  # vLLM's LoRARequest for it
    users: int = 0
    registered: bool = True


class VllmAdapters:
    """Adapters served through vLLM's ``AsyncLLM``, by name and vLLM id.

    Invariants: a name maps to at most one registered entry; an entry is in vLLM from a successful
    ``register`` until it is unregistered and no request holds it; ids are never reused.
    """

    def __init__(
        self,
        check: AdapterCheck,
        make_request: RequestFactory,
        add: Callable[[Any], Awaitable[Any]],
        remove: Callable[[int], Awaitable[Any]],
    ) -> None:
        self._check, self._make_request = check, make_request
        self._add, self._remove = add, remove
        self._names: dict[str, _Entry] = {}
        self._entries: dict[int, _Entry] = {}  # by id: registered, or still held by a request
        self._loading: set[str] = set()  # names whose registration is under way
        self._next_id = 1

    @property
    def served(self) -> Container[str]:
        """The registered names, a live view (what admission checks a request's adapter against)."""
        return self._names.keys()

    def names(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        return {name: entry.path for name, entry in self._names.items()}

    async def register(self, name: str, path: str) -> None:
        """Check the adapter, then load it into vLLM; raises ``InvalidRequestError`` naming it and
        why (``field`` ``lora_name`` for the name, ``lora_path`` for the adapter itself)."""
        if not name:
            raise InvalidRequestError("an adapter needs a name", "lora_name")
        if name in self._names or name in self._loading:
            raise InvalidRequestError(f"adapter {name!r} is already loaded", "lora_name")
        self._loading.add(name)
        try:
            try:
                self._check(name, path)
            except ValueError as exc:  # AdapterError: the adapter is at fault
                raise InvalidRequestError(str(exc), "lora_path") from None
            except OSError as exc:
                raise InvalidRequestError(f"adapter {name!r}: {exc}", "lora_path") from None
            entry = _Entry(self._next_id, name, path, self._make_request(name, self._next_id, path))
            self._next_id += 1
            try:
                await self._add(entry.request)
            except (ValueError, OSError, RuntimeError) as exc:  # what vLLM's loader refused
                raise InvalidRequestError(f"adapter {name!r}: vLLM refused it ({exc})", "lora_path") from None
            self._names[name] = self._entries[entry.id] = entry
        finally:
            self._loading.discard(name)

    async def unregister(self, name: str) -> None:
        """Forget ``name`` (``UnknownAdapterError`` if not served); removed from vLLM once no
        request holds it."""
        entry = self._names.pop(name, None)
        if entry is None:
            raise UnknownAdapterError(name, "lora_name")
        entry.registered = False
        await self._drop_if_unused(entry)

    def hold(self, name: str) -> Any:
        """A request for ``name`` starts: its ``LoRARequest`` (``UnknownAdapterError`` if not
        served, as when it was unloaded since admission)."""
        entry = self._names.get(name)
        if entry is None:
            raise UnknownAdapterError(name)
        entry.users += 1
        return entry.request

    async def release(self, request: Any) -> None:
        """The request holding ``request`` (a ``LoRARequest`` from ``hold``) ended."""
        entry = self._entries.get(request.lora_int_id)
        if entry is None:
            return
        entry.users -= 1
        await self._drop_if_unused(entry)

    async def _drop_if_unused(self, entry: _Entry) -> None:
        if entry.registered or entry.users > 0:
            return
        del self._entries[entry.id]
        await self._remove(entry.id)


async def start_adapters(
    lora: LoraSettings,
    model_dir: Path,
    make_request: RequestFactory,
    add: Callable[[Any], Awaitable[Any]],
    remove: Callable[[int], Awaitable[Any]],
) -> VllmAdapters:
    """The table for the model at ``model_dir``, checking adapters as the CPU engine does, with
    the start-up adapters loaded; raises ``ValueError`` naming one that cannot be served."""
    args = model_args_from_config(json.loads((model_dir / "config.json").read_text()))
    # vLLM adapts every linear layer of a dense model; an MoE model's experts are not checked here.
    modules = adaptable_modules(frozenset(PROJECTIONS) if args.moe is None else ATTENTION_PROJECTIONS)

    def check(name: str, path: str) -> None:
        check_adapter(name, path, args, modules, lora.max_lora_rank, lora.base_names)

    table = VllmAdapters(check, make_request, add, remove)
    for name, path in lora.modules:
        try:
            await table.register(name, path)
        except InvalidRequestError as exc:
            raise ValueError(f"option.lora_modules: {exc}") from None
        log.info("LoRA adapter %s served from %s", name, path)
    return table
