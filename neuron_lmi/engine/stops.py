"""Stop sequences matched on text: the match and everything after it never reach the client.

Text that could be the start of a stop sequence is held back until it either completes one
(the request stops there) or can no longer match (it is released).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.emitted = 0

    @property
    def emitted_text(self) -> str:
        return self.text[: self.emitted]

    def _held_suffix(self) -> int:
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(longest - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def add(self, delta: str) -> tuple[str, bool]:
        """Feed new text; return (text safe to emit, whether a stop sequence matched)."""
        if not self.stops:
            self.text += delta
            self.emitted = len(self.text)
            return delta, False
        start = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
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
