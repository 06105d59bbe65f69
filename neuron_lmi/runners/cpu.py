"""The CPU reference runner: the torch model, a ``cache_api.KVCache`` and shape buckets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from cache_api import RowTable
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.runners.buckets import pack_into_bins, pick_bucket, power_of_two_buckets


class CpuRunner:
    """Runs ``LlamaForCausalLM`` over a static KV cache of ``n_rows`` x ``n_positions``.

    Prefill pads prompts to a context bucket, packing several short prompts into one bucket-sized
    row (block-diagonal attention) and batching the rows of one bucket; decode
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
            lengths = [len(prompts[i]) for i in members]
            if self.model.rotary.spec.kind == "dynamic":
                bins = [[(j, 0)] for j in range(len(members))]  # its rope depends on each length
            else:
                bins = pack_into_bins(lengths, bucket)
            order, out, keys, values = self._encode_bins(bucket, bins, [prompts[i] for i in members])
            for b, j, offset in order:
                i = members[j]
                span = slice(offset, offset + lengths[j])
                self.cache.insert(rows[i], keys[:, b, :, span], values[:, b, :, span])
            logits[[members[j] for _, j, _ in order]] = out
        return logits

    def _encode_bins(
        self, bucket: int, bins: list[list[tuple[int, int]]], prompts: list[Sequence[int]]
    ) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lay prompts out in ``[len(bins), bucket]`` rows, several per row when they fit, so short
        prompts do not pay for a whole bucket of padding each."""
        n = len(bins)
        tokens = torch.zeros(n, bucket, dtype=torch.long)
        positions = torch.zeros(n, bucket, dtype=torch.long)
        segments = torch.full((n, bucket), -1, dtype=torch.long)
        order: list[tuple[int, int, int]] = []
        for b, members in enumerate(bins):
            filled = 0
            for j, offset in members:
                length = len(prompts[j])
                tokens[b, offset : offset + length] = torch.tensor(list(prompts[j]), dtype=torch.long)
                positions[b, offset : offset + length] = torch.arange(length)
                segments[b, offset : offset + length] = j
                order.append((b, j, offset))
                filled = max(filled, offset + length)
            # Padding is its own causal segment, so no attention row is fully masked.
            positions[b, filled:] = torch.arange(bucket - filled)
        if all(len(members) == 1 for members in bins):
            lengths = [len(prompts[members[0][0]]) for members in bins]
            out, keys, values = self.model.prefill(tokens, lengths)
        else:
            rows_idx = torch.tensor([b for b, _, _ in order])
            cols_idx = torch.tensor([offset + len(prompts[j]) - 1 for _, j, offset in order])
            out, keys, values = self.model.prefill_packed(tokens, positions, segments, (rows_idx, cols_idx))
        return order, out, keys, values

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
