"""Pure translations between neuron-lmi's engine types and vLLM's, testable without vLLM.

vLLM objects are read by attribute only (``CompletionOutput.token_ids/text/logprobs/finish_reason/
stop_reason``, ``Logprob.logprob/rank/decoded_token``), so tests pass simple stand-ins.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from neuron_lmi.engine.types import (
    EngineOverloadedError,
    FinishReason,
    GrammarKind,
    GrammarSpec,
    InvalidRequestError,
    PromptToken,
    SamplingParams,
    StopText,
    TokenEvent,
    TopToken,
)

# A request whose stream ends without a token (aborted inside vLLM) still gets a last event.
NO_TOKEN_ID = -1
# Sampling fields a model's generation_config.json may default (vLLM's get_diff_sampling_param).
DEFAULTABLE = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# vLLM's parameter names -> the engine's (the server then names them in each API's words).
VLLM_FIELDS = {"max_tokens": "max_new_tokens", "logprobs": "top_n_tokens", "prompt": "inputs"}
_LEADING_NAME = re.compile(r"^([a-z_]+) must\b")
_PROMPT = re.compile(r"\bprompt\b", re.IGNORECASE)


def sampling_kwargs(params: SamplingParams, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (the caller adds ``output_kind``).

    ``logprobs`` is requested (at least 0: the sampled token alone) unless the caller said it does
    not read them (``params.logprobs`` False, as for OpenAI requests without ``logprobs`` and LMI/TGI
    requests without ``details``/``top_n_tokens``): computing them costs vLLM throughput.
    ``top_n_tokens`` adds that many alternatives. Stop strings are cut from the text as OpenAI does,
    or kept (``include_stop_str_in_output``) for vLLM's flag and for TGI/LMI, whose text keeps them
    (vLLM ends the text with the stop string, TGI with the token that completed it: the same text
    unless a stop string ends inside a token). ``defaults`` (the model's generation_config.json, as
    vLLM's server reads it) fill the fields the request left unset (``params.unset``), as vLLM's
    server does: request, then model, then the neutral value.
    """
    kwargs = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.top_n_tokens if params.logprobs or params.top_n_tokens else None,
        "include_stop_str_in_output": params.stop_text is not StopText.CUT,
        "skip_special_tokens": params.skip_special_tokens,
    }
    kwargs.update(_non_neutral(params))
    for name in DEFAULTABLE:
        if name in params.unset and defaults and defaults.get(name) is not None:
            kwargs[name] = defaults[name]
    return kwargs


def _non_neutral(params: SamplingParams) -> dict[str, Any]:
    """The fields beyond the basics, only where they ask for something (neutral ones are left to
    vLLM's defaults and the model's generation_config.json)."""
    extras: dict[str, Any] = {
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "min_p": params.min_p,
        "min_tokens": params.min_tokens,
        "logit_bias": dict(params.logit_bias),
        "stop_token_ids": list(params.stop_token_ids),
        "structured_outputs": structured_outputs(params.grammar),
    }
    out = {name: value for name, value in extras.items() if value}
    if params.prompt_logprobs is not None:  # 0 asks for the prompt tokens' own log-probabilities
        out["prompt_logprobs"] = params.prompt_logprobs
    return out


def structured_outputs(grammar: GrammarSpec | None) -> dict[str, Any] | None:
    """Keyword arguments for vLLM's ``StructuredOutputsParams`` (the backend builds it). JSON takes
    vLLM's defaults (whitespace allowed), as on the CPU engine; the llguidance options a schema
    carries (``x-guidance``, from ``structured_outputs``' whitespace fields) become vLLM's own."""
    if grammar is None:
        return None
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        schema = grammar.schema()
        options = schema.pop("x-guidance", None) if isinstance(schema, dict) else None
        out: dict[str, Any] = {"json": schema}
        if options and options.get("whitespace_flexible") is False:
            out["disable_any_whitespace"] = True
        if options and options.get("whitespace_pattern") is not None:
            out["whitespace_pattern"] = options["whitespace_pattern"]
        return out
    if grammar.kind is GrammarKind.JSON_OBJECT:
        return {"json_object": True}
    if grammar.kind is GrammarKind.REGEX:
        return {"regex": grammar.value}
    return {"grammar": grammar.value}


def prompt_tokens(
    ids: Sequence[int],
    prompt_logprobs: Sequence[Mapping[int, Any] | None] | None,
    top_n: int,
    decode_token: Callable[[int], str],
) -> tuple[PromptToken, ...] | None:
    """vLLM's ``RequestOutput.prompt_logprobs`` (None first, then {token id: Logprob} per position)
    as the engine's scored prompt."""
    if prompt_logprobs is None:
        return None
    out = []
    for i, tid in enumerate(ids):
        position = prompt_logprobs[i] if i < len(prompt_logprobs) else None
        chosen = position.get(tid) if position else None
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else None
        out.append(
            PromptToken(
                int(tid),
                text if text is not None else decode_token(int(tid)),
                float(chosen.logprob) if chosen is not None else None,
                top_tokens(position, top_n),
            )
        )
    return tuple(out)


def refusal(exc: BaseException) -> InvalidRequestError | EngineOverloadedError:
    """A vLLM client error (``VLLMValidationError``, a ``ValueError`` from ``SamplingParams``, a
    ``GracefulHTTPError``) as the engine boundary's exception, naming the field when vLLM does
    (``parameter``), when its message starts with one (``repetition_penalty must be ...``), or
    ``inputs`` for a prompt vLLM refuses (too long, empty)."""
    message = str(exc.args[0]) if exc.args else str(exc)
    status = getattr(exc, "http_status", None)
    if status is not None and int(status) in (429, 503):
        return EngineOverloadedError(message)
    field = getattr(exc, "parameter", None)
    if field is None:
        match = _LEADING_NAME.match(message)
        field = match.group(1) if match else ("inputs" if _PROMPT.search(message) else None)
    return InvalidRequestError(message, VLLM_FIELDS.get(field, field) if field else None)


def map_finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """vLLM's ``finish_reason``/``stop_reason`` -> LMI's name.

    vLLM says "stop" for both an EOS (stop_reason None, or the id of a stop token) and a stop
    string (stop_reason is that string); LMI tells them apart.
    """
    if reason is None:
        return None
    if reason == "length":
        return FinishReason.LENGTH
    if reason == "stop":
        return FinishReason.STOP_SEQUENCE if isinstance(stop_reason, str) else FinishReason.EOS_TOKEN
    if reason == "abort":
        return FinishReason.ABORT
    return FinishReason.ERROR


def top_tokens(position: Mapping[int, Any] | None, top_n: int) -> tuple[TopToken, ...]:
    """The ``top_n`` most likely tokens at one position, most likely first.

    vLLM's dict holds the sampled token plus the top-n; the sampled token is an alternative only
    when it is itself among the top-n.
    """
    if not position or top_n <= 0:
        return ()
    ranked = sorted(position.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:top_n]
    return tuple(TopToken(int(tid), lp.decoded_token or "", float(lp.logprob)) for tid, lp in ranked)


def delta_to_events(
    request_id: str,
    start_index: int,
    prompt_tokens: int,
    completion: Any,
    top_n: int,
    special_ids: Collection[int],
    decode_token: Callable[[int], str],
) -> list[TokenEvent]:
    """One vLLM DELTA output -> one event per new token.

    A delta can carry several tokens when the consumer lags (vLLM merges queued deltas); their
    text arrives as one string, so it rides on the delta's last event and earlier events carry "".
    The concatenated ``text`` of a stream therefore equals vLLM's text exactly.
    """
    ids: Sequence[int] = list(completion.token_ids or ())
    logprobs = completion.logprobs
    finish = map_finish_reason(completion.finish_reason, completion.stop_reason)
    text = completion.text or ""
    if not ids:
        if finish is None and not text:
            return []
        # No new token but a final state (or held-back text): close the stream on a token-less
        # event, shaped as the CPU engine's (id -1, logprob 0.0).
        return [
            TokenEvent(request_id, start_index, NO_TOKEN_ID, "", text, 0.0, False, prompt_tokens, (), finish)
        ]
    events = []
    last = len(ids) - 1
    for i, tid in enumerate(ids):
        position = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        chosen = position.get(tid) if position else None
        token_text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else None
        events.append(
            TokenEvent(
                request_id=request_id,
                index=start_index + i,
                token_id=int(tid),
                token_text=token_text if token_text is not None else decode_token(int(tid)),
                text=text if i == last else "",
                logprob=float(chosen.logprob) if chosen is not None else 0.0,
                special=int(tid) in special_ids,
                prompt_tokens=prompt_tokens,
                top_tokens=top_tokens(position, top_n),
                finish_reason=finish if i == last else None,
            )
        )
    return events
