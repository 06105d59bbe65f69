"""Pure translations between neuron-lmi's engine types and vLLM's, testable without vLLM.

vLLM objects are read by attribute only (``CompletionOutput.token_ids/text/logprobs/finish_reason/
stop_reason``, ``Logprob.logprob/rank/decoded_token``), so tests pass simple stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent, TopToken

# A request whose stream ends without a token (aborted inside vLLM) still gets a last event.
NO_TOKEN_ID = -1


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (the caller adds ``output_kind=DELTA``).

    ``logprobs`` is requested (at least 0: the sampled token alone) unless the caller said it does
    not read them (``params.logprobs`` False, as for OpenAI requests without ``logprobs``): computing
    them costs vLLM throughput. ``top_n_tokens`` adds that many alternatives.
    Stop strings are cut from the text, as LMI and TGI do.
    """
    return {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.top_n_tokens if params.logprobs or params.top_n_tokens else None,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
    }


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
