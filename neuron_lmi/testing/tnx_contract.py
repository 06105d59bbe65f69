"""An in-repo stand-in for transformers-neuronx's continuous-batching model, on the CPU reference model.

``ContractModel.forward(input_ids, cache_ids, start_ids)`` behaves as ``LlamaForSampling.forward``
does with ``NeuronConfig(continuous_batching=...)`` (v0.13: ``base.py``
``_prepare_for_continuous_batching``, ``_prepare_for_par_ctx_rhs_padding``, ``_postprocess``), so
``NeuronRunner`` can be driven here against the same contract it drives on a device:

* ``start_ids`` ``[n]`` are seq_ids = rows of a cache of ``batch_size`` rows that the model owns;
* ``cache_ids`` is 2-D ``[n, T]`` (continuous batching forces 2-D cache ids);
* context encoding when ``T > 1`` and ``cache_ids[0, 0] == 0``: right padding, each row's cache ids
  ``0..len-1`` then zeros, ``T`` at most the largest context bucket; the prompt is padded up to a
  context bucket and the whole bucket is written into the row (positions past ``len`` hold padding
  garbage, as on the device); returns the logits of each row's last real token;
* token generation when ``T == 1``: the ``n`` rows are scattered into the full ``[batch_size, 1]``
  batch, rows not named get token 0 at position 0, *every* row is run and written, and the logits are
  gathered back by seq_id (when every row is named, in row order, as older releases do);
* ``T > 1`` with ``cache_ids[0, 0] > 0`` is the library's speculative path: not modelled, rejected.

Returns fp32 ``[n, vocab]``.  Anything the library would reject or silently mis-handle (left padding,
1-D cache ids, duplicate or out-of-range seq_ids, a context longer than the largest bucket) raises
``ValueError`` here, which is the point: the runner must not depend on behaviour the device lacks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from neuron_lmi.backends.tnx.args import tnx_context_buckets, tnx_token_buckets
from neuron_lmi.models.llama import LlamaForCausalLM


class ContractModel:
    """The continuous-batching ``forward`` contract over ``LlamaForCausalLM`` and its own KV cache.

    Invariants: the cache has exactly ``batch_size`` rows, all permanently "allocated" (the device
    has no free list); nothing but ``forward`` writes it; ``calls`` records each call's kind and
    shapes for tests.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        batch_size: int,
        n_positions: int,
        context_length_estimate: Sequence[int] | None = None,
    ) -> None:
        if n_positions > model.n_positions:
            raise ValueError(
                f"n_positions={n_positions} exceeds the model's rotary table ({model.n_positions})"
            )
        self.model = model
        self.batch_size = batch_size
        self.n_positions = n_positions
        self.token_buckets = list(tnx_token_buckets(n_positions))
        estimate = tuple(context_length_estimate) if context_length_estimate else None
        self.context_buckets = list(tnx_context_buckets(n_positions, estimate))
        self.cache = model.make_cache(batch_size, n_positions)
        for _ in range(batch_size):
            self.cache.rows.allocate()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __call__(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.forward(input_ids, cache_ids, start_ids)

    def forward(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        n, t = self._check_shapes(input_ids, cache_ids, start_ids)
        if t > 1 and int(cache_ids.flatten()[0]) == 0:
            self.calls.append(("context", (n, t)))
            return self._context(input_ids, cache_ids, start_ids)
        if t > 1:
            raise ValueError("cache_ids[0, 0] > 0 with several tokens is the speculative path, not modelled")
        self.calls.append(("token", (n, t)))
        return self._token(input_ids, cache_ids, start_ids)

    def _check_shapes(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> tuple[int, int]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [n_seqs, n_tokens], got {tuple(input_ids.shape)}")
        if cache_ids.shape != input_ids.shape:
            raise ValueError(
                f"cache_ids must be 2-D like input_ids {tuple(input_ids.shape)} under continuous batching, "
                f"got {tuple(cache_ids.shape)}"
            )
        n = input_ids.shape[0]
        seq_ids = start_ids.flatten().tolist()
        if start_ids.dim() != 1 or len(seq_ids) != n:
            raise ValueError(f"start_ids must be [{n}] seq_ids, got {tuple(start_ids.shape)}")
        if len(set(seq_ids)) != n or not all(0 <= s < self.batch_size for s in seq_ids):
            raise ValueError(f"seq_ids must be distinct rows in [0, {self.batch_size}), got {seq_ids}")
        if int(cache_ids.max()) >= self.n_positions or int(cache_ids.min()) < 0:
            raise ValueError(f"cache_ids must lie in [0, {self.n_positions}), got {cache_ids.tolist()}")
        return n, input_ids.shape[1]

    def _context(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        n, t = input_ids.shape
        if t > self.context_buckets[-1]:
            raise ValueError(
                f"context of {t} tokens exceeds the largest context bucket {self.context_buckets[-1]}"
            )
        lengths = (cache_ids.max(dim=1).values + 1).tolist()  # vectorized last_token_id
        for j, length in enumerate(lengths):
            expected = torch.zeros(t, dtype=cache_ids.dtype)
            expected[:length] = torch.arange(length)
            if not torch.equal(cache_ids[j], expected):
                raise ValueError(f"row {j}: cache_ids {cache_ids[j].tolist()} are not right-padded 0..len-1")
        bucket = self.context_buckets[bisect.bisect_left(self.context_buckets, t)]
        tokens = torch.zeros(n, bucket, dtype=torch.long)
        tokens[:, :t] = input_ids
        logits, keys, values = self.model.prefill(tokens, lengths)
        for j, row in enumerate(start_ids.tolist()):
            self.cache.insert(int(row), keys[:, j], values[:, j])  # the whole bucket, padding included
        return logits.float()

    def _token(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        full_ids = torch.zeros(self.batch_size, dtype=torch.long)
        full_pos = torch.zeros(self.batch_size, dtype=torch.long)
        seq_ids = start_ids.long()
        full_ids[seq_ids] = input_ids[:, 0].long()
        full_pos[seq_ids] = cache_ids[:, 0].long()
        attn_len = self.token_buckets[bisect.bisect_left(self.token_buckets, int(full_pos.max()) + 1)]
        logits = self.model.decode(
            full_ids, torch.arange(self.batch_size), full_pos, self.cache.k, self.cache.v, attn_len
        )
        if len(seq_ids) == self.batch_size:
            # Older releases (``_postprocess`` before v0.13) return the whole batch ungathered when
            # every row is named; model that, so a caller must name rows in seq_id order.
            return logits.float()
        return logits[seq_ids].float()
