"""``/openapi.json`` is the contract: schemathesis fuzzes every operation of a real server with it.

Each operation gets schema-valid bodies (positive) and schema-invalid ones (negative), a bounded
number of each, generated deterministically (``derandomize``) so CI runs the same cases. Every
response must: not be a 5xx; have a documented status and content type; validate against the
documented schema (for streams, every event or JSON line); reject what the schema forbids; and, when
it is a 4xx, be in the route's own error format naming the field. Afterwards no KV row is held and
``/ping`` answers 200.

Not checked: that every schema-valid body is accepted. Some limits cannot be written in a schema
(a prompt longer than the model's context, the served model's name, ``tool_choice`` needing
``tools``), and bodies are parsed strictly, so ``2.0`` is not an integer here although JSON Schema
says it is. Those requests are refused with a 4xx naming the field, which the checks below hold.

The model is the tiny random Llama behind ``tool_server`` (tools go through the built-in Hermes
prompt). ``FUZZ_EXAMPLES`` raises the number of positive cases per operation for a deeper local run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from neuron_lmi.server.errors import family_for_path
from neuron_lmi.server.openapi import ROUTES
from tests.server.conftest import AUTH, ServerProcess

POSITIVE = int(os.environ.get("FUZZ_EXAMPLES", "20"))
NEGATIVE = max(POSITIVE // 3, 1)
# Bounds on generated work, applied to valid bodies before they are sent: the model is random, so a
# case costs its token count and nothing more is learnt from longer outputs.
MAX_TOKENS = 8
MAX_CHOICES = 3
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


@schemathesis.deserializer("application/jsonlines")
def _json_lines(ctx: Any, response: Any) -> list[Any]:
    """LMI streams: the documented schema reads JSON lines as the array of their values."""
    return [json.loads(line) for line in response.content.decode().splitlines() if line.strip()]


def _bounded(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for owner, names in ((body, TOKEN_FIELDS), (body.get("parameters"), ("max_new_tokens",))):
        for name in names if isinstance(owner, dict) else ():
            value = owner.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                owner[name] = MAX_TOKENS
    for owner in (body, body.get("parameters")):
        for name in ("n", "best_of") if isinstance(owner, dict) else ():
            value = owner.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CHOICES:
                owner[name] = MAX_CHOICES


def _named_error(ctx: Any, response: Any, case: Any) -> None:
    """A 4xx is in the route's own error format; a validation error names its field."""
    status = response.status_code
    if not 400 <= status < 500:
        return
    family = family_for_path(case.path)
    body = json.loads(response.content)
    if family == "openai":
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        if error["type"] == "invalid_request_error" or status == 404:
            assert error["param"], f"a {status} that names no field: {body}"
        return
    assert isinstance(body.get("error"), str) and body["error"] and body.get("error_type"), body
    if family == "invocations":
        assert body["code"] == status and body["generated_text"] is None, body
    if body["error_type"] == "validation":
        assert body.get("field"), f"a {status} that names no field: {body}"


@pytest.fixture(scope="module")
def api(tool_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{tool_server.url}/openapi.json", headers=dict(AUTH), timeout=30)


def _fuzz(operation: Any, mode: GenerationMode, examples: int, server: ServerProcess) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        if mode is GenerationMode.POSITIVE:  # a bound could make an invalid body valid
            _bounded(case.body)
        response = case.call(base_url=server.url, headers=dict(AUTH), timeout=120)
        case.validate_response(
            response, excluded_checks=[positive_data_acceptance], additional_checks=[_named_error]
        )

    run()


@pytest.mark.parametrize(
    ("path", "method"), sorted(ROUTES), ids=[f"{m.upper()} {p}" for p, m in sorted(ROUTES)]
)
def test_operation_holds_to_its_schema(api: Any, tool_server: ServerProcess, path: str, method: str) -> None:
    operation = api[path][method.upper()]
    _fuzz(operation, GenerationMode.POSITIVE, POSITIVE if ROUTES[(path, method)].request else 1, tool_server)
    if ROUTES[(path, method)].request is not None:  # a GET without parameters has no invalid input
        _fuzz(operation, GenerationMode.NEGATIVE, NEGATIVE, tool_server)


def test_after_fuzzing_nothing_is_held_and_the_server_is_healthy(tool_server: ServerProcess) -> None:
    assert tool_server.wait_rows_free() == 0
    assert tool_server.metric("neuron_lmi_queue_length") == 0
    assert httpx.get(f"{tool_server.url}/ping", timeout=10).status_code == 200
