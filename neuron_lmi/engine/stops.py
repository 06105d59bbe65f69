"""Stop sequences matched on text, in one of three ways (``StopText``):

CUT      the match and everything after it never reach the client (OpenAI); text that could be
         the start of a stop sequence is held back until it completes one or can no longer match
INCLUDE  the text ends with the stop sequence (vLLM's include_stop_str_in_output); held back
         is nothing, since whatever precedes a match is printed either way
TOKEN    the text ends with the token that completed the match (TGI, LMI): every token's text
         is printed as it comes, so the tokens' texts add up to the text
"""

from __future__ import annotations

from neuron_lmi.engine.types import StopText


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], mode: StopText = StopText.CUT) -> None:
        self.stops = stops
        self.mode = mode
        self.text = ""
        self.emitted = 0

    @property
    def emitted_text(self) -> str:
        return self.text[: self.emitted]

    def _held_suffix(self) -> int:
        if self.mode is not StopText.CUT:
            return 0
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(longest - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _end_of_match(self, start: int) -> int:
        """Where the text ends after the earliest stop sequence found from ``start`` (-1: none)."""
        hits = [(i, len(s)) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return -1
        at, length = min(hits)
        if self.mode is StopText.CUT:
            return at
        if self.mode is StopText.INCLUDE:
            return at + length
        return len(self.text)

    def add(self, delta: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit, whether a stop sequence matched)."""
        if not self.stops:
            self.text += delta
            self.emitted = len(self.text)
            return delta, False
        start = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        self.text += delta
        cut = self._end_of_match(start)
        if cut >= 0:
            out = self.text[self.emitted : cut]
            self.text = self.text[:cut]
            self.emitted = cut
            return out, True
        safe_end = len(self.text) - self._held_suffix()
        out = self.text[self.emitted : safe_end]
        self.emitted = max(self.emitted, safe_end)
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
