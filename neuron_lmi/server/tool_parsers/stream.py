"""One choice's output, split into content and tool calls as tokens arrive, or all at once.

A stream releases content up to where a tool call might begin (the parser's ``held`` characters
wait for the next token), then each call once the parser sees it closed; at the end the parse of
the whole output decides what is left. With ``forced`` (a grammar made the output a call) the
parser's ``forced_prefix`` (a special token the grammar leaves out) is put in front first, and an
output that holds no complete call (it ran out of tokens inside one) is neither content nor a
call: OpenAI answers such a choice with ``finish_reason: "length"`` and no raw call text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_lmi.server.tool_parsers.base import Parsed, ToolCall, ToolParser


def parse_output(parser: ToolParser, text: str, forced: bool) -> Parsed:
    """The whole output of a finished choice; content is the output itself when no call is read
    (nothing, when a call was forced)."""
    if not forced:
        return parser.parse(text)
    parsed = parser.parse(parser.forced_prefix + text)
    return Parsed(None, parsed.calls)


@dataclass(slots=True)
class ToolCallStream:
    """Incremental :func:`parse_output`.

    Invariants: ``text[:released]`` was released as content (or is the forced prefix); once
    ``region`` is set, content stops and ``text[region:]`` is the tool-call region; ``sent`` calls
    were released, and they are the first calls of the final parse.
    """

    parser: ToolParser
    forced: bool = False
    text: str = ""
    released: int = 0
    region: int | None = None
    sent: int = 0
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.forced:
            self.text = self.parser.forced_prefix
            self.released = len(self.text)
            self.region = 0

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        """New content and newly closed calls after ``piece`` of output."""
        self.text += piece
        content = ""
        if self.region is None:
            start = self.parser.start(self.text)
            end = len(self.text) - self.parser.held(self.text) if start is None else start
            self.region = start
            if end > self.released:
                content, self.released = self.text[self.released : end], end
        if self.region is None:
            return content, []
        return content, self._release(self.parser.complete(self.text[self.region :]))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: unreleased content when no call was read, else the last calls."""
        parsed = self.parser.parse(self.text)
        if not parsed.calls:
            rest, self.released = self.text[self.released :], len(self.text)
            return ("" if self.forced else rest), []
        return "", self._release(list(parsed.calls))

    def _release(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.sent :]
        self.sent = max(self.sent, len(calls))
        self.calls += new
        return new
