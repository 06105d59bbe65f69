"""LMI (DJL Serving) and TGI request schemas, and the response bodies both APIs return.

One request schema serves ``/invocations``, ``/generate``, ``/`` and ``/generate_stream``: LMI's
``{"inputs", "parameters", "stream"}``, which TGI shares. TGI's client sends every parameter it
knows (``watermark``, ``grammar``, ``typical_p``...), so they are accepted, and refused by name
only when set to something this server cannot honour. ``parameters`` this server does not know
are passed over with a logged warning, as LMI does (LiteLLM's SageMaker provider sends its own
``sagemaker_base_url`` there); a known parameter of the wrong type is still refused by name. A stop
sequence ends the text as TGI's does: the text keeps it, and the tokens' texts add up to the text.
Response shapes differ:

    LMI token  {"id", "text", "log_prob", "special_token"}   (REFERENCE §2)
    TGI token  {"id", "text", "logprob", "special"}
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from neuron_lmi.engine.types import (
    FinishReason,
    SamplingParams,
    StopText,
    TokenEvent,
    TopToken,
)
from neuron_lmi.server.errors import Family, invalid
from neuron_lmi.server.generation import Collected
from neuron_lmi.server.schema_types import (
    NonEmptyStr,
    PositiveInt,
    RepetitionPenalty,
    RequestModel,
    Seed,
    Stop,
    TopK,
    TopN,
    TopP,
)
from neuron_lmi.server.schemas_grammar import TgiGrammar, tgi_grammar

DEFAULT_MAX_NEW_TOKENS = 30
MAX_BEST_OF = 16  # TGI's max_best_of (its launcher's default is 2; OpenAI's n/best_of limit here is 16)
# Parameters a model's generation_config.json may default; LMI/TGI have no min_p/presence_penalty.
DEFAULTABLE = ("temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty")
Style = Literal["lmi", "tgi"]
log = logging.getLogger(__name__)


class LmiParameters(RequestModel):
    """``parameters`` of an LMI/TGI request; None means "the server default". Keys it does not
    define are kept in ``model_extra`` and passed over (``to_sampling`` logs them)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_k: TopK | None = None
    top_p: TopP | None = None
    do_sample: bool | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: float | None = Field(
        default=None,
        ge=-2.0,
        le=2.0,
        description="In [-2, 2]: subtracted from a token's logit per time it was generated.",
    )
    stop: Stop | None = None
    seed: Seed | None = None
    details: bool = False
    decoder_input_details: bool = Field(
        default=False, description="Return the prompt's tokens and log-probabilities in details.prefill."
    )
    top_n_tokens: TopN | None = None
    return_full_text: bool = False
    truncate: PositiveInt | None = None
    typical_p: float | None = None
    best_of: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BEST_OF,
        description="Sample best_of sequences and return the one with the highest cumulative "
        "log-probability; the others in details.best_of_sequences (TGI). Needs sampling, no seed, no stream.",
    )
    watermark: bool = False
    grammar: TgiGrammar | None = Field(
        default=None, description="Constrain the output: a JSON Schema (type json) or a regex (type regex)."
    )
    ignore_eos: bool = False
    # LoRA: LMI's adapter per input (one name, or one per input of a list), TGI's adapter_id.
    adapters: str | list[str] | None = None
    adapter_id: str | None = None


class LmiRequest(RequestModel):
    """``{"inputs": str | [str], "parameters": {...}, "stream": bool}``."""

    inputs: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    parameters: LmiParameters = LmiParameters()
    stream: bool = False
    # LMI also takes the adapters beside ``inputs`` (as parameters.adapters).
    adapters: str | list[str] | None = None

    def adapter_list(self, n_inputs: int, family: Family) -> tuple[list[str | None], str]:
        """The adapter of each of ``n_inputs`` inputs (None: the base model) and the field that
        named them (TGI's ``parameters.adapter_id``, LMI's ``parameters.adapters`` or ``adapters``);
        a list must name one adapter per input."""
        p = self.parameters
        if p.adapter_id is not None:
            return [p.adapter_id or None] * n_inputs, "parameters.adapter_id"
        given, field = (
            (p.adapters, "parameters.adapters") if p.adapters is not None else (self.adapters, "adapters")
        )
        if isinstance(given, list):
            if len(given) != n_inputs:
                raise invalid(family, f"{field} lists {len(given)} names for {n_inputs} inputs", field)
            return [a or None for a in given], field
        return [given or None] * n_inputs, field

    def input_list(self, family: Family) -> list[str]:
        """The prompts, refusing an empty list or an empty prompt by name."""
        items = [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)
        if not items:
            raise invalid(family, "inputs must not be an empty list", "inputs")
        for i, text in enumerate(items):
            if not text:
                raise invalid(
                    family, "inputs must not be empty", "inputs" if len(items) == 1 else f"inputs.{i}"
                )
        return items


def _refuse_unsupported(p: LmiParameters, family: Family) -> None:
    unsupported = {
        "typical_p": p.typical_p is not None,
        "watermark": p.watermark,
    }
    for name, bad in unsupported.items():
        if bad:
            raise invalid(family, f"{name} is not supported by this server", f"parameters.{name}")
    if p.truncate is not None and p.truncate <= 0:
        raise invalid(family, f"truncate must be positive, got {p.truncate}", "parameters.truncate")


def _check_best_of(p: LmiParameters, family: Family, stream: bool) -> None:
    """TGI's rules for ``best_of`` > 1: candidates must differ (sampling, and no single seed shared
    by all), and only one sequence can be streamed."""
    if (p.best_of or 1) == 1:
        return
    field = "parameters.best_of"
    if not p.do_sample:
        raise invalid(family, "best_of > 1 needs sampling (do_sample: true)", field)
    if p.seed is not None:
        raise invalid(family, "seed must not be set when best_of > 1", "parameters.seed")
    if stream:
        raise invalid(family, "best_of > 1 is not supported when streaming tokens", field)


def to_sampling(p: LmiParameters, family: Family, stream: bool = True) -> SamplingParams:
    """LMI/TGI parameters as engine parameters; sampling happens only with ``do_sample: true``.

    The values are carried as sent and checked by admission (so ``temperature: -1`` is refused even
    without sampling); ``do_sample`` false makes decoding greedy. Log-probabilities are asked for
    only when the response shows them (``details``, ``top_n_tokens``); parameters left unset are
    named in ``unset`` for a backend with the model's own defaults (vLLM).
    """
    unset = {name for name in DEFAULTABLE if getattr(p, name) is None} | {"min_p", "presence_penalty"}
    if not p.do_sample:
        unset.discard("temperature")
    _refuse_unsupported(p, family)
    _check_best_of(p, family, stream)
    if p.model_extra:
        log.warning("parameters this server does not use, passed over: %s", ", ".join(sorted(p.model_extra)))
    stop = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop or ())
    return SamplingParams(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens,
        temperature=1.0 if p.temperature is None else p.temperature,
        top_k=0 if p.top_k is None else p.top_k,
        top_p=1.0 if p.top_p is None else p.top_p,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        stop=stop,
        seed=p.seed,
        top_n_tokens=0 if p.top_n_tokens is None else p.top_n_tokens,
        ignore_eos=p.ignore_eos,
        # best_of ranks candidates by their log-probabilities, so every backend must return them.
        logprobs=bool(p.details or p.top_n_tokens or (p.best_of or 1) > 1),
        stream=stream,
        unset=frozenset(unset),
        frequency_penalty=p.frequency_penalty or 0.0,
        grammar=tgi_grammar(p.grammar, family),
        prompt_logprobs=0 if p.decoder_input_details else None,
        stop_text=StopText.TOKEN,
        do_sample=p.do_sample,
    )


def token_dict(event_id: int, text: str, logprob: float, special: bool, style: Style) -> dict[str, Any]:
    if style == "lmi":
        return {"id": event_id, "text": text, "log_prob": logprob, "special_token": special}
    return {"id": event_id, "text": text, "logprob": logprob, "special": special}


def top_list(tops: tuple[TopToken, ...], special_ids: frozenset[int], style: Style) -> list[dict[str, Any]]:
    return [token_dict(t.id, t.text, t.logprob, t.id in special_ids, style) for t in tops]


def finish_name(reason: FinishReason | None) -> str:
    return "error" if reason in (None, FinishReason.ABORT) else reason.value


def stream_token(event: TokenEvent, style: Style) -> dict[str, Any]:
    """The per-token object of a stream: ``text`` is the printable increment, so texts concatenate
    to ``generated_text``."""
    return token_dict(event.token_id, event.text, event.logprob, event.special, style)


def lmi_details(
    out: Collected,
    inputs: str,
    p: LmiParameters,
    special_ids: frozenset[int],
    prefill: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """REFERENCE §2 ``details``; ``top_tokens`` only with ``top_n_tokens``, ``prefill`` only with
    ``decoder_input_details`` (prompt tokens with ``log_prob``, null for the first)."""
    details: dict[str, Any] = {
        "finish_reason": finish_name(out.finish_reason),
        "generated_tokens": out.generated_tokens,
        "inputs": inputs,
        "tokens": [token_dict(e.token_id, e.token_text, e.logprob, e.special, "lmi") for e in out.tokens],
    }
    if p.top_n_tokens:
        details["top_tokens"] = [top_list(e.top_tokens, special_ids, "lmi") for e in out.tokens]
    if prefill:
        details["prefill"] = prefill
    return details


def tgi_details(
    out: Collected,
    p: LmiParameters,
    prefill: list[dict[str, Any]],
    special_ids: frozenset[int],
    others: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """TGI's ``details`` as ``text_generation.types.Details`` parses it; ``others`` are the
    ``best_of_sequences`` (:func:`tgi_sequence` of each candidate not chosen)."""
    return {
        "finish_reason": finish_name(out.finish_reason),
        "generated_tokens": out.generated_tokens,
        "seed": p.seed,
        "prefill": prefill,
        "tokens": [token_dict(e.token_id, e.token_text, e.logprob, e.special, "tgi") for e in out.tokens],
        "top_tokens": [top_list(e.top_tokens, special_ids, "tgi") for e in out.tokens]
        if p.top_n_tokens
        else None,
        "best_of_sequences": others,
    }


def tgi_sequence(
    out: Collected, text: str, p: LmiParameters, prefill: list[dict[str, Any]], special_ids: frozenset[int]
) -> dict[str, Any]:
    """One of TGI's ``best_of_sequences``: a candidate's text with its own details."""
    details = tgi_details(out, p, prefill, special_ids)
    del details["best_of_sequences"]
    return {"generated_text": (text if p.return_full_text else "") + out.text, **details}
