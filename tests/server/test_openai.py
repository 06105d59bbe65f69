"""The official ``openai`` client against a real server: completions, chat, streaming, logprobs."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.clients import client, model  # noqa: F401 (fixtures)
from tests.server.conftest import API_KEY, ServerProcess, direct_greedy

PROMPT = "The capital of France is"


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_llama_dir) -> None:
    cards = client.models.list().data
    assert [c.id for c in cards] == [str(tiny_llama_dir)]


def test_completion_greedy_matches_engine(client: openai.OpenAI, model: str, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 8)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    choice = r.choices[0]
    assert choice.text == expected
    assert choice.finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.completion_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and len(lp.token_logprobs) == len(ids)
    assert all(len(top) <= 3 and top for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_completion_stream_with_usage(client: openai.OpenAI, model: str, direct_engine) -> None:
    expected, ids = direct_greedy(direct_engine, PROMPT, 6)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)


def test_completion_n_and_seed(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 3}
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 15


def test_chat_greedy_matches_engine_with_template(client: openai.OpenAI, model: str, direct_engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = direct_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected, out_ids = direct_greedy(direct_engine, list(ids), 7)
    r = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=7, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out_ids)
    content = choice.logprobs.content
    assert [len(c.top_logprobs) for c in content] == [2] * len(out_ids)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)


def test_chat_stream_n2_include_usage(client: openai.OpenAI, model: str, direct_engine) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = direct_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected, _ = direct_greedy(direct_engine, list(ids), 5)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finishes = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: expected, 1: expected}
    assert set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == 10


def test_stop_sequence_ends_with_stop(client: openai.OpenAI, model: str, direct_engine) -> None:
    expected, _ = direct_greedy(direct_engine, PROMPT, 10)
    stop = expected[3:6] if len(expected) > 6 else expected[-2:]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text or r.choices[0].text.endswith(stop)


def test_openai_errors_and_auth(tiny_server: ServerProcess, model: str) -> None:
    bad = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        good.completions.create(model=model, prompt="x", max_tokens=5, top_p=1.5)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        good.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
