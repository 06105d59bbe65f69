"""CPU tensor parallelism under every GQA strategy: same tokens and logits as tp=1, caches as planned.

Geometries are chosen so the tp degrees {1, 2, 3, 4, 8} hit query-head padding (6 q at tp 4, 8 q at
tp 3, 12 q at tp 8), KV replication (2 KV heads at tp 4/8), uneven MLP splits (intermediate 40 at
tp 3) and the library's fallbacks (shard-over-batch with 8 rows at tp 3, all-gather with
n_kv*head_dim not divisible by tp, n_kv % tp != 0 -> replicated-heads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.models import build_model
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.parallel import DUMMY, GQAStrategy, build_sharding_plan
from neuron_lmi.parallel.tp_model import ShardedKVCache, apply_tensor_parallel, plan_for_model

TP_DEGREES = (1, 2, 3, 4, 8)
N_ROWS, N_POSITIONS = 8, 32
GEOMETRIES = {  # name: (arch, query heads, KV heads, hidden size)
    "llama-4q-2kv": ("llama", 4, 2, 32),
    "llama-6q-2kv": ("llama", 6, 2, 48),
    "mistral-8q-8kv": ("mistral", 8, 8, 32),
    "mistral-12q-4kv": ("mistral", 12, 4, 48),
}


def write_tiny_checkpoint(out: Path, arch: str, n_q: int, n_kv: int, hidden: int) -> Path:
    """A random HF checkpoint without a tokenizer (these tests feed token ids), small vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    fields = dict(
        vocab_size=128, hidden_size=hidden, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=n_q, num_key_value_heads=n_kv, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "mistral":
        config, cls = MistralConfig(**fields, sliding_window=6), MistralForCausalLM
    else:
        config, cls = LlamaConfig(**fields), LlamaForCausalLM
    torch.manual_seed(n_q * 10 + n_kv)
    model = cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # well-separated greedy choices
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: intra-op threads only contend (tens of times slower on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LlamaForCausalLM]:
    models = {}
    for name, geometry in GEOMETRIES.items():
        path = write_tiny_checkpoint(tmp_path_factory.mktemp(name), *geometry)
        ckpt = load_checkpoint(path, dtype=torch.float32)
        models[name] = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    return models


def run_scenario(model: LlamaForCausalLM) -> tuple[list[list[int]], torch.Tensor, CpuRunner]:
    """Three prompts in scattered rows, two decode steps, one leaves and a new one joins its row."""
    runner = CpuRunner(model, N_ROWS, N_POSITIONS, context_buckets=[4, 8, 16])
    for _ in range(N_ROWS):
        runner.rows.allocate()
    rows, prompts = [1, 3, 6], [[5, 6, 7], list(range(20, 30)), [9, 8, 7, 6, 5]]
    logits = [runner.prefill(rows, prompts)]
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(2):
        logits.append(runner.decode(rows, tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    runner.rows.remove(3)
    runner.rows.allocate()  # row 3 again: the new prompt overwrites what is left there
    joined = runner.prefill([3], [[11, 12, 13, 14, 15, 16, 17]])
    step = [tokens[-1][0], int(joined.argmax()), tokens[-1][2]]
    for _ in range(2):
        logits.append(runner.decode(rows, step))
        step = logits[-1].argmax(-1).tolist()
        tokens.append(step)
    return tokens, torch.cat(logits), runner


@pytest.fixture(scope="module")
def references(base_models: dict[str, LlamaForCausalLM]) -> dict[str, tuple]:
    return {name: run_scenario(model) for name, model in base_models.items()}


def assert_cache_follows_plan(cache: ShardedKVCache, ref: CpuRunner, plan_rows: list[int]) -> None:
    """Every rank holds exactly its planned KV heads (zeros for padding) for the rows it stores."""
    plan = cache.plan
    for shard, rank_cache in zip(plan.ranks, cache.ranks, strict=True):
        assert rank_cache.n_kv_heads == len(shard.kv_heads)
        for row in plan_rows:
            length = ref.rows.length(row)
            if cache.placement.split:
                if row not in shard.batch_rows:
                    continue
                local = shard.batch_rows.index(row)
            else:
                local = row
            for slot, source in enumerate(shard.kv_heads):
                got = rank_cache.k[:, local, slot, :length]
                want = torch.zeros_like(got) if source == DUMMY else ref.cache.k[:, row, source, :length]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", [s.value for s in GQAStrategy])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_tp_matches_tp1_and_caches_follow_the_plan(
    base_models, references, geometry: str, strategy: str
) -> None:
    base = base_models[geometry]
    ref_tokens, ref_logits, ref_runner = references[geometry]
    for tp in TP_DEGREES:
        model = apply_tensor_parallel(base, tp, strategy, batch_size=N_ROWS)
        tokens, logits, runner = run_scenario(model)
        assert tokens == ref_tokens, f"tp={tp} {model.plan.strategy}"
        assert (logits - ref_logits).abs().max().item() < 1e-4, f"tp={tp} {model.plan.strategy}"
        cache = runner.cache
        assert isinstance(cache, ShardedKVCache)
        assert_cache_follows_plan(cache, ref_runner, [1, 3, 6])
        # Bytes: what the planner's plan (sized for this cache) says each rank/core stores.
        plan = plan_for_model(base, tp, strategy, batch_size=N_ROWS, n_positions=N_POSITIONS)
        assert (plan.strategy, plan.kv_layout) == (model.plan.strategy, model.plan.kv_layout)
        for shard, nbytes in zip(plan.ranks, cache.rank_nbytes(), strict=True):
            held = len(shard.batch_rows) if cache.placement.split else N_ROWS
            assert nbytes == shard.kv_cache_bytes_per_row * held
        assert max(cache.rank_nbytes()) == plan.kv_cache_bytes_per_core(N_ROWS)


def test_geometries_cover_padding_replication_and_fallbacks() -> None:
    seen = set()
    for _, n_q, n_kv, hidden in GEOMETRIES.values():
        for strategy in GQAStrategy:
            for tp in TP_DEGREES:
                plan = build_sharding_plan(n_q, n_kv, hidden // n_q, tp, strategy, N_ROWS, log_fallback=False)
                seen.add(("padding", plan.n_query_heads_padded > n_q))
                seen.add(("replication", plan.n_kv_heads_effective > n_kv))
                seen.add(("fallback", plan.fallback_reason is not None))
                seen.add(("rows split", plan.strategy is GQAStrategy.SHARD_OVER_BATCH and tp > 1))
    assert {(kind, True) for kind in ("padding", "replication", "fallback", "rows split")} <= seen


def test_shard_over_batch_needs_the_planned_rows(base_models) -> None:
    model = apply_tensor_parallel(base_models["llama-4q-2kv"], 2, "shard-over-batch", batch_size=4)
    with pytest.raises(ValueError, match="planned for 4 KV rows"):
        model.make_cache(8, N_POSITIONS)
    with pytest.raises(ValueError, match="positive integer"):
        apply_tensor_parallel(base_models["llama-4q-2kv"], 0)


def test_llm_with_tensor_parallel_degree_matches_tp1(tiny_llama_dir: Path) -> None:
    """The engine path (``backends/cpu/engine.py``): ``LLM(..., tensor_parallel_degree=2)`` gives tp=1's
    tokens."""
    from neuron_lmi.backends.cpu.llm import LLM
    from neuron_lmi.engine.types import SamplingParams

    prompts = [[5, 6, 7, 8], list(range(100, 117))]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = []
    for tp, gqa in ((1, None), (2, "shard-over-batch"), (4, "replicated-heads")):
        llm = LLM(
            str(tiny_llama_dir), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=64,
            tensor_parallel_degree=tp, group_query_attention=gqa,
        )  # fmt: skip
        outputs.append([c.token_ids for c in llm.generate(prompts, params)])
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
