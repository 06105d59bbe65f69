"""``neuron-lmi plan`` through the real CLI entry point: tables, JSON and exit statuses."""

from __future__ import annotations

import json

import pytest

from neuron_lmi.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_single_instance_table(capsys):
    code, out, _ = _run(capsys, "--model", "llama-2-70b", "--instance", "inf2.48xlarge", "--dtype", "fp16")
    assert code == 0
    assert "llama-2-70b on inf2.48xlarge (24 NeuronCores" in out
    assert "72/24" in out and "replicated-heads" in out
    assert "recommendation: tp=24" in out
    for strategy in ("shard-over-heads", "shard-over-batch", "replicated-heads", "all-gather-heads"):
        assert strategy in out


def test_single_instance_json(capsys):
    code, out, _ = _run(
        capsys, "--model", "mistral-7b", "--instance", "inf2.48xlarge", "--dtype", "bf16", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert data["recommended_tp"] == 8
    tp8 = next(o for o in data["options"] if o["tp_degree"] == 8)
    assert tp8["replicas"] == 3 and tp8["fits"] is True


def test_all_instances_comparison(capsys):
    code, out, _ = _run(capsys, "--model", "llama-2-70b")
    assert code == 0
    lines = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.startswith(("inf2.", "trn1.")) and ":" not in line
    }
    assert "does not fit" in lines["inf2.xlarge"]
    assert lines["inf2.48xlarge"].split()[3] == "24"
    assert lines["trn1.32xlarge"].split()[3] == "32"


def test_all_instances_json(capsys):
    code, out, _ = _run(capsys, "--model", "llama-2-7b", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"] == "llama-2-7b"
    assert {p["instance"]: p["recommended_tp"] for p in data["instances"]}["inf2.24xlarge"] == 8


def test_does_not_fit_exits_1_with_clear_message(capsys):
    code, out, _ = _run(capsys, "--model", "llama-2-70b", "--instance", "inf2.xlarge")
    assert code == 1
    assert "DOES NOT FIT" in out and "64.0 GiB per core" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--model", "gpt-5"), "neither a preset"),
        (("--model", "mistral-7b", "--instance", "inf2.4xlarge"), "unknown instance"),
        (("--model", "llama-2-7b", "--n-positions", "8192"), "max_position_embeddings"),
        (("--model", "llama-2-7b", "--batch-size", "0"), "batch_size"),
    ],
)
def test_bad_inputs_exit_2(capsys, argv, words):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert "neuron-lmi plan: error:" in err and words in err


def test_unknown_dtype_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "llama-2-7b", "--dtype", "int8"])
    assert exc.value.code == 2


def test_a_platform_limits_the_instances_and_names_the_release(capsys, monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    code, out, _ = _run(capsys, "--model", "llama-2-70b", "--platform", "trn1")
    assert code == 0
    assert out.startswith("platform trn1 (--platform); NxD Inference 0.8.0 (not installed; inferred from")
    assert "trn1.32xlarge" in out and "inf2.48xlarge" not in out and "trn2.48xlarge" not in out
    code, out, _ = _run(capsys, "--model", "llama-2-70b", "--platform", "trn2", "--json")
    data = json.loads(out)
    assert data["nxd_inference"]["library_version"] == "0.9.0"
    assert [p["instance"] for p in data["instances"]] == ["trn2.48xlarge"]
    code, out, _ = _run(capsys, "--model", "mixtral-8x7b", "--platform", "trn2")
    assert code == 0 and "NxD Inference 0.8.0 (assumed: not installed, the last release with mixtral)" in out
    # A MoE model that is not Mixtral is asked of the matrix as itself: Qwen3-MoE runs on 0.9.
    code, out, _ = _run(capsys, "--model", "qwen3-30b-a3b", "--platform", "trn2")
    assert code == 0 and "NxD Inference 0.9.0" in out and "mixtral" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--model", "mixtral-8x7b", "--platform", "trn2", "--nxdi-version", "0.9"), "has no mixtral"),
        (("--model", "llama-2-70b", "--platform", "inf2", "--nxdi-version", "0.9"), "Trn2 and newer only"),
        (("--model", "llama-2-70b", "--platform", "trn3"), "no trn3 instance"),
        (("--model", "gemma-3-27b", "--platform", "inf2"), "has no gemma3 application"),
        (
            ("--model", "llama-2-70b", "--platform", "trn1", "--instance", "inf2.xlarge"),
            "not a trn1 instance",
        ),
    ],
)
def test_what_the_platform_rules_out_exits_2(capsys, monkeypatch, argv, message):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err


def test_an_unknown_platform_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "llama-2-70b", "--platform", "inf3"])
    assert info.value.code == 2
    assert "--platform" in capsys.readouterr().err
