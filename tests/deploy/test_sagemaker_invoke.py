"""Calling an endpoint: JSON lines split across PayloadPart events at awkward byte offsets, and the
generate loop that continues while ``finish_reason == "length"`` (invoke_endpoint checked by Stubber)."""

from __future__ import annotations

import io
import json
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from neuron_lmi.deploy.sagemaker import EndpointError, JsonLinesDecoder, generate, iter_stream_objects

REGION = "us-east-1"
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": REGION}


def client(service: str, **kwargs: Any) -> Any:
    return boto3.client(service, **CREDS, **kwargs)


def _body(obj: Any) -> StreamingBody:
    data = json.dumps(obj).encode()
    return StreamingBody(io.BytesIO(data), len(data))


def test_generate_continues_while_finish_reason_is_length() -> None:
    runtime = client("sagemaker-runtime")
    rounds = [("Once upon", "length", 2), (" a time.", "eos_token", 3)]
    with Stubber(runtime) as stub:
        text = ""
        for piece, reason, tokens in rounds:
            payload = {"inputs": "Tell me" + text, "parameters": {"max_new_tokens": 2, "details": True}}
            expected = {
                "EndpointName": "ep",
                "ContentType": "application/json",
                "Accept": "application/json",
                "Body": json.dumps(payload).encode(),
            }
            details = {"finish_reason": reason, "generated_tokens": tokens}
            response = {"Body": _body({"generated_text": piece, "details": details})}
            stub.add_response("invoke_endpoint", response, expected)
            text += piece
        result = generate(runtime, "ep", "Tell me", {"max_new_tokens": 2}, max_rounds=5)
        stub.assert_no_pending_responses()
    assert (result.text, result.finish_reason, result.generated_tokens, result.rounds) == (
        "Once upon a time.",
        "eos_token",
        5,
        2,
    )


def _jsonl(objs: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(o, ensure_ascii=False).encode() + b"\n" for o in objs)


STREAM = [
    {"token": {"id": 1, "text": "Grüß", "log_prob": -0.1}},
    {"token": {"id": 2, "text": ' 東京 {"}', "log_prob": -0.2}},
    {"token": {"id": 3, "text": "!", "log_prob": -0.3}, "generated_text": 'Grüß 東京 {"}!', "details": {}},
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_json_lines_survive_any_payload_part_split(size) -> None:
    data = _jsonl(STREAM).replace(b"\n", b"\r\n", 1) + b"\n"  # CRLF and a blank line too
    events = [{"PayloadPart": {"Bytes": data[i : i + size]}} for i in range(0, len(data), size)]
    assert list(iter_stream_objects(events)) == STREAM


def test_stream_decoder_edge_cases() -> None:
    decoder = JsonLinesDecoder()
    assert decoder.feed(b'{"a": 1}\n{"b"') == [{"a": 1}]
    assert decoder.feed(b": 2}") == []
    assert decoder.close() == [{"b": 2}]  # last line without a newline
    with pytest.raises(EndpointError, match="malformed"):
        JsonLinesDecoder().feed(b"{not json}\n")
    failure = [{"PayloadPart": {"Bytes": b'{"token":{}}\n'}}, {"ModelStreamError": {"Message": "boom"}}]
    with pytest.raises(EndpointError, match=r"ModelStreamError.*boom"):
        list(iter_stream_objects(failure))


def test_streamed_generate_continues_and_reports_errors(monkeypatch) -> None:
    calls: list[dict[str, Any]] = []
    streams = [
        [
            *STREAM[:2],
            {"token": {"text": "!"}, "generated_text": "ab", "details": {"finish_reason": "length"}},
        ],
        [{"token": {"text": "c"}, "generated_text": "c", "details": {"finish_reason": "eos_token"}}],
    ]

    class FakeRuntime:  # the event stream itself is covered above; this checks the round logic
        def invoke_endpoint_with_response_stream(self, **kwargs: Any) -> dict[str, Any]:
            calls.append(json.loads(kwargs["Body"]))
            data = _jsonl(streams[len(calls) - 1])
            return {"Body": [{"PayloadPart": {"Bytes": data[:9]}}, {"PayloadPart": {"Bytes": data[9:]}}]}

    seen: list[str] = []
    result = generate(FakeRuntime(), "ep", "P", stream=True, on_text=seen.append)
    assert result.text == "abc" and result.rounds == 2 and result.finish_reason == "eos_token"
    assert [c["inputs"] for c in calls] == ["P", "Pab"] and all(c["stream"] for c in calls)
    assert seen == ["Grüß", ' 東京 {"}', "!", "c"]
    streams.append([{"generated_text": None, "error": "device lost", "code": 500}])
    calls[:] = [{}, {}]
    with pytest.raises(EndpointError, match="device lost"):
        generate(FakeRuntime(), "ep", "P", stream=True)
