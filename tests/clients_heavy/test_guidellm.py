"""guidellm (vLLM's load tester) against a real server on loopback: a short synchronous and a short
concurrent run, each bounded by a request count. Every request must succeed and produce the output
tokens it asked for (guidellm sends ``ignore_eos`` and vLLM's ``stream_options.continuous_usage_stats``
and counts tokens from the streamed usage).

guidellm lives in its own environment (``make test-clients-heavy`` builds ``.venv-clients`` with
scripts/setup_clients_env.sh); without it these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import ServerProcess, start_server

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = Path(os.environ.get("GUIDELLM", ROOT / ".venv-clients" / "bin" / "guidellm"))
OUTPUT_TOKENS = 8

pytestmark = pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no {GUIDELLM} (make test-clients-heavy)")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model; its name is its directory, which guidellm also loads the tokenizer from."""
    tmp = tmp_path_factory.mktemp("guidellm_server")
    args = ["--max-rolling-batch-size", "8", "--n-positions", "256", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, args, api_key=None)
    yield server
    server.stop()


def run_guidellm(server: ServerProcess, profile: str, requests: int, out: Path) -> dict[str, Any]:
    args = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={server.url}",
        "--profile",
        profile,
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return benchmark["requests"]


@pytest.mark.parametrize(("profile", "requests"), [("kind=synchronous", 4), ("kind=concurrent,streams=4", 8)])
def test_guidellm_run_has_no_errors_and_every_output_length(
    server: ServerProcess, tmp_path: Path, profile: str, requests: int
) -> None:
    result = run_guidellm(server, profile, requests, tmp_path / "guidellm.json")
    assert result["errored"] == [] and result["incomplete"] == []
    assert len(result["successful"]) == requests
    assert [r["output_tokens"] for r in result["successful"]] == [OUTPUT_TOKENS] * requests
    assert server.wait_rows_free() == 0
