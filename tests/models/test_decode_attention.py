"""``neuron_lmi::decode_attention``: the eager model's decode attention (SDPA over a masked cache
slice) for every query at its own row and position, in fp32 and bf16, with and without a sliding
window; queries sharing a row (a prompt chunk) equal causal SDPA over the chunk, beside decodes and
other chunks in one call; the hand-vectorised
path (head dims 64 and 128 on AVX-512 hosts) and the plain one (any other head dim); the Python
kernel where the native one is off; a position or row outside the cache refused."""

from __future__ import annotations

import pytest
import torch

from neuron_lmi.models import decode_attention as da
from neuron_lmi.models import ops
from neuron_lmi.models.llama import grouped_decode_attention
from tests.models.conftest import run_with_python_kernels


@pytest.fixture(autouse=True, scope="module")
def registered_kernel() -> None:
    assert ops.kernels() == "native"  # built with this host's compiler (or taken from its cache)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """The eager engine's decode attention on the same slice, masked as ``window_mask`` does."""
    key_pos = torch.arange(k.shape[2])
    mask = key_pos[None, :] <= positions[:, None]
    if window:
        mask &= key_pos[None, :] > positions[:, None] - window
    return grouped_decode_attention(q, k, v, mask[:, None, None, :], scale)


def cache_slices(
    rows: int, kv_heads: int, length: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the graphs pass them: strided slices of a larger ``[layers, rows, KVH, n_positions,
    D]`` cache (one layer, every row, the first ``length`` positions)."""
    k = torch.randn(2, rows, kv_heads, length + 9, dim, dtype=dtype)
    v = torch.randn(2, rows, kv_heads, length + 9, dim, dtype=dtype)
    return k[1, :, :, :length], v[1, :, :, :length]


def identity(n: int) -> torch.Tensor:
    return torch.arange(n)


CASES = [
    # heads, kv heads, head dim, length, window
    (9, 3, 64, 37, 0),  # SmolLM2's grouping; lengths not a multiple of 4 or 16
    (9, 3, 64, 200, 50),  # a sliding window
    (8, 8, 128, 21, 0),  # no grouping, head dim 128
    (24, 2, 64, 70, 0),  # 12 query heads per KV head: more than one pass of the value loop
    (4, 2, 48, 19, 7),  # head dim 48: the plain kernel
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "length", "window"), CASES)
def test_equals_the_eager_attention_for_every_query_at_its_own_row_and_position(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, length: int, window: int
) -> None:
    torch.manual_seed(heads * dim + length)
    k, v = cache_slices(8, kv_heads, length, dim, dtype)
    rows = torch.tensor([5, 0, 2, 2, 7, 1])  # any rows, in any order; row 2 twice at two positions
    n = len(rows)
    q = torch.randn(n, 1, heads, dim, dtype=dtype).transpose(1, 2)  # strided, as qkv() returns it
    positions = torch.tensor([length - 1, 0, 1, 3, length // 2, length - 2])
    got = da.decode_attention(q, k, v, rows, positions, dim**-0.5, window)
    assert got.shape == (n, heads, 1, dim) and got.dtype == dtype
    want = sdpa(q.float(), k[rows].float(), v[rows].float(), positions, dim**-0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(da.reference(q, k, v, rows, positions, dim**-0.5, window).float(), want,
                               rtol=tolerance, atol=tolerance)  # fmt: skip


@pytest.mark.parametrize("window", [0, 5])
def test_the_tokens_of_a_chunk_attend_causally_as_sdpa_over_the_chunk(window: int) -> None:
    """A prompt chunk's tokens, each a query of the same row at its own position, after a cached
    prefix: the same as SDPA of the chunk's queries over prefix + chunk with a causal mask."""
    torch.manual_seed(3)
    k, v = cache_slices(4, 3, 40, 64, torch.float32)
    start, t = 11, 9
    q = torch.randn(1, 9, t, 64)  # [1, H, T, D]: the chunk as the extend graph holds it
    key_pos, query_pos = torch.arange(start + t), torch.arange(start, start + t)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    keys, values = k[2:3, :, : start + t], v[2:3, :, : start + t]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True
    )  # [1, H, T, D]
    queries = q[0].transpose(0, 1)[:, :, None]  # [T, H, 1, D]: one query per token
    got = da.decode_attention(queries, k, v, torch.full((t,), 2), query_pos, 0.125, window)
    torch.testing.assert_close(got[:, :, 0].transpose(0, 1)[None], want, rtol=1e-5, atol=1e-5)


# (row, first position, tokens) runs of a step's queries, in order: decodes (one token) and prompt
# chunks (consecutive positions of one row), which the kernel takes a block of keys at a time for a
# block of queries. 130 tokens pass one work item's share (96 query lanes); row 1's two runs leave a
# gap in positions, so they are two chunks. On a host with AMX for bf16, runs of 32 tokens or more
# take ATen's attention instead: row 3's 40 tokens from position 0 unmasked (causal), the others masked.
STEP_RUNS = [
    (0, 50, 1),
    (1, 100, 70),
    (2, 0, 2),
    (3, 7, 1),
    (0, 120, 130),
    (1, 200, 3),
    (1, 180, 5),
    (3, 0, 40),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 128), (32, 8, 128)])
@pytest.mark.parametrize("window", [0, 40])
def test_prompt_chunks_beside_decodes_equal_the_eager_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, window: int
) -> None:
    """Chunks of 2 to 130 tokens, after prefixes or from position 0, beside decodes of the same and
    other rows: every query as the eager attention at its own row and position."""
    torch.manual_seed(heads + dim + window)
    k, v = cache_slices(4, kv_heads, 300, dim, dtype)
    rows_list: list[int] = []
    positions_list: list[int] = []
    for row, start, n in STEP_RUNS:
        rows_list += [row] * n
        positions_list += range(start, start + n)
    rows, positions = torch.tensor(rows_list), torch.tensor(positions_list)
    q = torch.randn(len(rows), 1, heads, dim, dtype=dtype).transpose(1, 2)
    got = da.decode_attention(q, k, v, rows, positions, dim**-0.5, window)
    want = sdpa(q.float(), k[rows].float(), v[rows].float(), positions, dim**-0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)


def test_a_row_reads_only_its_own_positions() -> None:
    """Whatever lies past a row's position (padding, another request's stale keys) changes nothing."""
    torch.manual_seed(1)
    k, v = cache_slices(4, 3, 40, 64, torch.float32)
    q = torch.randn(3, 9, 1, 64)
    rows, positions = torch.tensor([0, 1, 2]), torch.tensor([5, 17, 39])
    before = da.decode_attention(q, k, v, rows, positions, 0.125, 0)
    chunk = torch.randn(20, 9, 1, 64)  # a 20-token chunk of row 3 at positions 10..29
    chunk_before = da.decode_attention(chunk, k, v, torch.full((20,), 3), torch.arange(10, 30), 0.125, 0)
    k[0, :, 6:], v[1, :, 18:], k[2, :, :, :] = float("nan"), 1e30, float("nan")
    k[3, :, 30:], v[3, :, 30:] = float("nan"), float("nan")
    after = da.decode_attention(q[:2], k, v, rows[:2], positions[:2], 0.125, 0)
    torch.testing.assert_close(after, before[:2], rtol=0, atol=0)
    chunk_after = da.decode_attention(chunk, k, v, torch.full((20,), 3), torch.arange(10, 30), 0.125, 0)
    torch.testing.assert_close(chunk_after, chunk_before, rtol=0, atol=0)


def test_a_position_or_row_outside_the_cache_is_refused() -> None:
    k, v = cache_slices(2, 3, 16, 64, torch.float32)
    q = torch.randn(2, 9, 1, 64)
    with pytest.raises(RuntimeError, match=r"position 16 outside 0\.\.15"):
        da.decode_attention(q, k, v, identity(2), torch.tensor([3, 16]), 0.125, 0)
    with pytest.raises(RuntimeError, match=r"row 2 outside 0\.\.1"):
        da.decode_attention(q, k, v, torch.tensor([0, 2]), torch.tensor([3, 4]), 0.125, 0)
    with pytest.raises(RuntimeError, match="must all be fp32 or all bf16"):
        da.decode_attention(q, k.bfloat16(), v.bfloat16(), identity(2), torch.tensor([3, 4]), 0.125, 0)


def test_the_python_kernel_where_the_native_one_is_off() -> None:
    script = (
        "import torch\n"
        "from neuron_lmi.models import decode_attention as da\n"
        "from neuron_lmi.models.llama import grouped_decode_attention\n"
        "from neuron_lmi.models import ops\n"
        "assert ops.kernels() == 'python'\n"
        "q, k, v = torch.randn(3, 9, 1, 64), torch.randn(4, 3, 20, 64), torch.randn(4, 3, 20, 64)\n"
        "pos, rows = torch.tensor([19, 0, 7]), torch.tensor([3, 0, 3])\n"
        "key_pos = torch.arange(20)[None, :]\n"
        "mask = (key_pos <= pos[:, None]) & (key_pos > pos[:, None] - 4)\n"
        "want = grouped_decode_attention(q, k[rows], v[rows], mask[:, None, None, :], 0.125)\n"
        "got = da.decode_attention(q, k, v, rows, pos, 0.125, 4)\n"
        "torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)\n"
        "print('python kernel ok')\n"
    )
    assert "python kernel ok" in run_with_python_kernels(script)
