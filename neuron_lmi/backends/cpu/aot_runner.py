"""The CPU runner on ahead-of-time compiled graphs (AOTInductor packages from the compile cache).

Same contract, bucketing and ``cache_api.KVCache`` as ``CpuRunner``; only the kernels differ:

* prefill: each prompt runs the graph of the smallest context bucket that holds it (batch 1); a
  prompt longer than the largest context bucket is prefilled by the eager model instead (logged),
  as the compiled artifacts hold no graph for it;
* decode: the graph of the smallest token-generation bucket covering every stepping row runs all
  ``n_rows`` rows at once; rows not in the step are padding whose cache the graph leaves unchanged
  (see ``graphs.py``), and their logits are dropped.

The graphs come in loaded (``backends.cpu.backend`` compiles them on a cache miss, above the runner).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cache_api import KVCache, RowTable
from neuron_lmi.backends.cpu.aot import CompiledGraphs
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
