"""``CpuRunner.verify`` (a ``StepBatch`` with ``logit_counts``): the logits of each line's last
positions, as a whole-prompt forward computes them, with the rows left as ``extend`` leaves them."""

from __future__ import annotations

import pytest
import torch

from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.runners.base import BatchKind, StepBatch
from tests.backends.cpu.conftest import prompt


def test_a_verify_batch_returns_each_lines_last_positions_in_line_order(model) -> None:
    runner = CpuRunner(model, 4, 256)
    assert runner.capabilities.max_verify_tokens == runner.context_buckets[-1]
    assert not runner.capabilities.mixed_verify  # verify lines come in a batch of their own
    p, q, r = prompt(30, 7), prompt(12, 8), prompt(20, 9)
    rows = [runner.rows.allocate() for _ in range(3)]
    runner.prefill(rows, [p[:25], q[:7], r[:19]])
    chunks = (p[25:], q[7:], r[19:])
    batch = StepBatch(
        BatchKind.EXTEND, tuple(rows), (25, 7, 19), chunks, (True,) * 3, 3, logit_counts=(5, 3, 1)
    )
    got = runner.forward(batch)
    assert got.shape == (batch.n_logits, runner.vocab_size) == (9, runner.vocab_size)
    wanted = ((p, 5), (q, 3), (r, 1))
    expected = torch.cat([runner.prompt_logits(ids)[-n:] for ids, n in wanted])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert runner.rows.lengths(rows) == [30, 12, 20]


def test_verify_refuses_lines_longer_than_it_verifies(model) -> None:
    runner = CpuRunner(model, 2, 256, context_buckets=[4])
    row = runner.rows.allocate()
    runner.prefill([row], [prompt(3, 10)])
    with pytest.raises(ValueError, match="exceeds 4"):
        runner.verify([row], [prompt(5, 11)], [5])


def test_logit_counts_belong_to_extend_batches_with_one_count_per_line() -> None:
    with pytest.raises(ValueError, match="EXTEND"):
        StepBatch(BatchKind.DECODE, (0,), (3,), ((1,),), (True,), 1, logit_counts=(1,))
    with pytest.raises(ValueError, match="chunk length"):
        StepBatch(BatchKind.EXTEND, (0,), (3,), ((1, 2),), (True,), 1, logit_counts=(3,))
    lines = ((1, 2), (5, 6, 7))
    batch = StepBatch(BatchKind.EXTEND, (0, 1), (3, 0), lines, (True, False), 1, logit_counts=(2, 1))
    assert batch.n_logits == 3
    assert batch.line(0).logit_counts == (2,) and batch.line(0).decodes == 1
    assert batch.line(1).logit_counts == (1,) and batch.line(1).decodes == 0
