"""Tool calling on ``/v1/chat/completions``: what the prompt shows and how the output is read.

    tools, tool_choice, parallel_tool_calls  --plan_tools-->  ToolPlan (format, grammar, prompt kind)
    messages (+ tool_calls, tool results)    --render_chat--> prompt ids, through the chat template
    output                                   --tool_message / ToolChoiceStream--> content + tool_calls

The prompt. A chat template that uses ``tools`` renders the tools, the history's calls (arguments as
objects, as transformers documents) and the tool results itself. A template without tool support
(SmolLM2's) gets the built-in tool prompt, but only when ``option.tool_call_parser`` names a format:
that parser writes the tools and the format into the system message, earlier calls into the
assistant's text, and tool results as user messages (every template accepts those, including the
ones that insist on user/assistant turns). Without it, a request that needs tools is refused (400,
naming ``tools`` or the message), so a model never silently answers without seeing its tools.

The output. ``tool_choice`` "auto" (the default with tools) parses the output with the format's
parser (``option.tool_call_parser``, else the one the template's text names, else ``hermes``).
"required" and a named function also constrain decoding with the parser's grammar, so the output
is always a call whose arguments validate against the function's schema. "none" hides the tools
from the prompt (vLLM's ``exclude_tools_when_tool_choice_none``) and parses nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from neuron_lmi.engine.types import GrammarSpec, SamplingParams, TokenEvent
from neuron_lmi.server.errors import invalid
from neuron_lmi.server.options import AppOptions
from neuron_lmi.server.schemas_grammar import strict_schema
from neuron_lmi.server.schemas_openai import ChatMessage, ChatRequest
from neuron_lmi.server.schemas_tools import NamedToolChoice
from neuron_lmi.server.tool_parsers import FunctionSpec, ToolCall, ToolParser, detect_parser, get_parser
from neuron_lmi.server.tool_parsers.stream import ToolCallStream, parse_output


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses tools. Invariant: ``grammar`` is set only when ``parse`` is, and
    ``builtin_prompt`` only when the template has no tool support and the operator chose a format."""

    parser: ToolParser
    functions: tuple[FunctionSpec, ...] = ()  # shown in the prompt
    parse: bool = False
    grammar: GrammarSpec | None = None
    builtin_prompt: bool = False


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return str(template.get("tool_use") or template.get("default") or "")
    return template or ""


@functools.lru_cache(maxsize=16)
def _uses_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable."""
    try:
        import jinja2
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # a template with extension tags: fall back to reading it
        return re.search(r"\btools\b", template) is not None


def template_supports_tools(tokenizer: Any) -> bool:
    return _uses_tools(_template_text(tokenizer))


def _functions(req: ChatRequest) -> tuple[FunctionSpec, ...]:
    functions = tuple(
        FunctionSpec(
            t.function.name,
            t.function.description,
            strict_schema(t.function.parameters) if t.function.strict else t.function.parameters,
        )
        for t in req.tools or ()
    )
    seen: set[str] = set()
    for i, fn in enumerate(functions):
        if fn.name in seen:
            raise invalid("openai", f"tools: two functions are named {fn.name!r}", f"tools.{i}.function.name")
        seen.add(fn.name)
    return functions


def _forced_grammar(
    parser: ToolParser, functions: tuple[FunctionSpec, ...], choice: Any, parallel: bool
) -> GrammarSpec | None:
    if isinstance(choice, NamedToolChoice):
        chosen = [fn for fn in functions if fn.name == choice.function.name]
        if not chosen:
            message = f"tool_choice names {choice.function.name!r}, which is not among tools"
            raise invalid("openai", message, "tool_choice.function.name")
        functions, parallel = tuple(chosen), False
    elif choice != "required":
        return None
    try:  # admission compiles it (check_grammar); a refusal names ``tools``
        return parser.grammar(functions, parallel).named("tools")
    except ValueError as exc:
        raise invalid(
            "openai", f"tools: the parameters cannot be compiled into a grammar: {exc}", "tools"
        ) from None


def plan_tools(options: AppOptions, tokenizer: Any, req: ChatRequest) -> ToolPlan:
    """Validate the request's tool fields against the model and the server's options."""
    functions = _functions(req)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if functions else "none")
    if choice != "none" and not functions:
        if choice != "auto":
            raise invalid("openai", "tool_choice requires tools", "tool_choice")
        choice = "none"
    if choice == "auto" and not options.enable_auto_tool_choice:
        message = 'tool_choice "auto" is disabled on this server (option.enable_auto_tool_choice=false)'
        raise invalid("openai", message, "tool_choice")
    parse = choice != "none"
    history = next((i for i, m in enumerate(req.messages) if m.tool_calls or m.role == "tool"), None)
    builtin = False
    if (parse or history is not None) and not template_supports_tools(tokenizer):
        if options.tool_call_parser is None:
            where = "tools" if parse else f"messages.{history}"
            message = (
                "the model's chat template has no tool support; start the server with "
                "option.tool_call_parser (e.g. hermes) to use the built-in tool prompt"
            )
            raise invalid("openai", message, where)
        builtin = True
    parser = get_parser(options.tool_call_parser or detect_parser(_template_text(tokenizer)))
    parallel = req.parallel_tool_calls is not False
    grammar = _forced_grammar(parser, functions, choice, parallel) if parse else None
    return ToolPlan(parser, functions if parse else (), parse, grammar, builtin)


# -- the prompt ------------------------------------------------------------------------------------


def _text(m: ChatMessage) -> str:
    if isinstance(m.content, list):
        return "".join(part.text for part in m.content)
    return m.content or ""


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise invalid("openai", f"{where}: not JSON: {exc}", where) from None
    if not isinstance(value, dict):
        raise invalid("openai", f"{where}: the arguments must be a JSON object", where)
    return value


def _template_message(m: ChatMessage, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise invalid("openai", "only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(
                        call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                    ),
                },
            }
            for j, call in enumerate(m.tool_calls)
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _builtin_messages(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The history for a template without tool support, in the parser's own words (module doc)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.pop("tool_calls", None)
        if calls:
            parsed = [ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in calls]
            names.update({c["id"]: c["function"]["name"] for c in calls})
            text = plan.parser.render_calls(parsed)
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id", ""))
            result = plan.parser.render_result(m["content"], name)
            if out and out[-1].get("tool_result"):  # parallel results share one user turn
                out[-1]["content"] += "\n" + result
                continue
            m = {"role": "user", "content": result, "tool_result": True}
        out.append(m)
    for m in out:
        m.pop("tool_result", None)
    if plan.functions:
        prompt = plan.parser.system_prompt(plan.functions)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(tokenizer: Any, model_name: str, req: ChatRequest, plan: ToolPlan) -> list[int]:
    """The prompt's token ids: the model's chat template with a generation prompt (module doc)."""
    if not req.messages:
        raise invalid("openai", "messages must not be empty", "messages")
    if not _template_text(tokenizer):
        raise invalid("openai", f"model {model_name!r} has no chat template; use /v1/completions", "messages")
    messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
    kwargs: dict[str, Any] = req.template_kwargs()
    if plan.builtin_prompt:
        messages = _builtin_messages(messages, plan)
    elif plan.functions:
        kwargs["tools"] = [fn.as_tool() for fn in plan.functions]
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except Exception as exc:  # a template may raise on e.g. roles or call ids it does not accept
        raise invalid("openai", f"chat template failed: {exc}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# -- the output ------------------------------------------------------------------------------------


def tool_text(event: TokenEvent, markers: frozenset[str]) -> str:
    """An event's text as the parser reads it: with the format's special tokens, which the
    detokenizer skips (text flushed by the event comes before its token)."""
    if event.special and event.token_text in markers:
        return event.text + event.token_text
    return event.text


def _call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def with_tool_grammar(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """``params`` constrained to the plan's tool calls ("required" or a named function)."""
    if plan.grammar is None:
        return params
    if params.grammar is not None:
        message = "response_format cannot be combined with a required or named tool_choice"
        raise invalid("openai", message, "response_format")
    return dataclasses.replace(params, grammar=plan.grammar)


def tool_message(
    plan: ToolPlan, events: Sequence[TokenEvent], text: str, marked: str | None = None
) -> tuple[dict[str, Any], bool]:
    """A finished choice's ``message`` and whether it holds tool calls (``text``: its plain text;
    ``marked``: the text the parser reads, when not all of ``events``' text: an answer after thinking)."""
    if not plan.parse:
        return {"role": "assistant", "content": text}, False
    if marked is None:
        marked = "".join(tool_text(e, plan.parser.markers) for e in events)
    parsed = parse_output(plan.parser, marked, plan.grammar is not None)
    if not parsed.calls:  # a forced call cut short is no content either (parsed.content is None)
        return {"role": "assistant", "content": text if plan.grammar is None else parsed.content}, False
    calls = [_call_json(c, plan.parser.new_id()) for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True


@dataclass(slots=True)
class ToolChoiceStream:
    """One streamed choice: each event becomes content and ``delta.tool_calls`` entries.

    A call goes out as two entries with its index: the id, type and name (arguments ""), then the
    arguments; the ``openai`` client joins entries by index. Invariant: indexes count from 0.
    """

    plan: ToolPlan
    stream: ToolCallStream = field(init=False)

    def __post_init__(self) -> None:
        self.stream = ToolCallStream(self.plan.parser, forced=self.plan.grammar is not None)

    @property
    def called(self) -> bool:
        return self.stream.sent > 0

    def chunks(
        self, idx: int, event: TokenEvent, logprobs: dict[str, Any] | None, finish: str | None
    ) -> list[dict[str, Any]]:
        """The stream's choice objects for ``event``: its content (and log-probabilities), then one
        per tool-call entry; the last carries the finish reason ("tool_calls" once a call went out)."""
        content, deltas = self.on_event(event)
        out = [{"index": idx, "delta": {"content": content}, "logprobs": logprobs, "finish_reason": None}]
        out += [
            {"index": idx, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None}
            for d in deltas
        ]
        if finish is not None:
            out[-1]["finish_reason"] = "tool_calls" if self.called else finish
        return out

    def on_event(self, event: TokenEvent, text: str | None = None) -> tuple[str, list[dict[str, Any]]]:
        """Content and tool-call entries for ``event`` (``text``: what the parser reads of it, when not
        all of its text: the answer part after thinking)."""
        content, calls = self.stream.feed(
            tool_text(event, self.plan.parser.markers) if text is None else text
        )
        if event.finish_reason is not None:
            rest, last = self.stream.finish()
            content, calls = content + rest, calls + last
        first = self.stream.sent - len(calls)
        deltas: list[dict[str, Any]] = []
        for k, call in enumerate(calls, start=first):
            head = _call_json(ToolCall(call.name, ""), self.plan.parser.new_id())
            deltas += [{"index": k, **head}, {"index": k, "function": {"arguments": call.arguments}}]
        return content, deltas
