"""``option.speculative_config``: vLLM's speculative-decoding settings, with vLLM's field names.

The value is a JSON object (a properties or environment string, or a mapping from the Python API)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}

LMI's own keys for a draft model, ``option.speculative_draft_model`` and ``option.speculative_length``
(``lmi_draft_model``), give the same ``draft_model`` setting.

Parsed here into a frozen ``SpeculativeConfig``; what is wrong in it is a ``ValueError`` naming the
field, which the loader reports against ``option.speculative_config``. Whether a backend can run the
method is the engine's to say at start-up (``engine.speculation.check_speculation``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KEY = "option.speculative_config"
# vLLM's SpeculativeMethod values (vllm/config/speculative.py) that this project knows by name.
# "ngram" and "draft_model" run in the CPU engine; the others are refused at start-up as "not
# supported yet on this backend".
NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
DRAFT_MODEL_KEY = "option.speculative_draft_model"  # LMI's names for a draft model
LENGTH_KEY = "option.speculative_length"
DEFAULT_SPECULATIVE_LENGTH = 5  # LMI's speculative_length when only the draft model is given
VLLM_METHODS = frozenset(
    {
        "ngram",
        "ngram_gpu",
        "draft_model",
        "medusa",
        "mlp_speculator",
        "suffix",
        "eagle",
        "eagle3",
        "mtp",
        "custom_class",
    }
)
# vLLM's prompt-lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def json_value(text: str) -> Any:
    """A key's JSON text decoded; a ValueError saying where it is not JSON (the loader adds the key).
    Here, the lowest module of ``config`` that reads JSON keys: ``options`` uses it too."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object: {exc.msg} at column {exc.colno}") from exc


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """One speculative-decoding setting. Invariants: ``num_speculative_tokens >= 1``; for
    ``ngram``, ``1 <= prompt_lookup_min <= prompt_lookup_max``; ``method`` is one of vLLM's; a
    ``draft_model`` names its ``model`` (a path or name, fetched and checked by the engine)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # the draft model (draft_model; eagle...: not run here yet)
    # The key it was configured with, for start-up errors (LMI's draft-model keys or this one).
    key: str = field(default=KEY, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The setting with vLLM's names, as it would be written in serving.properties."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == NGRAM:
            out |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.model is not None:
            out["model"] = self.model
        return out

    def __str__(self) -> str:  # what print-config and write_properties show
        return json.dumps(self.to_json(), separators=(",", ":"))


def _positive_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """``value`` (a JSON string, a mapping, a ``SpeculativeConfig`` or None/empty) as a
    ``SpeculativeConfig``; vLLM's defaults: a ``model`` alone means ``draft_model``, and for
    ``ngram`` a missing lookup bound equals the other (both missing: 5)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        value = json_value(value)
    if not isinstance(value, Mapping):
        raise ValueError('must be a JSON object such as {"method": "ngram", "num_speculative_tokens": 4}')
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    model = value.get("model")
    method = value.get("method") or ("draft_model" if model else None)
    if method not in VLLM_METHODS:
        raise ValueError(f"method {method!r} is not a speculative method; use 'ngram'")
    if method == DRAFT_MODEL and not model:
        raise ValueError("method 'draft_model' needs model (the draft's path or name)")
    k = _positive_int(value, "num_speculative_tokens")
    if k is None:
        raise ValueError("num_speculative_tokens is required (an integer >= 1)")
    low = _positive_int(value, "prompt_lookup_min")
    high = _positive_int(value, "prompt_lookup_max")
    low, high = low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP
    if low > high:
        raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    return SpeculativeConfig(str(method), k, low, high, str(model) if model is not None else None)


def lmi_draft_model(model: str, length: int | None) -> SpeculativeConfig:
    """LMI's ``option.speculative_draft_model`` and ``option.speculative_length`` (default
    ``DEFAULT_SPECULATIVE_LENGTH``) as the ``draft_model`` setting vLLM's JSON would give."""
    if not model.strip():
        raise ValueError("must name the draft model (a path or name)")
    k = length or DEFAULT_SPECULATIVE_LENGTH
    return SpeculativeConfig(DRAFT_MODEL, k, model=model.strip(), key=DRAFT_MODEL_KEY)
