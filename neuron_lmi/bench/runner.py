"""The load loop: a fixed number of concurrent workers per level, each sending one request at a time.

Bounded by construction: a level ends after ``requests`` requests or once ``duration`` seconds have
passed (no new request starts after that; those in flight finish or hit ``timeout``). Nothing is
retried: every failure becomes a :class:`RequestResult` with an error kind that the summary counts.
Requests go only to the one URL given; redirects are not followed and proxy variables are ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from neuron_lmi.bench.protocols import Api, Chunk, ServerError
from neuron_lmi.bench.workload import BenchRequest, Workload

LEVEL_INDEX_STRIDE = 10_000_000  # levels draw disjoint request indices: no prompt is sent twice


@dataclass(slots=True)
class RequestResult:
    """The outcome of one request. Times are seconds; ``token_times`` (hence ``ttft`` and ``itl``)
    exist only when streaming."""

    index: int
    ok: bool
    e2e: float
    prompt_tokens: int
    output_tokens: int = 0
    # Wall-clock time of sending (``time.time()``): lines up requests of separate load processes.
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # after sending, one per chunk with tokens
    error: str | None = None  # a short kind, counted in the summary: "HTTP 503", "timeout", ...
    detail: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def itl(self) -> list[float]:
        return [later - earlier for earlier, later in itertools.pairwise(self.token_times)]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One benchmark run: where, what, and how much. Exactly one of requests/duration is set."""

    url: str
    api: Api
    workload: Workload
    concurrency: tuple[int, ...]
    stream: bool = False
    requests: int | None = None
    duration: float | None = None
    timeout: float = 300.0
    api_key: str | None = None
    progress: bool = True

    def validate(self) -> None:
        if (self.requests is None) == (self.duration is None):
            raise ValueError("give exactly one of --requests and --duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency must be positive integers, got {self.concurrency}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--url {self.url!r}: expected http(s)://host[:port][/path]")

    def endpoint(self) -> str:
        """The URL as given when it has a path, else the base URL plus the API's default path."""
        parts = urlsplit(self.url)
        if parts.path not in ("", "/"):
            return self.url
        return self.url.rstrip("/") + self.api.path(self.stream)


@dataclass(slots=True)
class LevelRun:
    concurrency: int
    results: list[RequestResult]
    wall_s: float


def _failure(req: BenchRequest, start: float, kind: str, detail: str) -> RequestResult:
    return RequestResult(
        req.index, False, time.perf_counter() - start, req.prompt_tokens, error=kind, detail=detail[:300]
    )


def _finish(req: BenchRequest, start: float, chunks_tokens: int, last: Chunk | None) -> RequestResult:
    reported = None
    if last is not None and last.reported_output_tokens is not None:
        reported = int(last.reported_output_tokens)
    prompt = req.prompt_tokens
    if last is not None and last.reported_prompt_tokens is not None:
        prompt = int(last.reported_prompt_tokens)
    output = reported if reported is not None else chunks_tokens
    return RequestResult(req.index, True, time.perf_counter() - start, prompt, output)


async def _send_streaming(
    client: httpx.AsyncClient, config: LoadConfig, url: str, req: BenchRequest
) -> RequestResult:
    start = time.perf_counter()
    async with client.stream("POST", url, json=config.api.body(req, True)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            return _failure(req, start, f"HTTP {resp.status_code}", body)
        parser = config.api.stream_parser()
        token_times: list[float] = []
        n_tokens = 0
        summary = Chunk()
        async for line in resp.aiter_lines():
            chunk = parser.feed(line)
            if chunk is None:
                continue
            if chunk.tokens:
                token_times.append(time.perf_counter() - start)
                n_tokens += chunk.tokens
            if chunk.reported_output_tokens is not None:
                summary.reported_output_tokens = chunk.reported_output_tokens
            if chunk.reported_prompt_tokens is not None:
                summary.reported_prompt_tokens = chunk.reported_prompt_tokens
            summary.done = summary.done or chunk.done
    if not summary.done:
        return _failure(req, start, "incomplete stream", f"stream ended after {n_tokens} tokens")
    result = _finish(req, start, n_tokens, summary)
    result.token_times = token_times
    return result


async def _send_whole(
    client: httpx.AsyncClient, config: LoadConfig, url: str, req: BenchRequest
) -> RequestResult:
    start = time.perf_counter()
    resp = await client.post(url, json=config.api.body(req, False))
    if resp.status_code != 200:
        return _failure(req, start, f"HTTP {resp.status_code}", resp.text)
    try:
        payload = resp.json()
    except ValueError:
        return _failure(req, start, "bad response", resp.text)
    chunk = config.api.parse_response(payload)
    return _finish(req, start, 0, chunk)


async def send_one(
    client: httpx.AsyncClient, config: LoadConfig, url: str, req: BenchRequest
) -> RequestResult:
    """Send one request and measure it; every failure is returned, never raised or retried."""
    sent_at, start = time.time(), time.perf_counter()
    send = _send_streaming if config.stream else _send_whole
    try:
        # httpx's timeout applies per read; this bounds the whole request, slow streams included
        async with asyncio.timeout(config.timeout):
            result = await send(client, config, url, req)
    except TimeoutError:
        result = _failure(req, start, "timeout", f"no complete response within {config.timeout} s")
    except httpx.TimeoutException as exc:
        result = _failure(req, start, "timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        result = _failure(req, start, type(exc).__name__, str(exc))
    except ServerError as exc:
        result = _failure(req, start, "server error", str(exc))
    result.sent_at = sent_at
    return result


async def run_level(
    config: LoadConfig, concurrency: int, level_pos: int, on_done: Callable[[RequestResult], None]
) -> LevelRun:
    """Run one concurrency level with its own connection pool and return every request's result."""
    url = config.endpoint()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 10.0))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    counter = itertools.count()
    results: list[RequestResult] = []
    deadline: float | None = None  # set once the client exists: its set-up is not load time

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            n = next(counter)
            if config.requests is not None and n >= config.requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            req = config.workload.request(level_pos * LEVEL_INDEX_STRIDE + n)
            result = await send_one(client, config, url, req)
            results.append(result)
            on_done(result)

    async with httpx.AsyncClient(
        headers=headers, timeout=timeout, limits=limits, follow_redirects=False, trust_env=False
    ) as client:
        start = time.perf_counter()
        deadline = start + config.duration if config.duration is not None else None
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LevelRun(concurrency, sorted(results, key=lambda r: r.index), wall)


async def run_sweep(config: LoadConfig) -> list[LevelRun]:
    """Run every concurrency level in order, with a tqdm bar on stderr per level."""
    from tqdm import tqdm

    config.validate()
    runs = []
    for pos, concurrency in enumerate(config.concurrency):
        total = config.requests
        with tqdm(
            total=total,
            desc=f"concurrency {concurrency}",
            unit="req",
            file=sys.stderr,
            disable=not config.progress,
            dynamic_ncols=True,
        ) as bar:
            errors = 0

            def on_done(result: RequestResult, bar: tqdm = bar) -> None:
                nonlocal errors
                errors += 0 if result.ok else 1
                bar.update(1)
                bar.set_postfix(errors=errors, refresh=False)

            runs.append(await run_level(config, concurrency, pos, on_done))
    return runs
