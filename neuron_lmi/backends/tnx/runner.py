"""The Neuron runner: a ``ModelRunner`` on transformers-neuronx's continuous-batching ``forward``.

The contract it drives (aws-neuron/transformers-neuronx v0.13, ``base.py``
``_prepare_for_continuous_batching`` / ``_postprocess``, ``llama/model.py`` ``forward``)::

    logits = model.forward(input_ids, cache_ids, start_ids)         # fp32 [n, vocab]
      start_ids  [n]     seq_ids = KV-cache batch rows (our RowTable rows)
      prefill    input_ids [n, T] right-padded, cache_ids [n, T] = 0..len-1 then 0 (2-D: continuous
                 batching forces use_2d_cache_ids); context encoding because T > 1 and
                 cache_ids[0, 0] == 0; T <= the largest context bucket; logits of each last real token.
                 Context graphs are compiled for batch 1 under continuous batching, so the runner
                 sends one prompt per call (n = 1), each padded by the library to its own bucket
      decode     input_ids [n, 1], cache_ids [n, 1] = positions; the library scatters the n rows into
                 the full [max_num_seqs, 1] batch (absent rows get token 0 at position 0), runs it
                 and gathers the logits back by seq_id

Two consequences the runner handles: (1) a decode call writes *every* row of the compiled batch, so
in-use rows that are not decoding this step ride along as passengers at their next (unwritten)
position and their logits are dropped; otherwise a row prefilled this step would lose position 0;
(2) there is no free on the device: ``RowTable`` frees a row and its next prefill overwrites it.
Prompts longer than the largest context bucket are context-encoded up to it and the rest fed one
token per call, as the library's own ``context`` does.

What ran where: this module's logic runs in the test suite against
``neuron_lmi.testing.tnx_contract.ContractModel`` (the same forward contract on the CPU reference
model); the calls into transformers-neuronx (``from_pretrained``, ``to_neuron``, ``save``/``load``
through the compile cache, in ``compile`` and ``backend``) are written against the library's API and
checked with stand-in classes, not run on a Neuron device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from cache_api import RowTable
from neuron_lmi.backends.row_batch import check_prompts, token_batch
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

log = logging.getLogger(__name__)


class SamplingModel(Protocol):
    """What the runner needs of ``LlamaForSampling``/``MistralForSampling`` (or ``ContractModel``)."""

    def forward(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor: ...


class NeuronRunner(ForwardByKind):
    """``ModelRunner`` over a compiled continuous-batching model of ``n_rows`` x ``n_positions``.

    Invariants: ``rows`` is the only record of which device rows hold what (the device keeps no
    free list); every in-use row with room is part of every decode call, so a call never writes a
    position an in-use row has already filled; logits come back fp32 ``[len(rows), vocab_size]``
    in the order asked.  ``context_buckets`` are the compiled context-encoding lengths (the runner
    leaves padding up to a bucket to the library).
    """

    capabilities = RunnerCapabilities()  # whole prompts and decodes; the rows it leaves out it fills itself

    def __init__(
        self,
        model: SamplingModel,
        n_rows: int,
        n_positions: int,
        vocab_size: int,
        context_buckets: Sequence[int],
    ) -> None:
        if not context_buckets or min(context_buckets) < 1 or max(context_buckets) > n_positions:
            raise ValueError(
                f"context_buckets must be positive and <= n_positions={n_positions}, got {context_buckets}"
            )
        self.model = model
        self.rows = RowTable(n_rows, n_positions)
        self.n_positions = n_positions
        self.vocab_size = vocab_size
        self.max_context = max(context_buckets)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        check_prompts(self.rows, rows, prompts, self.n_positions)
        logits = torch.empty(len(rows), self.vocab_size)
        single = []
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            head = list(prompt[: self.max_context])
            if len(head) > 1:  # context encoding, one prompt per call (its own bucket; batch 1 compiled)
                logits[i] = self._context(row, head)[0]
            else:
                self.rows.set_length(row, 0)
                single.append(i)
        if single:  # a one-token prompt is a decode at position 0
            logits[single] = self._token_step([rows[i] for i in single], [prompts[i][0] for i in single])
        # Tokens past the largest context bucket go through token generation, one per call.
        pending = [i for i, p in enumerate(prompts) if len(p) > self.max_context]
        while pending:
            step_rows = [rows[i] for i in pending]
            step_tokens = [prompts[i][self.rows.length(rows[i])] for i in pending]
            logits[pending] = self._token_step(step_rows, step_tokens)
            pending = [i for i in pending if self.rows.length(rows[i]) < len(prompts[i])]
        return logits

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._token_step(list(rows), list(tokens))

    def _context(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Context encoding of one prompt into ``row``: ids ``[1, T]``, 2-D cache ids ``0..T-1``."""
        input_ids = torch.tensor([prompt], dtype=torch.long)
        cache_ids = torch.arange(len(prompt))[None, :]
        out = self.model.forward(input_ids, cache_ids, torch.tensor([row], dtype=torch.long))
        self.rows.set_length(row, len(prompt))
        return self._check_logits(out, 1)

    def _token_step(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``rows`` at its next position (``row_batch.token_batch``: every
        other live row rides along, lines in ascending seq_id order)."""
        batch = token_batch(self.rows, rows, tokens, self.n_positions)
        out = self.model.forward(batch.tokens[:, None], batch.positions[:, None], batch.seq_ids)
        return batch.restore(self._check_logits(out, len(batch.order)))

    def _check_logits(self, out: torch.Tensor, n: int) -> torch.Tensor:
        if out.dim() != 2 or out.shape[0] != n or out.shape[1] < self.vocab_size:
            raise RuntimeError(f"model returned logits {tuple(out.shape)}, expected [{n}, {self.vocab_size}]")
        return out[:, : self.vocab_size].float()
