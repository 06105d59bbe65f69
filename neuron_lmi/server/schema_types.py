"""Constrained field types shared by the request schemas, so ``/openapi.json`` states the limits the
server enforces (and pydantic enforces them first, naming the field). The limits themselves are the
engine's (``neuron_lmi.engine.types``); the engine still checks them for callers without HTTP.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class RequestModel(BaseModel):
    """A request object: unknown fields are refused by name, and ``null`` means "not set" for every
    known field (the field takes its default), as OpenAI's and vLLM's servers take it: their clients (the
    TGI client's ``chat``, LangChain, LiteLLM) send ``null`` for whatever the caller left out. A
    required field sent as ``null`` is refused as missing, by name."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = _field_names(cls)
        return {key: value for key, value in data.items() if value is not None or key not in names}


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """A model's field names as a body may spell them (name or alias), computed once per model."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
