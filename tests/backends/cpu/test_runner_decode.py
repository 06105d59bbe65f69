"""``CpuRunner.decode``: rows asked in any order, of any lengths, get the logits each would get alone;
the model reads a run of rows in place or groups rows by length, with the same result."""

from __future__ import annotations

import pytest
import torch

from neuron_lmi.backends.cpu.runner import CpuRunner
from tests.backends.cpu.conftest import prompt


def alone(model, tokens: list[int], next_token: int) -> torch.Tensor:
    runner = CpuRunner(model, 1, 256)
    row = runner.rows.allocate()
    runner.prefill([row], [tokens])
    return runner.decode([row], [next_token])[0]


# Lengths 5..200 span the 8..256 length buckets; rows 0-3 are one slice, rows {0, 2, 3} are not.
LENGTHS = [5, 200, 40, 9]


@pytest.mark.parametrize("asked", [[0, 1, 2, 3], [3, 1, 0, 2], [2, 0, 3]])
def test_decode_in_any_row_order_matches_each_row_alone(model, asked: list[int]) -> None:
    runner = CpuRunner(model, len(LENGTHS), 256)
    rows = [runner.rows.allocate() for _ in LENGTHS]
    prompts = [prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    runner.prefill(rows, prompts)
    got = runner.decode([rows[i] for i in asked], [7 + i for i in asked])
    for j, i in enumerate(asked):
        torch.testing.assert_close(got[j], alone(model, prompts[i], 7 + i), atol=1e-4, rtol=1e-4)
    assert [runner.rows.length(rows[i]) for i in asked] == [LENGTHS[i] + 1 for i in asked]


def test_grouping_by_length_is_chosen_only_where_it_reads_less(model) -> None:
    rows, positions = torch.arange(4), torch.tensor([4, 199, 39, 8])
    # One slice: 256 + 8 + 64 + 16 = 344 positions grouped vs 4 x 256 = 1024 in one: groups pay.
    assert len(model._attention_groups(rows, positions, [8, 256, 64, 16], one_slice=True)) == 4
    # One slice, even lengths: one attention in place.
    assert model._attention_groups(rows, positions, [64, 128, 128, 128], one_slice=True) == ()
    # Not a slice: rows are gathered anyway, so they are grouped.
    assert len(model._attention_groups(rows, positions, [64, 128, 128, 128], one_slice=False)) == 2
