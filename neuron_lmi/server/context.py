"""The per-app objects every route needs, kept on ``app.state.ctx`` (no module-level globals)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from neuron_lmi.engine.protocol import Engine
from neuron_lmi.server.metrics import ServerMetrics
from neuron_lmi.server.options import AppOptions
from neuron_lmi.server.reasoning import Reasoner, reasoner_for


@dataclass(slots=True)
class ServerContext:
    """Engine, options and metrics of one app.

    Invariants: ``ready`` turns true only after ``engine.start()`` returned; ``special_ids`` is the
    tokenizer's special-token ids (for ``special``/``special_token`` flags of alternatives);
    ``reasoning`` is set when ``options.reasoning_parser`` is (checked against the tokenizer).
    """

    engine: Engine
    options: AppOptions
    metrics: ServerMetrics
    model_name: str
    special_ids: frozenset[int]
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False
    fatal: str | None = None
    reasoning: Reasoner | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def healthy(self) -> bool:
        """Loaded and the engine loop alive; a stats failure counts as unhealthy."""
        if not self.ready or self.fatal is not None:
            return False
        try:
            return bool(self.engine.stats().alive)
        except Exception:
            return False

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def make_context(engine: Engine, options: AppOptions) -> ServerContext:
    tok = engine.tokenizer
    special = frozenset(int(i) for i in getattr(tok, "all_special_ids", ()) or ())
    return ServerContext(
        engine=engine,
        options=options,
        metrics=ServerMetrics(engine),
        model_name=options.served_model_name or engine.model_name,
        special_ids=special,
        reasoning=reasoner_for(options.reasoning_parser, tok),
    )


def ctx_of(request: Request) -> ServerContext:
    return request.app.state.ctx  # type: ignore[no-any-return]
