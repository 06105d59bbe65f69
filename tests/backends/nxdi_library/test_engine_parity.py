"""(a) ``NxdiRunner`` over the real application, inside ``EngineCore`` and behind the real server,
gives the CPU engine's greedy tokens.

The schedule joins six requests into four rows step by step: one- and two-token prompts, a prompt
longer than a Mistral window of 8, full and partial batches, rows freed and reused. Where the
application keeps no sliding window (Mixtral), the reference is the CPU engine without one too.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.common import eos_ids_for
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.nxdi.runner import on_cpu_application, runner_for
from neuron_lmi.backends.nxdi.support import release
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.conftest import run_schedule
from tests.backends.nxdi.test_families import tiny_checkpoint
from tests.backends.nxdi_library import library
from tests.backends.nxdi_library.conftest import ARCHES, nxdi_plan, start_up_refusal
from tests.server.conftest import free_port, start_server

ROWS, N_POSITIONS = 4, 64
SCHEDULE = [(0, 5, 6), (0, 20, 7), (2, 1, 5), (3, 9, 9), (3, 2, 3), (6, 12, 5), (7, 1, 4)]
pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")


@pytest.fixture(scope="module", params=ARCHES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, N_POSITIONS)


def reference(checkpoint: Path, plan: Any) -> tuple[Any, Any, list[int]]:
    """The CPU engine's model, without a window where the application keeps none."""
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    if plan.sliding_window is None and model.args.sliding_window is not None:
        model = model.without_window()
    tokenizer = load_tokenizer(ckpt)
    return model, tokenizer, eos_ids_for(ckpt.config, tokenizer)


@pytest.mark.parametrize("sampling", ["host", "on-device"])
def test_the_runner_on_the_library_gives_the_cpu_engine_tokens(checkpoint: Path, sampling: str) -> None:
    device = sampling == "on-device"  # the default; without log-probabilities the device's tokens count
    extra = "" if device else "option.on_device_sampling=false\n"
    plan, _ = nxdi_plan(checkpoint, ROWS, N_POSITIONS, extra=extra)
    assert plan.on_device_sampling == device
    model, tokenizer, eos = reference(checkpoint, plan)
    expected = run_schedule(EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, eos), SCHEDULE)

    runner = runner_for(on_cpu_application(plan), plan, model.args.vocab_size)
    riders: list[tuple[int, int]] = []  # (row, position) of every line written for a row not asked
    rider = runner._rider

    def counted(row: int) -> tuple[int, int] | None:
        write = rider(row)
        if write is not None:
            riders.append((row, write[1]))
        return write

    runner._rider = counted  # type: ignore[method-assign]
    got = run_schedule(EngineCore(runner, tokenizer, eos), SCHEDULE, logprobs=not device)

    assert got == expected
    assert riders == []  # the engine decodes every live row in every call: nothing rides
    assert all(len(got[f"r{i}"]) == new for i, (_, _, new) in enumerate(SCHEDULE))
    assert runner.rows.in_use() == []


def test_the_server_on_the_library_answers_concurrent_completions(checkpoint: Path, tmp_path: Path) -> None:
    """``neuron-lmi serve --backend neuron`` with ``override_neuron_config.on_cpu``, as a user runs it."""
    plan, _ = nxdi_plan(checkpoint, ROWS, N_POSITIONS)
    model, tokenizer, eos = reference(checkpoint, plan)
    prompts = [[11], [12, 13], *[list(range(20 + i, 20 + i + n)) for i, n in enumerate((3, 9, 17, 30))]]
    core = EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, eos)
    requests = [core.make_request(p, _greedy(10), request_id=str(i)) for i, p in enumerate(prompts)]
    for request in requests:
        core.add(request)
    while core.has_work():
        core.step()
    expected = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in requests]

    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={checkpoint}\noption.max_rolling_batch_size={ROWS}\n"
        f"option.n_positions={N_POSITIONS}\noption.dtype=fp32\noption.tensor_parallel_degree=1\n"
        'option.override_neuron_config={"on_cpu": true}\n',
        encoding="utf-8",
    )
    launcher = [sys.executable, str(Path(__file__).with_name("launch_server.py"))]
    args = ["--backend", "neuron", "--properties", str(props)]
    refused = start_up_refusal(plan.model_type)
    if refused:  # refused at start-up, naming why; exit status 2
        command = [*launcher, "serve", "--model", str(checkpoint), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and refused in done.stderr, done.stderr[-2000:]
        return
    # This process's own gloo group holds its MASTER_PORT: the server gets another.
    server = start_server(checkpoint, tmp_path, args, env={"MASTER_PORT": str(free_port())}, command=launcher)
    try:
        with server.client() as http:
            info = http.get("/info").json()
            body = {"model": info["model_id"], "max_tokens": 10, "temperature": 0}
            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(
                    pool.map(lambda p: http.post("/v1/completions", json={**body, "prompt": p}), prompts)
                )
        assert info["model_device_type"] == "neuron-nxdi"
        assert [a.status_code for a in answers] == [200] * len(prompts), [a.text for a in answers]
        assert [a.json()["choices"][0]["text"] for a in answers] == expected
        assert server.wait_rows_free() == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "override_neuron_config.on_cpu=true" in log and "no Neuron devices used" in log
    # 0.8.0 lacks a CPU-path method: the product supplies it and says so (test_cpu_mode.py)
    supplied = "_get_captured_tensors_offset, which its CPU mode calls" in log
    assert supplied is ((release(library.library_version()) or (0, 9)) <= (0, 8))


def _greedy(n: int) -> Any:
    from neuron_lmi.engine.types import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0)


@pytest.mark.parametrize("length", [3, 7])
def test_a_row_riding_along_keeps_its_ring(checkpoint: Path, length: int) -> None:
    """Where a live row must ride all the same, its write leaves the ring as it was: at its next
    position while the ring has a free slot (3 < W-1), else its last token again (W-1 = 7)."""
    plan, _ = nxdi_plan(checkpoint, ROWS, N_POSITIONS)
    model, _, _ = reference(checkpoint, plan)
    cpu = CpuRunner(model, ROWS, N_POSITIONS)
    nxdi = runner_for(on_cpu_application(plan), plan, model.args.vocab_size)
    logits = []
    for runner in (cpu, nxdi):
        a, b = runner.rows.allocate(), runner.rows.allocate()
        runner.prefill([a, b], [list(range(40, 52)), list(range(60, 60 + length))])
        runner.decode([a], [7])  # b rides along
        logits.append(runner.decode([a, b], [8, 9]))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ("option.tensor_parallel_degree=2\noption.dtype=fp32\n", "option.tensor_parallel_degree=2"),
        ("option.tensor_parallel_degree=2\noption.dtype=bf16\n", "option.tensor_parallel_degree=2"),
        ("option.tensor_parallel_degree=1\noption.dtype=fp16\n", "option.dtype=fp16"),
    ],
)
def test_the_cpu_mode_refuses_what_to_cpu_cannot_run(options: str, named: str, tmp_path: Path) -> None:
    """A CLI error naming the key and a non-zero exit, before any weights are read."""
    checkpoint = make_tiny_checkpoint(tmp_path / "model", arch="llama")
    props = tmp_path / "serving.properties"
    props.write_text(f'{options}option.override_neuron_config={{"on_cpu": true}}\n', encoding="utf-8")
    launcher = [sys.executable, str(Path(__file__).with_name("launch_server.py"))]
    command = [
        *launcher,
        "serve",
        "--backend",
        "neuron",
        "--model",
        str(checkpoint),
        "--properties",
        str(props),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert named in done.stderr and "on_cpu" in done.stderr
