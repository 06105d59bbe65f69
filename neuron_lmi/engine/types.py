"""The data that crosses the engine boundary: sampling parameters in, token events out.

Everything here is plain and frozen so that the server, the CPU engine, the Neuron runner and the
vLLM adapter can share it without sharing any behaviour.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class FinishReason(enum.StrEnum):
    """Why a sequence stopped, with LMI's names (TGI and OpenAI names are derived at the edge)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORT = "abort"
    ERROR = "error"


class InvalidRequestError(ValueError):
    """A request the engine refuses before it runs. ``field`` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownAdapterError(InvalidRequestError):
    """A request names a LoRA adapter the engine does not serve (or is unloading): HTTP 404."""

    def __init__(self, adapter: str, field: str = "adapter") -> None:
        super().__init__(f"the adapter {adapter!r} does not exist", field)
        self.adapter = adapter


class EngineOverloadedError(RuntimeError):
    """The rolling batch and its bounded queue are full; the caller should retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served until it restarts. ``retry_after_s``:
    while a restart is under way, when to try again (None: no restart is coming)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# vLLM sets no limit; OpenAI allows 4. Matching costs a substring search per stop per token.
MAX_STOP_SEQUENCES = 64
MAX_TOP_N_TOKENS = 20
MAX_LOGIT_BIAS = 100.0
MAX_ADDITIVE_PENALTY = 2.0


class StopText(enum.StrEnum):
    """What a matched stop sequence leaves in a request's text."""

    CUT = "cut"  # OpenAI's: the text ends just before the stop sequence (held back until decided)
    INCLUDE = "include"  # vLLM's include_stop_str_in_output: the text ends with the stop sequence
    # TGI's (and LMI's): the text ends with the token that completed the stop sequence, so the
    # tokens' texts add up to the text, streamed or not; nothing is held back.
    TOKEN = "token"


class GrammarKind(enum.StrEnum):
    """What ``GrammarSpec.value`` holds (vLLM's structured-output kinds, by their usual names)."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema, as canonical JSON text
    JSON_OBJECT = "json_object"  # any JSON object; value is ""
    REGEX = "regex"  # a regular expression the whole output matches
    EBNF = "ebnf"  # a context-free grammar, GBNF (llama.cpp) or Lark syntax


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on a request's whole output; hashable, so compiled grammars cache on it.

    Build one with the constructors (``GrammarSpec.json_schema(schema_dict)``...): a JSON schema is
    stored as compact JSON text with its keys in the client's order, because the grammar generates
    an object's properties in the order the schema lists them (as OpenAI and vLLM do: a schema that
    asks for ``reasoning`` before ``answer`` gets them in that order).
    """

    kind: GrammarKind
    value: str = ""
    # The request field the grammar came from, as the client spelled it (``response_format``,
    # ``tools``, ``parameters.grammar``): admission's refusal names it. Not part of the grammar.
    field: str = dataclasses.field(default="grammar", compare=False)

    def named(self, field: str) -> GrammarSpec:
        """This grammar, refused (if it is) under ``field``."""
        return dataclasses.replace(self, field=field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> GrammarSpec:
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls(GrammarKind.EBNF, grammar)

    def schema(self) -> Any:
        """The JSON schema (``{"type": "object"}`` for JSON_OBJECT); None for regex and EBNF."""
        if self.kind is GrammarKind.JSON_OBJECT:
            return {"type": "object"}
        return json.loads(self.value) if self.kind is GrammarKind.JSON_SCHEMA else None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy decoding (argmax); top_k/top_p then have no effect.
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` makes sampling reproducible
    independently of what else is in the batch (each request owns its random generator).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_n_tokens: int = 0
    ignore_eos: bool = False
    # Whether the caller reads per-token log-probabilities. A backend where they cost extra (vLLM)
    # may skip them when False and report 0.0; so does the CPU engine when no request of a batch asks.
    logprobs: bool = True
    # Whether the caller reads tokens as they come. False lets a backend deliver the result at once
    # (vLLM's FINAL_ONLY output, as vLLM's server does for non-streaming requests).
    stream: bool = True
    # Sampling fields the request left unset (they hold neutral values here). A backend that knows
    # the model's defaults (vLLM reads generation_config.json) fills these, as vLLM's server does.
    unset: frozenset[str] = frozenset()
    # OpenAI's additive penalties over the generated tokens: logits -= presence * (count > 0)
    # + frequency * count. Both in [-2, 2]; 0 disables.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs added to the logits before sampling, bias in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # EOS is masked until this many tokens were generated (stop strings still end the text).
    min_tokens: int = 0
    # Tokens whose probability is below ``min_p`` x the most likely token's are dropped (0 disables).
    min_p: float = 0.0
    # Constrains the whole output (JSON schema, regex, grammar); None costs nothing.
    grammar: GrammarSpec | None = None
    # Score the prompt: None no, 0 each prompt token's log-probability, k > 0 also k alternatives.
    prompt_logprobs: int | None = None
    # What a matched stop sequence leaves in the text (OpenAI cuts it, TGI/LMI keep it).
    stop_text: StopText = StopText.CUT
    # Token ids that end the request as EOS does (vLLM's stop_token_ids; printed as nothing).
    stop_token_ids: tuple[int, ...] = ()
    # Whether special tokens (EOS, tool-call markers...) are left out of the text (vLLM's default).
    skip_special_tokens: bool = True

    # LMI/TGI's ``do_sample``: False decodes greedily whatever ``temperature`` says (the value is
    # still validated, as TGI refuses ``temperature: -1`` without sampling).
    do_sample: bool = True
    # The LoRA adapter the request runs with (OpenAI's ``model``, LMI's ``parameters.adapters``,
    # TGI's ``parameters.adapter_id``); None: the base model. Not sampling, but a request field that
    # crosses every boundary with the rest: admission checks that the engine serves it.
    adapter: str | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def validate(self, max_new_tokens_limit: int | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the first parameter that is out of range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequestError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", "max_new_tokens"
            )
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequestError(
                f"max_new_tokens={self.max_new_tokens} exceeds the limit of {max_new_tokens_limit}",
                "max_new_tokens",
            )
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise InvalidRequestError(
                f"temperature must be in [0, 100], got {self.temperature!r}", "temperature"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be a non-negative integer, got {self.top_k!r}", "top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not (0.0 < self.repetition_penalty <= 100.0):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}",
                "repetition_penalty",
            )
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", "stop")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop sequences must be non-empty strings", "stop")
        if not (0 <= self.top_n_tokens <= MAX_TOP_N_TOKENS):
            raise InvalidRequestError(
                f"top_n_tokens must be in [0, {MAX_TOP_N_TOKENS}], got {self.top_n_tokens!r}", "top_n_tokens"
            )
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed!r}", "seed")
        self._validate_extras()

    def _validate_extras(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= MAX_ADDITIVE_PENALTY):
                limit = f"{MAX_ADDITIVE_PENALTY:g}"
                raise InvalidRequestError(f"{name} must be in [-{limit}, {limit}], got {value!r}", name)
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {token}",
                    "logit_bias",
                )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids (non-negative)", "stop_token_ids")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_N_TOKENS:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, {MAX_TOP_N_TOKENS}], got {self.prompt_logprobs!r}",
                "prompt_logprobs",
            )


@dataclass(frozen=True, slots=True)
class TopToken:
    """One alternative at a position: token id, its text, and its log-probability."""

    id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token of one request, in order.

    ``text`` is the new *printable* text this token adds (it can be empty while a multi-byte
    character or a possible stop sequence is held back). The last event of a stream has
    ``finish_reason`` set; its ``text`` flushes whatever was held back. An event that carries no
    token (an abort, or an error with ``error`` set) has ``token_id == -1``.
    """

    request_id: str
    index: int
    token_id: int
    token_text: str
    text: str
    logprob: float
    special: bool
    prompt_tokens: int
    top_tokens: tuple[TopToken, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    # The scored prompt (``SamplingParams.prompt_logprobs``), on a request's first event only.
    prompt: tuple[PromptToken, ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptToken:
    """A prompt token with its log-probability given the tokens before it (None for the first),
    and the most likely alternatives at its position when asked for (``prompt_logprobs > 0``)."""

    id: int
    text: str
    logprob: float | None
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics and /ping."""

    rows_total: int
    rows_used: int
    positions_used: int
    waiting: int
    running: int
    alive: bool
    extra: dict[str, float] = field(default_factory=dict)
