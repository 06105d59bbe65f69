"""``neuron_lmi::lora_delta``: the native kernel against the Python one, over lines of one slot in a
run and scattered, lines of no adapter, fp32 and bf16; and against the update written out by hand."""

from __future__ import annotations

import pytest
import torch

from neuron_lmi.models import lora_delta, ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0, 0, 0, 0, 0], [-1, 2, 2, -1, 0], [1, -1, 1, 2, 1], [-1] * 5])
def test_native_kernel_equals_the_update_line_by_line(slots: list[int], dtype: torch.dtype) -> None:
    assert ops.kernels() == "native"
    gen = torch.Generator().manual_seed(len(slots) + sum(slots))
    lines, per_line, d_in, d_out, rank, n_slots = len(slots), 3, 24, 40, 6, 3
    x = torch.randn(lines, per_line, d_in, generator=gen).to(dtype)
    y = torch.randn(lines, per_line, d_out, generator=gen).to(dtype)
    a = torch.randn(n_slots, rank, d_in, generator=gen).to(dtype)
    b = torch.randn(n_slots, rank, d_out, generator=gen).to(dtype)
    index = torch.tensor(slots, dtype=torch.long)
    got = torch.ops.neuron_lmi.lora_delta(y, x, index, a, b)
    python = lora_delta.reference(y, x, index, a, b)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(got, python, **tol)
    for line, slot in enumerate(slots):
        want = y[line] if slot < 0 else y[line] + ((x[line] @ a[slot].T) @ b[slot]).to(dtype)
        torch.testing.assert_close(got[line], want, **tol)
    assert got.data_ptr() != y.data_ptr()  # a new tensor: y is an input the caller keeps


def test_a_slot_past_the_stack_is_refused() -> None:
    ops.kernels()
    x, y = torch.zeros(2, 1, 4), torch.zeros(2, 1, 5)
    a, b = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)
    with pytest.raises(RuntimeError, match="names slot 2 of 2"):
        torch.ops.neuron_lmi.lora_delta(y, x, torch.tensor([0, 2]), a, b)
