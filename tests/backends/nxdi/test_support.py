"""The Neuron SDK matrix and NxD Inference's CPU mode: what dispatch and the plan accept and refuse.

Pure decisions over hand-made probes and configurations (no Neuron package here); the real library
checks the same plans in tests/backends/nxdi_library.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_lmi.backends.dispatch import BackendProbe, BackendUnavailableError, choose_backend
from neuron_lmi.backends.nxdi.plan import plan_nxdi
from neuron_lmi.backends.nxdi.support import (
    Platform,
    UnsupportedReleaseError,
    check_release,
    host_platform,
    target_platform,
)
from tests.backends.nxdi.test_plan import LLAMA_3_8B, MISTRAL_7B, MIXTRAL_8X7B, plan_for

ON_CPU = 'option.override_neuron_config={"on_cpu": true}\n'


@pytest.mark.parametrize(
    ("version", "platform", "model_type", "refused"),
    [
        ("0.9.0", "trn1", "llama", "supports Trn2 and newer only"),
        ("0.9.0", "inf2", "mistral", "supports Trn2 and newer only"),
        ("0.9.0", "trn1n", "llama", "supports Trn2 and newer only"),
        ("0.10.1", "trn2", "mixtral", "has no mixtral"),
        ("0.9.0", "trn2", "llama", None),
        ("0.9.0", None, "llama", None),
        ("0.8.0", "trn1", "mixtral", None),
        ("0.8.0", "trn2", "mixtral", None),
        (None, "inf2", "llama", None),
    ],
)
def test_the_sdk_matrix(
    version: str | None, platform: str | None, model_type: str, refused: str | None
) -> None:
    if refused is None:
        check_release(version, platform, model_type)
        return
    with pytest.raises(UnsupportedReleaseError, match=refused) as info:
        check_release(version, platform, model_type)
    assert "Neuron SDK 2.28 (neuronx-distributed-inference 0.8.x)" in str(info.value)


def test_the_platform_from_the_override_or_the_instance_type(tmp_path: Path) -> None:
    dmi = tmp_path / "product_name"
    dmi.write_text("inf2.48xlarge\n", encoding="ascii")
    assert host_platform({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}, str(dmi)) == "trn2"
    assert host_platform({}, str(dmi)) == "inf2"
    dmi.write_text("m7i.large\n", encoding="ascii")
    assert host_platform({}, str(dmi)) is None
    assert host_platform({}, str(tmp_path / "absent")) is None


def test_the_release_decides_the_mapping(tmp_path: Path) -> None:
    props = "option.tensor_parallel_degree=8\noption.n_positions=4096\n"
    new, resolved = plan_for(tmp_path, MISTRAL_7B, props)
    assert new.library_version == "0.9.0" and new.application.application == "NeuronMistralForCausalLM"
    old = plan_nxdi(resolved.config, MISTRAL_7B, new.model_path, None, "0.8.0", "trn1")
    assert old.application.application == "NeuronLlamaForCausalLM"  # 0.8 has no models/mistral
    # The same keywords but one: 0.8's Llama application fuses Q/K/V weights, 0.9's Mistral does not.
    assert old.neuron_config == {**new.neuron_config, "fused_qkv": True}
    assert new.neuron_config["fused_qkv"] is False
    assert old.sliding_window == new.sliding_window is None  # a window of 4096 covers n_positions
    assert old.describe()["library_version"] == "0.8.0"
    assert (
        plan_nxdi(resolved.config, MISTRAL_7B, new.model_path, None, None, "inf2").library_version == "0.8.0"
    )
    with pytest.raises(UnsupportedReleaseError, match="Trn2 and newer"):
        plan_nxdi(resolved.config, MISTRAL_7B, new.model_path, None, "0.9.0", "inf2")


def test_an_override_only_0_9_knows_is_reported_on_0_8(tmp_path: Path) -> None:
    props = (
        'option.tensor_parallel_degree=8\noption.override_neuron_config={"enable_ve_data_parallel": true}\n'
    )
    plan, resolved = plan_for(tmp_path, LLAMA_3_8B, props)
    assert "override_neuron_config.enable_ve_data_parallel" not in plan.ignored
    old = plan_nxdi(resolved.config, LLAMA_3_8B, plan.model_path, None, "0.8.0", None)
    assert "NxD Inference 0.8.0" in old.ignored["override_neuron_config.enable_ve_data_parallel"]


def test_mixtral_is_planned_for_0_8_and_a_short_window_is_named(tmp_path: Path) -> None:
    windowed = {**MIXTRAL_8X7B, "sliding_window": 1024}
    plan, resolved = plan_for(
        tmp_path, windowed, "option.tensor_parallel_degree=32\noption.n_positions=2048\n"
    )
    assert plan.library_version == "0.8.0" and "last release with mixtral" in plan.version_source
    assert plan.sliding_window is None  # NxD Inference's Mixtral keeps no ring
    assert "attend to the whole sequence" in plan.ignored["config.json sliding_window"]
    with pytest.raises(UnsupportedReleaseError, match="has no mixtral"):
        plan_nxdi(resolved.config, windowed, plan.model_path, None, "0.9.0", "trn2")


def test_cpu_mode_plans_one_bucket_and_one_rank(tmp_path: Path) -> None:
    props = "option.tensor_parallel_degree=1\noption.n_positions=512\noption.dtype=bf16\n" + ON_CPU
    plan, _ = plan_for(tmp_path, LLAMA_3_8B, props)
    assert plan.on_cpu and plan.context_buckets == plan.token_buckets == (512,)
    assert plan.neuron_config["on_cpu"] is True


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        (
            "option.tensor_parallel_degree=8\noption.dtype=fp32\n",
            "option.tensor_parallel_degree=8 needs torchrun",
        ),
        (
            "option.tensor_parallel_degree=2\noption.dtype=bf16\n",
            "option.tensor_parallel_degree=2 needs torchrun",
        ),
        ("option.tensor_parallel_degree=1\noption.dtype=fp16\n", "refuses option.dtype=fp16"),
    ],
)
def test_cpu_mode_refusals_name_the_key(tmp_path: Path, properties: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_for(tmp_path, LLAMA_3_8B, properties + ON_CPU)


def test_dispatch_takes_the_cpu_mode_without_devices() -> None:
    cpu_host = BackendProbe(nxdi_version="0.8.0", neuron_platform="trn1")
    choice = choose_backend("neuron", cpu_host, None, nxdi_on_cpu=True)
    assert choice.name == "neuron-nxdi" and "no Neuron devices used" in choice.reason
    assert choose_backend("auto", cpu_host, "nxdi", nxdi_on_cpu=True).name == "neuron-nxdi"
    assert choose_backend("auto", cpu_host, None, nxdi_on_cpu=True).name == "cpu"
    with pytest.raises(BackendUnavailableError, match="no Neuron devices"):
        choose_backend("neuron", cpu_host, None)  # without on_cpu: the refusal of before
    with pytest.raises(BackendUnavailableError, match="does not import"):
        choose_backend("neuron", BackendProbe(), None, nxdi_on_cpu=True)
    with pytest.raises(BackendUnavailableError, match=r"pin Neuron SDK 2\.28"):
        choose_backend(
            "neuron", BackendProbe(nxdi_version="0.9.0", neuron_platform="trn1"), None, nxdi_on_cpu=True
        )


def test_dispatch_refuses_0_9_on_an_inf2_host() -> None:
    inf2 = BackendProbe(neuron_devices=12, nxdi_version="0.9.0", neuron_platform="inf2")
    with pytest.raises(BackendUnavailableError, match="supports Trn2 and newer only"):
        choose_backend("neuron", inf2)
    trn2 = BackendProbe(neuron_devices=16, nxdi_version="0.9.0", neuron_platform="trn2")
    assert choose_backend("neuron", trn2).name == "neuron-nxdi"


def test_cpu_mode_runs_one_rank_for_max() -> None:
    from neuron_lmi.backends.dispatch import resolve_tp_degree

    cpu_host = BackendProbe(nxdi_version="0.9.0")
    assert resolve_tp_degree("max", "neuron-nxdi", cpu_host, {}, nxdi_on_cpu=True) == (
        1,
        "max: NxD Inference's CPU mode runs one rank",
    )
    with pytest.raises(BackendUnavailableError, match="no NeuronCores are visible"):
        resolve_tp_degree("max", "neuron-nxdi", cpu_host, {})


def test_an_explicit_key_lets_0_9_start_on_inf2_trn1_with_a_warning() -> None:
    warning = check_release("0.9.0", "trn1", "llama", allow_unsupported_platform=True)
    assert warning is not None
    assert "option.allow_unsupported_nxdi_on_inf2_trn1" in warning and "NKI kernels" in warning
    assert check_release("0.9.0", "trn2", "llama", allow_unsupported_platform=True) is None
    with pytest.raises(UnsupportedReleaseError, match="has no mixtral"):  # the key does not reach it
        check_release("0.9.0", "inf2", "mixtral", allow_unsupported_platform=True)
    with pytest.raises(UnsupportedReleaseError, match="supports Trn2 and newer only") as info:
        check_release("0.9.0", "inf2", "llama")
    assert "option.allow_unsupported_nxdi_on_inf2_trn1=true" in str(info.value)  # how to proceed


def test_the_key_reaches_dispatch_and_the_start_up_warning(tmp_path: Path) -> None:
    inf2 = BackendProbe(neuron_devices=12, nxdi_version="0.9.0", neuron_platform="inf2")
    choice = choose_backend("neuron", inf2, None, allow_unsupported_platform=True)
    assert choice.name == "neuron-nxdi"
    props = "option.tensor_parallel_degree=8\noption.allow_unsupported_nxdi_on_inf2_trn1=true\n"
    plan, resolved = plan_for(tmp_path, LLAMA_3_8B, props)
    allowed = plan_nxdi(resolved.config, LLAMA_3_8B, plan.model_path, None, "0.9.0", "inf2")
    assert len(allowed.warnings) == 1 and "no longer supports NKI kernels" in allowed.warnings[0]
    assert allowed.describe()["warnings"] == list(allowed.warnings)
    with pytest.raises(UnsupportedReleaseError, match="has no mixtral"):
        plan_nxdi(resolved.config, MIXTRAL_8X7B, plan.model_path, None, "0.9.0", "inf2")


def test_the_platform_key_wins_and_contradictions_name_it(tmp_path: Path) -> None:
    dmi = tmp_path / "product_name"
    dmi.write_text("trn1.32xlarge\n", encoding="ascii")
    override = {"NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}
    assert target_platform("inf2", override, dmi_product=str(dmi)) == Platform(
        "inf2", "option.neuron_platform"
    )
    assert target_platform(None, override, dmi_product=str(dmi)) == Platform(
        "inf2", "NEURON_PLATFORM_TARGET_OVERRIDE"
    )
    assert target_platform(None, {}, dmi_product=str(dmi)) == Platform("trn1", "instance type trn1.32xlarge")
    assert target_platform(None, {}, dmi_product=str(tmp_path / "absent")).name is None
    with pytest.raises(ValueError, match="--platform=trn2 contradicts NEURON_PLATFORM_TARGET_OVERRIDE=inf2"):
        target_platform("trn2", override, key="--platform", dmi_product=str(dmi))
    # A compile may target another chip than its build host; a server may not.
    assert target_platform("inf2", {}, dmi_product=str(dmi)).name == "inf2"
    with pytest.raises(ValueError, match=r"option\.neuron_platform=inf2, but this host is a trn1\.32xlarge"):
        target_platform("inf2", {}, serving=True, dmi_product=str(dmi))


def test_the_release_follows_the_platform_and_says_why(tmp_path: Path) -> None:
    _, resolved = plan_for(tmp_path, LLAMA_3_8B, "option.tensor_parallel_degree=8\n")
    for chip, version in (("inf2", "0.8.0"), ("trn1", "0.8.0"), ("trn2", "0.9.0"), ("trn3", "0.9.0")):
        planned = plan_nxdi(
            resolved.config, LLAMA_3_8B, str(tmp_path), None, None, Platform(chip, "--platform")
        )
        assert planned.library_version == version
        assert planned.version_source.startswith(f"not installed; inferred from platform {chip} (--platform)")
        assert (planned.platform, planned.platform_source) == (chip, "--platform")
    given = plan_nxdi(
        resolved.config,
        LLAMA_3_8B,
        str(tmp_path),
        None,
        "0.9",
        Platform("trn2", "--platform"),
        "--nxdi-version",
    )
    assert (given.library_version, given.version_source) == ("0.9", "--nxdi-version")


def test_the_probe_takes_the_platform_key(tmp_path: Path) -> None:
    from neuron_lmi.backends.host import probe_host

    absent = str(tmp_path / "none*")
    probe = probe_host("cpu", dev_glob=absent, env={}, nvidia_glob=absent, neuron_platform="trn1")
    assert probe.neuron_platform == "trn1"
    overridden = probe_host(
        "cpu", dev_glob=absent, env={"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}, nvidia_glob=absent
    )
    assert overridden.neuron_platform == "trn2"
