"""LoRA adapters through a real server on loopback: chosen per request by OpenAI's ``model``, LMI's
``parameters.adapters`` and TGI's ``parameters.adapter_id``; listed in ``/v1/models``; loaded and
unloaded at run time (vLLM's and LMI's routes); 404 and 400 refusals naming the field; a stream
running while its adapter is unloaded finishes; no KV row is left behind."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter, merge_adapter, other_base
from tests.engine.conftest import hf_greedy
from tests.server.conftest import ServerProcess, start_server

PROMPT = "Deep learning on Inferentia"
NEW = 6


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http_adapters")
    return {
        "qv": make_tiny_adapter(root / "qv", tiny_llama_dir, 4, ("q_proj", "v_proj"), 8.0, seed=11),
        "mlp": make_tiny_adapter(root / "mlp", tiny_llama_dir, 8, MLP, 16.0, seed=12),
        "all": make_tiny_adapter(root / "all", tiny_llama_dir, 2, ATTENTION + MLP, 4.0, seed=13),
        "big": make_tiny_adapter(root / "big", tiny_llama_dir, 16, ("q_proj",), seed=14),
        "wide": make_tiny_adapter(
            root / "wide", other_base(tiny_llama_dir, root / "wide_base", hidden_size=128), 2, ("q_proj",)
        ),
    }


@pytest.fixture(scope="module")
def lora_server(
    tiny_llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("lora_server")
    args = ["--max-rolling-batch-size", "4", "--n-positions", "128", "--dtype", "fp32"]
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    lora += ["--lora-modules", f"qv={adapter_dirs['qv']}"]
    # ``python -m`` from the checkout: the code under test, whichever copy the console script imports.
    server = start_server(
        tiny_llama_dir, tmp, [*args, *lora], command=[sys.executable, "-m", "neuron_lmi.cli"]
    )
    yield server
    code = server.stop()
    if code != 0:
        print(server.log.read_text()[-3000:])


@pytest.fixture(scope="module")
def http(lora_server: ServerProcess) -> Iterator[httpx.Client]:
    with lora_server.client() as client:
        yield client


def expected_ids(tiny_llama_dir: Path, adapter_dir: Path | None, tmp: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = merge_adapter(tiny_llama_dir, adapter_dir, tmp / "merged") if adapter_dir else tiny_llama_dir
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(PROMPT)
    return hf_greedy(model, prompt, NEW)[0]


def lmi_ids(http: httpx.Client, parameters: dict, path: str = "/invocations", **top: object) -> list[int]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "details": True, **parameters}, **top}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    out = out[0] if isinstance(out, list) else out
    return [t["id"] for t in out["details"]["tokens"]]


def completion(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW})


def test_models_lists_adapters_with_their_parent(http: httpx.Client, adapter_dirs) -> None:
    data = http.get("/v1/models").json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m.get("parent")) for m in data] == [(base, None), ("qv", base)]
    listed = http.get("/adapters").json()["adapters"]
    assert [(a["name"], Path(a["src"]).resolve()) for a in listed] == [("qv", adapter_dirs["qv"].resolve())]


def test_each_api_selects_the_adapter(http: httpx.Client, tiny_llama_dir, adapter_dirs, tmp_path) -> None:
    want = expected_ids(tiny_llama_dir, adapter_dirs["qv"], tmp_path)
    assert want != expected_ids(tiny_llama_dir, None, tmp_path)  # the adapter changes the tokens
    assert lmi_ids(http, {"adapters": "qv"}) == want
    assert lmi_ids(http, {"adapter_id": "qv"}, "/generate") == want
    assert lmi_ids(http, {}, adapters="qv") == want  # LMI's adapters beside inputs
    adapted = completion(http, "qv").json()
    base = completion(http, http.get("/v1/models").json()["data"][0]["id"]).json()
    assert adapted["model"] == "qv" and adapted["choices"][0]["text"] != base["choices"][0]["text"]


def test_load_and_unload_at_run_time(http: httpx.Client, tiny_llama_dir, adapter_dirs, tmp_path) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapter_dirs["mlp"])})
    assert r.status_code == 200, r.text
    assert lmi_ids(http, {"adapters": "mlp"}) == expected_ids(tiny_llama_dir, adapter_dirs["mlp"], tmp_path)
    assert "mlp" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    r = http.post("/adapters", params={"name": "all", "src": str(adapter_dirs["all"])})
    assert r.status_code == 200, r.text
    # Three adapters on two slots: requests for each in turn still run (least recently used evicted).
    assert completion(http, "all").status_code == 200
    assert completion(http, "qv").status_code == 200
    assert http.delete("/adapters/all").status_code == 200
    r = completion(http, "all")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert r.status_code == 404, r.text


def load(http: httpx.Client, name: str, path: Path | str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_refusals_name_the_field(http: httpx.Client, adapter_dirs) -> None:
    r = load(http, "big", adapter_dirs["big"])
    assert r.status_code == 400 and "'big'" in r.text and "max_lora_rank=8" in r.text
    r = load(http, "wide", adapter_dirs["wide"])
    assert (
        r.status_code == 400 and "another base model" in r.text and r.json()["error"]["param"] == "lora_path"
    )
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapter_dirs["qv"])})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    body = {"inputs": PROMPT, "parameters": {"adapters": "nope"}}
    r = http.post("/invocations", json=body)
    assert r.status_code == 404 and r.json()["field"] == "parameters.adapters", r.text
    r = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 404 and r.json()["field"] == "parameters.adapter_id", r.text
    r = http.post("/invocations", json={"inputs": [PROMPT, PROMPT], "parameters": {"adapters": ["qv"]}})
    assert r.status_code == 400 and r.json()["field"] == "parameters.adapters"
    r = completion(http, "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.delete("/adapters/nope").status_code == 404


def test_a_running_stream_finishes_while_its_adapter_unloads(
    http: httpx.Client, lora_server: ServerProcess, adapter_dirs
) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": str(adapter_dirs["all"])})
    assert r.status_code == 200, r.text
    body = {"model": "tmp", "prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True}
    chunks = []
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 200
        assert completion(http, "tmp").status_code == 404
        chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert lora_server.wait_rows_free() == 0
