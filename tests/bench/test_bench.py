"""``neuron-lmi bench`` against a fake remote server on loopback, in all three wire formats."""

from __future__ import annotations

import argparse
import csv
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.bench.protocols import (
    Api,
    LMIStreamParser,
    OpenAIStreamParser,
    RequestOptions,
    ServerError,
    TGIStreamParser,
)
from neuron_lmi.bench.report import percentile
from neuron_lmi.bench.runner import LEVEL_INDEX_STRIDE
from neuron_lmi.bench.workload import TokenCount, Workload, parse_token_count
from neuron_lmi.commands import bench


def run_bench(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "results.json"
    args = parser.parse_args(["bench", "--no-progress", "--out", str(out), *argv])
    code = args.func(args)
    return code, json.loads(out.read_text())


@pytest.mark.parametrize(
    ("api", "extra"),
    [("openai", []), ("openai", ["--openai-endpoint", "completions"]), ("tgi", []), ("lmi", [])],
)
def test_streaming_sweep_counts_tokens_and_latencies(fake_server, tmp_path, api, extra, capsys) -> None:
    argv = ["--url", fake_server.url, "--api", api, "--stream", "--concurrency", "1,4"]
    code, results = run_bench([*argv, "--requests", "8", "--output-tokens", "6", *extra], tmp_path)
    assert code == 0
    assert [level["concurrency"] for level in results["levels"]] == [1, 4]
    for level in results["levels"]:
        assert level["requests"] == 8
        assert level["success_pct"] == 100.0
        assert level["output_tokens"] == 8 * 6
        assert level["errors_by_kind"] == {}
        assert 0 < level["ttft_p50_ms"] <= level["ttft_p90_ms"] <= level["ttft_p99_ms"]
        assert 0 < level["itl_p50_ms"] <= level["itl_p99_ms"]
        assert level["e2e_p50_ms"] >= level["ttft_p50_ms"]
        assert level["requests_per_s"] > 0 and level["output_tokens_per_s"] > 0
    assert fake_server.state.received == 16
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "out tok/s" in table


def test_timeline_holds_every_requests_send_time_and_token_arrivals(fake_server, tmp_path) -> None:
    timeline = tmp_path / "timeline.json"
    before = time.time()
    argv = ["--url", fake_server.url, "--api", "tgi", "--stream", "--concurrency", "2", "--requests", "4"]
    code, results = run_bench([*argv, "--output-tokens", "5", "--timeline", str(timeline)], tmp_path)
    after = time.time()
    assert code == 0
    (level,) = json.loads(timeline.read_text())["levels"]
    assert level["concurrency"] == 2 and [r["index"] for r in level["requests"]] == [0, 1, 2, 3]
    for request in level["requests"]:
        assert request["ok"] and before <= request["sent_at"] <= after
        times = request["token_times"]
        assert len(times) == 5 and times == sorted(times) and request["sent_at"] + times[-1] <= after
    # the summary's latencies are the timeline's
    firsts = sorted(r["token_times"][0] for r in level["requests"])
    assert results["levels"][0]["ttft_p50_ms"] == pytest.approx(1e3 * (firsts[1] + firsts[2]) / 2)


def test_a_timeline_must_be_json(fake_server, tmp_path) -> None:
    with pytest.raises(ValueError, match="--timeline"):
        run_bench(["--url", fake_server.url, "--timeline", str(tmp_path / "t.csv")], tmp_path)


def test_errors_are_counted_not_retried(fake_server, tmp_path) -> None:
    fake_server.state.fail_every = 4  # requests 4, 8, 12 fail: 503, 500, 503
    argv = ["--url", fake_server.url, "--api", "tgi", "--stream", "--concurrency", "3"]
    code, results = run_bench([*argv, "--requests", "12", "--output-tokens", "5"], tmp_path)
    (level,) = results["levels"]
    assert code == 0
    assert fake_server.state.received == 12  # nothing retried
    assert (level["requests"], level["successes"], level["errors"]) == (12, 9, 3)
    assert level["success_pct"] == 75.0
    assert level["errors_by_kind"] == {"HTTP 503": 2, "HTTP 500": 1}
    assert level["error_details"] and all("injected failure" in d for d in level["error_details"])
    assert level["output_tokens"] == 9 * 5


def test_uniform_output_tokens_match_the_workload(fake_server, tmp_path) -> None:
    argv = ["--url", fake_server.url, "--api", "lmi", "--stream", "--seed", "7"]
    code, results = run_bench(
        [*argv, "--requests", "10", "--prompt-tokens", "normal:40:10", "--output-tokens", "uniform:2:9"],
        tmp_path,
    )
    workload = Workload(parse_token_count("normal:40:10"), parse_token_count("uniform:2:9"), seed=7)
    expected = [workload.request(i) for i in range(10)]  # level 0 uses indices 0..9
    assert results["levels"][0]["output_tokens"] == sum(r.max_tokens for r in expected)
    sent = sorted(fake_server.state.bodies, key=lambda b: b["inputs"])
    assert sorted(r.prompt for r in expected) == [b["inputs"] for b in sent]
    assert all(b["stream"] is True and b["parameters"]["details"] is True for b in sent)
    assert code == 0


@pytest.mark.parametrize("api", ["openai", "tgi", "lmi"])
def test_whole_responses_and_csv_and_plot(fake_server, tmp_path, api) -> None:
    fake_server.state.fail_every = 5
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out, png = tmp_path / "r.csv", tmp_path / "plots" / "latency.png"
    base = ["bench", "--url", fake_server.url, "--api", api, "--concurrency", "1,2,8", "--requests", "10"]
    args = parser.parse_args(
        [*base, "--output-tokens", "4", "--no-progress", "--out", str(out), "--plot", str(png)]
    )
    assert args.func(args) == 0
    rows = list(csv.DictReader(out.open()))
    assert [int(r["concurrency"]) for r in rows] == [1, 2, 8]
    assert sum(int(r["errors"]) for r in rows) == 30 // 5
    assert all(int(r["output_tokens"]) == 4 * int(r["successes"]) for r in rows)
    assert all(r["ttft_p50_ms"] == "" for r in rows)  # no TTFT without streaming
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_duration_mode_stops_by_itself(fake_server, tmp_path) -> None:
    start = time.monotonic()
    argv = ["--url", fake_server.url, "--api", "openai", "--stream", "--concurrency", "2"]
    code, results = run_bench([*argv, "--duration", "0.5", "--output-tokens", "3"], tmp_path)
    assert code == 0
    assert time.monotonic() - start < 10
    level = results["levels"][0]
    assert level["requests"] >= 2 and level["requests"] == fake_server.state.received
    assert results["config"]["duration_s"] == 0.5


def test_unreachable_server_counts_connection_errors(tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the run: nothing listens there
    code, results = run_bench(["--url", f"http://127.0.0.1:{port}", "--requests", "3"], tmp_path)
    assert code == 1
    assert results["levels"][0]["errors_by_kind"] == {"ConnectError": 3}


def test_slow_streams_are_cut_at_the_timeout(fake_server, tmp_path) -> None:
    start = time.monotonic()
    argv = ["--url", fake_server.url, "--api", "tgi", "--stream", "--requests", "2", "--timeout", "0.3"]
    code, results = run_bench([*argv, "--output-tokens", "5000"], tmp_path)  # ~5 s of tokens each
    assert code == 1 and time.monotonic() - start < 4
    assert results["levels"][0]["errors_by_kind"] == {"timeout": 2}


def test_full_url_is_used_as_given(fake_server, tmp_path) -> None:
    url = fake_server.url + "/v1/completions"
    code, results = run_bench(["--url", url, "--api", "openai", "--requests", "2"], tmp_path)
    assert code == 0 and results["config"]["url"] == url
    assert all("prompt" in body for body in fake_server.state.bodies)


def test_several_models_are_asked_for_in_turn() -> None:
    """``--model a,b,c`` (a base model and its adapters): request i names models[i % 3]."""
    api = Api("openai", RequestOptions(models=("base", "a1", "a2"), openai_endpoint="completions"))
    workload = Workload(parse_token_count("8"), parse_token_count("4"), 0)
    named = [api.body(workload.request(i), stream=True)["model"] for i in range(5)]
    assert named == ["base", "a1", "a2", "base", "a1"]
    assert "model" not in Api("openai", RequestOptions()).body(workload.request(0), stream=True)


def test_stream_parsers_report_errors_and_skip_comments() -> None:
    openai = OpenAIStreamParser()
    assert openai.feed(": ping") is None and openai.feed("") is None
    assert openai.feed('data: {"choices":[{"delta":{"content":"hi"}}]}').tokens == 1
    assert openai.feed("data: [DONE]").done
    with pytest.raises(ServerError, match="overloaded"):
        openai.feed('data: {"error": {"message": "overloaded", "type": "server_error"}}')
    with pytest.raises(ServerError, match="bad input"):
        TGIStreamParser().feed('data:{"error":"bad input","error_type":"validation"}')
    with pytest.raises(ServerError, match="out of memory"):
        LMIStreamParser().feed('{"generated_text": null, "error": "out of memory", "code": 500}')
    last = LMIStreamParser().feed(
        '{"token":{"id":1,"text":"x"},"generated_text":"x","details":{"generated_tokens":1}}'
    )
    assert last is not None and last.done and last.reported_output_tokens == 1


def test_token_count_parsing() -> None:
    assert parse_token_count("128") == TokenCount("fixed", 128)
    assert parse_token_count("uniform:50:100") == TokenCount("uniform", 50, 100)
    assert parse_token_count("normal:1000:100").describe() == "normal:1000:100"
    for bad in ("0", "uniform:5", "uniform:9:3", "poisson:3:4", "abc", "normal:-1:2"):
        with pytest.raises(ValueError, match="token count"):
            parse_token_count(bad)


def test_percentile_and_level_indices() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    workload = Workload(parse_token_count("10"), parse_token_count("5"))
    assert workload.request(3) == workload.request(3)
    assert workload.request(3).prompt != workload.request(LEVEL_INDEX_STRIDE + 3).prompt
