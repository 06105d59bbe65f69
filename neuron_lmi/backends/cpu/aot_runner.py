"""The CPU runner on ahead-of-time compiled graphs (AOTInductor packages from the compile cache).

Same contract, bucketing and ``cache_api.KVCache`` as ``CpuRunner``; only the kernels differ:

* prefill: each prompt runs the graph of the smallest context bucket that holds it (batch 1); a
  prompt longer than the largest context bucket is prefilled by the eager model instead (logged),
  as the compiled artifacts hold no graph for it;
* decode: the graph of the smallest token-generation bucket covering every stepping row runs all
  ``n_rows`` rows at once; rows not in the step are padding whose cache the graph leaves unchanged
  (see ``graphs.py``), and their logits are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_api import KVCache, RowTable
from compile_cache import CompileCache, Entry, normalize_dtype
from neuron_lmi.backends.common import cache_for
from neuron_lmi.backends.cpu.aot import CompiledGraphs, CpuPlan, compile_cpu_entry, cpu_key_inputs
from neuron_lmi.backends.cpu.buckets import pick_bucket
from neuron_lmi.backends.cpu.graphs import padded_decode_inputs
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

log = logging.getLogger(__name__)


class CompiledCpuRunner(ForwardByKind):
    """``ModelRunner`` over ``CompiledGraphs``; ``model`` supplies the shared weights (and the eager
    prefill for over-long prompts). Invariant: the cache has ``plan.n_rows`` rows and
    ``plan.n_positions`` positions, the shapes every graph was compiled for."""

    capabilities = RunnerCapabilities()  # bucket graphs: whole prompts and decodes

    def __init__(self, model: LlamaForCausalLM, graphs: CompiledGraphs) -> None:
        plan, a = graphs.plan, model.args
        self.model, self.graphs, self.plan = model, graphs, plan
        self.n_positions = plan.n_positions
        self.vocab_size = a.vocab_size
        self.cache = KVCache(
            a.n_layers, plan.n_rows, a.n_kv_heads, plan.n_positions, a.head_dim, dtype=model.dtype
        )
        self.context_buckets = list(plan.context_buckets)
        self.token_buckets = list(plan.token_buckets)
        self._warned_long = False

    @property
    def rows(self) -> RowTable:
        return self.cache.rows

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        if len(rows) != len(prompts):
            raise ValueError("prefill: rows and prompts differ in length")
        logits = torch.empty(len(rows), self.vocab_size)
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            if not prompt:
                raise ValueError(f"prefill: prompt for row {row} is empty")
            self.rows.check_in_use(row)
            n = len(prompt)
            if n > self.context_buckets[-1]:
                logits[i] = self._eager_prefill(row, prompt)
                continue
            bucket = pick_bucket(self.context_buckets, n)
            tokens = torch.zeros(1, bucket, dtype=torch.long)
            tokens[0, :n] = torch.tensor(list(prompt), dtype=torch.long)
            last = torch.tensor([n - 1], dtype=torch.long)
            row_t = torch.tensor([row], dtype=torch.long)
            (out,) = self.graphs.prefill[bucket]([tokens, last, row_t, self.cache.k, self.cache.v])
            self.rows.set_length(row, n)
            logits[i] = out[0]
        return logits

    def _eager_prefill(self, row: int, prompt: Sequence[int]) -> torch.Tensor:
        if not self._warned_long:
            log.warning(
                "prompt of %d tokens exceeds the largest compiled context bucket %d: prefilling it "
                "eagerly (compile with --context-length-estimate up to n_positions to avoid this)",
                len(prompt),
                self.context_buckets[-1],
            )
            self._warned_long = True
        out, keys, values = self.model.prefill(torch.tensor([list(prompt)], dtype=torch.long), [len(prompt)])
        self.cache.insert(row, keys[:, 0], values[:, 0])
        return out[0]

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        if len(rows) != len(tokens):
            raise ValueError("decode: rows and tokens differ in length")
        positions = self.cache.reserve_next(rows)
        attn_len = pick_bucket(self.token_buckets, int(positions.max()) + 1)
        step, step_pos, active, index = padded_decode_inputs(self.plan.n_rows, rows, tokens, positions)
        (out,) = self.graphs.decode[attn_len]([step, step_pos, active, self.cache.k, self.cache.v])
        return out[index]


@dataclass(frozen=True)
class OpenedRunner:
    """What ``open_compiled_runner`` did: the runner, its cache entry, and whether it compiled."""

    runner: CompiledCpuRunner
    entry: Entry
    compiled: bool
    seconds: float


def open_compiled_runner(
    model: LlamaForCausalLM,
    weights_path: str | Path,
    plan: CpuPlan,
    cache: CompileCache,
    no_compile: bool = False,
    progress: bool = False,
) -> OpenedRunner:
    """Find (or compile, unless ``no_compile``) the entry for ``plan`` and load it as a runner.

    A hit loads without compiling; a damaged entry is set aside by the cache and recompiled.
    Logs hit or miss with the key. Raises ``CacheMissError``/``CorruptEntryError`` when
    ``no_compile`` and nothing usable is stored.
    """
    started = time.monotonic()
    inputs = cpu_key_inputs(model, weights_path, plan)
    ran: list[bool] = []

    def compile_fn(out: Path) -> None:
        ran.append(True)
        log.info("compile cache miss key=%s: compiling %d graphs", inputs.key(), len(plan.graphs()))
        compile_cpu_entry(model, plan, out, progress=progress)

    entry = cache.get_or_compile(inputs, compile_fn, no_compile=no_compile)
    if not ran:
        log.info("compile cache hit key=%s path=%s", entry.key, entry.path)
    runner = CompiledCpuRunner(model, CompiledGraphs(model, entry.path, plan))
    return OpenedRunner(runner, entry, bool(ran), time.monotonic() - started)


def compiled_runner_for_engine(
    model: LlamaForCausalLM,
    weights_path: str | Path,
    n_rows: int,
    n_positions: int,
    dtype: str,
    *,
    context_length_estimate: Sequence[int] | None = None,
    compiled_graph_path: str | None = None,
    no_compile: bool = False,
) -> CompiledCpuRunner:
    """What ``build_cpu_engine_core`` calls when ``CpuEngineOptions.compiled`` is set: the same plan
    and key as ``neuron-lmi compile --target cpu`` with the same settings."""
    estimate = tuple(context_length_estimate) if context_length_estimate else None
    plan = CpuPlan.default(n_rows, n_positions, normalize_dtype(dtype), estimate)
    opened = open_compiled_runner(model, weights_path, plan, cache_for(compiled_graph_path), no_compile)
    log.info(
        "compiled CPU graphs: key=%s %s in %.1fs (%s)",
        opened.entry.key,
        "compiled" if opened.compiled else "loaded",
        opened.seconds,
        opened.entry.path,
    )
    return opened.runner
