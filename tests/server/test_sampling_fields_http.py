"""Every sampling field over HTTP on a real server: echo with prompt log-probabilities (against
transformers), decoder_input_details, best_of, per-choice seeds, logit_bias, and 400s by name."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server.clients import client, http, model  # noqa: F401 (fixtures)
from tests.server.conftest import API_KEY, ServerProcess, start_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def fp32_server(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model in fp32, so prompt log-probabilities compare with transformers' fp32 closely
    (the default CPU dtype may be bf16)."""
    args = ["--dtype", "fp32", "--max-rolling-batch-size", "2", "--n-positions", "128"]
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("fp32_server"), args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fp32_client(fp32_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_llama_dir):
    """transformers' log-probability of each prompt token given the ones before it, and the top ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    return ids, chosen, logprobs.topk(2, -1).indices.tolist()


def test_echo_with_logprobs_scores_the_prompt_as_transformers(
    fp32_client: openai.OpenAI, model: str, fp32_server: ServerProcess, hf_prompt_logprobs
) -> None:
    ids, expected, top_ids = hf_prompt_logprobs
    r = fp32_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=2e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert max(lp.top_logprobs[1].values()) >= max(lp.token_logprobs[1], -1e9)
    assert len(top_ids) == len(ids) - 1
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)]) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert fp32_server.wait_rows_free() == 0


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    fp32_client: openai.OpenAI, model: str, fp32_server: ServerProcess, hf_prompt_logprobs
) -> None:
    """What evaluation harnesses send for a log-likelihood: the prompt back, scored, nothing generated."""
    ids, expected, _ = hf_prompt_logprobs
    r = fp32_client.completions.create(
        model=model, prompt=[PROMPT, PROMPT], max_tokens=0, temperature=0, echo=True, logprobs=1
    )
    assert [c.text for c in r.choices] == [PROMPT, PROMPT]
    for choice in r.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == len(ids)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 2 * len(ids)
    for bad in ({"echo": False}, {"echo": True, "stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            fp32_client.completions.create(model=model, prompt=PROMPT, max_tokens=0, **bad)
        assert info.value.body["param"] == "max_tokens"
    assert fp32_server.wait_rows_free() == 0


def test_echo_with_logprobs_streams_the_prompt_first(
    fp32_client: openai.OpenAI, model: str, hf_prompt_logprobs
) -> None:
    ids, expected, _ = hf_prompt_logprobs
    chunks = list(
        fp32_client.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=2e-4)


def test_decoder_input_details_scores_the_prompt(fp32_server: ServerProcess, hf_prompt_logprobs) -> None:
    from text_generation import Client

    ids, expected, _ = hf_prompt_logprobs
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}}
    with fp32_server.client() as http:
        prefill = http.post("/generate", json=body).json()["details"]["prefill"]
    assert [t["id"] for t in prefill] == ids
    assert prefill[0]["log_prob"] is None
    assert [t["log_prob"] for t in prefill[1:]] == pytest.approx(expected, abs=2e-4)
    tgi = Client(fp32_server.url, headers=dict(fp32_server.headers), timeout=60)
    r = tgi.generate(PROMPT, max_new_tokens=2, decoder_input_details=True)
    assert [t.logprob for t in r.details.prefill[1:]] == pytest.approx(expected, abs=2e-4)


def test_best_of_returns_the_n_most_likely_candidates(client: openai.OpenAI, model: str) -> None:
    common: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
    }
    every = client.completions.create(n=4, logprobs=0, **common).choices
    totals = sorted((sum(c.logprobs.token_logprobs) for c in every), reverse=True)
    best = client.completions.create(n=2, best_of=4, logprobs=0, **common)
    got = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1]
    assert got == pytest.approx(totals[:2], abs=1e-4)
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)


def test_tgi_best_of_answers_with_the_most_likely_and_lists_the_others(tiny_server: ServerProcess) -> None:
    from text_generation import Client

    tgi = Client(tiny_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    r = tgi.generate(PROMPT, max_new_tokens=6, do_sample=True, temperature=1.0, best_of=3)
    others = r.details.best_of_sequences
    assert others is not None and len(others) == 2

    def total(tokens: Any) -> float:
        return sum(t.logprob for t in tokens)

    assert all(total(r.details.tokens) >= total(o.tokens) for o in others)
    assert all(o.generated_tokens == len(o.tokens) and o.generated_text for o in others)
    assert total(r.details.tokens) == pytest.approx(sum(t.logprob for t in r.details.tokens))
    # LMI's /generate answers with the best candidate alone.
    with tiny_server.client(timeout=120) as http:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": True, "best_of": 2}}
        lmi = http.post("/generate", json=body)
    assert lmi.status_code == 200 and isinstance(lmi.json()["generated_text"], str)
    assert tiny_server.wait_rows_free() == 0


def test_seed_makes_each_choice_reproducible(client: openai.OpenAI, model: str) -> None:
    def texts() -> list[str]:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=9, n=3)
        return [c.text for c in r.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) > 1  # choice i samples with seed + i


def test_logit_bias_forces_and_forbids_tokens(client: openai.OpenAI, model: str) -> None:
    def tokens(bias: dict[str, int] | None) -> list[str]:
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, logit_bias=bias
        )
        return r.choices[0].logprobs.tokens

    forced = tokens({"1000": 100})
    assert len(set(forced)) == 1  # the same (forced) token every step
    plain = tokens(None)
    assert forced != plain
    assert tokens({"1000": -100}) == plain  # a ban on a token greedy never picks changes nothing


def test_many_stop_sequences_up_to_the_limit(client: openai.OpenAI, model: str) -> None:
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0]
    stops = [f"never-{i}" for i in range(40)] + [plain.text[3:6]]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=stops)
    assert r.choices[0].text == plain.text[: plain.text.index(plain.text[3:6])]
    assert r.choices[0].finish_reason == "stop"


def test_penalties_min_p_and_min_tokens_are_accepted(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        temperature=0.9,
        seed=1,
        presence_penalty=1.2,
        frequency_penalty=0.8,
        extra_body={"min_p": 0.05, "min_tokens": 12},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_info_and_openapi_document_the_fields(http: httpx.Client) -> None:
    info = http.get("/info").json()["supported_parameters"]
    for name in (
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_tokens",
        "min_p",
        "response_format",
    ):
        assert name in info["openai_chat"] and name in info["openai_completions"]
    assert {"best_of", "echo"} <= set(info["openai_completions"]) and "suffix" not in info[
        "openai_completions"
    ]
    assert {"grammar", "frequency_penalty", "decoder_input_details"} <= set(info["lmi_tgi"])
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert (
        "description" in props["presence_penalty"] and props["presence_penalty"]["anyOf"][0]["maximum"] == 2
    )
    assert "ResponseFormat" in schemas and "schema" in schemas["JsonSchemaFormat"]["properties"]
    assert "TgiGrammar" in schemas


OK_CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/chat/completions", {**OK_CHAT, "frequency_penalty": -3}, 400, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 150}}, 400, "logit_bias"),
        ("/v1/chat/completions", {**OK_CHAT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "suffix": "tail"}, 400, "suffix"),
        ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 50}, 400, "logprobs"),
        (
            "/generate",
            {"inputs": "x", "parameters": {"frequency_penalty": 9}},
            400,
            "parameters.frequency_penalty",
        ),
        ("/generate", {"inputs": "x", "parameters": {"best_of": 2}}, 400, "parameters.best_of"),
        (
            "/generate",
            {"inputs": "x", "parameters": {"best_of": 2, "do_sample": True, "seed": 1}},
            400,
            "parameters.seed",
        ),
        (
            "/generate_stream",
            {"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}},
            422,  # TGI's status for a validation error
            "parameters.best_of",
        ),
        (
            "/generate",
            {"inputs": "x", "parameters": {"best_of": 17, "do_sample": True}},
            400,
            "parameters.best_of",
        ),
        ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ],
)
def test_bad_sampling_values_are_refused_by_name(
    http: httpx.Client, tiny_server: ServerProcess, route: str, body: dict[str, Any], status: int, field: str
) -> None:
    r = http.post(route, json=body)
    assert r.status_code == status, r.text
    got = r.json()["error"]["param"] if route.startswith("/v1/") else r.json()["field"]
    assert got == field, r.text
    assert tiny_server.wait_rows_free() == 0
