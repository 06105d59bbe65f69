"""Tool calling on ``neuron-lmi serve --backend vllm``: the server suite's ``test_tools_http.py`` on
SmolLM2 served by vLLM. Our server renders the tools (the Hermes prompt: SmolLM2's template has
none) and parses the calls; vLLM decodes under the call grammar as its own structured output, so a
named or required ``tool_choice`` returns a call that validates, in the same response shape.

``test_auto_answers_with_content_when_the_model_does_not_call`` stays in the CPU suite: it relies on
the tiny random model not writing a call, and SmolLM2 under a tool prompt may well write one.
"""

from __future__ import annotations

import pytest

from tests.gpu_fallback.conftest import start_vllm_server, stop_vllm_server, vllm_skip_reason

_reason = vllm_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

from tests.server.test_tools_http import (  # noqa: E402, F401
    client,
    model,
    test_no_rows_leak,
    test_required_calls_validate_for_every_choice,
    test_response_format_and_a_forced_call_do_not_mix,
    test_round_trip_with_a_named_tool,
    test_stream_chunks_carry_the_call_by_index,
    test_streamed_tool_calls_reassemble_in_the_client,
    test_tools_need_template_support_or_a_parser,
)


@pytest.fixture(scope="module")
def tool_server(vllm_env, smollm2_safetensors, tmp_path_factory: pytest.TempPathFactory):
    """vLLM behind our server with ``option.tool_call_parser=hermes``; 512 positions for the tool prompt."""
    args = ["--max-rolling-batch-size", "4", "--n-positions", "512", "--tool-call-parser", "hermes"]
    server = start_vllm_server(vllm_env, smollm2_safetensors, tmp_path_factory.mktemp("vllm_tools"), args)
    yield server
    stop_vllm_server(server)


@pytest.fixture(scope="session")
def tiny_server(vllm_server):
    return vllm_server
