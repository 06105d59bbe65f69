"""Incremental detokenization that never emits half a UTF-8 character or drops a leading space.

Decoding a growing window and emitting only the new suffix keeps byte-level BPE merges and
SentencePiece's leading-space handling right; a window that ends in U+FFFD is an incomplete
character and is held until the next token completes it.

``TextStream`` adds stop sequences on top: it is what turns one request's token ids into the text a
client sees. It lives in the engines' fronts only (``TextSink`` for the in-process fronts, the API
process for ``ProcessEngine``): the core ends requests on tokens (EOS, stop ids, length) and never
sees text. A Hugging Face *fast* tokenizer is decoded through its Rust backend directly,
which is what ``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``
does after several microseconds of Python per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from neuron_lmi.engine.stops import StopMatcher
from neuron_lmi.engine.types import FinishReason, PromptToken, SamplingParams, StopText, TokenEvent, TopToken

# Prompt tokens kept as left context, so the first generated token decodes with its space.
CONTEXT_TOKENS = 5

Decode = Callable[[list[int]], str]


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Decode:
    """``ids -> text`` with special tokens skipped (unless asked not to) and no clean-up, as fast as
    the tokenizer allows."""
    skip = skip_special_tokens
    backend = _plain_fast_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)  # type: ignore[no-any-return]
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)  # type: ignore[no-any-return]


def _plain_fast_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast tokenizer whose ``decode`` is transformers' own (a subclass
    that overrides it gets its override)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    return getattr(tokenizer, "_tokenizer", None)


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, one token at a time.

    Invariants: ``ids[prefix_offset:read_offset]`` is the window whose text was already emitted
    (left context for the next token); everything after ``read_offset`` is held.
    """

    __slots__ = ("_decode", "_prefix_text", "ids", "prefix_offset", "read_offset")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        decode: Decode | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = decode or text_decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._prefix_text: str | None = None  # text of the emitted window, decoded once per window

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        return self._prefix_text

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._prefix()
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._prefix_text = None
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character stays replaced)."""
        prefix = self._prefix()
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = None
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class TextStream:
    """The printable text of one request: detokenized, with stop sequences held back and cut.

    ``add`` takes each generated token with the finish reason the engine gave it (token-level:
    EOS or length); it returns the text to print and the finish reason the client sees, which is
    ``STOP_SEQUENCE`` when a stop sequence matched (the caller then ends the request).
    """

    __slots__ = ("detokenizer", "stops")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stops: tuple[str, ...],
        decode: Decode | None = None,
        stop_text: StopText = StopText.CUT,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, decode)
        self.stops = StopMatcher(stops, stop_text)

    def add(self, token_id: int, finish: FinishReason | None) -> tuple[str, FinishReason | None]:
        if finish is FinishReason.EOS_TOKEN:
            text = ""  # EOS prints nothing; what was held is flushed below
        else:
            text, hit = self.stops.add(self.detokenizer.add(token_id))
            if hit:
                return text, FinishReason.STOP_SEQUENCE
        if finish in (FinishReason.EOS_TOKEN, FinishReason.LENGTH):
            tail, hit = self.stops.add(self.detokenizer.flush())
            text += tail if hit else tail + self.stops.flush()
            finish = FinishReason.STOP_SEQUENCE if hit else finish
        return text, finish


def text_stream(
    tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, skipping: Decode | None = None
) -> TextStream:
    """The ``TextStream`` of one request: its stop sequences and ``stop_text``; special tokens
    skipped unless ``params.skip_special_tokens`` is off. ``skipping`` is the front's shared
    ``text_decoder(tokenizer)`` (built once; made here when not given)."""
    if params.skip_special_tokens:
        decode = skipping or text_decoder(tokenizer)
    else:
        decode = text_decoder(tokenizer, False)
    return TextStream(tokenizer, prompt_ids, params.stop, decode, params.stop_text)


class TokenTexts:
    """Each token id's own text, special tokens included, decoded once per id: an event's
    ``token_text`` and the texts of its alternatives and scored prompt. The core sends ids only;
    a front fills these in."""

    __slots__ = ("_decode", "_texts")

    def __init__(self, tokenizer: Any) -> None:
        self._decode = text_decoder(tokenizer, skip_special_tokens=False)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def alternatives(self, top: tuple[TopToken, ...]) -> tuple[TopToken, ...]:
        return tuple(TopToken(t.id, self(t.id), t.logprob) for t in top)

    def prompt(self, prompt: tuple[PromptToken, ...] | None) -> tuple[PromptToken, ...] | None:
        if prompt is None:
            return None
        return tuple(PromptToken(p.id, self(p.id), p.logprob, self.alternatives(p.top)) for p in prompt)


class TextSink:
    """An event sink that puts each token's texts on its event (``TextStream``, ``TokenTexts``)
    before passing it on. When a stop sequence ends the request here, the passed event says
    ``STOP_SEQUENCE`` and ``on_stop`` is called (the front then aborts the request in the core);
    nothing after a request's last event passes."""

    __slots__ = ("done", "on_stop", "sink", "text", "texts")

    def __init__(
        self,
        text: TextStream,
        texts: TokenTexts,
        sink: Callable[[TokenEvent], None],
        on_stop: Callable[[], None],
    ) -> None:
        self.text, self.texts, self.sink, self.on_stop, self.done = text, texts, sink, on_stop, False

    def __call__(self, event: TokenEvent) -> None:
        if self.done:
            return
        stopped = False
        if event.token_id >= 0:
            text, finish = self.text.add(event.token_id, event.finish_reason)
            stopped = finish is FinishReason.STOP_SEQUENCE and event.finish_reason is None
            texts = self.texts
            event = dataclasses.replace(
                event,
                token_text=texts(event.token_id),
                text=text,
                finish_reason=finish,
                top_tokens=texts.alternatives(event.top_tokens),
                prompt=texts.prompt(event.prompt),
            )
        self.done = event.finish_reason is not None
        self.sink(event)
        if stopped:
            self.on_stop()
