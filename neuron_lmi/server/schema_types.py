"""Constrained field types shared by the request schemas, so ``/openapi.json`` states the limits the
server enforces (and pydantic enforces them first, naming the field). The limits themselves are the
engine's (``neuron_lmi.engine.types``); the engine still checks them for callers without HTTP.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from neuron_lmi.engine.types import MAX_STOP_SEQUENCES, MAX_TOP_N_TOKENS

NonEmptyStr = Annotated[str, Field(min_length=1)]
PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, description="0 disables top-k.")]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]
TopN = Annotated[int, Field(ge=0, le=MAX_TOP_N_TOKENS)]
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_SEQUENCES)]
