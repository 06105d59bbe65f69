"""The CPU reference runner: the torch model, a ``cache_api.KVCache`` and shape buckets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from cache_api import RowTable
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.runners.buckets import pick_bucket, power_of_two_buckets


class CpuRunner:
    """Runs ``LlamaForCausalLM`` over a static KV cache of ``n_rows`` x ``n_positions``.

    Prefill pads each prompt to a context bucket and batches prompts of the same bucket; decode
    attends over the smallest token-generation bucket that covers every active row.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        n_rows: int,
        n_positions: int,
        context_buckets: list[int] | None = None,
    ) -> None:
        if n_positions > model.n_positions:
            raise ValueError(
                f"n_positions={n_positions} exceeds the model's rotary table ({model.n_positions})"
            )
        a = model.args
        self.model = model
        self.n_positions = n_positions
        self.vocab_size = a.vocab_size
        # The model lays out its own cache: one KVCache, or one per tensor-parallel rank.
        self.cache = model.make_cache(n_rows, n_positions)
        self.context_buckets = (
            sorted(context_buckets) if context_buckets else power_of_two_buckets(n_positions)
        )
        if self.context_buckets[-1] < n_positions:
            self.context_buckets.append(n_positions)
        self.token_buckets = power_of_two_buckets(n_positions)

    @property
    def rows(self) -> RowTable:
        return self.cache.rows

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        if len(rows) != len(prompts):
            raise ValueError("prefill: rows and prompts differ in length")
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prefill: prompt for row {rows[i]} is empty")
            by_bucket[pick_bucket(self.context_buckets, len(prompt))].append(i)
        logits = torch.empty(len(rows), self.vocab_size)
        for bucket, members in by_bucket.items():
            tokens = torch.zeros(len(members), bucket, dtype=torch.long)
            lengths = [len(prompts[i]) for i in members]
            for j, i in enumerate(members):
                tokens[j, : lengths[j]] = torch.tensor(prompts[i], dtype=torch.long)
            out, keys, values = self.model.prefill(tokens, lengths)
            for j, i in enumerate(members):
                self.cache.insert(rows[i], keys[:, j, :, : lengths[j]], values[:, j, :, : lengths[j]])
            logits[members] = out
        return logits

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        positions = self.cache.reserve_next(rows)
        attn_len = pick_bucket(self.token_buckets, int(positions.max()) + 1)
        return self.model.decode(
            torch.tensor(list(tokens), dtype=torch.long),
            torch.tensor(list(rows), dtype=torch.long),
            positions,
            self.cache.k,
            self.cache.v,
            attn_len,
        )
