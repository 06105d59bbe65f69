"""Reasoning output by vLLM's parser names (``option.reasoning_parser``), read from the generated text.

    deepseek_r1  [<think>] thinking </think> answer    no </think>: all of it is thinking
    qwen3        <think> thinking </think> answer      no <think> first: all of it is answer

The split runs in the server on the text the engine returns, so it works on every backend. A chat
choice gets ``message.reasoning`` (and vLLM's older name ``reasoning_content``, same value) and
``content`` holds the answer only; a stream sends ``delta.reasoning`` chunks, then the answer's
content chunks. The tags never reach the client. ``include_reasoning: false`` drops the thinking.

deepseek_r1 follows vLLM's ``DeepSeekR1ReasoningParser``: R1's chat template may end the prompt with
``<think>\\n`` so the output starts inside the thinking, and a leading ``<think>`` is dropped when the
model writes it. qwen3 follows vLLM's ``Qwen3ReasoningParser`` up to v0.12: thinking only inside a
``<think>`` block that opens the output (leading whitespace allowed); with ``enable_thinking: false``
Qwen3's template closes an empty block in the prompt, so the output is all answer. Unlike vLLM's,
text before a late ``<think>`` is not dropped: the whole output is then answer. A block cut by
``max_tokens`` is thinking in both (``content`` null), as vLLM streams it and as its later Qwen3
parser also answers unstreamed.

Structured output (and a forced tool call) constrains the answer, not the thinking, as in vLLM:
the grammar becomes "a think block, then the constraint" (:func:`with_think_block`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from neuron_lmi.engine.grammar import with_json_options
from neuron_lmi.engine.types import GrammarKind, GrammarSpec, SamplingParams, TokenEvent
from neuron_lmi.server.tool_parsers.base import held_prefix
from neuron_lmi.server.tools import ToolChoiceStream, ToolPlan, tool_message, tool_text

# Whitespace a model writes between </think> and its answer (Qwen3: "\n\n"), bounded.
GAP = r"/[ \t\r\n]{0,8}/"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One parser: its tags, and whether thinking needs the start tag (else it is the output's start)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    start_required: bool = False


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1"),
    "qwen3": ReasoningFormat("qwen3", start_required=True),
}


class Phase(enum.Enum):
    HEAD = "head"  # nothing but whitespace or part of the start tag yet
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(slots=True)
class ReasoningStream:
    """The split of one output as its text arrives.

    Invariants: what ``feed`` and ``finish`` returned, joined, is the split of the whole text (as
    :func:`split`); ``held`` is text not yet released: whitespace or a start-tag prefix in HEAD, a
    possible end-tag prefix in REASONING, nothing in CONTENT.
    """

    fmt: ReasoningFormat
    phase: Phase = Phase.HEAD
    held: str = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """(thinking, answer) released by ``piece``; each may be empty."""
        self.held += piece
        reasoning = ""
        if self.phase is Phase.HEAD:
            head, start = self.held.lstrip(), self.fmt.start
            if len(head) < len(start) and start.startswith(head):
                return "", ""
            if head.startswith(start):
                self.held, self.phase = head[len(start) :], Phase.REASONING
            else:
                self.phase = Phase.CONTENT if self.fmt.start_required else Phase.REASONING
        if self.phase is Phase.REASONING:
            end = self.held.find(self.fmt.end)
            if end < 0:
                cut = len(self.held) - held_prefix(self.held, self.fmt.end)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(self.fmt.end) :]
            self.phase = Phase.CONTENT
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left at the end: thinking cut short stays thinking."""
        rest, self.held = self.held, ""
        if self.phase is Phase.CONTENT or (self.phase is Phase.HEAD and self.fmt.start_required):
            return "", rest
        return rest, ""


def split(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """A whole output as (thinking, answer), without the tags; each may be empty."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    return reasoning + rest_reasoning, content + rest_content


@dataclass(frozen=True, slots=True)
class Reasoner:
    """A format bound to a tokenizer that has both tags in its vocabulary.

    ``markers`` are the tags that are special tokens there (the detokenizer skips those, so the
    split puts them back from the token's text); ``ids`` the tags' token ids (start, end).
    """

    fmt: ReasoningFormat
    ids: tuple[int, int]
    markers: frozenset[str]


def _is_special(tokenizer: Any, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if token_id in added:
        return bool(getattr(added[token_id], "special", False))
    return token_id in set(getattr(tokenizer, "all_special_ids", ()) or ())


def reasoner_for(name: str | None, tokenizer: Any) -> Reasoner | None:
    """The server's reasoner (None without a parser); ValueError for an unknown parser or a tokenizer
    without the parser's tags (vLLM refuses both at start-up too)."""
    if name is None:
        return None
    fmt = PARSERS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (fmt.start, fmt.end) if tag not in vocab]
    if missing:
        raise ValueError(
            f"reasoning parser {name!r} needs the tokens {fmt.start!r} and {fmt.end!r}; "
            f"the model's tokenizer has no {' or '.join(map(repr, missing))}"
        )
    start, end = int(vocab[fmt.start]), int(vocab[fmt.end])
    markers = frozenset(tag for tag, i in ((fmt.start, start), (fmt.end, end)) if _is_special(tokenizer, i))
    return Reasoner(fmt, (start, end), markers)


# -- structured output ---------------------------------------------------------------------------


def _answer_rule(spec: GrammarSpec) -> str:
    """The constraint as the body of a llguidance Lark rule."""
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
        return "%json " + json.dumps(with_json_options(spec.schema()), separators=(",", ":"))
    if spec.kind is GrammarKind.REGEX:
        return "/" + llguidance.regex_to_lark(spec.value) + "/"
    return "%lark {\n" + any_to_lark(spec.value) + "\n}"


def think_grammar(reasoner: Reasoner, spec: GrammarSpec) -> GrammarSpec:
    """``spec`` with the format's think block allowed in front (required for deepseek_r1, whose
    output starts inside it; optional for qwen3). The tags are matched by token id: llguidance reads
    every added token of a Hugging Face tokenizer as special, whose text no string literal matches."""
    start_id, end_id = reasoner.ids
    gap = f"thought <[{end_id}]> {GAP}"
    if reasoner.fmt.start_required:
        head = f"start: think? answer\nthink: <[{start_id}]> {gap}"
    else:
        head = f"start: <[{start_id}]>? {gap} answer"
    lark = f"{head}\nthought: /(?s:.*)/\nanswer: {_answer_rule(spec)}\n"
    return GrammarSpec.ebnf(lark).named(spec.field)


def with_think_block(params: SamplingParams, reasoner: Reasoner | None) -> SamplingParams:
    """``params`` whose grammar (if any) lets the model think first."""
    if reasoner is None or params.grammar is None:
        return params
    return dataclasses.replace(params, grammar=think_grammar(reasoner, params.grammar))


# -- the chat response ---------------------------------------------------------------------------


def reasoning_fields(reasoning: str, include: bool) -> dict[str, str | None]:
    """vLLM's ``reasoning`` and its deprecated alias ``reasoning_content`` (null when empty or not
    asked for)."""
    value = reasoning if include and reasoning else None
    return {"reasoning": value, "reasoning_content": value}


def reasoning_message(
    reasoner: Reasoner, plan: ToolPlan, events: Sequence[TokenEvent], include: bool
) -> tuple[dict[str, Any], bool]:
    """A finished choice's ``message`` (and whether it holds tool calls): the tool parser reads the
    answer only, so a call after a think block parses as it does without one."""
    tags = reasoner.markers
    reasoning, content = split(reasoner.fmt, "".join(tool_text(e, tags) for e in events))
    marked = None
    if plan.parse:
        marked = split(reasoner.fmt, "".join(tool_text(e, tags | plan.parser.markers) for e in events))[1]
    message, called = tool_message(plan, events, content, marked)
    message["content"] = message.get("content") or None
    return {**message, **reasoning_fields(reasoning, include)}, called


def stream_markers(reasoner: Reasoner, plan: ToolPlan) -> frozenset[str]:
    """The special tokens whose text a streamed choice's split must see."""
    return reasoner.markers | (plan.parser.markers if plan.parse else frozenset())


def _chunk(idx: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}


@dataclass(slots=True)
class ReasoningChoiceStream:
    """One streamed choice of a reasoning model: ``delta.reasoning`` chunks, then the answer's
    content and ``delta.tool_calls`` chunks (the tool stream reads the answer only).

    Invariants: an event yields no chunk when it released nothing and carries neither
    log-probabilities nor the finish reason (the tags themselves); otherwise the first chunk has
    its log-probabilities and the last its finish reason ("tool_calls" once a call went out).
    """

    reasoner: Reasoner
    plan: ToolPlan
    include: bool
    split: ReasoningStream = dataclasses.field(init=False)
    tools: ToolChoiceStream | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.split = ReasoningStream(self.reasoner.fmt)
        self.tools = ToolChoiceStream(self.plan) if self.plan.parse else None

    def chunks(
        self, idx: int, event: TokenEvent, logprobs: dict[str, Any] | None, finish: str | None
    ) -> list[dict[str, Any]]:
        reasoning, content = self.split.feed(tool_text(event, stream_markers(self.reasoner, self.plan)))
        if event.finish_reason is not None:
            rest_reasoning, rest_content = self.split.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        out = [_chunk(idx, reasoning_fields(reasoning, True))] if reasoning and self.include else []
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.on_event(event, content)
        if content:
            out.append(_chunk(idx, {"content": content}))
        out += [_chunk(idx, {"tool_calls": [call]}) for call in calls]
        if not out and (logprobs is not None or finish is not None):
            out.append(_chunk(idx, {}))
        if out:
            out[0]["logprobs"] = logprobs
        if finish is not None:
            out[-1]["finish_reason"] = "tool_calls" if self.tools and self.tools.called else finish
        return out
