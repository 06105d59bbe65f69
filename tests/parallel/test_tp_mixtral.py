"""Mixtral under CPU tensor parallelism: experts split inside (w1/w3 rows, w2 columns), router
replicated, partial sums all-reduced; tokens and logits as at tp=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from neuron_lmi.models import MixtralForCausalLM, build_model
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.models.mixtral import MixtralDecoderLayer
from neuron_lmi.parallel import GQAStrategy
from neuron_lmi.parallel.tp_model import apply_tensor_parallel
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

from .test_tp_model import N_POSITIONS, N_ROWS, one_thread, run_scenario  # noqa: F401 (autouse fixture)

TP_DEGREES = (1, 2, 4)
INTERMEDIATE = 42  # not a multiple of 4: tp=4 pads each expert's slice (11 rows, the last 9 real)
VARIANTS = {"4-experts": {}, "8-experts-window-6": {"num_local_experts": 8, "sliding_window": 6}}


@pytest.fixture(scope="module")
def mixtral_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    common = {"intermediate_size": INTERMEDIATE, "num_hidden_layers": 2}
    return {
        name: make_tiny_checkpoint(
            tmp_path_factory.mktemp(name), "mixtral", seed=21 + i, **common, **overrides
        )
        for i, (name, overrides) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def base_models(mixtral_dirs: dict[str, Path]) -> dict[str, MixtralForCausalLM]:
    models = {}
    for name, path in mixtral_dirs.items():
        ckpt = load_checkpoint(path, dtype=torch.float32)
        models[name] = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    return models


@pytest.mark.parametrize("strategy", [None, *(s.value for s in GQAStrategy)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixtral_tp_matches_tp1(base_models, variant: str, strategy: str | None) -> None:
    base = base_models[variant]
    ref_tokens, ref_logits, _ = run_scenario(base)
    for tp in TP_DEGREES:
        model = apply_tensor_parallel(base, tp, strategy, batch_size=N_ROWS)
        tokens, logits, _ = run_scenario(model)
        assert tokens == ref_tokens, f"tp={tp} {model.plan.strategy}"
        assert (logits - ref_logits).abs().max().item() < 1e-4, f"tp={tp} {model.plan.strategy}"


def test_experts_are_split_by_intermediate_rows_and_router_replicated(base_models) -> None:
    base = base_models["4-experts"]
    src = base.layers[0]
    assert isinstance(src, MixtralDecoderLayer)
    ranks = apply_tensor_parallel(base, 4).layers[0].ranks
    rows = -(-INTERMEDIATE // 4)  # ceil: 11 rows per rank, the last rank 9 real + 2 zero
    w1, w3 = src.experts_gate_up.split(INTERMEDIATE, dim=1)
    real_w1, real_w3, real_w2 = [], [], []
    for r, rank in enumerate(ranks):
        assert isinstance(rank, MixtralDecoderLayer) and rank.router is src.router
        assert rank.experts_gate_up.shape == (4, 2 * rows, base.args.hidden_size)
        assert rank.experts_down.shape == (4, base.args.hidden_size, rows)
        n = min((r + 1) * rows, INTERMEDIATE) - r * rows
        gate, up = rank.experts_gate_up.split(rows, dim=1)
        real_w1.append(gate[:, :n])
        real_w3.append(up[:, :n])
        real_w2.append(rank.experts_down[:, :, :n])
        assert not gate[:, n:].any() and not up[:, n:].any() and not rank.experts_down[:, :, n:].any()
    # Each real row/column of every expert lives on exactly one rank, in order.
    assert torch.equal(torch.cat(real_w1, dim=1), w1) and torch.equal(torch.cat(real_w3, dim=1), w3)
    assert torch.equal(torch.cat(real_w2, dim=2), src.experts_down)


def test_llm_serves_mixtral_at_tp2_like_tp1(mixtral_dirs: dict[str, Path]) -> None:
    """The engine path (``backends/cpu/engine.py``): ``LLM(..., tensor_parallel_degree=2)`` on Mixtral."""
    from neuron_lmi.backends.cpu.llm import LLM
    from neuron_lmi.engine.types import SamplingParams

    prompts = [[5, 6, 7, 8], list(range(100, 117))]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outputs = []
    for tp in (1, 2):
        llm = LLM(
            str(mixtral_dirs["8-experts-window-6"]), dtype="fp32", enforce_eager=True,
            max_rolling_batch_size=4, n_positions=64, tensor_parallel_degree=tp,
        )  # fmt: skip
        outputs.append([c.token_ids for c in llm.generate(prompts, params)])
    assert outputs[1] == outputs[0]
