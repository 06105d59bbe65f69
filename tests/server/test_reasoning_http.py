"""Reasoning output through a real server and the official ``openai`` client.

Two servers run the scripted tiny model (``reasoning_model``: greedy output ``<think>Let me
think</think>\\n\\nHello!``) with the real chat templates: Qwen3's with ``--reasoning-parser qwen3``,
DeepSeek-R1's with ``OPTION_REASONING_PARSER=deepseek_r1`` (the environment's spelling).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from neuron_lmi.server.schemas_responses import ChatCompletion, ChatCompletionChunk
from tests.server.conftest import API_KEY, ServerProcess, cli_command, start_server
from tests.server.reasoning_model import ANSWER, THINKING, make_scripted_checkpoint

ARGS = ["--max-rolling-batch-size", "4", "--n-positions", "512", "--dtype", "fp32"]
ASK: list[Any] = [{"role": "user", "content": "Say hello."}]
GREEDY: dict[str, Any] = {"max_tokens": 40, "temperature": 0}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"greeting": {"enum": ["hello", "hi"]}},
    "required": ["greeting"],
    "additionalProperties": False,
}


def _serve(
    model: Path, tmp: Path, args: list[str], env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    server = start_server(model, tmp, [*ARGS, *args], env)
    yield server
    if server.stop() != 0:
        print(server.log.read_text()[-3000:])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_checkpoint(tmp_path_factory.mktemp("qwen3") / "model", "qwen3")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(qwen3_dir, tmp_path_factory.mktemp("qwen3_server"), ["--reasoning-parser", "qwen3"])


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_scripted_checkpoint(tmp_path_factory.mktemp("r1") / "model", "deepseek-r1")
    env = {"OPTION_REASONING_PARSER": "deepseek_r1"}
    yield from _serve(model, tmp_path_factory.mktemp("r1_server"), [], env)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3(qwen3_server: ServerProcess) -> openai.OpenAI:
    return _client(qwen3_server)


@pytest.fixture(scope="module")
def r1(r1_server: ServerProcess) -> openai.OpenAI:
    return _client(r1_server)


@pytest.fixture(scope="module")
def token_ids(qwen3_dir: Path) -> dict[str, str]:
    """logit_bias keys for the scripted branches (both servers share the vocabulary)."""
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    return {name: str(tok.convert_tokens_to_ids(name)) for name in ("<think>", "<tool_call>")}


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def reasoning_of(message: Any) -> tuple[Any, Any]:
    extra = message.model_extra or {}
    return extra["reasoning"], extra["reasoning_content"]


def stream(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], str, str]:
    """The stream's chunks, its joined reasoning and its joined content."""
    chunks = list(client.chat.completions.create(model=model_of(client), messages=ASK, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    return chunks, reasoning, "".join(d.content or "" for d in deltas)


def test_the_answer_and_the_thinking_are_apart(qwen3: openai.OpenAI) -> None:
    response = qwen3.chat.completions.create(model=model_of(qwen3), messages=ASK, **GREEDY)
    ChatCompletion.model_validate(response.model_dump(exclude_unset=True))  # as /openapi.json says
    choice = response.choices[0]
    assert reasoning_of(choice.message) == (THINKING, THINKING)
    assert choice.message.content == ANSWER and choice.finish_reason == "stop"


def test_a_stream_sends_the_thinking_first_and_never_the_tags(qwen3: openai.OpenAI) -> None:
    chunks, reasoning, content = stream(qwen3, **GREEDY)
    assert (reasoning, content) == (THINKING, ANSWER)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [
        "reasoning" if (d.model_extra or {}).get("reasoning") else "content"
        for d in deltas
        if d.content or d.model_extra
    ]
    assert (
        kinds.index("content") > kinds.index("reasoning")
        and "reasoning" not in kinds[kinds.index("content") :]
    )
    for d in deltas:
        assert (d.model_extra or {}).get("reasoning") == (d.model_extra or {}).get("reasoning_content")
        assert "think>" not in json.dumps([d.content, d.model_extra])
    assert chunks[-1].choices[0].finish_reason == "stop"
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump(exclude_unset=True))


def test_chat_template_kwargs_reach_the_template(qwen3: openai.OpenAI) -> None:
    """Qwen3's enable_thinking=false closes an empty block in the prompt: the model answers at once."""
    thinking = qwen3.chat.completions.create(model=model_of(qwen3), messages=ASK, **GREEDY)
    plain = qwen3.chat.completions.create(
        model=model_of(qwen3),
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
    )
    message = plain.choices[0].message
    assert reasoning_of(message) == (None, None) and message.content == "Hello!"
    assert plain.usage and thinking.usage and plain.usage.prompt_tokens > thinking.usage.prompt_tokens


@pytest.mark.parametrize("value", ["enable_thinking", ["enable_thinking"], 1])
def test_chat_template_kwargs_must_be_an_object(qwen3: openai.OpenAI, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        qwen3.chat.completions.create(
            model=model_of(qwen3), messages=ASK, extra_body={"chat_template_kwargs": value}
        )
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_include_reasoning_false_drops_the_thinking(qwen3: openai.OpenAI) -> None:
    extra = {"include_reasoning": False}
    message = (
        qwen3.chat.completions.create(model=model_of(qwen3), messages=ASK, extra_body=extra, **GREEDY)
        .choices[0]
        .message
    )
    assert reasoning_of(message) == (None, None) and message.content == ANSWER
    _, reasoning, content = stream(qwen3, extra_body=extra, **GREEDY)
    assert (reasoning, content) == ("", ANSWER)


def test_thinking_cut_by_max_tokens_is_reasoning_with_no_content(qwen3: openai.OpenAI) -> None:
    choice = qwen3.chat.completions.create(
        model=model_of(qwen3), messages=ASK, max_tokens=3, temperature=0
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert reasoning_of(choice.message)[0] == "Let me"
    chunks, reasoning, content = stream(qwen3, max_tokens=3, temperature=0)
    assert (reasoning, content) == ("Let me", "") and chunks[-1].choices[0].finish_reason == "length"


def test_a_tool_call_after_thinking_parses(qwen3: openai.OpenAI, token_ids: dict[str, str]) -> None:
    kwargs: Any = {"tools": TOOLS, "logit_bias": {token_ids["<tool_call>"]: 10}, **GREEDY}
    choice = qwen3.chat.completions.create(model=model_of(qwen3), messages=ASK, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    assert reasoning_of(choice.message)[0] == THINKING
    chunks, reasoning, _ = stream(qwen3, **kwargs)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert reasoning == THINKING and calls[0].function.name == "get_time"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_tool_call_leaves_the_thinking_free(qwen3: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    r = qwen3.chat.completions.create(
        model=model_of(qwen3), messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0
    )
    choice = r.choices[0]
    assert reasoning_of(choice.message)[0] == THINKING
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


def test_structured_output_constrains_the_answer_not_the_thinking(
    qwen3: openai.OpenAI, r1: openai.OpenAI
) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": SCHEMA}}
    for client in (qwen3, r1):
        choice = client.chat.completions.create(
            model=model_of(client), messages=ASK, response_format=fmt, max_tokens=60, temperature=0
        ).choices[0]
        assert reasoning_of(choice.message)[0] == THINKING
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        assert choice.finish_reason == "stop"


def test_deepseek_r1_reads_thinking_with_or_without_the_start_tag(
    r1: openai.OpenAI, token_ids: dict[str, str]
) -> None:
    with_tag = r1.chat.completions.create(model=model_of(r1), messages=ASK, **GREEDY).choices[0].message
    without = (
        r1.chat.completions.create(
            model=model_of(r1), messages=ASK, logit_bias={token_ids["<think>"]: -100}, **GREEDY
        )
        .choices[0]
        .message
    )
    for message in (with_tag, without):
        assert reasoning_of(message) == (THINKING, THINKING) and message.content == ANSWER
    _, reasoning, content = stream(r1, logit_bias={token_ids["<think>"]: -100}, **GREEDY)
    assert (reasoning, content) == (THINKING, ANSWER)
    cut = r1.chat.completions.create(model=model_of(r1), messages=ASK, max_tokens=2, temperature=0).choices[0]
    assert reasoning_of(cut.message)[0] == "Let" and cut.message.content is None


def test_lmi_routes_keep_the_whole_text(qwen3_server: ServerProcess) -> None:
    body = {
        "inputs": "Say hello.\n",
        "parameters": {"max_new_tokens": 20, "do_sample": False, "details": True},
    }
    with qwen3_server.client() as http:
        for path in ("/generate", "/invocations"):
            out = http.post(path, json=body).json()
            out = out[0] if isinstance(out, list) else out
            assert out["generated_text"] == f"<think>{THINKING}</think>{ANSWER}", path
            tokens = out["details"]["tokens"]
            assert "".join(t["text"] for t in tokens if not t["special_token"]) == out["generated_text"], path


def test_no_rows_leak(qwen3_server: ServerProcess, r1_server: ServerProcess) -> None:
    assert qwen3_server.wait_rows_free() == 0 and r1_server.wait_rows_free() == 0


def _start_fails(model: Path, tmp: Path, args: list[str], env: dict[str, str]) -> str:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SM_"))}
    full_env |= {"OPTION_ENFORCE_EAGER": "true", "NEURON_LMI_SAGEMAKER_ROOT": str(tmp / "none"), **env}
    cmd = [*cli_command(), "serve", "--model", str(model), "--port", "0", *ARGS, *args]
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_start_up_refuses_a_parser_the_tokenizer_cannot_serve(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's tokenizer has no </think>; an unknown name is refused before the model loads."""
    log = _start_fails(tiny_llama_dir, tmp_path, ["--reasoning-parser", "qwen3"], {})
    assert "reasoning parser 'qwen3' needs the tokens" in log and "'</think>'" in log
    log = _start_fails(tiny_llama_dir, tmp_path, [], {"OPTION_REASONING_PARSER": "granite"})
    assert "OPTION_REASONING_PARSER" in log and "granite" in log
