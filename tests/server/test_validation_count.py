"""A request is validated once (``Engine.admit``), whatever route it came by, counted in a real server
and its engine process.

A sitecustomize on the server's PYTHONPATH (so in the API process and in the engine process, which
is a fresh interpreter) wraps ``SamplingParams.validate`` and llguidance's grammar check so that each
call appends its process id to a file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ServerProcess, start_server

COUNTING_HOOK = """
import os
import llguidance
from neuron_lmi.engine import types

LOG = os.environ["VALIDATION_LOG"]

def _record(what):
    with open(LOG, "a") as f:
        f.write(f"{what} {os.getpid()}\\n")

original_validate = types.SamplingParams.validate
def validate(self, *args, **kwargs):
    _record("params")
    return original_validate(self, *args, **kwargs)
types.SamplingParams.validate = validate

original_grammar = llguidance.LLMatcher.validate_grammar_with_warnings
def validate_grammar(*args, **kwargs):
    _record("grammar")
    return original_grammar(*args, **kwargs)
llguidance.LLMatcher.validate_grammar_with_warnings = staticmethod(validate_grammar)
"""


@pytest.fixture(scope="module")
def counted(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("validation_count")
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(COUNTING_HOOK)
    log = tmp / "validations.log"
    env = {"PYTHONPATH": str(hook), "VALIDATION_LOG": str(log)}
    args = ["--max-rolling-batch-size", "2", "--n-positions", "128", "--dtype", "fp32"]
    server = start_server(tiny_llama_dir, tmp, args, env=env)
    yield server, log
    server.stop()


def _calls(log: Path) -> list[tuple[str, int]]:
    if not log.exists():
        return []
    return [(what, int(pid)) for what, pid in (line.split() for line in log.read_text().splitlines())]


def test_each_route_validates_a_request_once_in_the_api_process(
    counted: tuple[ServerProcess, Path],
) -> None:
    server, log = counted
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0.5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        ("/invocations", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}}),
        ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "do_sample": True}}),
    ]
    with server.client() as client:
        for path, body in requests:
            before = len(_calls(log))
            response = client.post(path, json=body)
            assert response.status_code == 200, (path, response.text)
            new = _calls(log)[before:]
            assert [what for what, _ in new if what == "params"] == ["params"], (path, new)
            assert {pid for _, pid in new} == {server.proc.pid}, (path, new)  # none in the engine
            grammars = [what for what, _ in new if what == "grammar"]
            assert len(grammars) == (1 if "response_format" in body else 0), (path, new)

        before = len(_calls(log))  # a refusal: checked once, refused with the client's field name
        refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1000})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "max_tokens", error
        assert error["message"].startswith("max_tokens=1000 exceeds"), error
        assert [what for what, _ in _calls(log)[before:]] == ["params"]
