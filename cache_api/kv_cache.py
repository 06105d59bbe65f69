"""The KV cache as preallocated tensors, one row per sequence slot.

Layout (one tensor for keys, one for values; both contiguous)::

    k, v : [n_layers, n_rows, n_kv_heads, n_positions, head_dim]
              |        |        |           |            |
              |        |        |           |            +-- one head's vector
              |        |        |           +-- token position 0 .. n_positions-1 of that sequence
              |        |        +-- this rank's KV heads (all of them at tp=1; a shard under a plan)
              |        +-- row = sequence slot = transformers-neuronx seq_id
              +-- decoder layer

    row 0: [p0 p1 p2 p3 .. .. .. ..]   length 4, in use
    row 1: [.. .. .. .. .. .. .. ..]   free
    row 2: [p0 p1 .. .. .. .. .. ..]   length 2, in use

Positions at or past a row's length hold stale data and are always masked by attention, so freeing
a row is O(1) bookkeeping and the next insert simply overwrites it. Inserting a prefilled
sequence touches only its own row: the other rows' cache is never recomputed.

Prefix reuse, two ways: ``copy(src, dst, n)`` duplicates a row's first ``n`` positions into
another (the source keeps running); a freed row that *retains* its prefix (``remove(row, keep)``)
is claimed whole by ``allocate(row, keep)``, with no copy at all::

    copy(0, 3, 3):   row 0 [a b c d ..]  ->  row 3 [a b c .. ..]   length 3, row 0 unchanged
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache_api.rows import CacheError, Occupancy, RowTable


class KVCache:
    """Cache tensors plus the ``RowTable`` that says which rows hold what.

    Several ``KVCache`` objects may share one ``RowTable`` (one per tensor-parallel rank, each with
    its own KV heads); ``allocate``/``remove`` then act on the shared table once.
    """

    def __init__(
        self,
        n_layers: int,
        n_rows: int,
        n_kv_heads: int,
        n_positions: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        rows: RowTable | None = None,
    ) -> None:
        if rows is None:
            rows = RowTable(n_rows, n_positions)
        elif (rows.n_rows, rows.n_positions) != (n_rows, n_positions):
            raise ValueError("shared RowTable has a different shape than this cache")
        self.rows = rows
        shape = (n_layers, n_rows, n_kv_heads, n_positions, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def n_rows(self) -> int:
        return self.rows.n_rows

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def n_positions(self) -> int:
        return self.rows.n_positions

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def bytes_per_row(self) -> int:
        return self.nbytes() // self.n_rows

    def allocate(self, row: int | None = None, keep: int = 0) -> int:
        return self.rows.allocate(row, keep)

    def remove(self, row: int, keep: int = 0) -> None:
        self.rows.remove(row, keep)

    def occupancy(self) -> Occupancy:
        return self.rows.occupancy()

    def insert(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a prefilled sequence, ``[n_layers, n_kv_heads, T, head_dim]``, into positions 0..T-1."""
        self.rows.check_in_use(row)
        expected = (self.n_layers, self.n_kv_heads)
        if keys.shape != values.shape or tuple(keys.shape[:2]) != expected or keys.shape[3] != self.head_dim:
            raise CacheError(
                f"insert into row {row}: expected [layers={expected[0]}, kv_heads={expected[1]}, T, "
                f"head_dim={self.head_dim}], got keys {tuple(keys.shape)} values {tuple(values.shape)}"
            )
        length = keys.shape[2]
        if length > self.n_positions:
            raise CacheError(
                f"insert into row {row}: {length} positions exceed n_positions={self.n_positions}"
            )
        self.k[:, row, :, :length].copy_(keys)
        self.v[:, row, :, :length].copy_(values)
        self.rows.set_length(row, length)

    def reserve_next(self, rows: Sequence[int]) -> torch.Tensor:
        """Claim the next position of each row (raises when a row is full); returns them as a tensor."""
        return torch.tensor(self.rows.reserve_next(rows), dtype=torch.long)

    def append(self, rows: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one position to each row; keys and values: ``[layers, len(rows), kv_heads, head_dim]``."""
        if (
            keys.shape != (self.n_layers, len(rows), self.n_kv_heads, self.head_dim)
            or values.shape != keys.shape
        ):
            raise CacheError(
                f"append: unexpected shape keys {tuple(keys.shape)} values {tuple(values.shape)}"
            )
        positions = self.reserve_next(rows)
        row_index = torch.tensor(list(rows), dtype=torch.long)
        for layer in range(self.n_layers):
            write_step(self.k[layer], self.v[layer], row_index, positions, keys[layer], values[layer])

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of row ``src`` into row ``dst`` (shared-prefix reuse)."""
        self.rows.check_in_use(src)
        self.rows.check_in_use(dst)
        if src == dst:
            raise CacheError(f"copy: source and destination are the same row {src}")
        if not (0 <= n <= self.rows.length(src)):
            raise CacheError(f"copy: row {src} holds {self.rows.length(src)} positions, cannot copy {n}")
        self.k[:, dst, :, :n].copy_(self.k[:, src, :, :n])
        self.v[:, dst, :, :n].copy_(self.v[:, src, :, :n])
        self.rows.set_length(dst, n)

    def row_keys(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a row's valid keys and values, ``[n_layers, n_kv_heads, length, head_dim]``."""
        length = self.rows.length(row)
        return self.k[:, row, :, :length], self.v[:, row, :, :length]


def write_step(
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Write one position per row into one layer's cache, in place.

    ``k_layer`` is ``[n_rows, kv_heads, n_positions, head_dim]``; ``k_new`` is ``[B, kv_heads, head_dim]``.
    This is the only in-place write a decode step makes, which is what lets a compiled graph take
    the cache as a mutated input.
    """
    k_layer[rows, :, positions] = k_new
    v_layer[rows, :, positions] = v_new
