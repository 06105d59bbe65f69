"""SmolLM2-135M-Instruct (the built-in GGUF) through the server: real text, chat template, parity."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import cpu_options
from tests.server.conftest import API_KEY, ServerProcess, direct_greedy, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("smol_server")
    args = ["--max-rolling-batch-size", "4", "--n-positions", "512", "--dtype", "fp32"]  # as smol_engine
    server = start_server("smollm2", tmp, args)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def smol_engine():
    from neuron_lmi.backends.cpu.engine import cpu_thread_engine

    return cpu_thread_engine(cpu_options("smollm2", max_rolling_batch_size=1, n_positions=512))


def test_smollm2_chat_and_invocations_match_engine(smol_server: ServerProcess, smol_engine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smol_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected, _ = direct_greedy(smol_engine, list(ids), 24)
    client = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected
    assert "Paris" in expected
    prompt = "The three primary colors are"
    want, _ = direct_greedy(smol_engine, prompt, 12)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}
    out = httpx.post(
        f"{smol_server.url}/invocations", json=body, headers=dict(smol_server.headers), timeout=120
    )
    assert out.json()["generated_text"] == want
