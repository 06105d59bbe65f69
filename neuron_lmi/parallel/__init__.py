"""Tensor-parallel planning: GQA sharding plans (``gqa``) and per-instance capacity plans (``planner``).

Pure arithmetic, no torch and no Neuron imports: the CPU tensor-parallel transform, the Neuron
backend and ``neuron-lmi plan`` all read the same frozen plans.
"""

from neuron_lmi.parallel.gqa import RankShard, ShardingPlan, build_sharding_plan
from neuron_lmi.parallel.tnx_rules import DUMMY, GQAStrategy, qkv_padding, resolve_strategy

__all__ = [
    "DUMMY",
    "GQAStrategy",
    "RankShard",
    "ShardingPlan",
    "build_sharding_plan",
    "qkv_padding",
    "resolve_strategy",
]
