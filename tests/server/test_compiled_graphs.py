"""``neuron-lmi serve`` as shipped: the CPU engine prefills and decodes through compiled graphs
unless ``option.enforce_eager``, and its greedy tokens over HTTP are the eager engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import ServerProcess, direct_greedy, start_server

pytestmark = pytest.mark.slow


def test_serve_defaults_to_the_compiled_graphs(
    tiny_llama_dir: Path, tmp_path: Path, direct_engine, tiny_server: ServerProcess
) -> None:
    # The other tests' server runs with OPTION_ENFORCE_EAGER=true: no compiled graph at all.
    assert "compiled step" not in tiny_server.log.read_text()
    assert "compiled extend" not in tiny_server.log.read_text()
    args = ["--max-rolling-batch-size", "8", "--n-positions", "256", "--dtype", "fp32"]
    env = {"OPTION_ENFORCE_EAGER": "false", "NEURON_LMI_CACHE_DIR": str(tmp_path / "cache")}
    server = start_server(tiny_llama_dir, tmp_path, args, env=env)
    try:
        prompts = ["Deep learning on Inferentia", "Hello world, this is"]
        with server.client() as http:
            for prompt in prompts:
                _, ids = direct_greedy(direct_engine, prompt, 24)
                body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}}
                r = http.post("/invocations", json=body)
                assert r.status_code == 200, r.text
                assert [t["id"] for t in r.json()["details"]["tokens"]] == ids
        assert server.wait_rows_free() == 0
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    assert "compiled step: key=" in log and "compiled extend: key=" in log, log[-3000:]
    assert list((tmp_path / "cache").rglob("step.pt2")) and list((tmp_path / "cache").rglob("extend.pt2"))
