"""The contract between the rolling-batch engine and a backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from cache_api import RowTable


class ModelRunner(Protocol):
    """One model step on one backend.

    Invariants: ``prefill`` writes each prompt into its (allocated) row from position 0 and returns
    the logits of its last token; ``decode`` appends one token to each row and returns its logits.
    Logits are fp32 ``[len(rows), vocab]`` in the order of ``rows``. Nothing above the runner knows
    bucket sizes or tensor layouts.
    """

    rows: RowTable
    vocab_size: int
    n_positions: int

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor: ...
