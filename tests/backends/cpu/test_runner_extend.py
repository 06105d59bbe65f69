"""``CpuRunner.extend``: appending chunks to rows that hold a prefix equals one whole prefill."""

from __future__ import annotations

import pytest
import torch

from neuron_lmi.backends.cpu.buckets import chunk_buckets
from neuron_lmi.backends.cpu.runner import CpuRunner
from tests.backends.cpu.conftest import prompt


def test_prefill_then_extends_match_one_whole_prefill_in_logits_and_cache(model) -> None:
    runner = CpuRunner(model, 4, 256)
    p, q = prompt(100, 1), prompt(70, 2)
    whole_p, whole_q, part_p, part_q = (runner.rows.allocate() for _ in range(4))
    expected = runner.prefill([whole_p, whole_q], [p, q])
    runner.prefill([part_p, part_q], [p[:37], q[:5]])
    # Two rows with different prefixes and chunk lengths in one call, then one row alone.
    middle = runner.extend([part_p, part_q], [p[37:90], q[5:]])
    last = runner.extend([part_p], [p[90:]])
    torch.testing.assert_close(last[0], expected[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(middle[1], expected[1], atol=1e-4, rtol=0)
    assert runner.rows.lengths([part_p, part_q]) == [100, 70]
    for whole, part in ((whole_p, part_p), (whole_q, part_q)):
        k_whole, v_whole = runner.cache.row_keys(whole)
        k_part, v_part = runner.cache.row_keys(part)
        torch.testing.assert_close(k_part, k_whole, atol=1e-5, rtol=0)
        torch.testing.assert_close(v_part, v_whole, atol=1e-5, rtol=0)


def test_copy_then_extend_reuses_a_prefix(model) -> None:
    runner = CpuRunner(model, 2, 256)
    system, user = prompt(60, 3), prompt(9, 4)
    src, dst = runner.rows.allocate(), runner.rows.allocate()
    runner.prefill([src], [system + prompt(5, 5)])
    runner.copy(src, dst, 60)
    got = runner.extend([dst], [user])
    expected = runner.prefill([src], [system + user])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_extend_refuses_empty_repeated_and_overflowing_chunks(model) -> None:
    runner = CpuRunner(model, 2, 64)
    row = runner.rows.allocate()
    runner.prefill([row], [prompt(60, 6)])
    with pytest.raises(ValueError, match="empty"):
        runner.extend([row], [[]])
    with pytest.raises(ValueError, match="repeat"):
        runner.extend([row, row], [[1], [2]])
    with pytest.raises(ValueError, match="exceed n_positions=64"):
        runner.extend([row], [[1] * 5])
    assert runner.rows.length(row) == 60


def test_chunk_buckets_are_fine_below_the_largest_context_bucket() -> None:
    assert chunk_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert chunk_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert chunk_buckets(32) == [1, 2, 4, 8, 16, 32] and chunk_buckets(8) == [1, 2, 4, 8]
