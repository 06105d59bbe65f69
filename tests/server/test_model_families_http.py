"""``neuron-lmi serve`` on the families beyond Llama/Mistral/Mixtral: greedy tokens over HTTP on
loopback are transformers' own (a Gemma 3 vision-language checkpoint served text-only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.engine.conftest import hf_greedy
from tests.server.conftest import start_server


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_served_greedy_tokens_are_transformers(family: str, tmp_path: Path) -> None:
    import transformers

    path = make_tiny_checkpoint(tmp_path / family, family, seed=41)
    config = transformers.AutoConfig.from_pretrained(str(path))
    hf = getattr(transformers, config.architectures[0]).from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    args = ["--max-rolling-batch-size", "2", "--n-positions", "128", "--dtype", "fp32"]
    server = start_server(path, tmp_path, args)
    try:
        with server.client() as http:
            for prompt in ("Deep learning on Inferentia", "Hello world, this is"):
                want, _ = hf_greedy(hf, tokenizer.encode(prompt), 16)
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}
                r = http.post("/invocations", json=body)
                assert r.status_code == 200, r.text
                assert [t["id"] for t in r.json()["details"]["tokens"]] == want
        assert server.wait_rows_free() == 0
    finally:
        assert server.stop() == 0
    assert config.architectures[0] in server.log.read_text()
