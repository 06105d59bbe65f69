"""What the HTTP layer needs to know beyond the engine: limits, access control, identity."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 6 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AppOptions:
    """Settings for :func:`neuron_lmi.server.create_app`.

    Invariants: ``max_body_bytes`` is positive; ``api_key`` None means no authentication;
    ``served_model_name`` None means "use ``engine.model_name``". ``on_fatal`` is called once, with a
    reason, when the engine loop is found dead and ``fail_fast`` is set (the CLI uses it to stop
    uvicorn and exit non-zero).
    """

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str | None = None
    dtype: str = "fp32"
    fail_fast: bool = False
    grace_period_s: float = 30.0
    health_poll_s: float = 1.0
    sagemaker: bool = False
    start_engine: bool = True
    on_fatal: Callable[[str], None] | None = None
    # Tool calling: a parser name (neuron_lmi.server.tool_parsers) or None to read it from the chat
    # template; set, it also enables the built-in tool prompt for a template without tool support.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = True
    # Reasoning output: a parser name (neuron_lmi.server.reasoning.PARSERS) or None for none.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.health_poll_s <= 0:
            raise ValueError(f"health_poll_s must be positive, got {self.health_poll_s}")
