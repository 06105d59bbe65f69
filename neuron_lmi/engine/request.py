"""One request's whole state, owned by the engine thread."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neuron_lmi.engine.grammar import GrammarState
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


EventSink = Callable[[TokenEvent], None]


@dataclass(slots=True, eq=False)
class Request:
    """Prompt, output so far, KV row and status of one sequence.

    Invariants: ``row`` is set exactly while ``status`` is RUNNING; ``prefilled`` counts the prompt
    tokens whose K/V are in the row (computed or reused), and no token is sampled before it reaches
    ``len(prompt_ids)``; ``output_ids`` and ``logprobs`` grow together; once FINISHED,
    ``finish_reason`` is set and nothing changes. ``spec_misses`` and ``spec_pause`` are its
    speculative-decoding back-off, ``spec_accepted`` and ``spec_rejected`` its recent acceptance
    (``engine.speculation.Speculator``).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    sink: EventSink | None = None
    grammar: GrammarState | None = None  # advanced once per generated token
    status: Status = Status.WAITING
    row: int | None = None
    prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    spec_misses: int = 0  # drafts in a row with nothing accepted
    spec_pause: int = 0  # decode steps left without drafts
    spec_accepted: float = 0.0  # accepted drafts, older verifies weighted down (ACCEPTANCE_DECAY)
    spec_rejected: float = 0.0  # verifies that ended at a rejected draft, weighted alike
    # The LoRA adapter's registration id while the request holds it (``engine.lora``; None: the base
    # model), and the runner slot it runs in while it holds a row.
    adapter_id: int | None = None
    lora_slot: int | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prompt_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
