"""64 concurrent mixed requests, some abandoned mid-stream: every answer consistent, no leaked rows."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.server.conftest import ServerProcess, direct_greedy

PROMPTS = ["One two three", "The quick brown fox", "Neuron cores are", "Once upon a time"]
MAX_NEW = 8


async def _lmi(http: httpx.AsyncClient, prompt: str) -> str:
    r = await http.post("/invocations", json={"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW}})
    r.raise_for_status()
    return r.json()["generated_text"]


async def _lmi_stream(http: httpx.AsyncClient, prompt: str, disconnect_after: int | None) -> str | None:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW}, "stream": True}
    async with http.stream("POST", "/invocations", json=body) as r:
        r.raise_for_status()
        seen = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            obj = json.loads(line)
            seen += 1
            if disconnect_after is not None and seen >= disconnect_after:
                return None  # leaving the block closes the connection mid-stream
            if "generated_text" in obj:
                return obj["generated_text"]
    raise AssertionError("stream ended without generated_text")


async def _openai_stream(http: httpx.AsyncClient, prompt: str, disconnect_after: int | None) -> str | None:
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        seen = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            seen += 1
            if disconnect_after is not None and seen >= disconnect_after:
                return None
            text += json.loads(line[6:])["choices"][0]["text"]
    raise AssertionError("stream ended without [DONE]")


async def _chat(http: httpx.AsyncClient, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW, "temperature": 0}
    r = await http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def _run_all(server: ServerProcess) -> list[tuple[str, str, str | None]]:
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(
        base_url=server.url, headers=dict(server.headers), timeout=120, limits=limits
    ) as http:
        jobs = []
        for i in range(64):
            prompt = PROMPTS[i % len(PROMPTS)]
            kind = ("lmi", "lmi_stream", "openai_stream", "chat")[(i // 4) % 4]
            cut = 2 if i % 3 == 0 else None
            if kind == "lmi":
                coro = _lmi(http, prompt)
            elif kind == "lmi_stream":
                coro = _lmi_stream(http, prompt, cut)
            elif kind == "openai_stream":
                coro = _openai_stream(http, prompt, cut)
            else:
                coro = _chat(http, prompt)
            jobs.append((kind, prompt, coro))
        results = await asyncio.gather(*(c for _, _, c in jobs))
    return [(kind, prompt, res) for (kind, prompt, _), res in zip(jobs, results, strict=True)]


def test_64_mixed_requests_with_disconnects(tiny_server: ServerProcess, direct_engine) -> None:
    results = asyncio.run(_run_all(tiny_server))
    expected = {p: direct_greedy(direct_engine, p, MAX_NEW)[0] for p in PROMPTS}
    tok = direct_engine.tokenizer
    chat_expected = {
        p: direct_greedy(
            direct_engine,
            list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)),
            MAX_NEW,
        )[0]
        for p in PROMPTS
    }
    finished = 0
    for kind, prompt, text in results:
        if text is None:
            continue  # disconnected on purpose
        finished += 1
        want = chat_expected[prompt] if kind == "chat" else expected[prompt]
        assert text == want, (kind, prompt)
    assert finished >= 48
    assert tiny_server.wait_rows_free(timeout_s=15) == 0
    assert tiny_server.metric("neuron_lmi_queue_length") == 0
    assert httpx.get(f"{tiny_server.url}/ping", timeout=5).status_code == 200
