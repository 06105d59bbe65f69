"""Tensor parallelism on CPU as a transform of ``LlamaForCausalLM`` (and Mixtral): N logical ranks.

``apply_tensor_parallel(model, tp, strategy, batch_size=rows)`` splits every decoder layer by a
``ShardingPlan`` (``parallel.gqa``), the same plan the Neuron backend and ``neuron-lmi plan`` read.
The model code is not forked: each rank is a layer of the model's own class holding fewer heads and
a slice of the MLP, and ``ShardedDecoderLayer`` stands in for a layer by running its ranks and
summing their partial outputs (the all-reduce)::

    x ──┬─ rank 0: qkv(own q heads, own KV heads) ─ attention over rank 0's cache ─ wo rows ─┐
        ├─ rank 1: ...                                                                      ├─ Σ ─ + x
        └─ rank N-1                                                                         ┘
    x ──┬─ rank r: gate/up rows [r*I/N, (r+1)*I/N) ─ down columns ─┐    (Mixtral: the same slice of
        └─ ...                                                      ├─ Σ ─ + x   every expert, ``tp_mlp``)

Per-rank KV caches (``ShardedKVCache``)::

    heads split (shard-over-heads, replicated-heads, all-gather-heads): every rank holds every row,
      rank r: k [layers, n_rows, plan.ranks[r].kv_heads, n_positions, head_dim]   one shared RowTable
    rows split (shard-over-batch): rank r holds rows plan.ranks[r].batch_rows, all KV heads;
      a rank attending a row it does not hold reads it from the owner (the library's AllToAll)

Padding query heads (``DUMMY``) get zero q and o weights, padding KV heads zero k/v weights, padded
MLP columns zero weights: each contributes exactly zero, so outputs match tp=1 up to the order of
the fp32 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from cache_api import CacheError, KVCache, RowTable, write_step
from neuron_lmi.models.args import ModelArgs
from neuron_lmi.models.llama import DecodeInputs, DecoderLayer, LlamaForCausalLM, grouped_decode_attention
from neuron_lmi.models.rope import apply_rotary
from neuron_lmi.parallel.gqa import RankShard, ShardingPlan, build_sharding_plan
from neuron_lmi.parallel.head_layout import DUMMY, GQAStrategy
from neuron_lmi.parallel.tp_mlp import MLP_SHARDERS, mlp_slice

__all__ = [
    "RowPlacement",
    "ShardedDecoderLayer",
    "ShardedKVCache",
    "TensorParallelLlama",
    "apply_tensor_parallel",
    "plan_for_model",
]


def plan_for_model(
    model: LlamaForCausalLM,
    tp_degree: int,
    gqa_strategy: GQAStrategy | str | None = None,
    batch_size: int = 1,
    n_positions: int | None = None,
) -> ShardingPlan:
    """The plan for ``model``'s geometry, sized for a cache of ``n_positions`` (default: the model's)."""
    a = model.args
    return build_sharding_plan(
        a.n_heads,
        a.n_kv_heads,
        a.head_dim,
        tp_degree,
        gqa_strategy,
        batch_size,
        n_layers=a.n_layers,
        n_positions=n_positions or model.n_positions,
        dtype_bytes=torch.empty((), dtype=model.dtype).element_size(),
    )


def apply_tensor_parallel(
    model: LlamaForCausalLM,
    tp_degree: int,
    gqa_strategy: GQAStrategy | str | None = None,
    batch_size: int | None = None,
) -> TensorParallelLlama:
    """Split ``model`` over ``tp_degree`` logical ranks as transformers-neuronx would.

    ``batch_size`` is the number of KV rows the runner will allocate (the rolling batch size); it
    only matters for shard-over-batch, which needs it divisible by ``tp_degree`` (else the plan
    falls back, and logs why).  ``None`` assumes ``tp_degree`` rows.  The returned model shares the
    embedding, final norm, head and rotary tables with ``model``; its layers are new tensors.
    """
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tensor_parallel_degree must be a positive integer, got {tp_degree!r}")
    unsupported = _unsupported(model)
    if unsupported:
        raise ValueError(
            f"tensor_parallel_degree={tp_degree}: {model.args.architecture} has {unsupported}, which "
            "the CPU's logical ranks do not shard; use tensor_parallel_degree=1"
        )
    plan = plan_for_model(model, tp_degree, gqa_strategy, batch_size or tp_degree)
    return TensorParallelLlama(model, plan)


def _unsupported(model: LlamaForCausalLM) -> str | None:
    """What of ``model`` the sharded layers do not compute (Qwen's and Gemma's additions), if any."""
    a = model.args
    features = {
        "q/k/v biases without an o bias": a.qkv_bias and not a.attention_bias,
        "q/k norms": a.qk_norm,
        "per-layer attention windows": len(model.attention_kinds) > 1,
        "layers of its own": any(type(layer) not in MLP_SHARDERS for layer in model.layers),
        "scaled embeddings": a.embed_scale is not None,
    }
    found = [name for name, present in features.items() if present]
    return ", ".join(found) or None


class RowPlacement:
    """Where each KV row lives: on every rank, or (shard-over-batch) on exactly one owner rank.

    Invariant: ``owner[row]`` holds ``row`` at local index ``local[row]``; when rows are not split,
    every rank holds every row at its own index and ``owner`` is ``None``.
    """

    def __init__(self, plan: ShardingPlan) -> None:
        self.split = plan.strategy is GQAStrategy.SHARD_OVER_BATCH
        self.n_rows = plan.batch_size
        self.owner: torch.Tensor | None = None
        self.local = torch.arange(plan.batch_size)
        if self.split:
            self.owner = torch.empty(plan.batch_size, dtype=torch.long)
            for shard in plan.ranks:
                for i, row in enumerate(shard.batch_rows):
                    self.owner[row], self.local[row] = shard.rank, i

    def write(
        self,
        rank: int,
        k_layer: Sequence[torch.Tensor],
        v_layer: Sequence[torch.Tensor],
        step: DecodeInputs,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> None:
        """Rank ``rank`` writes this step's K/V (``[B, kvh, D]``) for the rows it stores."""
        rows, positions = step.rows, step.positions
        if self.owner is None:
            write_step(k_layer[rank], v_layer[rank], rows, positions, k_new, v_new)
            return
        mine = self.owner[rows] == rank
        if bool(mine.any()):
            local = self.local[rows[mine]]
            write_step(k_layer[rank], v_layer[rank], local, positions[mine], k_new[mine], v_new[mine])

    def read(self, rank: int, cache: Sequence[torch.Tensor], step: DecodeInputs) -> torch.Tensor:
        """``[B, kvh, attn_len, D]`` for ``step.rows`` as rank ``rank`` attends them."""
        if self.owner is None:
            rows = step.row_slice if step.row_slice is not None else step.rows
            return cache[rank][rows, :, : step.attn_len]
        owners = self.owner[step.rows]
        first = cache[0]
        out = first.new_empty(len(step.rows), first.shape[1], step.attn_len, first.shape[3])
        for o in owners.unique().tolist():
            sel = owners == o
            out[sel] = cache[o][self.local[step.rows[sel]], :, : step.attn_len]
        return out


class ShardedDecoderLayer(nn.Module):
    """One decoder layer as ``tp`` rank-local ``DecoderLayer``s plus the collectives between them.

    Invariants: ``ranks[r]`` holds exactly ``plan.ranks[r].query_heads`` (in that order) and
    ``plan.ranks[r].kv_heads``; each real query head attends the local KV slot holding
    ``plan.kv_head_of(h)``.  ``prefill_step`` returns K/V concatenated over ranks (the plan's
    ``kv_layout`` order) or, with rows split, the one full copy every rank computed.
    """

    def __init__(self, layer: DecoderLayer, plan: ShardingPlan, args: ModelArgs, placement: RowPlacement):
        super().__init__()
        self.ranks = nn.ModuleList(_shard_layer(layer, shard, plan, args) for shard in plan.ranks)
        self.slots = [_query_slots(shard, plan) for shard in plan.ranks]
        self.placement = placement

    def _for_queries(self, rank: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots[rank]
        if slots is None:  # local heads are uniform groups: attend without expanding K/V
            return k, v
        return k.index_select(1, slots), v.index_select(1, slots)

    def prefill_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys, values, partials = [], [], []
        for r, layer in enumerate(self.ranks):
            q, k, v = layer.qkv(x)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            keys.append(k)
            values.append(v)
            kq, vq = self._for_queries(r, k, v)
            attn = F.scaled_dot_product_attention(q, kq, vq, attn_mask=mask, scale=scale, enable_gqa=True)
            partials.append(layer.attn_out(attn))
        x = x + _all_reduce(partials)
        x = x + _all_reduce([layer.mlp(x) for layer in self.ranks])
        if self.placement.split:
            return x, keys[0], values[0]
        return x, torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def decode_step(
        self,
        x: torch.Tensor,
        k_layer: Sequence[torch.Tensor],
        v_layer: Sequence[torch.Tensor],
        step: DecodeInputs,
    ) -> torch.Tensor:
        queries = []
        for r, layer in enumerate(self.ranks):  # every write lands before any rank reads
            q, k, v = layer.qkv(x)
            q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
            self.placement.write(r, k_layer, v_layer, step, k[:, :, 0], v[:, :, 0])
            queries.append(q)
        partials = []
        for r, layer in enumerate(self.ranks):
            k_all, v_all = self._for_queries(
                r, self.placement.read(r, k_layer, step), self.placement.read(r, v_layer, step)
            )
            attn = grouped_decode_attention(queries[r], k_all, v_all, step.mask, step.scale)
            partials.append(layer.attn_out(attn))
        x = x + _all_reduce(partials)
        return x + _all_reduce([layer.mlp(x) for layer in self.ranks])


class ShardedKVCache:
    """One ``KVCache`` per rank, laid out by the plan; the runner's ``rows`` table is shared.

    Invariants: ``ranks[r]`` has ``len(plan.ranks[r].kv_heads)`` heads and, with rows split,
    ``len(plan.ranks[r].batch_rows)`` rows (else all ``n_rows``), so ``ranks[r].nbytes()`` equals
    ``plan.ranks[r].kv_cache_bytes_per_row`` times its rows for a plan sized at this
    ``n_positions``.  ``k[layer][rank]`` / ``v[layer][rank]`` are views of the rank tensors (what
    ``LlamaForCausalLM.decode`` indexes by layer).  With rows split, the ranks' own RowTables are
    unused: lengths live in ``rows`` only.
    """

    def __init__(
        self,
        plan: ShardingPlan,
        placement: RowPlacement,
        args: ModelArgs,
        n_rows: int,
        n_positions: int,
        dtype: torch.dtype,
    ) -> None:
        if placement.split and n_rows != placement.n_rows:
            raise ValueError(
                f"shard-over-batch was planned for {placement.n_rows} KV rows, the cache asks for {n_rows}; "
                "pass batch_size=<max rolling batch size> to apply_tensor_parallel"
            )
        self.plan, self.placement = plan, placement
        self.rows = RowTable(n_rows, n_positions)
        self.ranks = [
            KVCache(
                args.n_layers,
                len(shard.batch_rows) if placement.split else n_rows,
                len(shard.kv_heads),
                n_positions,
                args.head_dim,
                dtype=dtype,
                rows=None if placement.split else self.rows,
            )
            for shard in plan.ranks
        ]
        self.k = [tuple(c.k[i] for c in self.ranks) for i in range(args.n_layers)]
        self.v = [tuple(c.v[i] for c in self.ranks) for i in range(args.n_layers)]

    @property
    def n_positions(self) -> int:
        return self.rows.n_positions

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.ranks)

    def rank_nbytes(self) -> list[int]:
        return [c.nbytes() for c in self.ranks]

    def insert(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a prefilled row: ``[n_layers, kv_heads, T, D]`` in the layout ``prefill`` returns."""
        self.rows.check_in_use(row)
        length = keys.shape[2]
        if self.placement.split:
            owner, local = int(self.placement.owner[row]), int(self.placement.local[row])  # type: ignore[index]
            cache = self.ranks[owner]
            if keys.shape[1] != cache.n_kv_heads or length > self.n_positions:
                raise CacheError(f"insert into row {row}: unexpected keys {tuple(keys.shape)}")
            cache.k[:, local, :, :length].copy_(keys)
            cache.v[:, local, :, :length].copy_(values)
            self.rows.set_length(row, length)
            return
        per = self.plan.kv_heads_per_rank
        if keys.shape[1] != per * len(self.ranks):
            raise CacheError(
                f"insert into row {row}: expected {per * len(self.ranks)} KV heads, got {keys.shape[1]}"
            )
        for r, cache in enumerate(self.ranks):
            cache.insert(row, keys[:, r * per : (r + 1) * per], values[:, r * per : (r + 1) * per])

    def reserve_next(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.tensor(self.rows.reserve_next(rows), dtype=torch.long)


class TensorParallelLlama(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose layers are ``ShardedDecoderLayer``s and whose cache is per rank.

    ``prefill``/``decode``/``logits`` are the base class's, unchanged.  Built from a loaded model:
    it skips the base ``__init__`` (which would allocate a second full set of weights) and takes
    the base model's shared tensors instead.
    """

    def __init__(self, base: LlamaForCausalLM, plan: ShardingPlan) -> None:
        nn.Module.__init__(self)
        self.args, self.dtype, self.n_positions = base.args, base.dtype, base.n_positions
        self.embed, self.norm, self.lm_head = base.embed, base.norm, base.lm_head
        self.rotary, self.scale = base.rotary, base.scale
        self.attention_kinds, self.layer_kind = base.attention_kinds, base.layer_kind
        self.plan = plan
        self.placement = RowPlacement(plan)
        self.layers = nn.ModuleList(
            ShardedDecoderLayer(layer, plan, base.args, self.placement) for layer in base.layers
        )
        self.eval()

    @property
    def tp_degree(self) -> int:
        return self.plan.tp_degree

    def make_cache(self, n_rows: int, n_positions: int) -> ShardedKVCache:  # type: ignore[override]
        return ShardedKVCache(self.plan, self.placement, self.args, n_rows, n_positions, self.dtype)


# -- weight splitting -----------------------------------------------------------------------------


def _all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    out = partials[0]
    for p in partials[1:]:
        out = out + p
    return out


def _take_heads(t: torch.Tensor, heads: Sequence[int], head_dim: int) -> torch.Tensor:
    """Rows of ``t`` (``[n_heads * head_dim, ...]``) for ``heads`` in order; zeros for ``DUMMY``."""
    blocks = t.reshape(-1, head_dim, *t.shape[1:])
    out = blocks.new_zeros(len(heads), *blocks.shape[1:])
    for i, h in enumerate(heads):
        if h != DUMMY:
            out[i] = blocks[h]
    return out.reshape(-1, *t.shape[1:])


def _shard_layer(layer: DecoderLayer, shard: RankShard, plan: ShardingPlan, args: ModelArgs) -> DecoderLayer:
    """Rank ``shard.rank``'s copy of ``layer`` (same class): its heads and its slice of the MLP."""
    d, h, kvh = args.head_dim, args.n_heads, args.n_kv_heads
    mlp = mlp_slice(args.intermediate_size, plan.tp_degree, shard.rank)
    rank_args = replace(args, intermediate_size=mlp.size)
    out = type(layer)(rank_args, len(shard.query_heads), len(shard.kv_heads), layer.wqkv.dtype)
    out.input_norm, out.post_norm = layer.input_norm, layer.post_norm

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split([h * d, kvh * d, kvh * d])
        heads = (shard.query_heads, shard.kv_heads, shard.kv_heads)
        return torch.cat([_take_heads(t, hs, d) for t, hs in zip((q, k, v), heads, strict=True)])

    with torch.no_grad():
        out.wqkv.copy_(qkv_rows(layer.wqkv))
        out.wo.copy_(_take_heads(layer.wo.t(), shard.query_heads, d).t())
        if layer.bqkv is not None and out.bqkv is not None:
            out.bqkv.copy_(qkv_rows(layer.bqkv))
        # The output bias is added once after the all-reduce: rank 0 carries it, the others zero.
        if layer.bo is not None and out.bo is not None and shard.rank == 0:
            out.bo.copy_(layer.bo)
    MLP_SHARDERS[type(layer)](layer, out, mlp)
    return out


def _query_slots(shard: RankShard, plan: ShardingPlan) -> torch.Tensor | None:
    """Local KV slot for each local query head, or ``None`` when slot == head // group already."""
    slots = [shard.kv_heads.index(plan.kv_head_of(q)) if q != DUMMY else DUMMY for q in shard.query_heads]
    n_q, n_kv = len(shard.query_heads), len(shard.kv_heads)
    if n_q % n_kv == 0 and all(s in (DUMMY, i // (n_q // n_kv)) for i, s in enumerate(slots)):
        return None
    return torch.tensor([max(s, 0) for s in slots], dtype=torch.long)
