"""LoRA adapters on ``neuron-lmi serve --backend vllm`` (vLLM's CPU build), one server for the module.

Adapters come from ``--lora-modules``, from the model directory's ``adapters/`` and from the run-time
routes; each is chosen by OpenAI's ``model``, LMI's ``parameters.adapters`` or TGI's
``parameters.adapter_id``. Greedy tokens per adapter equal transformers on the base weights with the
adapter merged as PEFT merges it (fp32). Requests here run one at a time: vLLM's CPU LoRA code reads
"no adapter" (index -1) as its last slot, so a base-model request batched with adapter requests runs
with that slot's adapter (docs/lora.md; ``scripts/vllm_lora_slot_check.py`` shows it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.gpu_fallback.conftest import start_vllm_server, stop_vllm_server, vllm_skip_reason

_reason = vllm_skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

import torch  # noqa: E402

from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter, other_base  # noqa: E402
from tests.engine.conftest import hf_greedy  # noqa: E402

PROMPT = "Deep learning on Inferentia"
NEW = 6


@pytest.fixture(scope="module")
def adapter_dirs(smollm2_safetensors: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_adapters")
    base = smollm2_safetensors
    return {
        "qv": make_tiny_adapter(root / "qv", base, 8, ("q_proj", "v_proj"), 16.0, seed=11),
        "all": make_tiny_adapter(root / "all", base, 8, ATTENTION + MLP, 16.0, seed=13),
        "big": make_tiny_adapter(root / "big", base, 32, ("q_proj",), seed=14),
        "wide": make_tiny_adapter(
            root / "wide", other_base(base, root / "wide_base", hidden_size=128), 8, ("q_proj",)
        ),
    }


@pytest.fixture(scope="module")
def model_dir(smollm2_safetensors: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 (its files linked) with one adapter in LMI's ``adapters/`` folder."""
    folder = tmp_path_factory.mktemp("vllm_lora_model")
    for file in smollm2_safetensors.iterdir():
        (folder / file.name).symlink_to(file)
    make_tiny_adapter(folder / "adapters" / "mlp", smollm2_safetensors, 16, MLP, 16.0, seed=12)
    return folder


@pytest.fixture(scope="module")
def lora_server(vllm_env, model_dir: Path, adapter_dirs, tmp_path_factory: pytest.TempPathFactory):
    args = ["--max-rolling-batch-size", "4", "--n-positions", "128"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "2"]
    args += ["--lora-modules", f"qv={adapter_dirs['qv']}"]
    server = start_vllm_server(vllm_env, model_dir, tmp_path_factory.mktemp("vllm_lora_server"), args)
    yield server
    stop_vllm_server(server)


@pytest.fixture(scope="module")
def http(lora_server) -> Iterator[httpx.Client]:
    with lora_server.client(timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def reference(smollm2_safetensors: Path):
    """Greedy ids of transformers (fp32) on the base weights, or with an adapter merged in place as
    PEFT's ``merge_and_unload`` computes it (``W + s B A``), undone after each call."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_safetensors), dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(str(smollm2_safetensors)).encode(PROMPT)
    params = dict(model.named_parameters())

    @contextmanager
    def merged(adapter: Path):
        config = json.loads((adapter / "adapter_config.json").read_text())
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        deltas = {}
        for key, a in weights.items():
            if ".lora_A." in key:
                b = weights[key.replace(".lora_A.", ".lora_B.")]
                scale = config["lora_alpha"] / (math.sqrt(a.shape[0]) if config["use_rslora"] else a.shape[0])
                name = key.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
                deltas[name] = scale * (b @ a)
        with torch.no_grad():
            for name, delta in deltas.items():
                params[name] += delta
            try:
                yield
            finally:
                for name, delta in deltas.items():
                    params[name] -= delta

    def greedy(adapter: Path | None) -> list[int]:
        if adapter is None:
            return hf_greedy(model, prompt, NEW)[0]
        with merged(adapter):
            return hf_greedy(model, prompt, NEW)[0]

    return greedy


def lmi_ids(http: httpx.Client, parameters: dict, path: str = "/invocations") -> list[int]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "details": True, **parameters}}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    out = out[0] if isinstance(out, list) else out
    return [t["id"] for t in out["details"]["tokens"]]


def completion(http: httpx.Client, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def base_name(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_models_lists_start_up_adapters_with_their_parent(http: httpx.Client, model_dir, adapter_dirs):
    data = http.get("/v1/models").json()["data"]
    base = data[0]["id"]
    assert sorted((m["id"], m.get("parent")) for m in data[1:]) == [("mlp", base), ("qv", base)]
    listed = {a["name"]: Path(a["src"]).resolve() for a in http.get("/adapters").json()["adapters"]}
    assert listed == {"qv": adapter_dirs["qv"].resolve(), "mlp": (model_dir / "adapters" / "mlp").resolve()}


def test_each_api_selects_the_adapter_with_merged_weights_tokens(
    http: httpx.Client, reference, model_dir, adapter_dirs
) -> None:
    base = reference(None)
    qv, mlp = reference(adapter_dirs["qv"]), reference(model_dir / "adapters" / "mlp")
    assert len({tuple(base), tuple(qv), tuple(mlp)}) == 3  # each adapter changes the tokens
    assert lmi_ids(http, {"adapters": "qv"}) == qv
    assert lmi_ids(http, {"adapter_id": "mlp"}, "/generate") == mlp
    assert lmi_ids(http, {}) == base  # the base model, after adapter requests filled both slots
    adapted = completion(http, "qv", logprobs=0).json()
    assert adapted["model"] == "qv" and adapted["choices"][0]["logprobs"] is not None
    assert adapted["usage"]["completion_tokens"] == NEW


def test_load_and_unload_at_run_time(http: httpx.Client, reference, adapter_dirs) -> None:
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapter_dirs["all"])})
    assert r.status_code == 200, r.text
    assert "all" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    # Three adapters over max_loras=2 and max_cpu_loras=2: vLLM evicts the least recently used and
    # reads it again from its path when a request needs it.
    assert lmi_ids(http, {"adapters": "all"}) == reference(adapter_dirs["all"])
    assert lmi_ids(http, {"adapters": "qv"}) == reference(adapter_dirs["qv"])
    assert http.delete("/adapters/all").status_code == 200
    r = completion(http, "all")
    assert r.status_code == 404 and "'all'" in r.text and r.json()["error"]["param"] == "model", r.text
    # LMI's register route, then vLLM's unload route; a second unload is a 404.
    r = http.post("/adapters", params={"name": "again", "src": str(adapter_dirs["all"])})
    assert r.status_code == 200, r.text
    assert lmi_ids(http, {"adapters": "again"}) == reference(adapter_dirs["all"])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
    assert r.status_code == 404 and "'again'" in r.text, r.text


def test_bad_adapters_are_400_naming_them(http: httpx.Client, adapter_dirs) -> None:
    def load(name: str, path: Path | str) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    r = load("big", adapter_dirs["big"])
    assert r.status_code == 400 and "'big'" in r.text and "max_lora_rank=16" in r.text, r.text
    r = load("wide", adapter_dirs["wide"])
    assert r.status_code == 400 and "another base model" in r.text, r.text
    assert r.json()["error"]["param"] == "lora_path"
    r = load("qv", adapter_dirs["qv"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = load("x", "/no/such/adapter")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    names = {a["name"] for a in http.get("/adapters").json()["adapters"]}
    assert names == {"qv", "mlp"}  # nothing else changed


def test_unknown_adapters_are_404_naming_them(http: httpx.Client) -> None:
    r = http.post("/invocations", json={"inputs": PROMPT, "parameters": {"adapters": "nope"}})
    assert r.status_code == 404 and "'nope'" in r.text and r.json()["field"] == "parameters.adapters"
    r = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 404 and r.json()["field"] == "parameters.adapter_id", r.text
    r = completion(http, "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert http.delete("/adapters/nope").status_code == 404


def test_a_running_stream_finishes_while_its_adapter_unloads(http: httpx.Client, lora_server, adapter_dirs):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": str(adapter_dirs["all"])})
    assert r.status_code == 200, r.text
    body = {"model": "tmp", "prompt": PROMPT, "max_tokens": 24, "stream": True, "ignore_eos": True}
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
