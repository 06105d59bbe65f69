"""neuron_lmi.server.reasoning: the split, its stream, the tokenizer check, the grammar, the message."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from neuron_lmi.engine.grammar import grammar_text
from neuron_lmi.engine.types import FinishReason, GrammarSpec, TokenEvent
from neuron_lmi.server.reasoning import (
    PARSERS,
    Reasoner,
    ReasoningChoiceStream,
    ReasoningStream,
    reasoner_for,
    reasoning_message,
    split,
    think_grammar,
)
from neuron_lmi.server.tool_parsers import FunctionSpec, get_parser
from neuron_lmi.server.tools import ToolPlan

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
CASES: list[tuple[str, str, tuple[str, str], tuple[str, str]]] = [
    # text, why, deepseek_r1 (thinking, answer), qwen3 (thinking, answer)
    ("<think>\nplan\n</think>\n\nHi", "a whole block", ("\nplan\n", "\n\nHi"), ("\nplan\n", "\n\nHi")),
    ("plan</think>Hi", "R1 after a template that opened the block", ("plan", "Hi"), ("", "plan</think>Hi")),
    ("Hi there", "no tags", ("Hi there", ""), ("", "Hi there")),
    ("<think>plan, cut sh", "cut by max_tokens", ("plan, cut sh", ""), ("plan, cut sh", "")),
    (
        "  <think>a</think>b</think>c",
        "whitespace first; first end tag",
        ("a", "b</think>c"),
        ("a", "b</think>c"),
    ),
    ("Hi <think>a</think>b", "a late block is no block", ("Hi <think>a", "b"), ("", "Hi <think>a</think>b")),
    ("<thi", "a tag cut short", ("<thi", ""), ("", "<thi")),
    ("", "nothing", ("", ""), ("", "")),
]


@pytest.mark.parametrize(("text", "why", "r1", "qwen3"), CASES, ids=[c[1] for c in CASES])
def test_split_matches_vllm_parsers(text: str, why: str, r1: tuple[str, str], qwen3: tuple[str, str]) -> None:
    assert split(R1, text) == r1
    assert split(QWEN3, text) == qwen3


@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=lambda f: f.name)
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_a_stream_releases_what_split_finds_however_the_text_is_cut(fmt: Any, text: str) -> None:
    for size in (1, 2, 3, 5):
        stream = ReasoningStream(fmt)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == split(fmt, text)
        thinking_done = False  # once an answer piece went out, no thinking follows
        for reasoning, content in pieces:
            assert not (thinking_done and reasoning)
            thinking_done = thinking_done or bool(content)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int], special: set[int]) -> None:
        self.vocab, self.all_special_ids = vocab, sorted(special)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_reasoner_needs_a_known_parser_and_the_tags_in_the_vocabulary() -> None:
    tok = FakeTokenizer({"<think>": 5, "</think>": 6, "a": 0}, special={6})
    assert reasoner_for(None, tok) is None
    reasoner = reasoner_for("qwen3", tok)
    assert reasoner is not None and reasoner.ids == (5, 6) and reasoner.markers == {"</think>"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"):
        reasoner_for("granite", tok)
    with pytest.raises(ValueError, match="has no '</think>'"):
        reasoner_for("deepseek_r1", FakeTokenizer({"<think>": 5}, set()))


class ByteTokenizer:
    """Bytes, then <think>, </think> and an EOS, for llguidance (special tags when asked)."""

    def __init__(self, special_tags: bool) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"<think>", b"</think>", b"<eos>"]
        self.special_token_ids = [256, 257, 258] if special_tags else [258]
        self.eos_token_id, self.bos_token_id = 258, None

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def _accepts(spec: GrammarSpec, pieces: list[str], special_tags: bool) -> bool:
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer(special_tags)))
    matcher = llguidance.LLMatcher(tok, grammar_text(spec), log_level=0)
    tags = {"<think>": 256, "</think>": 257}
    ids = [i for p in pieces for i in ([tags[p]] if p in tags else list(p.encode()))]
    return matcher.consume_tokens(ids) and matcher.is_accepting()


ANSWER = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]})
THOUGHT = ["<think>", "free </thin text {", "</think>", '\n\n{"a": "x"}']


@pytest.mark.parametrize("special_tags", [False, True])
def test_a_grammar_constrains_the_answer_not_the_thinking(special_tags: bool) -> None:
    markers = frozenset({"<think>", "</think>"}) if special_tags else frozenset()
    r1 = think_grammar(Reasoner(R1, (256, 257), markers), ANSWER.named("response_format"))
    qwen3 = think_grammar(Reasoner(QWEN3, (256, 257), markers), ANSWER)
    assert r1.field == "response_format"
    for spec in (r1, qwen3):
        assert _accepts(spec, THOUGHT, special_tags)
        assert not _accepts(spec, ["<think>", "ok", "</think>", "free text"], special_tags)
    assert _accepts(r1, ["free", "</think>", '{"a":"x"}'], special_tags)  # R1: the prompt opened it
    assert not _accepts(r1, ['{"a":"x"}'], special_tags)  # R1 always thinks first
    assert _accepts(qwen3, ['{"a":"x"}'], special_tags)  # Qwen3 with enable_thinking false
    assert not _accepts(qwen3, ["free", "</think>", '{"a":"x"}'], special_tags)


HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("inner", "answer"),
    [
        (GrammarSpec.json_object(), "{}"),
        (GrammarSpec.regex(r"\d{2}/x"), "12/x"),
        (GrammarSpec.ebnf('start: "yes" | "no"'), "no"),
        (GrammarSpec.ebnf('root ::= "{" "}"'), "{}"),  # GBNF
        (get_parser("hermes").grammar([FunctionSpec("f", None, {"type": "object"})], True), HERMES_CALL),
    ],
    ids=["json_object", "regex", "lark", "gbnf", "hermes tool call"],
)
def test_every_kind_of_grammar_can_follow_a_think_block(inner: GrammarSpec, answer: str) -> None:
    spec = think_grammar(Reasoner(QWEN3, (256, 257), frozenset()), inner)
    assert _accepts(spec, ["<think>", "hm", "</think>", answer], False)
    assert not _accepts(spec, ["<think>", "hm", "</think>", "free text"], False)


def event(text: str, finish: FinishReason | None = None, token_text: str | None = None) -> TokenEvent:
    special = token_text is not None
    return TokenEvent("r", 0, 1, token_text or text, text, 0.0, special, 3, finish_reason=finish)


CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
HERMES = ToolPlan(get_parser("hermes"), (FunctionSpec("get_time", None, None),), parse=True)
QWEN3_TAGS = Reasoner(QWEN3, (1, 2), frozenset())


def test_tool_calls_are_read_from_the_answer_only() -> None:
    events = [
        event("<think>"),
        event(f"maybe {CALL}?"),
        event("</think>"),
        event(f"\n\n{CALL}", FinishReason.EOS_TOKEN),
    ]
    message, called = reasoning_message(QWEN3_TAGS, HERMES, events, include=True)
    assert called and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert message["reasoning"] == message["reasoning_content"] == f"maybe {CALL}?"
    message, called = reasoning_message(QWEN3_TAGS, HERMES, events[:3], include=False)
    assert not called and message["content"] is None and message["reasoning"] is None


def test_special_tags_come_back_from_the_token_text() -> None:
    """A tokenizer where </think> is special: the detokenizer skips it, the split must not."""
    reasoner = Reasoner(R1, (1, 2), frozenset({"</think>"}))
    events = [event("plan"), event("", token_text="</think>"), event("Hi", FinishReason.EOS_TOKEN)]
    no_tools = ToolPlan(get_parser("hermes"))
    message, _ = reasoning_message(reasoner, no_tools, events, include=True)
    assert (message["reasoning"], message["content"]) == ("plan", "Hi")


def test_stream_sends_thinking_then_the_answer_and_never_the_tags() -> None:
    stream = ReasoningChoiceStream(QWEN3_TAGS, HERMES, include=True)
    texts = ["<think>", "a", "</", "think>", "\n\n", CALL[:15], CALL[15:]]
    chunks: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        chunks += stream.chunks(
            0, event(text, FinishReason.EOS_TOKEN if last else None), None, "stop" if last else None
        )
    deltas = [c["delta"] for c in chunks]
    kinds = [next(iter(d)) for d in deltas]
    assert kinds[0] == "reasoning" and kinds.count("tool_calls") == 2
    assert "".join(d.get("content", "") for d in deltas) == "\n\n"  # before the call, as without thinking
    assert "".join(d.get("reasoning", "") for d in deltas) == "a"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "think>" not in json.dumps(deltas)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    quiet = ReasoningChoiceStream(QWEN3_TAGS, ToolPlan(get_parser("hermes")), include=False)
    out = [quiet.chunks(0, event(t), None, None) for t in ("<think>", "a", "</think>")]
    assert out == [[], [], []]  # nothing to send: no thinking asked for, no answer yet
    (last,) = quiet.chunks(0, event("b", FinishReason.LENGTH), {"content": []}, "length")
    assert last["delta"] == {"content": "b"} and last["logprobs"] == {"content": []}
