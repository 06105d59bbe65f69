"""Grouped-query-attention sharding plans: which heads and KV-cache rows each tensor-parallel rank holds.

``build_sharding_plan`` reproduces the decisions transformers-neuronx (v0.13) makes for a GQA model:
the strategy fallbacks of ``decoder.py`` ``check_gqa_fallback``, the head counts of ``utils.py``
``get_qkv_padding`` and the weight layout of ``DecoderLayer.to_neuron`` (end or per-group "interleaved"
zero padding of query heads, ``repeat_interleave`` replication of KV heads, then a contiguous split
over ranks), from the layouts of ``head_layout``.  ``lay_out_plan`` takes a strategy already chosen,
for a backend with a rule of its own (transformers-neuronx's continuous batching,
``backends/tnx/gqa.py``).  The result is a frozen, executable description: a CPU runner can split
weights by it and must get the same outputs as tp=1.

Global layout, then a contiguous split (Llama-2-70B, 64 query / 8 KV heads, tp=24, replicated)::

    query heads padded 64 -> 72, one dummy (-1) per KV group of 8:
        [0..7, -1 | 8..15, -1 | ... | 56..63, -1]        9 per group, 3 per rank
    KV heads replicated 8 -> 24 (each source head copied 3 times):
        [0, 0, 0 | 1, 1, 1 | ... | 7, 7, 7]             1 per rank
    rank r: query heads layout[3r:3r+3], KV head r // 3

Invariants of a ``ShardingPlan`` (``check_executable`` enforces them):
    * every real query head appears exactly once across ranks; dummy heads are ``DUMMY`` (-1);
    * query head ``h`` attends with KV head ``h // (n_query_heads // n_kv_heads)`` and that KV head
      is among the KV heads of the rank holding ``h``;
    * ranks hold equal numbers of query heads and of KV heads;
    * under ``shard-over-batch`` each KV-cache row lives on exactly one rank, otherwise on all ranks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from neuron_lmi.parallel.head_layout import DUMMY, GQAStrategy, layouts, resolve_strategy

log = logging.getLogger(__name__)

__all__ = [
    "DUMMY",
    "GQAStrategy",
    "PlanGeometry",
    "RankShard",
    "ShardingPlan",
    "build_sharding_plan",
    "lay_out_plan",
]


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one rank holds.

    ``query_heads``: global query-head indices in local order (``DUMMY`` for padding heads); the
    rank owns these columns of q_proj and rows of o_proj.
    ``kv_heads``: for each local KV-cache head, the source KV head it copies (``DUMMY`` = zeros).
    ``kv_weight_columns``: ``(start, stop)`` into the K/V projection's output columns
    (``n_kv_heads * head_dim``) that this rank computes before a collective (all-gather or
    all-to-all); ``None`` when the rank computes its ``kv_heads`` whole from replicated rows.
    ``batch_rows``: KV-cache rows (sequence slots) stored on this rank.
    ``kv_cache_bytes_per_row``: bytes this rank stores for one row it holds (K and V, all layers).
    """

    rank: int
    query_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_weight_columns: tuple[int, int] | None
    batch_rows: tuple[int, ...]
    kv_cache_bytes_per_row: int

    @property
    def real_query_heads(self) -> tuple[int, ...]:
        return tuple(h for h in self.query_heads if h != DUMMY)


@dataclass(frozen=True, slots=True)
class ShardingPlan:
    """An executable GQA sharding decision for one model geometry, tp degree and batch size.

    ``strategy`` is what the library would actually run after its fallbacks; ``fallback_reason``
    says why it differs from ``requested`` (``None`` when it does not).  ``query_layout`` and
    ``kv_layout`` are the global padded orders that ``ranks`` split contiguously (under
    ``all-gather-heads`` ``kv_layout`` is the gathered per-rank order; under ``shard-over-batch``
    it is the plain KV heads, which every rank holds for its own rows).

    Executing it: a rank computes q for ``query_heads`` and k/v for ``kv_heads`` (zeros for
    ``DUMMY``), attends each real query head with the local slot holding ``kv_head_of(h)``, and
    multiplies by its o_proj rows; the ranks' partial outputs are summed (all-reduce).  Where
    ``kv_weight_columns`` is set the library computes only that column slice and gathers
    (all-gather-heads) or exchanges (shard-over-batch, AllToAll over rows) the rest; computing the
    whole ``kv_heads`` locally gives the same numbers.  Under shard-over-batch the library attends
    all heads for the rank's own rows; per-head ownership as above is numerically the same.
    """

    n_query_heads: int
    n_kv_heads: int
    head_dim: int
    tp_degree: int
    batch_size: int
    requested: GQAStrategy | None
    strategy: GQAStrategy
    fallback_reason: str | None
    query_layout: tuple[int, ...]
    kv_layout: tuple[int, ...]
    ranks: tuple[RankShard, ...]

    @property
    def n_query_heads_padded(self) -> int:
        return len(self.query_layout)

    @property
    def n_kv_heads_effective(self) -> int:
        """KV heads after replication and padding, summed over ranks' caches (``n_kv_heads`` for
        shard-over-batch, where heads are whole on every rank but rows are split)."""
        return len(self.kv_layout)

    @property
    def query_heads_per_rank(self) -> int:
        return len(self.ranks[0].query_heads)

    @property
    def kv_heads_per_rank(self) -> int:
        return len(self.ranks[0].kv_heads)

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head."""
        return self.n_query_heads // self.n_kv_heads

    def kv_head_of(self, query_head: int) -> int:
        return query_head // self.group_size

    @property
    def kv_bytes_per_row_per_core(self) -> int:
        """KV-cache bytes one batch row costs the busiest core (rows split over ranks under
        shard-over-batch, so a row costs each core 1/tp of a full row there)."""
        full = max(r.kv_cache_bytes_per_row for r in self.ranks)
        if self.strategy is GQAStrategy.SHARD_OVER_BATCH:
            return math.ceil(full / self.tp_degree)
        return full

    def kv_cache_bytes_per_core(self, rows: int) -> int:
        """KV-cache bytes on the busiest core for a cache of ``rows`` rows."""
        full = max(r.kv_cache_bytes_per_row for r in self.ranks)
        if self.strategy is GQAStrategy.SHARD_OVER_BATCH:
            return math.ceil(rows / self.tp_degree) * full
        return rows * full

    def check_executable(self) -> None:
        """Raise ``ValueError`` naming the first broken invariant (see the module docstring)."""
        _check_executable(self)


def build_sharding_plan(
    n_query_heads: int,
    n_kv_heads: int,
    head_dim: int,
    tp_degree: int,
    strategy: GQAStrategy | str | None = None,
    batch_size: int = 1,
    *,
    n_layers: int = 1,
    n_positions: int = 1,
    dtype_bytes: int = 2,
    log_fallback: bool = True,
) -> ShardingPlan:
    """Plan how ``tp_degree`` ranks share the attention heads and KV cache.

    ``strategy=None`` is the library default (shard-over-heads, or plain MHA when query and KV head
    counts are equal); a strategy the geometry does not admit falls back (``resolve_strategy``).
    ``n_layers``, ``n_positions`` and ``dtype_bytes`` only size ``RankShard.kv_cache_bytes_per_row``
    (defaults give bytes per token per layer at 16 bit). A fallback is logged as a warning, as the
    library warns (``log_fallback=False`` for callers that explore many plans and report
    ``fallback_reason`` themselves).
    """
    requested = GQAStrategy.parse(strategy)
    geometry = PlanGeometry(
        n_query_heads, n_kv_heads, head_dim, tp_degree, batch_size, n_layers, n_positions, dtype_bytes
    )
    effective, reason = resolve_strategy(
        n_query_heads, n_kv_heads, head_dim, tp_degree, requested, batch_size
    )
    if reason and log_fallback:
        log.warning("GQA %s -> %s: %s", requested or "default", effective, reason)
    return lay_out_plan(geometry, requested, effective, reason)


@dataclass(frozen=True, slots=True)
class PlanGeometry:
    """What a plan is laid out over: the model's heads, the degree, and the cache it sizes."""

    n_query_heads: int
    n_kv_heads: int
    head_dim: int
    tp_degree: int
    batch_size: int = 1
    n_layers: int = 1
    n_positions: int = 1
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        _validate_geometry(
            self.n_query_heads, self.n_kv_heads, self.head_dim, self.tp_degree, self.batch_size
        )
        for name in ("n_layers", "n_positions", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def lay_out_plan(
    geometry: PlanGeometry, requested: GQAStrategy | None, effective: GQAStrategy, reason: str | None
) -> ShardingPlan:
    """The executable plan of ``effective`` over ``geometry``, recording what was asked and why it
    differs. A caller with its own rule for the strategy (``backends/tnx/gqa.py``) comes in here."""
    g = geometry
    tp_degree, batch_size = g.tp_degree, g.batch_size
    row_bytes = 2 * g.n_layers * g.n_positions * g.head_dim * g.dtype_bytes  # K and V, per cached head
    q_layout, kv_layout, kv_columns = layouts(g.n_query_heads, g.n_kv_heads, g.head_dim, tp_degree, effective)
    q_per, kv_per = len(q_layout) // tp_degree, len(kv_layout) // tp_degree
    rows_per = batch_size // tp_degree if effective is GQAStrategy.SHARD_OVER_BATCH else batch_size
    ranks = []
    for r in range(tp_degree):
        if effective is GQAStrategy.SHARD_OVER_BATCH:
            kv_heads, rows = kv_layout, tuple(range(r * rows_per, (r + 1) * rows_per))
        else:
            kv_heads, rows = kv_layout[r * kv_per : (r + 1) * kv_per], tuple(range(batch_size))
        ranks.append(
            RankShard(
                rank=r,
                query_heads=q_layout[r * q_per : (r + 1) * q_per],
                kv_heads=kv_heads,
                kv_weight_columns=kv_columns[r] if kv_columns else None,
                batch_rows=rows,
                kv_cache_bytes_per_row=len(kv_heads) * row_bytes,
            )
        )
    plan = ShardingPlan(
        n_query_heads=g.n_query_heads,
        n_kv_heads=g.n_kv_heads,
        head_dim=g.head_dim,
        tp_degree=tp_degree,
        batch_size=batch_size,
        requested=requested,
        strategy=effective,
        fallback_reason=reason,
        query_layout=q_layout,
        kv_layout=kv_layout,
        ranks=tuple(ranks),
    )
    plan.check_executable()
    return plan


def _validate_geometry(n_q: int, n_kv: int, head_dim: int, tp: int, batch: int) -> None:
    for name, value in (
        ("n_query_heads", n_q),
        ("n_kv_heads", n_kv),
        ("head_dim", head_dim),
        ("tp_degree", tp),
        ("batch_size", batch),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if n_q % n_kv != 0:
        raise ValueError(f"n_query_heads={n_q} must be a multiple of n_kv_heads={n_kv}")


def _check_executable(plan: ShardingPlan) -> None:
    seen: dict[int, int] = {}
    for shard in plan.ranks:
        counts = (len(shard.query_heads), len(shard.kv_heads))
        if counts != (plan.query_heads_per_rank, plan.kv_heads_per_rank):
            raise ValueError(f"rank {shard.rank} holds a different number of heads from rank 0")
        for h in shard.real_query_heads:
            if h in seen:
                raise ValueError(f"query head {h} is on ranks {seen[h]} and {shard.rank}")
            seen[h] = shard.rank
            if plan.kv_head_of(h) not in shard.kv_heads:
                raise ValueError(f"rank {shard.rank} has query head {h} without KV head {plan.kv_head_of(h)}")
        if any(k != DUMMY and not 0 <= k < plan.n_kv_heads for k in shard.kv_heads):
            raise ValueError(f"rank {shard.rank} names a KV head outside 0..{plan.n_kv_heads - 1}")
    missing = sorted(set(range(plan.n_query_heads)) - set(seen))
    if missing:
        raise ValueError(f"query heads on no rank: {missing}")
    rows = [row for shard in plan.ranks for row in shard.batch_rows]
    if plan.strategy is GQAStrategy.SHARD_OVER_BATCH and sorted(rows) != list(range(plan.batch_size)):
        raise ValueError("shard-over-batch must place every KV-cache row on exactly one rank")
