"""A real server with ``--speculative-config`` (n-gram) on loopback: greedy text and token ids equal the
non-speculative server's, the stream carries every accepted token, and ``/metrics`` has vLLM's
spec_decode counters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_server

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
# Repeated phrases: the lookup finds drafts in the prompt, and the tiny model's own loops accept them.
PROMPTS = ["one two three four one two three four one two three", "Deep learning on Inferentia"]


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``tiny_server``'s model and options, with n-gram speculation."""
    tmp = tmp_path_factory.mktemp("spec_server")
    args = ["--max-rolling-batch-size", "8", "--n-positions", "256", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, [*args, "--speculative-config", NGRAM])
    yield server
    code = server.stop()
    if code != 0:
        print(server.log.read_text()[-3000:])


def stream_ids(server: ServerProcess, prompt: str, n: int) -> tuple[list[int], str]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}, "stream": True}
    with server.client(timeout=120) as http, http.stream("POST", "/invocations", json=body) as r:
        assert r.status_code == 200
        lines = [json.loads(line) for line in r.iter_lines() if line]
    return [line["token"]["id"] for line in lines], lines[-1]["generated_text"]


def test_greedy_text_equals_the_non_speculative_servers(
    spec_server: ServerProcess, tiny_server: ServerProcess
) -> None:
    for prompt in PROMPTS:
        expected_ids, expected_text = stream_ids(tiny_server, prompt, 24)
        ids, text = stream_ids(spec_server, prompt, 24)
        assert (ids, text) == (expected_ids, expected_text)
        assert len(ids) == 24  # one stream event per token, accepted drafts included
    with spec_server.client() as spec, tiny_server.client() as plain:
        model = spec.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        got = spec.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert got == plain.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert spec_server.wait_rows_free() == 0


def test_metrics_carry_vllms_spec_decode_counters(spec_server: ServerProcess) -> None:
    stream_ids(spec_server, PROMPTS[0], 16)
    drafts = spec_server.metric("vllm:spec_decode_num_drafts_total")
    draft_tokens = spec_server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    text = httpx.get(f"{spec_server.url}/metrics", headers=dict(spec_server.headers), timeout=10).text
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_pos = [line for line in text.splitlines() if line.startswith(name)]
    assert [line.split("{")[1].split("}")[0] for line in per_pos] == [f'position="{i}"' for i in range(4)]
    assert float(per_pos[0].rsplit(" ", 1)[1]) > 0
