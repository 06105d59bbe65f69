"""The engine loop's own clock: how much host time each step costs beside the model's forward.

    one loop iteration = take new requests and aborts  ─┐
                         EngineCore.step()              │ host: scheduling, sampling, stop checks,
                           └─ runner.prefill/decode ◀── │       events, sending them on
                         hand the events over          ─┘ model: the runner's forward calls only

``TimedRunner`` wraps a ``ModelRunner`` and adds up the time spent inside its forward calls;
``StepClock`` turns iterations into running means (over the last ``window`` steps that decoded),
reported in ``EngineStats.extra`` and from there on ``/metrics``. Host time is measured twice: on
the wall clock (what the model waits for) and as the loop thread's own CPU time (what it costs;
unlike the wall clock it does not grow when other processes take the cores). Decode steps are the ones that
matter for throughput (a prefill's host time is dwarfed by its forward), so the means are over
iterations whose batch had decodes; the step count and the last batch size say what they cover.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

FORWARD_METHODS = ("prefill", "decode", "extend", "prompt_logits")
DEFAULT_WINDOW = 256


class TimedRunner:
    """A ``ModelRunner`` that also counts the seconds spent in its forward calls.

    Everything else (``rows``, ``vocab_size``, optional capabilities such as ``extend``/``copy``) is
    the wrapped runner's own: ``hasattr`` answers as it would.
    """

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self.forward_s = 0.0
        self.forward_cpu_s = 0.0  # CPU time of the calling thread inside forward calls
        self.decoded_rows = 0
        for name in FORWARD_METHODS:
            method = getattr(runner, name, None)
            if method is not None:
                setattr(self, name, self._timed(method, counts_rows=name == "decode"))

    def _timed(self, method: Any, counts_rows: bool) -> Any:
        def call(rows: Sequence[int], *args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(rows, *args, **kwargs)
            finally:
                self.forward_s += time.perf_counter() - start
                self.forward_cpu_s += time.thread_time() - cpu
                if counts_rows:
                    self.decoded_rows += len(rows)

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    @property
    def wrapped(self) -> Any:
        return self._runner


def time_runner(core: Any) -> TimedRunner:
    """Wrap ``core.runner`` once (idempotent) and return the wrapper."""
    runner = core.runner
    if not isinstance(runner, TimedRunner):
        runner = TimedRunner(runner)
        core.runner = runner
    return runner


class StepClock:
    """Running means of host and model time per engine step that decoded.

    Invariants: host + model time of an iteration is its wall time; means cover at most the last
    ``window`` decode steps; ``steps`` counts all iterations that ran ``EngineCore.step``.
    """

    def __init__(self, runner: TimedRunner, window: int = DEFAULT_WINDOW) -> None:
        self.runner = runner
        self.steps = 0
        self._window: deque[tuple[float, float, float, int]] = deque()
        self._size = window
        self._sums = [0.0, 0.0, 0.0, 0.0]  # host s, model s, host CPU s, decoded rows (window)
        self._last_host = 0.0
        self._start = self._cpu = self._forward0 = self._forward_cpu0 = 0.0
        self._rows0 = 0

    def begin(self) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()
        self._forward0, self._forward_cpu0 = self.runner.forward_s, self.runner.forward_cpu_s
        self._rows0 = self.runner.decoded_rows

    def end(self) -> None:
        """Close the iteration opened by ``begin`` (everything in between counts)."""
        wall = time.perf_counter() - self._start
        cpu = time.thread_time() - self._cpu
        model = self.runner.forward_s - self._forward0
        model_cpu = self.runner.forward_cpu_s - self._forward_cpu0
        rows = self.runner.decoded_rows - self._rows0
        self.steps += 1
        if rows:
            self._add((max(wall - model, 0.0), model, max(cpu - model_cpu, 0.0), rows))

    def _add(self, sample: tuple[float, float, float, int]) -> None:
        if len(self._window) == self._size:
            old = self._window.popleft()
            for i in range(4):
                self._sums[i] -= old[i]
        self._window.append(sample)
        for i in range(4):
            self._sums[i] += sample[i]
        self._last_host = sample[0]

    def snapshot(self) -> dict[str, float]:
        """``EngineStats.extra`` entries (milliseconds; zero before the first decode step)."""
        n = len(self._window)
        host, model, host_cpu, rows = self._sums
        return {
            "steps": float(self.steps),
            "host_ms_per_step": 1000.0 * host / n if n else 0.0,
            "host_cpu_ms_per_step": 1000.0 * host_cpu / n if n else 0.0,
            "model_ms_per_step": 1000.0 * model / n if n else 0.0,
            "decode_batch": rows / n if n else 0.0,
            "host_ms_per_step_last": 1000.0 * self._last_host,
        }
