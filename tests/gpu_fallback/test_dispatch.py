"""Backend dispatch: the choice is a pure function of the request and a supplied host probe."""

from __future__ import annotations

import pytest

from neuron_lmi.backends.dispatch import (
    BackendProbe,
    BackendUnavailableError,
    choose_backend,
    probe_host,
    requested_from_lmi,
)

NEURON_HOST = BackendProbe(neuron_devices_present=True, neuron_library_importable=True)
CUDA_HOST = BackendProbe(cuda_available=True, vllm_importable=True, vllm_platform="cuda")
CUDA_NO_VLLM = BackendProbe(cuda_available=True)
LAPTOP = BackendProbe()
VLLM_CPU_BUILD = BackendProbe(vllm_importable=True, vllm_platform="cpu")


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (NEURON_HOST, "neuron"),
        (CUDA_HOST, "vllm"),
        (CUDA_NO_VLLM, "cpu"),
        (LAPTOP, "cpu"),
        # vLLM's CPU build runs only when asked for: on CPU the reference engine stays the default.
        (VLLM_CPU_BUILD, "cpu"),
        # Devices without the library (or the reverse) are not a Neuron host.
        (BackendProbe(neuron_devices_present=True), "cpu"),
        (BackendProbe(neuron_library_importable=True, cuda_available=True, vllm_importable=True), "vllm"),
        # Neuron wins on a host that somehow has both.
        (BackendProbe(True, True, True, True, "cuda"), "neuron"),
    ],
)
def test_auto(probe: BackendProbe, expected: str) -> None:
    choice = choose_backend("auto", probe)
    assert choice.name == expected
    assert choice.reason.startswith("auto:")
    assert "CUDA" in choice.reason  # the log line says what was found


@pytest.mark.parametrize(
    ("requested", "probe", "missing"),
    [
        ("neuron", LAPTOP, "no Neuron devices"),
        ("neuron", BackendProbe(neuron_devices_present=True), "no importable Neuron library"),
        ("vllm", LAPTOP, "vLLM does not import"),
        ("vllm", CUDA_NO_VLLM, "vLLM does not import"),
        ("vllm", BackendProbe(vllm_importable=True, vllm_platform="cuda"), "no CUDA device"),
    ],
)
def test_forced_backend_that_cannot_run(requested: str, probe: BackendProbe, missing: str) -> None:
    with pytest.raises(BackendUnavailableError, match=missing) as info:
        choose_backend(requested, probe)
    assert f"backend '{requested}'" in str(info.value)


@pytest.mark.parametrize(
    ("requested", "probe"),
    [
        ("cpu", NEURON_HOST),
        ("cpu", CUDA_HOST),
        ("neuron", NEURON_HOST),
        ("vllm", CUDA_HOST),
        ("vllm", VLLM_CPU_BUILD),
        ("VLLM", CUDA_HOST),
    ],
)
def test_forced_backend_that_can_run(requested: str, probe: BackendProbe) -> None:
    choice = choose_backend(requested, probe)
    assert choice.name == requested.lower()
    assert choice.reason.startswith("forced")


def test_unknown_backend_names_the_value() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        choose_backend("tpu", LAPTOP)


@pytest.mark.parametrize(
    ("backend", "rolling_batch", "engine", "expected"),
    [
        (None, None, None, "auto"),
        (None, "vllm", "Python", "vllm"),
        (None, "lmi-dist", "MPI", "vllm"),
        (None, "tnx", "Python", "neuron"),
        (None, "auto", None, "auto"),
        (None, "disable", None, "auto"),
        ("cpu", None, None, "cpu"),
        ("auto", "tnx", None, "neuron"),
        ("vllm", "vllm", "MPI", "vllm"),
        ("cpu", "auto", None, "cpu"),
    ],
)
def test_lmi_selectors(backend, rolling_batch, engine, expected) -> None:
    assert requested_from_lmi(backend, rolling_batch, engine) == expected


def test_lmi_selectors_then_dispatch() -> None:
    assert choose_backend(requested_from_lmi(rolling_batch="vllm"), CUDA_HOST).name == "vllm"
    with pytest.raises(BackendUnavailableError, match="vLLM"):
        choose_backend(requested_from_lmi(rolling_batch="vllm"), LAPTOP)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rolling_batch": "trtllm"}, "option.rolling_batch must be one of"),
        ({"engine": "DeepSpeed"}, "engine must be Python or MPI"),
        ({"backend": "cpu", "rolling_batch": "vllm"}, "conflicts with option.rolling_batch=vllm"),
        ({"backend": "gpu"}, "'gpu'"),
    ],
)
def test_lmi_selector_errors(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        requested_from_lmi(**kwargs)


def test_probe_host_never_raises_and_reads_device_glob(tmp_path) -> None:
    (tmp_path / "neuron0").touch()
    probe = probe_host(dev_glob=str(tmp_path / "neuron*"))
    assert probe.neuron_devices_present
    # No Neuron library in this environment: a Neuron-less host must fall back, not crash.
    if not probe.neuron_library_importable:
        assert choose_backend("auto", probe).name in ("cpu", "vllm")
    assert not probe_host(dev_glob=str(tmp_path / "nothing*")).neuron_devices_present
