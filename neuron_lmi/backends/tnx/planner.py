"""Capacity planning: for each tensor-parallel degree an instance supports, what one NeuronCore holds.

Per core, under the layout transformers-neuronx runs with continuous batching
(``gqa.continuous_batching_plan``):

    weights  = layers x (q, k, v, o columns of the rank's heads + gate/up/down rows of
               ceil(intermediate / tp) for every expert (one MLP when dense) + the router (experts x
               hidden, replicated) + two norms) + final norm + lm_head columns ceil(vocab / tp)
               (the token embedding stays on the host: ``on_device_embedding`` is off by default)
    experts  = the expert part of weights: all experts' slices, so a MoE model's weights per core
               are about its total / tp (NxD Inference splits inside every expert; no expert
               parallelism)
    padding  = weights - (device weights / tp): dummy heads, replicated KV weights, MLP/vocab padding
    KV row   = 2 (K, V) x layers x n_positions x local KV heads x head_dim x dtype bytes
    rows     = floor((the instance's HBM per core x (1 - headroom) - weights) / KV row)   (a
               multiple of tp when the cache is split over the batch)

Recommendation, matching AWS's published choices (LMI's transformers-neuronx tuning guide; REFERENCE
§6): the largest supported degree up to 8 that fits ``batch_size`` rows -- beyond 8 per-token latency
gains flatten while collectives grow, and the remaining cores serve replicas -- otherwise the
smallest larger degree that fits (Llama-2-70B: 24 on inf2.48xlarge, 32 on trn1.32xlarge).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from neuron_lmi.backends.tnx.gqa import continuous_batching_plan
from neuron_lmi.config.dtypes import DTYPES
from neuron_lmi.parallel.catalog import GIB, INSTANCES, InstanceSpec, ModelSpec
from neuron_lmi.parallel.gqa import PlanGeometry, ShardingPlan
from neuron_lmi.parallel.head_layout import GQAStrategy

DTYPE_BYTES = {d.name: d.n_bytes for d in DTYPES.values()}  # the dtype table's, by LMI name
DEFAULT_HEADROOM = 0.10  # NEFFs, activations, collectives' buffers and runtime scratch
LATENCY_TP_CAP = 8


@dataclass(frozen=True, slots=True)
class StrategyCost:
    """One GQA strategy at one tp degree: what the library runs, and its KV cost per core."""

    requested: str
    effective: str
    fallback_reason: str | None
    query_heads_per_core: int
    kv_heads_per_core: int
    kv_bytes_per_row_per_core: int
    weight_bytes_per_core: int
    max_rows: int


@dataclass(frozen=True, slots=True)
class TpOption:
    """One tp degree on one instance, sized with the library's default GQA strategy.

    ``fits`` means the weights and ``batch_size`` KV rows fit in the per-core budget.
    """

    tp_degree: int
    replicas: int
    strategy: str
    fallback_reason: str | None
    query_heads_padded: int
    kv_heads_effective: int
    weight_bytes_per_core: int
    expert_weight_bytes_per_core: int  # the MoE experts' share of weight_bytes_per_core; 0 if dense
    ideal_weight_bytes_per_core: int
    padding_bytes_per_core: int
    kv_bytes_per_row_per_core: int
    max_rows: int
    fits: bool
    strategies: tuple[StrategyCost, ...]


@dataclass(frozen=True, slots=True)
class InstancePlan:
    """Every tp option of one instance and the recommended one (``None`` when nothing fits)."""

    model: str
    instance: str
    cores: int
    hbm_bytes_per_core: int
    dtype: str
    n_positions: int
    batch_size: int
    headroom: float
    budget_bytes_per_core: int
    options: tuple[TpOption, ...]
    recommended_tp: int | None
    reason: str

    @property
    def recommended(self) -> TpOption | None:
        return next((o for o in self.options if o.tp_degree == self.recommended_tp), None)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def plan_instance(
    model: ModelSpec,
    instance: InstanceSpec,
    dtype: str = "fp16",
    n_positions: int | None = None,
    batch_size: int = 1,
    headroom: float = DEFAULT_HEADROOM,
) -> InstancePlan:
    """Size ``model`` at every tp degree of ``instance`` and pick one (see the module docstring)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    positions = model.default_n_positions if n_positions is None else n_positions
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"n_positions must be a positive integer, got {positions!r}")
    if positions > model.max_position_embeddings:
        raise ValueError(
            f"n_positions={positions} exceeds {model.name}'s max_position_embeddings="
            f"{model.max_position_embeddings}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    budget = int(instance.hbm_bytes_per_core * (1 - headroom))
    options = tuple(
        _option(model, instance, tp, DTYPE_BYTES[dtype], positions, batch_size, budget)
        for tp in instance.tp_degrees
    )
    recommended, reason = _recommend(model, instance, options, batch_size, budget)
    return InstancePlan(
        model=model.name,
        instance=instance.name,
        cores=instance.cores,
        hbm_bytes_per_core=instance.hbm_bytes_per_core,
        dtype=dtype,
        n_positions=positions,
        batch_size=batch_size,
        headroom=headroom,
        budget_bytes_per_core=budget,
        options=options,
        recommended_tp=recommended,
        reason=reason,
    )


def plan_all_instances(model: ModelSpec, **kwargs: object) -> tuple[InstancePlan, ...]:
    """``plan_instance`` for every known instance, in catalog order."""
    return tuple(plan_instance(model, spec, **kwargs) for spec in INSTANCES.values())  # type: ignore[arg-type]


def weight_bytes_per_core(model: ModelSpec, plan: ShardingPlan, dtype_bytes: int) -> int:
    """Device-resident weight bytes on the busiest core under ``plan``."""
    h, d, tp = model.hidden_size, model.head_dim, plan.tp_degree
    shard = plan.ranks[0]
    q_cols = len(shard.query_heads) * d
    slices = [r.kv_weight_columns for r in plan.ranks if r.kv_weight_columns is not None]
    kv_cols = max(stop - start for start, stop in slices) if slices else len(shard.kv_heads) * d
    mlp = model.mlp_copies * 3 * h * math.ceil(model.intermediate_size / tp)
    per_layer = h * (2 * q_cols + 2 * kv_cols) + mlp + model.n_experts * h + 2 * h
    elements = model.n_layers * per_layer + h + h * math.ceil(model.vocab_size / tp)
    return elements * dtype_bytes


def expert_weight_bytes_per_core(model: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """Bytes of every layer's expert slices on one core (0 for a dense model; the router excluded)."""
    per_layer = model.n_experts * 3 * model.hidden_size * math.ceil(model.intermediate_size / tp)
    return model.n_layers * per_layer * dtype_bytes


def ideal_weight_bytes_per_core(model: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """Device weights split evenly with no padding or replication (norms stay duplicated)."""
    h, d = model.hidden_size, model.head_dim
    attention = h * d * (2 * model.n_heads + 2 * model.n_kv_heads)
    mlp = model.mlp_copies * 3 * h * model.intermediate_size
    sharded = model.n_layers * (attention + mlp) + h * model.vocab_size
    duplicated = model.n_layers * (2 * h + model.n_experts * h) + h  # norms and routers
    return math.ceil(sharded / tp) * dtype_bytes + duplicated * dtype_bytes


def _option(
    model: ModelSpec,
    instance: InstanceSpec,
    tp: int,
    dtype_bytes: int,
    positions: int,
    batch: int,
    budget: int,
) -> TpOption:
    plans = [_plan(model, tp, s, dtype_bytes, positions, batch) for s in (None, *GQAStrategy)]
    costs = tuple(_strategy_cost(model, p, dtype_bytes, budget) for p in plans)
    default, plan = costs[0], plans[0]
    weights = default.weight_bytes_per_core
    ideal = ideal_weight_bytes_per_core(model, tp, dtype_bytes)
    return TpOption(
        tp_degree=tp,
        replicas=instance.cores // tp,
        strategy=default.effective,
        fallback_reason=default.fallback_reason,
        query_heads_padded=plan.n_query_heads_padded,
        kv_heads_effective=plan.n_kv_heads_effective,
        weight_bytes_per_core=weights,
        expert_weight_bytes_per_core=expert_weight_bytes_per_core(model, tp, dtype_bytes),
        ideal_weight_bytes_per_core=ideal,
        padding_bytes_per_core=max(weights - ideal, 0),
        kv_bytes_per_row_per_core=default.kv_bytes_per_row_per_core,
        max_rows=default.max_rows,
        fits=default.max_rows >= batch,
        strategies=costs[1:],
    )


def _plan(
    model: ModelSpec, tp: int, strategy: GQAStrategy | None, dtype_bytes: int, positions: int, batch: int
) -> ShardingPlan:
    geometry = PlanGeometry(
        model.n_heads,
        model.n_kv_heads,
        model.head_dim,
        tp,
        batch_size=batch,
        n_layers=model.n_layers,
        n_positions=positions,
        dtype_bytes=dtype_bytes,
    )
    return continuous_batching_plan(geometry, strategy)  # how neuron-lmi always serves


def _strategy_cost(model: ModelSpec, plan: ShardingPlan, dtype_bytes: int, budget: int) -> StrategyCost:
    weights = weight_bytes_per_core(model, plan, dtype_bytes)
    row = plan.kv_bytes_per_row_per_core
    if plan.strategy is GQAStrategy.SHARD_OVER_BATCH:
        # Each core holds ceil(rows / tp) whole rows; count whole rows, in multiples of tp.
        per_core_rows = max(budget - weights, 0) // max(r.kv_cache_bytes_per_row for r in plan.ranks)
        rows = per_core_rows * plan.tp_degree
    else:
        rows = max(budget - weights, 0) // row
    return StrategyCost(
        requested=plan.requested.value if plan.requested else "default",
        effective=plan.strategy.value,
        fallback_reason=plan.fallback_reason,
        query_heads_per_core=plan.query_heads_per_rank,
        kv_heads_per_core=plan.kv_heads_per_rank,
        kv_bytes_per_row_per_core=row,
        weight_bytes_per_core=weights,
        max_rows=rows,
    )


def _recommend(
    model: ModelSpec, instance: InstanceSpec, options: tuple[TpOption, ...], batch: int, budget: int
) -> tuple[int | None, str]:
    fitting = [o for o in options if o.fits]
    if not fitting:
        best = min(options, key=lambda o: o.weight_bytes_per_core)
        what = (
            f"weights alone need {best.weight_bytes_per_core / GIB:.1f} GiB per core"
            if best.weight_bytes_per_core > budget
            else f"only {best.max_rows} of {batch} KV rows fit"
        )
        return None, (
            f"{model.name} does not fit on {instance.name} at any supported tp degree "
            f"({', '.join(map(str, instance.tp_degrees))}): at tp={best.tp_degree} {what}, "
            f"budget {budget / GIB:.1f} GiB per core"
        )
    small = [o for o in fitting if o.tp_degree <= LATENCY_TP_CAP]
    if small:
        pick = max(small, key=lambda o: o.tp_degree)
        why = f"largest supported degree <= {LATENCY_TP_CAP} that fits"
    else:
        pick = min(fitting, key=lambda o: o.tp_degree)
        why = f"smallest degree that fits (no degree <= {LATENCY_TP_CAP} holds the weights)"
    replicas = f"{pick.replicas} replica{'s' if pick.replicas != 1 else ''} on {instance.cores} cores"
    return pick.tp_degree, (
        f"tp={pick.tp_degree}: {why}; {pick.weight_bytes_per_core / GIB:.1f} GiB weights per core, "
        f"up to {pick.max_rows} rows; {replicas}"
    )
