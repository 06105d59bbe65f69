"""Head layouts of the four GQA sharding strategies: how query and KV heads are padded, replicated
and ordered before ranks split them contiguously.

This is the sharding model every tensor-parallel path here executes: the CPU engine's tensor
parallelism runs these layouts, and the NeuronCore planner sizes them. The strategies and their
arithmetic are the ones transformers-neuronx (v0.13) defines, read in aws-neuron/transformers-neuronx:
``constants.py`` (``GQA`` names), ``decoder.py`` ``check_gqa_fallback`` (which layouts a geometry
admits, and the fallback to shard-over-heads, then replicated-heads), ``utils.py``
``get_qkv_padding`` (head counts) and ``pad_interleaved``, and ``DecoderLayer.to_neuron`` (query
padding at the end or per KV group, ``repeat_interleave`` replication of KV heads, MHA KV heads
padded like query heads). What only that library does with a request, beyond the geometry (its
continuous-batching rule), lives in ``backends/tnx/gqa.py``.
A layout is the global head order that ranks then split contiguously; ``DUMMY`` marks a padding head.
"""

from __future__ import annotations

import logging
import math
from enum import StrEnum

log = logging.getLogger(__name__)

DUMMY = -1  # a zero-weight padding head: it holds no real query/KV head


class GQAStrategy(StrEnum):
    """transformers-neuronx ``GQA`` values (``constants.py``)."""

    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"

    @classmethod
    def parse(cls, value: str | GQAStrategy | None) -> GQAStrategy | None:
        """``None`` stays ``None`` (library default); anything else must be one of the four names."""
        if value is None or isinstance(value, GQAStrategy):
            return value
        try:
            return cls(str(value).strip().lower().replace("_", "-"))
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise ValueError(f"group_query_attention={value!r} is not one of: {choices}") from None


def resolve_strategy(
    n_query_heads: int,
    n_kv_heads: int,
    head_dim: int,
    tp_degree: int,
    requested: GQAStrategy | None,
    batch_size: int = 1,
) -> tuple[GQAStrategy, str | None]:
    """The strategy the library runs, and why it differs from ``requested`` (or ``None``).

    Mirrors ``check_gqa_fallback``: shard-over-batch needs ``batch % tp == 0``; all-gather-heads needs
    ``n_kv*head_dim % tp == 0`` and, when query heads need padding, padding divisible by the KV
    heads; both fall back to shard-over-heads, which needs ``n_kv % tp == 0`` or else becomes
    replicated-heads.  One guard is ours: all-gather also needs each KV head to be gathered whole on
    the ranks of its query heads (``n_kv % tp == 0`` or ``tp % n_kv == 0``), otherwise the library's
    gathered layout would split a head; we fall back instead.
    """
    if requested is None and n_query_heads == n_kv_heads:
        return GQAStrategy.SHARD_OVER_HEADS, None  # MHA: the library applies no GQA config
    wanted = requested or GQAStrategy.SHARD_OVER_HEADS
    if wanted is GQAStrategy.REPLICATED_HEADS:
        return wanted, None
    reasons: list[str] = []
    if wanted is GQAStrategy.SHARD_OVER_BATCH:
        if batch_size % tp_degree == 0:
            return wanted, None
        reasons.append(
            f"shard-over-batch needs batch_size % tp_degree == 0 (batch_size={batch_size}, "
            f"tp_degree={tp_degree}); using shard-over-heads"
        )
    elif wanted is GQAStrategy.ALL_GATHER_HEADS:
        why = _all_gather_blocker(n_query_heads, n_kv_heads, head_dim, tp_degree)
        if why is None:
            return wanted, None
        reasons.append(f"{why}; using shard-over-heads")
    if n_kv_heads % tp_degree != 0:
        reasons.append(
            f"n_kv_heads={n_kv_heads} is not divisible by tp_degree={tp_degree}; "
            "KV heads are replicated (replicated-heads)"
        )
        return GQAStrategy.REPLICATED_HEADS, "; ".join(reasons)
    return GQAStrategy.SHARD_OVER_HEADS, "; ".join(reasons) or None


def qkv_padding(
    n_query_heads: int, n_kv_heads: int, tp_degree: int, strategy: GQAStrategy
) -> tuple[int, int]:
    """Query and KV head counts after padding, as ``utils.get_qkv_padding`` computes them.

    (The library later pads MHA KV heads together with the query heads; ``build_sharding_plan``
    reflects that in ``kv_layout``.)
    """
    q_padded = _round_up(n_query_heads, tp_degree)
    if n_query_heads == n_kv_heads or strategy is not GQAStrategy.REPLICATED_HEADS:
        return q_padded, n_kv_heads
    ratio = n_query_heads // n_kv_heads  # full replication: GQA becomes MHA
    extra = q_padded - n_query_heads
    if (
        n_kv_heads < tp_degree
        and tp_degree % n_kv_heads == 0
        and (n_query_heads % tp_degree == 0 or (extra > 0 and extra % n_kv_heads == 0))
    ):
        ratio = tp_degree // n_kv_heads  # partial: one KV head per rank
    elif q_padded * n_kv_heads == n_query_heads * tp_degree:
        ratio = 1  # each rank's query heads are exactly one group
    kv_padded = max(n_kv_heads * ratio, tp_degree)
    if kv_padded == n_query_heads:
        kv_padded = q_padded
    return q_padded, kv_padded


# -- layouts -------------------------------------------------------------------------------------


def layouts(
    n_q: int, n_kv: int, head_dim: int, tp: int, strategy: GQAStrategy
) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, int]] | None]:
    """Global query layout, KV layout, and per-rank K/V projection column slices (or ``None``)."""
    q_padded = _round_up(n_q, tp)
    if strategy is GQAStrategy.SHARD_OVER_BATCH:
        return _end_padded(n_q, q_padded), tuple(range(n_kv)), _column_slices(n_kv * head_dim, tp)
    if strategy is GQAStrategy.ALL_GATHER_HEADS:
        q_layout = _interleave_padded(n_q, n_kv, q_padded)
        kv_per = max(n_kv // tp, 1)
        kv_layout = tuple((r * kv_per + i) * n_kv // (tp * kv_per) for r in range(tp) for i in range(kv_per))
        return q_layout, kv_layout, _column_slices(n_kv * head_dim, tp)
    if n_q == n_kv:  # MHA: KV heads are padded together with the query heads
        layout = _end_padded(n_q, q_padded)
        return layout, layout, None
    if strategy is GQAStrategy.SHARD_OVER_HEADS:  # n_kv % tp == 0, hence n_q % tp == 0
        return tuple(range(n_q)), tuple(range(n_kv)), None
    return (*_replicated_layouts(n_q, n_kv, tp), None)


def _replicated_layouts(n_q: int, n_kv: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``DecoderLayer.to_neuron`` for replicated-heads: pad Q, repeat (or zero-pad) KV, pad like Q.

    Falls back to full replication (KV layout == Q layout, always executable) in the corner cases
    where the library's arithmetic would not keep query heads beside their KV head.
    """
    group = n_q // n_kv
    q_padded, kv_padded = qkv_padding(n_q, n_kv, tp, GQAStrategy.REPLICATED_HEADS)
    extra = q_padded - n_q
    interleaved = tp % n_kv == 0 and extra > 0 and extra % n_kv == 0
    q_layout = _interleave_padded(n_q, n_kv, q_padded) if interleaved else _end_padded(n_q, q_padded)
    full = tuple(h // group if h != DUMMY else DUMMY for h in q_layout)
    if kv_padded % n_kv == 0 and not (kv_padded == q_padded and extra > 0):
        ratio = kv_padded // n_kv
    else:
        ratio = int((kv_padded - extra) / n_kv)  # the library truncates toward zero
    if ratio == 0:
        kv_layout = (*range(n_kv), *([DUMMY] * (kv_padded - n_kv)))
    elif ratio > 0 and n_kv * ratio == n_q:
        kv_layout = full  # replicated up to the query heads, then padded exactly like them
    elif ratio > 0:
        kv_layout = tuple(k for k in range(n_kv) for _ in range(ratio))
    else:
        kv_layout = ()
    if not _layout_executable(q_layout, kv_layout, group, tp):
        log.warning("replicated-heads: library layout would split a group at tp=%d; fully replicating", tp)
        kv_layout = full
    return q_layout, kv_layout


def _layout_executable(q_layout: tuple[int, ...], kv_layout: tuple[int, ...], group: int, tp: int) -> bool:
    if not kv_layout or len(kv_layout) % tp:
        return False
    q_per, kv_per = len(q_layout) // tp, len(kv_layout) // tp
    for r in range(tp):
        local_kv = set(kv_layout[r * kv_per : (r + 1) * kv_per])
        if any(h != DUMMY and h // group not in local_kv for h in q_layout[r * q_per : (r + 1) * q_per]):
            return False
    return True


def _end_padded(n: int, padded: int) -> tuple[int, ...]:
    return (*range(n), *([DUMMY] * (padded - n)))


def _interleave_padded(n_q: int, n_kv: int, padded: int) -> tuple[int, ...]:
    """``utils.pad_interleaved``: each KV group's query heads followed by its share of dummies."""
    group, pad = n_q // n_kv, (padded - n_q) // n_kv
    return tuple(h for g in range(n_kv) for h in (*range(g * group, (g + 1) * group), *([DUMMY] * pad)))


def _column_slices(total: int, tp: int) -> list[tuple[int, int]]:
    per = math.ceil(total / tp)
    return [(min(r * per, total), min((r + 1) * per, total)) for r in range(tp)]


def _all_gather_blocker(n_q: int, n_kv: int, head_dim: int, tp: int) -> str | None:
    if (n_kv * head_dim) % tp != 0:
        return f"all-gather-heads needs n_kv_heads*head_dim ({n_kv}x{head_dim}) divisible by tp_degree={tp}"
    pad = _round_up(n_q, tp) - n_q
    if pad % n_kv != 0:
        return (
            f"all-gather-heads needs the {pad} padding query heads (n_query_heads={n_q} at "
            f"tp_degree={tp}) to divide evenly over {n_kv} KV heads"
        )
    if n_kv % tp != 0 and tp % n_kv != 0:  # our guard, see resolve_strategy
        return f"all-gather-heads cannot gather whole KV heads: {n_kv} KV heads over tp_degree={tp}"
    return None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
