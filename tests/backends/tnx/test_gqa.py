"""transformers-neuronx's continuous-batching rule over the shared layouts (``backends/tnx/gqa.py``)."""

from __future__ import annotations

import pytest

from neuron_lmi.backends.tnx.gqa import continuous_batching_plan, continuous_batching_strategy
from neuron_lmi.parallel import GQAStrategy, build_sharding_plan
from neuron_lmi.parallel.gqa import PlanGeometry

SOB, SOH, REP = GQAStrategy.SHARD_OVER_BATCH, GQAStrategy.SHARD_OVER_HEADS, GQAStrategy.REPLICATED_HEADS


def test_shard_over_batch_is_replaced_at_any_tp_above_one_whatever_the_batch():
    # Batch 8 over tp 4 admits shard-over-batch geometrically; the library's batch-1 context
    # decoders do not, so it runs shard-over-heads (8 KV heads divide over 4 ranks).
    assert build_sharding_plan(32, 8, 128, 4, SOB, batch_size=8).strategy is SOB
    plan = continuous_batching_plan(PlanGeometry(32, 8, 128, 4, batch_size=8), SOB)
    assert plan.requested is SOB and plan.strategy is SOH
    assert plan.fallback_reason is not None and "batch 1" in plan.fallback_reason
    assert "batch_size % tp_degree" not in plan.fallback_reason


def test_the_fallback_replicates_when_kv_heads_do_not_divide():
    strategy, reason = continuous_batching_strategy(64, 8, 128, 24, SOB)
    assert strategy is REP
    assert reason is not None and "batch 1" in reason and "replicated" in reason


@pytest.mark.parametrize("strategy", [None, SOH, REP, GQAStrategy.ALL_GATHER_HEADS])
def test_other_strategies_run_as_the_geometry_admits(strategy):
    geometry = PlanGeometry(64, 8, 128, 24, batch_size=4, n_layers=80, n_positions=4096)
    ours = continuous_batching_plan(geometry, strategy)
    shared = build_sharding_plan(
        64, 8, 128, 24, strategy, 4, n_layers=80, n_positions=4096, log_fallback=False
    )
    assert ours == shared


def test_tp_one_keeps_shard_over_batch():
    plan = continuous_batching_plan(PlanGeometry(32, 8, 128, 1, batch_size=3), SOB)
    assert plan.strategy is SOB and plan.fallback_reason is None


def test_geometry_is_validated_naming_the_field():
    with pytest.raises(ValueError, match="n_positions"):
        PlanGeometry(32, 8, 128, 4, n_positions=0)
    with pytest.raises(ValueError, match="tp_degree"):
        PlanGeometry(32, 8, 128, 0)
