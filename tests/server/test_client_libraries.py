"""The client libraries people point at an OpenAI/TGI/SageMaker server, unchanged, against a real
server on loopback (issue 26): Hugging Face's ``text-generation``, LangChain's ``langchain-openai``,
``instructor`` and ``LiteLLM``, each pinned in pyproject's dev extra. docs/clients.md says what ran.

The model is the tiny random Llama (greedy): its words are noise, so every structured answer below
is the grammar's doing, and schemas bound strings and arrays so a valid answer fits ``max_tokens``.
Tools need ``tool_server`` (its template has no tool support: the built-in Hermes prompt).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field
from text_generation import AsyncClient, Client
from text_generation.types import Grammar, GrammarType, Message

from tests.server.conftest import API_KEY, AUTH, ServerProcess, start_server

PROMPT = "Deep learning on Inferentia"
ASK = "What will the weather be in Paris?"
# text_generation 0.7 still calls pydantic's deprecated ``.dict()``; LiteLLM and instructor warn
# about things of their own. Not our concern here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class Weather(BaseModel):
    """A forecast request, as a tool's arguments or a structured answer (no other properties:
    ``additionalProperties: false``, which clients' strict modes also imply)."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


# -- Hugging Face text-generation 0.7.0 ------------------------------------------------------------


@pytest.fixture(scope="module")
def tgi(tiny_server: ServerProcess) -> Client:
    return Client(tiny_server.url, headers=AUTH, timeout=120)


def test_tgi_generate_details_and_stream_agree(tgi: Client) -> None:
    out = tgi.generate(PROMPT, max_new_tokens=8, decoder_input_details=True, top_n_tokens=2)
    details = out.details
    assert details.generated_tokens == 8 and len(details.tokens) == 8
    assert details.prefill and details.prefill[0].logprob is None
    assert all(p.logprob is not None for p in details.prefill[1:])
    assert all(len(top) == 2 for top in details.top_tokens)
    streamed = list(tgi.generate_stream(PROMPT, max_new_tokens=8))
    assert "".join(r.token.text for r in streamed) == streamed[-1].generated_text == out.generated_text
    assert [r.token.id for r in streamed] == [t.id for t in details.tokens]


def test_tgi_stop_sequences_best_of_and_grammar(tgi: Client) -> None:
    full = tgi.generate(PROMPT, max_new_tokens=12)
    texts = [t.text for t in full.details.tokens]
    stop = texts[3] + texts[4]
    if stop.strip() and full.generated_text.find(stop) == len("".join(texts[:5])) - len(stop):
        cut = tgi.generate(PROMPT, max_new_tokens=12, stop_sequences=[stop])
        assert cut.generated_text == "".join(texts[:5]) and cut.generated_text.endswith(stop)
        assert cut.details.finish_reason.value == "stop_sequence"
    best = tgi.generate(PROMPT, max_new_tokens=4, do_sample=True, best_of=2)
    assert len(best.details.best_of_sequences) == 1
    grammar = Grammar(type=GrammarType.Json, value=Weather.model_json_schema())
    answer = tgi.generate(PROMPT, max_new_tokens=120, grammar=grammar)
    assert answer.details.finish_reason.value == "eos_token", answer.generated_text
    Weather.model_validate_json(answer.generated_text)


def test_tgi_chat_sends_model_tgi_and_nulls(tgi: Client) -> None:
    out = tgi.chat(messages=[Message(role="user", content="Name a planet.")], max_tokens=4)
    assert out.choices[0].message.role == "assistant" and out.usage["completion_tokens"] == 4


def test_tgi_async_client_concurrent_requests(tiny_server: ServerProcess, tgi: Client) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    alone = [tgi.generate(p, max_new_tokens=6).generated_text for p in prompts]

    async def together() -> list[str]:
        client = AsyncClient(tiny_server.url, headers=AUTH, timeout=120)
        outs = await asyncio.gather(*(client.generate(p, max_new_tokens=6) for p in prompts))
        return [o.generated_text for o in outs]

    assert asyncio.run(together()) == alone


# -- LangChain: langchain-openai 1.7.4 -------------------------------------------------------------


def model_of(server: ServerProcess) -> str:
    """The served model's name, as a client reads it from /v1/models."""
    import httpx

    models = httpx.get(f"{server.url}/v1/models", headers=dict(server.headers), timeout=10).json()
    return str(models["data"][0]["id"])


def _chat_model(server: ServerProcess, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        model=model_of(server),
        temperature=0,
        max_retries=0,
        timeout=120,
        **kwargs,
    )


def test_langchain_invoke_and_stream_agree(tiny_server: ServerProcess) -> None:
    llm = _chat_model(tiny_server, max_tokens=8)
    text = llm.invoke("Name a planet.").content
    assert isinstance(text, str) and text
    assert "".join(chunk.content for chunk in llm.stream("Name a planet.")) == text
    assert [m.content for m in llm.batch(["Name a planet.", "Name a planet."])] == [text, text]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(tool_server: ServerProcess, method: str) -> None:
    llm = _chat_model(tool_server, max_tokens=120)
    answer = llm.with_structured_output(Weather, method=method).invoke(ASK)
    assert isinstance(answer, Weather)


def test_langchain_json_mode_gives_an_object(tool_server: ServerProcess) -> None:
    import openai

    llm = _chat_model(tool_server, max_tokens=200)
    structured = llm.with_structured_output(None, method="json_mode")
    try:
        answer = structured.invoke(ASK + " Answer in JSON.")
    except openai.LengthFinishReasonError:
        # Any object, from a random model: keys and strings of noise can fill max_tokens (a trained
        # model ends; see docs/clients.md). The request itself was taken: json_object, no 400.
        return
    assert isinstance(answer, dict)


def test_langchain_named_tool_and_round_trip(tool_server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _chat_model(tool_server, max_tokens=120)
    forced = llm.bind_tools([Weather], tool_choice="Weather")
    history: list[Any] = [HumanMessage(ASK)]
    call_message = forced.invoke(history)
    (call,) = call_message.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])
    history += [call_message, ToolMessage(json.dumps({"forecast": "sunny"}), tool_call_id=call["id"])]
    answer = llm.bind_tools([Weather]).invoke(history)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


# -- instructor 1.17.0 ------------------------------------------------------------------------------


def _instructor(server: ServerProcess, mode_name: str) -> Any:
    import instructor
    import openai

    raw = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return instructor.from_openai(raw, mode=getattr(instructor.Mode, mode_name))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_validated_objects(tool_server: ServerProcess, mode: str) -> None:
    client = _instructor(tool_server, mode)
    messages = [{"role": "user", "content": ASK}]
    request = {"model": model_of(tool_server), "response_model": Weather, "messages": messages}
    options = {"max_tokens": 120, "temperature": 0, "max_retries": 0}
    answer = client.chat.completions.create(**request, **options)
    assert isinstance(answer, Weather)
    partials = list(client.chat.completions.create_partial(**request, **options))
    # The last partial is the whole answer; instructor hands back subclasses, so compare values.
    assert partials and Weather.model_validate(partials[-1].model_dump()).model_dump() == answer.model_dump()


# -- LiteLLM 1.110.2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def open_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model without an API key, as in a SageMaker container (AWS signs the requests;
    LiteLLM's sagemaker/ provider sends a SigV4 Authorization header this server does not check)."""
    tmp = tmp_path_factory.mktemp("open_server")
    args = ["--max-rolling-batch-size", "4", "--n-positions", "256", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, args, api_key=None)
    yield server
    server.stop()


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm", "huggingface"])
def test_litellm_chat_providers(open_server: ServerProcess, provider: str) -> None:
    import litellm

    messages = [{"role": "user", "content": "Name a planet."}]
    kwargs: dict[str, Any] = {"api_base": f"{open_server.url}/v1", "api_key": "none", "max_tokens": 5}
    if provider == "huggingface":
        kwargs["api_base"] = open_server.url  # TGI's Messages API: {base}/v1/chat/completions
    model = f"{provider}/{model_of(open_server)}"
    out = litellm.completion(model=model, messages=messages, temperature=0, **kwargs)
    text = out.choices[0].message.content
    assert out.usage.completion_tokens == 5 and text
    chunks = litellm.completion(model=model, messages=messages, temperature=0, stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_litellm_text_completion(open_server: ServerProcess) -> None:
    import litellm

    out = litellm.text_completion(
        model=f"text-completion-openai/{model_of(open_server)}",
        prompt=PROMPT,
        api_base=f"{open_server.url}/v1",
        api_key="none",
        max_tokens=5,
        temperature=0,
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].text


def test_litellm_sagemaker_invocations(open_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    import litellm

    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")):
        monkeypatch.setenv(name, value)
    out = litellm.completion(
        model="sagemaker/any-endpoint",
        messages=[{"role": "user", "content": PROMPT}],
        sagemaker_base_url=f"{open_server.url}/invocations",
        aws_region_name="us-east-1",
        max_tokens=5,
        temperature=0.01,
    )
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "do_sample": False}}
    assert out.choices[0].message.content
    assert httpx.post(f"{open_server.url}/invocations", json=body, timeout=60).status_code == 200
