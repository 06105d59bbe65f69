"""Clients of the tiny server, shared by the HTTP test modules. They are imported by name (not
put in ``conftest.py``) so that the vLLM tier, which star-imports those modules, gets them too; a
module may define its own ``client`` for another server (``test_tools_http.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, ServerProcess


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    """The official ``openai`` client on the tiny server (a module may override it for another server)."""
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(tiny_server: ServerProcess) -> Iterator[httpx.Client]:
    with tiny_server.client(timeout=120) as c:
        yield c
