"""GQA sharding plans: the library's worked examples, every strategy and fallback, and executability.

The executability check runs real (tiny) attention split by the plan with torch and compares it with
the unsplit computation, which is what the CPU tensor-parallel transform will do.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from neuron_lmi.parallel import (
    DUMMY,
    GQAStrategy,
    ShardingPlan,
    build_sharding_plan,
    qkv_padding,
    resolve_strategy,
)

HEADS = {  # name: (query heads, KV heads, head_dim)
    "smollm2-135m": (9, 3, 64),
    "tiny": (4, 2, 64),
    "mistral-7b": (32, 8, 128),
    "llama-2-70b": (64, 8, 128),
    "llama-2-13b-mha": (40, 40, 128),
}
TPS = (1, 2, 3, 4, 8, 24, 32)
STRATEGIES = (None, *GQAStrategy)
SOH, SOB, REP, AGH = (
    GQAStrategy.SHARD_OVER_HEADS,
    GQAStrategy.SHARD_OVER_BATCH,
    GQAStrategy.REPLICATED_HEADS,
    GQAStrategy.ALL_GATHER_HEADS,
)


def test_llama_70b_tp24_pads_queries_to_72_and_kv_to_24():
    plan = build_sharding_plan(64, 8, 128, 24)
    assert plan.strategy is REP
    assert "not divisible by tp_degree=24" in plan.fallback_reason
    assert qkv_padding(64, 8, 24, REP) == (72, 24)
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (72, 24)
    assert (plan.query_heads_per_rank, plan.kv_heads_per_rank) == (3, 1)
    # One dummy query head at the end of each KV group of 8 (interleaved padding).
    assert plan.query_layout[:9] == (*range(8), DUMMY)
    assert plan.kv_layout == tuple(k for k in range(8) for _ in range(3))
    assert plan.ranks[2].query_heads == (6, 7, DUMMY)
    assert plan.ranks[3].query_heads == (8, 9, 10)
    assert [r.kv_heads for r in plan.ranks[:4]] == [(0,), (0,), (0,), (1,)]


def test_llama_70b_tp8_is_plain_shard_over_heads():
    plan = build_sharding_plan(64, 8, 128, 8)
    assert plan.strategy is SOH
    assert plan.fallback_reason is None
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (64, 8)
    assert (plan.query_heads_per_rank, plan.kv_heads_per_rank) == (8, 1)
    assert plan.ranks[5].query_heads == tuple(range(40, 48))
    assert plan.ranks[5].kv_heads == (5,)


def test_llama_70b_tp32_partial_replication_one_kv_head_per_rank():
    plan = build_sharding_plan(64, 8, 128, 32)
    assert plan.strategy is REP
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (64, 32)
    assert plan.ranks[7].query_heads == (14, 15)
    assert plan.ranks[7].kv_heads == (1,)


def test_library_docstring_example_72q_24kv_tp32_pads_kv_with_zero_heads():
    # utils.get_qkv_padding comment: TP = 32, Q heads = 72 (96 after padding), KV heads = 24.
    plan = build_sharding_plan(72, 24, 128, 32, "replicated-heads")
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (96, 32)
    assert plan.ranks[23].query_heads == (69, 70, 71) and plan.ranks[23].kv_heads == (23,)
    assert plan.ranks[24].query_heads == (DUMMY,) * 3 and plan.ranks[24].kv_heads == (DUMMY,)


def test_mha_pads_kv_heads_together_with_query_heads():
    plan = build_sharding_plan(40, 40, 128, 24)
    assert plan.strategy is SOH and plan.fallback_reason is None  # the library skips GQA for MHA
    assert plan.n_query_heads_padded == plan.n_kv_heads_effective == 48
    assert plan.kv_layout == plan.query_layout
    assert plan.ranks[19].query_heads == (38, 39) and plan.ranks[20].query_heads == (DUMMY, DUMMY)


def test_smollm_9q_3kv_tp4_zero_pads_the_fourth_kv_head():
    plan = build_sharding_plan(9, 3, 64, 4)
    assert plan.strategy is REP
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (12, 4)
    assert [r.query_heads for r in plan.ranks] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (DUMMY,) * 3]
    assert [r.kv_heads for r in plan.ranks] == [(0,), (1,), (2,), (DUMMY,)]


def test_smollm_9q_3kv_tp2_fully_replicates():
    plan = build_sharding_plan(9, 3, 64, 2)
    assert (plan.n_query_heads_padded, plan.n_kv_heads_effective) == (10, 10)
    assert plan.ranks[1].query_heads == (5, 6, 7, 8, DUMMY)
    assert plan.ranks[1].kv_heads == (1, 2, 2, 2, DUMMY)


def test_shard_over_batch_splits_rows_and_keeps_whole_heads():
    plan = build_sharding_plan(
        32, 8, 128, 8, "shard-over-batch", batch_size=16, n_layers=32, n_positions=4096
    )
    assert plan.strategy is SOB and plan.fallback_reason is None
    assert [r.batch_rows for r in plan.ranks[:2]] == [(0, 1), (2, 3)]
    assert all(r.kv_heads == tuple(range(8)) for r in plan.ranks)
    assert plan.ranks[3].kv_weight_columns == (384, 512)  # 8*128 columns, 128 per rank
    full_row = 2 * 32 * 4096 * 8 * 128 * 2
    assert plan.ranks[0].kv_cache_bytes_per_row == full_row
    assert plan.kv_bytes_per_row_per_core == full_row // 8
    assert plan.kv_cache_bytes_per_core(16) == 2 * full_row


def test_shard_over_batch_falls_back_to_heads_when_batch_not_divisible(caplog):
    with caplog.at_level(logging.WARNING, logger="neuron_lmi.parallel.gqa"):
        plan = build_sharding_plan(32, 8, 128, 8, "shard-over-batch", batch_size=6)
    assert plan.strategy is SOH
    assert "batch_size % tp_degree" in plan.fallback_reason
    assert "shard-over-batch -> shard-over-heads" in caplog.text
    assert all(r.batch_rows == tuple(range(6)) for r in plan.ranks)


def test_shard_over_batch_double_fallback_to_replicated():
    plan = build_sharding_plan(64, 8, 128, 24, "shard-over-batch", batch_size=4)
    assert plan.strategy is REP
    assert "batch_size" in plan.fallback_reason and "replicated" in plan.fallback_reason


def test_all_gather_heads_at_tp32_gathers_one_kv_head_per_rank():
    plan = build_sharding_plan(64, 8, 128, 32, "all-gather-heads")
    assert plan.strategy is AGH and plan.fallback_reason is None
    assert plan.ranks[5].kv_weight_columns == (160, 192)  # 1024 KV columns / 32 ranks
    assert plan.ranks[5].kv_heads == (1,)  # ranks 4..7 gather KV head 1
    assert plan.ranks[5].query_heads == (10, 11)


@pytest.mark.parametrize(
    ("heads", "tp", "expected", "words"),
    [
        ((64, 8, 128), 24, REP, "n_kv_heads*head_dim"),  # 1024 % 24
        ((9, 3, 64), 2, REP, "padding query heads"),  # 1 pad head over 3 KV heads
        ((9, 3, 64), 4, REP, "cannot gather whole KV heads"),  # our guard
        ((32, 8, 128), 3, REP, "n_kv_heads*head_dim"),
    ],
)
def test_all_gather_heads_fallbacks(heads, tp, expected, words):
    plan = build_sharding_plan(*heads, tp, "all-gather-heads")
    assert plan.strategy is expected
    assert words in plan.fallback_reason


def test_all_gather_heads_with_interleaved_query_padding():
    plan = build_sharding_plan(9, 3, 64, 24, "all-gather-heads")
    assert plan.strategy is AGH
    assert plan.query_layout[:8] == (0, 1, 2, *([DUMMY] * 5))
    assert [plan.ranks[r].kv_heads for r in (0, 7, 8, 23)] == [(0,), (0,), (1,), (2,)]


def test_explicit_replicated_heads_when_kv_divides_tp_keeps_kv_unreplicated():
    plan = build_sharding_plan(32, 8, 128, 8, "replicated-heads")
    assert plan.strategy is REP and plan.n_kv_heads_effective == 8
    plan = build_sharding_plan(32, 8, 128, 4, "replicated-heads")
    assert plan.n_kv_heads_effective == 32  # full replication: GQA becomes MHA


@pytest.mark.parametrize(
    ("heads", "strategy", "tp", "batch"),
    [(h, s, tp, b) for h, s, tp, b in itertools.product(HEADS.values(), STRATEGIES, TPS, (1, 7, 96))],
)
def test_every_plan_is_executable(heads, strategy, tp, batch):
    plan = build_sharding_plan(*heads, tp, strategy, batch_size=batch)
    plan.check_executable()
    n_q, n_kv, _ = heads
    assert plan.n_query_heads_padded % tp == 0 and plan.n_query_heads_padded >= n_q
    assert plan.n_kv_heads_effective % tp == 0 or plan.strategy is SOB
    if plan.strategy is not SOB:
        assert plan.n_kv_heads_effective >= n_kv
    assert (plan.fallback_reason is None) == (plan.strategy is (strategy or SOH))


@pytest.mark.parametrize(("name", "tp", "strategy"), list(itertools.product(HEADS, TPS, STRATEGIES)))
def test_split_attention_equals_unsplit(name, tp, strategy):
    n_q, n_kv, _ = HEADS[name]
    plan = build_sharding_plan(n_q, n_kv, 4, tp, strategy, batch_size=tp * 2)
    torch.testing.assert_close(_split_attention(plan), _reference_attention(plan), rtol=1e-5, atol=1e-5)


def test_resolve_strategy_default_and_mha():
    assert resolve_strategy(32, 8, 128, 8, None) == (SOH, None)
    assert resolve_strategy(40, 40, 128, 24, None) == (SOH, None)
    strategy, reason = resolve_strategy(40, 40, 128, 24, SOH)
    assert strategy is REP and "40" in reason  # explicit GQA config on MHA: the library warns


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"n_query_heads": 10, "n_kv_heads": 4}, "multiple of n_kv_heads"),
        ({"tp_degree": 0}, "tp_degree"),
        ({"head_dim": -1}, "head_dim"),
        ({"batch_size": 0}, "batch_size"),
        ({"strategy": "shard-over-rows"}, "shard-over-rows"),
        ({"n_positions": 0}, "n_positions"),
    ],
)
def test_invalid_inputs_raise_value_error(kwargs, words):
    args = {"n_query_heads": 32, "n_kv_heads": 8, "head_dim": 128, "tp_degree": 8} | kwargs
    with pytest.raises(ValueError, match=words):
        build_sharding_plan(**args)


def test_plan_is_frozen():
    plan = build_sharding_plan(32, 8, 128, 8)
    with pytest.raises(AttributeError):
        plan.tp_degree = 4  # type: ignore[misc]


# -- a tiny attention, split by the plan -----------------------------------------------------------

HIDDEN, TOKENS = 8, 5


def _weights(plan: ShardingPlan) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(plan.n_query_heads * 100 + plan.n_kv_heads)
    d = plan.head_dim
    shapes = {
        "x": (TOKENS, HIDDEN),
        "wq": (HIDDEN, plan.n_query_heads * d),
        "wk": (HIDDEN, plan.n_kv_heads * d),
        "wv": (HIDDEN, plan.n_kv_heads * d),
        "wo": (plan.n_query_heads * d, HIDDEN),
    }
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.T) / q.shape[-1] ** 0.5
    mask = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _head(w: torch.Tensor, h: int, d: int, dim: int) -> torch.Tensor:
    return w[:, h * d : (h + 1) * d] if dim == 1 else w[h * d : (h + 1) * d, :]


def _reference_attention(plan: ShardingPlan) -> torch.Tensor:
    w, d, x = _weights(plan), plan.head_dim, _weights(plan)["x"]
    out = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for h in range(plan.n_query_heads):
        k = plan.kv_head_of(h)
        q, key, val = x @ _head(w["wq"], h, d, 1), x @ _head(w["wk"], k, d, 1), x @ _head(w["wv"], k, d, 1)
        out += _attend(q, key, val) @ _head(w["wo"], h, d, 0)
    return out


def _split_attention(plan: ShardingPlan) -> torch.Tensor:
    """Each rank builds local weights from the plan alone (zeros for DUMMY heads), attends with the
    local KV slot holding its query head's KV head, and the partial o_proj outputs are summed."""
    w, d, x = _weights(plan), plan.head_dim, _weights(plan)["x"]

    def col(name: str, h: int) -> torch.Tensor:
        return _head(w[name], h, d, 1) if h != DUMMY else torch.zeros(HIDDEN, d, dtype=torch.float64)

    total = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for shard in plan.ranks:
        local_k = [x @ col("wk", k) for k in shard.kv_heads]
        local_v = [x @ col("wv", k) for k in shard.kv_heads]
        for h in shard.real_query_heads:
            slot = shard.kv_heads.index(plan.kv_head_of(h))
            total += _attend(x @ col("wq", h), local_k[slot], local_v[slot]) @ _head(w["wo"], h, d, 0)
    return total
