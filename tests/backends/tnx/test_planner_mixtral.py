"""Planner on Mixtral-8x7B (all experts counted, split over tp) and trn2.48xlarge (24 GiB per core)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_lmi.backends.tnx.planner import ideal_weight_bytes_per_core, plan_all_instances, plan_instance
from neuron_lmi.cli import main
from neuron_lmi.parallel.catalog import (
    GIB,
    INSTANCES,
    PRESETS,
    get_instance,
    load_model_spec,
    model_spec_from_config,
)
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

# config.json of mistralai/Mixtral-8x7B-v0.1 (the fields the planner reads).
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 32768, "sliding_window": None, "rope_theta": 1e6,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}  # fmt: skip


def _plan(instance: str, **kwargs):
    return plan_instance(load_model_spec("mistralai/Mixtral-8x7B-v0.1"), get_instance(instance), **kwargs)


def test_preset_is_the_published_config_and_counts_46_7b_parameters() -> None:
    preset = PRESETS["mixtral-8x7b"]
    assert model_spec_from_config(MIXTRAL_8X7B_CONFIG, name="mixtral-8x7b") == preset
    assert (preset.n_experts, preset.experts_per_token) == (8, 2)
    embedding = 32000 * 4096  # stays on the host, so not in the device weights
    assert ideal_weight_bytes_per_core(preset, 1, 1) + embedding == 46_702_792_704  # "46.7B parameters"


@pytest.mark.parametrize(
    ("instance", "tp"),
    [("inf2.xlarge", None), ("inf2.48xlarge", 8), ("trn1.32xlarge", 8), ("trn2.48xlarge", 8)],
)
def test_mixtral_8x7b_fits_where_its_weights_do(instance: str, tp: int | None) -> None:
    plan = _plan(instance)
    assert plan.recommended_tp == tp, plan.reason
    if tp is None:
        assert "weights alone need 43.4 GiB per core" in plan.reason


def test_weights_per_core_are_the_total_over_tp_with_every_expert() -> None:
    plan = _plan("trn1.32xlarge")
    by_tp = {o.tp_degree: o for o in plan.options}
    experts = 32 * 8 * 3 * 4096 * 14336 * 2  # every layer's 8 experts, fp16
    for tp in (1, 2, 8):
        assert by_tp[tp].expert_weight_bytes_per_core == experts // tp
        assert by_tp[tp].weight_bytes_per_core == by_tp[tp].ideal_weight_bytes_per_core  # 8 KV heads divide
    # At tp=32 KV heads are replicated 4x (padding) but the experts still split 32 ways.
    assert by_tp[32].expert_weight_bytes_per_core == experts // 32 and by_tp[32].padding_bytes_per_core > 0


def test_memory_per_core_belongs_to_the_instance() -> None:
    assert INSTANCES["trn2.48xlarge"].hbm_bytes_per_core == 24 * GIB
    assert INSTANCES["trn2.48xlarge"].tp_degrees == (1, 2, 4, 8, 16, 32, 64)
    assert INSTANCES["trn2.48xlarge"].hbm_bytes == 1536 * GIB  # 16 chips x 96 GiB
    assert INSTANCES["inf2.48xlarge"].hbm_bytes_per_core == 16 * GIB
    trn2, inf2 = _plan("trn2.48xlarge"), _plan("inf2.48xlarge")
    assert trn2.budget_bytes_per_core == int(24 * GIB * 0.9) and inf2.budget_bytes_per_core == int(
        16 * GIB * 0.9
    )
    # Same weights and KV row at tp=8, more rows in the larger core.
    assert trn2.recommended.max_rows > inf2.recommended.max_rows
    assert [p.instance for p in plan_all_instances(PRESETS["mixtral-8x7b"])][-1] == "trn2.48xlarge"


def test_mixtral_config_json_and_tiny_checkpoint_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    assert load_model_spec(str(tmp_path)).n_experts == 8
    tiny = load_model_spec(str(make_tiny_checkpoint(tmp_path / "tiny", "mixtral")))
    assert (tiny.n_experts, tiny.experts_per_token) == (4, 2)
    assert plan_instance(tiny, get_instance("inf2.xlarge")).recommended_tp == 2


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_local_experts": None}, "lacks num_local_experts"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_inconsistent_mixtral_configs_are_rejected(change: dict, words: str) -> None:
    config = {k: v for k, v in (MIXTRAL_8X7B_CONFIG | change).items() if v is not None}
    with pytest.raises(ValueError, match=words):
        model_spec_from_config(config)


def test_plan_command_says_does_not_fit_on_inf2_xlarge(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "mixtral-8x7b", "--instance", "inf2.xlarge"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "experts/core" in out


def test_plan_command_compares_instances(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("inf2.", "trn"))}
    assert "does not fit" in " ".join(rows["inf2.xlarge"])
    for instance in ("inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge"):
        assert rows[instance][3] == "8", rows[instance]
    assert main(["plan", "--model", "mixtral-8x7b", "--instance", "trn2.48xlarge"]) == 0
    assert "64 NeuronCores x 24 GiB" in capsys.readouterr().out
