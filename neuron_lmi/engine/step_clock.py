"""The engine loop's own clock: how much host time each step costs beside the model's forward.

    one loop iteration = take new requests and aborts  ─┐
                         EngineCore.step()              │ host: scheduling, sampling, stop checks,
                           └─ runner.forward ◀───────── │       events, sending them on
                         hand the events over          ─┘ model: the runner's forward calls only

The core adds up the time spent inside its runner's forward calls (``ForwardTimer``);
``StepClock`` turns iterations into running means (over the last ``window`` steps that decoded),
reported in ``EngineStats.extra`` and from there on ``/metrics``. Host time is measured twice: on
the wall clock (what the model waits for) and as the loop thread's own CPU time (what it costs;
unlike the wall clock it does not grow when other processes take the cores). Decode steps are the ones that
matter for throughput (a prefill's host time is dwarfed by its forward), so the means are over
iterations whose batch had decodes; the step count and the last batch size say what they cover.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_WINDOW = 256
FULL_BATCH = 0.9  # a decode step with at least this share of the KV rows counts as a full batch


class ForwardTimer:
    """The seconds an ``EngineCore`` spends inside its runner's forward calls (``forward``,
    ``forward_sampled``, ``prompt_logits``), and the rows they decoded. The core times each call
    itself (``timed``); a batch's decoded rows are its ``StepBatch.decodes`` (a mixed step's
    one-token chunks)."""

    __slots__ = ("decoded_rows", "forward_cpu_s", "forward_s")

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.forward_cpu_s = 0.0  # CPU time of the calling thread inside forward calls
        self.decoded_rows = 0

    def timed(self, call: Callable[[], T], decodes: int = 0) -> T:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return call()
        finally:
            self.forward_s += time.perf_counter() - start
            self.forward_cpu_s += time.thread_time() - cpu
            self.decoded_rows += decodes


class _Window:
    """Running sums of the last ``size`` samples (host s, model s, host CPU s, decoded rows)."""

    def __init__(self, size: int) -> None:
        self.samples: deque[tuple[float, float, float, int]] = deque()
        self.size = size
        self.sums = [0.0, 0.0, 0.0, 0.0]

    def add(self, sample: tuple[float, float, float, int]) -> None:
        if len(self.samples) == self.size:
            old = self.samples.popleft()
            for i in range(4):
                self.sums[i] -= old[i]
        self.samples.append(sample)
        for i in range(4):
            self.sums[i] += sample[i]

    def means(self, suffix: str) -> dict[str, float]:
        n = len(self.samples) or 1
        host, model, host_cpu, rows = (v / n for v in self.sums)
        return {
            f"host_ms_per_{suffix}": 1000.0 * host,
            f"host_cpu_ms_per_{suffix}": 1000.0 * host_cpu,
            f"model_ms_per_{suffix}": 1000.0 * model,
            f"decode_batch_{suffix}": rows,
        }


class StepClock:
    """Running means of host and model time per engine step that decoded.

    Two windows: every decode step (``*_per_step``) and the steps that decoded at least
    ``FULL_BATCH`` of the KV rows (``*_per_full_step``: the figure to compare with a device's
    decode step at the batch size it was compiled for). Host + model time of an iteration is its
    wall time; ``steps`` counts all iterations that ran ``EngineCore.step``.
    """

    def __init__(self, timer: ForwardTimer, n_rows: int, window: int = DEFAULT_WINDOW) -> None:
        self.timer = timer
        self.steps = 0
        self.full_rows = max(1, math.ceil(FULL_BATCH * n_rows))
        self._all = _Window(window)
        self._full = _Window(window)
        self._start = self._cpu = self._forward0 = self._forward_cpu0 = 0.0
        self._rows0 = 0

    def begin(self) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()
        self._forward0, self._forward_cpu0 = self.timer.forward_s, self.timer.forward_cpu_s
        self._rows0 = self.timer.decoded_rows

    def end(self) -> None:
        """Close the iteration opened by ``begin`` (everything in between counts)."""
        wall = time.perf_counter() - self._start
        cpu = time.thread_time() - self._cpu
        model = self.timer.forward_s - self._forward0
        model_cpu = self.timer.forward_cpu_s - self._forward_cpu0
        rows = self.timer.decoded_rows - self._rows0
        self.steps += 1
        if rows:
            sample = (max(wall - model, 0.0), model, max(cpu - model_cpu, 0.0), rows)
            self._all.add(sample)
            if rows >= self.full_rows:
                self._full.add(sample)

    def snapshot(self) -> dict[str, float]:
        """``EngineStats.extra`` entries (milliseconds; zero before the first such step)."""
        means = self._all.means("step")
        means["decode_batch"] = means.pop("decode_batch_step")
        full = self._full.means("full_step")
        full.pop("decode_batch_full_step")
        return {"steps": float(self.steps), **means, **full}
