"""Tensor parallelism: the GQA head layouts (``head_layout``), the sharding plans built on them
(``gqa``), and the CPU engine's tensor-parallel transform (``tp_model``, ``tp_mlp``).

The plans are pure arithmetic, with no torch and no Neuron import: the CPU transform executes them,
and transformers-neuronx's backend (its continuous-batching rule and the NeuronCore planner, in
``backends/tnx``) sizes them for ``neuron-lmi plan``.
"""

from neuron_lmi.parallel.gqa import RankShard, ShardingPlan, build_sharding_plan
from neuron_lmi.parallel.head_layout import DUMMY, GQAStrategy, qkv_padding, resolve_strategy

__all__ = [
    "DUMMY",
    "GQAStrategy",
    "RankShard",
    "ShardingPlan",
    "build_sharding_plan",
    "qkv_padding",
    "resolve_strategy",
]
