"""What transformers-neuronx runs for a GQA request under continuous batching, beyond the geometry.

The layouts and the geometric fallbacks are the shared sharding model (``parallel/head_layout.py``);
this module holds the rule only this library adds. Read in aws-neuron/transformers-neuronx (v0.13):
under continuous batching the context-encoding decoders are built with batch 1 (``llama/model.py``
``context_batch_sizes``) and share one ``neuron_config`` with the token decoder, so
``decoder.py`` ``check_gqa_fallback`` rejects shard-over-batch at any tp > 1 whatever the rolling
batch size, and every graph runs the fallback. neuron-lmi always serves with continuous batching,
so the mapping (``args.py``) and the planner (``planner.py``) both report what this rule runs.
"""

from __future__ import annotations

from neuron_lmi.parallel.gqa import PlanGeometry, ShardingPlan, lay_out_plan
from neuron_lmi.parallel.head_layout import GQAStrategy, resolve_strategy


def continuous_batching_strategy(
    n_query_heads: int,
    n_kv_heads: int,
    head_dim: int,
    tp_degree: int,
    requested: GQAStrategy | None,
) -> tuple[GQAStrategy, str | None]:
    """The strategy the library runs under continuous batching, and why it differs from ``requested``."""
    strategy, reason = resolve_strategy(n_query_heads, n_kv_heads, head_dim, tp_degree, requested, 1)
    if requested is GQAStrategy.SHARD_OVER_BATCH and tp_degree > 1:
        reason = (
            "continuous batching builds the context-encoding decoders with batch 1, so "
            f"transformers-neuronx replaces shard-over-batch at tp_degree={tp_degree}; "
            + (reason or "").split("; ", 1)[-1]
        )
    return strategy, reason


def continuous_batching_plan(geometry: PlanGeometry, strategy: GQAStrategy | str | None) -> ShardingPlan:
    """The sharding plan the library runs for ``strategy`` under continuous batching."""
    requested = GQAStrategy.parse(strategy)
    effective, reason = continuous_batching_strategy(
        geometry.n_query_heads, geometry.n_kv_heads, geometry.head_dim, geometry.tp_degree, requested
    )
    return lay_out_plan(geometry, requested, effective, reason)
