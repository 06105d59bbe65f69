from __future__ import annotations

import pytest

from neuron_lmi.engine.detokenizer import IncrementalDetokenizer, TextSink, TokenTexts, text_stream
from neuron_lmi.engine.stops import StopMatcher
from neuron_lmi.engine.types import FinishReason, SamplingParams, StopText, TokenEvent


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out, hit = "", False
    for piece in pieces:
        text, hit = matcher.add(piece)
        out += text
        if hit:
            break
    return out, hit


def test_stop_split_across_pieces_is_excluded_and_stops():
    out, hit = feed(StopMatcher(("\n\nUser:",)), ["Hello", " there\n", "\nUs", "er: more"])
    assert hit
    assert out == "Hello there"


def test_partial_stop_prefix_is_held_then_released():
    matcher = StopMatcher(("STOP",))
    text, hit = matcher.add("abcST")
    assert (text, hit) == ("abc", False)
    text, hit = matcher.add("ay")
    assert (text, hit) == ("STay", False)
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins():
    out, hit = feed(StopMatcher(("world", "lo w")), ["hello world"])
    assert hit and out == "hel"


def test_flush_releases_held_text_at_the_end():
    matcher = StopMatcher(("</s>",))
    assert matcher.add("done </") == ("done ", False)
    assert matcher.flush() == "</"
    assert matcher.emitted_text == "done </"


def test_without_stops_everything_passes_through():
    assert feed(StopMatcher(()), ["a", "b"]) == ("ab", False)


PIECES = [" the", " primary", " col", "ors", ": red"]


@pytest.mark.parametrize(
    ("mode", "texts"),
    [
        # OpenAI: the stop sequence is cut, and its first characters were held back meanwhile.
        (StopText.CUT, [" the", " primary", " ", "", ""]),
        # vLLM's include_stop_str_in_output: nothing held back, the text ends with the stop sequence.
        (StopText.INCLUDE, [" the", " primary", " col", "ors", ":"]),
        # TGI: every piece as it came, the last one whole.
        (StopText.TOKEN, PIECES),
    ],
)
def test_stop_modes_per_piece(mode: StopText, texts: list[str]) -> None:
    matcher = StopMatcher(("colors:",), mode)
    out = [matcher.add(piece) for piece in PIECES]
    assert [text for text, _ in out] == texts
    assert [hit for _, hit in out] == [False] * 4 + [True]
    assert matcher.emitted_text == "".join(texts)


def test_token_mode_texts_add_up_to_the_text_when_no_stop_matches() -> None:
    matcher = StopMatcher(("zzz",), StopText.TOKEN)
    assert [matcher.add(p)[0] for p in PIECES] == PIECES
    assert matcher.flush() == ""


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, how are you?",
        "naïve café — 東京タワー 🚀🎉 done",
        "  leading spaces\n\ttabs and\nnewlines  ",
    ],
)
def test_incremental_detokenization_reassembles_text_exactly(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    pieces = [detok.add(t) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🚀"


def _token_event(token_id: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("r", 0, token_id, "", "", -1.0, False, 3, finish_reason=finish)


def test_text_sink_ends_a_request_on_a_stop_sequence_and_passes_nothing_after(tokenizer) -> None:
    """The front's text: the core sends token ids only; the sink adds their text, ends the request
    with STOP_SEQUENCE when a stop sequence matches (asking the front to abort it in the core), and
    drops whatever the core still sends for it."""
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(" one two three four five", add_special_tokens=False)
    params = SamplingParams(stop=("three",))
    passed: list[TokenEvent] = []
    stops: list[bool] = []
    texts = TokenTexts(tokenizer)
    sink = TextSink(text_stream(tokenizer, prompt, params), texts, passed.append, lambda: stops.append(True))
    for token in ids:
        sink(_token_event(token))
    sink(_token_event(-1, FinishReason.ABORT))  # the abort the front asked for: not passed on
    assert stops == [True] and passed[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.text for e in passed) == " one two "
    assert [e.token_text for e in passed] == [tokenizer.decode([t]) for t in ids[: len(passed)]]
    assert all(e.finish_reason is None for e in passed[:-1])


def test_text_sink_leaves_a_token_level_end_to_the_core(tokenizer) -> None:
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    passed: list[TokenEvent] = []
    stops: list[bool] = []
    text = text_stream(tokenizer, prompt, SamplingParams())
    sink = TextSink(text, TokenTexts(tokenizer), passed.append, lambda: stops.append(True))
    for i, token in enumerate(ids):
        sink(_token_event(token, FinishReason.LENGTH if i == len(ids) - 1 else None))
    assert stops == [] and passed[-1].finish_reason is FinishReason.LENGTH
    assert "".join(e.text for e in passed) == " one two"
