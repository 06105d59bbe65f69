"""Admission: the one validator in front of every engine (the CPU engine's process and thread
fronts, the Neuron runners' engine, the vLLM adapter). Every request is checked here once, in the
API process, and becomes a ``ValidRequest``; ``Engine.generate`` takes only that type, and nothing
behind it checks the request again.

    prompt + SamplingParams + request id --Engine.admit--> ValidRequest --Engine.generate--> events

It checks, in this order, and raises with one set of messages: the engine is alive and accepting
(``check_accepting``: ``EngineDeadError``, ``EngineOverloadedError`` while shutting down); the
parameters (``SamplingParams.validate``); the prompt's token ids (non-empty, inside the vocabulary);
prompt plus ``max_new_tokens`` within ``n_positions``; what the backend can do (``RunnerCapabilities``:
prompt scoring, a device sampler's limits); the grammar; the request id is not already in flight; and
capacity: a request may wait for a KV row only while fewer than ``max_queue_size`` wait beyond the
free rows. Errors name the engine's field (``max_new_tokens``, ``inputs``, ``grammar`` or the field
the grammar came from); the server spells them as its client did.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from neuron_lmi.engine.device_sampling import host_field
from neuron_lmi.engine.grammar import check_grammar
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
    UnknownAdapterError,
)
from neuron_lmi.runners.base import RunnerCapabilities

SHUTDOWN_RETRY_S = 5.0
# A backend that scores prompts and samples on the host (the vLLM adapter's).
HOST_SAMPLING = RunnerCapabilities(prompt_logits=True)


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The numbers admission checks against; an engine that learns them late (vLLM) replaces them."""

    n_positions: int
    vocab_size: int
    max_batch_size: int
    max_queue_size: int
    # What the backend can do (what admission refuses beyond the parameters' own ranges).
    capabilities: RunnerCapabilities = HOST_SAMPLING
    backend_label: str = "this backend"  # names the backend in a refusal


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request every check has passed: its id, its prompt as token ids, its parameters, and what
    the backend prepared while admitting it (the vLLM adapter's own sampling parameters)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    backend_params: Any = None


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many requests wait for a KV row, and how many rows are free, as the engine counts them."""

    waiting: int
    free_rows: int

    @classmethod
    def of_in_flight(cls, in_flight: int, max_batch_size: int) -> Capacity:
        """For a front that only counts its open requests: the first ``max_batch_size`` hold rows."""
        return cls(max(0, in_flight - max_batch_size), max(0, max_batch_size - in_flight))


class Admission:
    """Turns what a client sent into a ``ValidRequest``, or raises naming the field and why."""

    def __init__(self, encode: Callable[[str], Sequence[int]], limits: AdmissionLimits) -> None:
        self.encode = encode
        self.limits = limits
        # The LoRA adapters served now, by name: a live view the front keeps current as adapters are
        # loaded and unloaded (an adapter being unloaded has already left it).
        self.adapters: Container[str] = frozenset()

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("inputs must not be empty", "inputs")
            return list(self.encode(prompt))
        if not prompt:
            raise InvalidRequestError("inputs must not be empty", "inputs")
        vocab = self.limits.vocab_size
        ids = []
        for token in prompt:
            try:
                token_id = operator.index(token)  # ints and integer scalars, never a float or a string
            except TypeError:
                raise InvalidRequestError(f"token id {token!r} is not an integer", "inputs") from None
            if not 0 <= token_id < vocab:
                message = f"token id {token!r} is outside the vocabulary [0, {vocab})"
                raise InvalidRequestError(message, "inputs")
            ids.append(token_id)
        return ids

    def admit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        in_flight: Container[str],
        capacity: Capacity | None = None,
    ) -> ValidRequest:
        """Every check but liveness (``check_accepting``) in one place; ``capacity`` None skips the
        overload check (the caller makes it when it queues the request)."""
        n_positions = self.limits.n_positions
        params.validate(max_new_tokens_limit=n_positions - 1)
        ids = self.prompt_ids(prompt)
        if len(ids) + params.max_new_tokens > n_positions:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens plus max_new_tokens={params.max_new_tokens} exceeds "
                f"n_positions={n_positions}",
                "inputs",
            )
        self._check_backend(params)
        if params.grammar is not None:
            check_grammar(params.grammar)
        request_id = request_id or uuid.uuid4().hex
        if request_id in in_flight:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        if capacity is not None:
            self.check_capacity(capacity)
        return ValidRequest(request_id, ids, params)

    def _check_backend(self, params: SamplingParams) -> None:
        limits = self.limits
        bad = [t for t, _ in params.logit_bias if t >= limits.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary", "logit_bias")
        if params.adapter is not None:
            self._check_adapter(params)
        if params.prompt_logprobs is not None and not limits.capabilities.prompt_logits:
            message = f"{limits.backend_label} cannot score prompts (prompt log-probabilities)"
            raise InvalidRequestError(message, "prompt_logprobs")
        device = limits.capabilities.device_sampling
        field = host_field(params, device) if device is not None and not device.logits else None
        if field is not None:
            message = (
                f"{field} needs host sampling, and {limits.backend_label} samples on the device "
                "without returning logits (see docs/configuration.md, on-device sampling)"
            )
            raise InvalidRequestError(message, field)

    def _check_adapter(self, params: SamplingParams) -> None:
        label = self.limits.backend_label
        if not self.limits.capabilities.lora:
            message = f"{label} serves no LoRA adapters (option.enable_lora), asked for {params.adapter!r}"
            raise InvalidRequestError(message, "adapter")
        if params.adapter not in self.adapters:
            raise UnknownAdapterError(params.adapter)  # type: ignore[arg-type]
        if params.prompt_logprobs is not None:  # the prompt is scored by the base model only
            raise InvalidRequestError(
                f"prompt log-probabilities are not computed with an adapter ({params.adapter!r})",
                "prompt_logprobs",
            )

    def check_capacity(self, capacity: Capacity) -> None:
        queue = self.limits.max_queue_size
        if capacity.waiting >= queue + capacity.free_rows:
            raise EngineOverloadedError(
                f"{capacity.waiting} requests are already waiting for a KV row "
                f"({capacity.free_rows} free, max_queue_size={queue})"
            )


def check_accepting(alive: bool, stopping: bool, what: str = "the engine loop") -> None:
    """``EngineDeadError`` when the engine has stopped, ``EngineOverloadedError`` while it drains."""
    if not alive:
        raise EngineDeadError(f"{what} is not running")
    if stopping:
        raise EngineOverloadedError("the server is shutting down", retry_after_s=SHUTDOWN_RETRY_S)
