"""Backend dispatch: the choice is a pure function of the request and a supplied host probe; the probe
itself never initialises CUDA."""

from __future__ import annotations

import sys
import types

import pytest

from neuron_lmi.backends.dispatch import (
    BackendProbe,
    BackendUnavailableError,
    choose_backend,
    probe_host,
    requested_from_lmi,
    resolve_tp_degree,
)
from neuron_lmi.backends.host import (
    cuda_device_count,
    parse_core_list,
    visible_gpu_count,
    visible_neuron_cores,
)

SDK_2_26 = BackendProbe(neuron_devices=12, nxdi_version="0.9.0")  # NxD Inference only
SDK_2_20 = BackendProbe(neuron_devices=12, tnx_version="0.13.0")  # transformers-neuronx only
SDK_2_24 = BackendProbe(neuron_devices=12, nxdi_version="0.3.0", tnx_version="0.13.0")
VLLM_NEURON_HOST = BackendProbe(
    neuron_devices=16, nxdi_version="0.6.0", vllm_neuron_version="0.2.0", vllm_importable=True
)
NEURON_NO_LIBRARY = BackendProbe(neuron_devices=1)
CUDA_HOST = BackendProbe(cuda_devices=4, vllm_importable=True, vllm_platform="cuda")
CUDA_NO_VLLM = BackendProbe(cuda_devices=1)
LAPTOP = BackendProbe()
VLLM_CPU_BUILD = BackendProbe(vllm_importable=True, vllm_platform="cpu")


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        (SDK_2_26, "neuron-nxdi"),
        (SDK_2_20, "neuron-tnx"),
        (SDK_2_24, "neuron-nxdi"),  # both: NxD Inference wins
        (CUDA_HOST, "vllm"),
        (CUDA_NO_VLLM, "cpu"),
        (LAPTOP, "cpu"),
        # vLLM's CPU build runs only when asked for: on CPU the reference engine stays the default.
        (VLLM_CPU_BUILD, "cpu"),
        # Neuron wins on a host that somehow has both.
        (
            BackendProbe(neuron_devices=2, nxdi_version="0.9.0", cuda_devices=1, vllm_importable=True),
            "neuron-nxdi",
        ),
    ],
)
def test_auto(probe: BackendProbe, expected: str) -> None:
    choice = choose_backend("auto", probe)
    assert choice.name == expected
    assert choice.reason.startswith("auto:")
    assert "CUDA" in choice.reason  # the log line says what was found


def test_auto_on_the_sdk_2_26_ami_names_the_library_and_version() -> None:
    """Today's inf2/trn1 DLAMI has NxD Inference and no transformers-neuronx: serve it with NxD."""
    choice = choose_backend("auto", SDK_2_26)
    assert (choice.library, choice.version) == ("neuronx-distributed-inference", "0.9.0")
    assert "NxD Inference imports" in choice.reason
    assert "transformers-neuronx not importable" in choice.reason
    assert choice.summary().startswith("backend neuron-nxdi on neuronx-distributed-inference 0.9.0: auto:")
    tnx = choose_backend("auto", SDK_2_20)
    assert (tnx.library, tnx.version) == ("transformers-neuronx", "0.13.0")
    assert "NxD Inference does not" in tnx.reason


@pytest.mark.parametrize("requested", ["auto", "neuron"])
def test_neuron_devices_without_either_library_fail_naming_both(requested: str) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        choose_backend(requested, NEURON_NO_LIBRARY)
    message = str(info.value)
    for words in ("neuronx-distributed-inference", "transformers-neuronx", "pip.repos.neuron.amazonaws.com"):
        assert words in message


@pytest.mark.parametrize(
    ("loader", "probe", "expected"),
    [
        ("nxdi", SDK_2_24, "neuron-nxdi"),
        ("tnx", SDK_2_24, "neuron-tnx"),
        ("TNX", SDK_2_24, "neuron-tnx"),
        ("vllm", VLLM_NEURON_HOST, "vllm-neuron"),
        (None, SDK_2_20, "neuron-tnx"),
    ],
)
def test_model_loader_picks_the_library(loader, probe, expected) -> None:
    for requested in ("auto", "neuron"):
        choice = choose_backend(requested, probe, loader)
        assert choice.name == expected
        if loader:
            assert f"option.model_loader={loader.lower()}" in choice.reason


@pytest.mark.parametrize(
    ("loader", "probe", "missing"),
    [
        ("nxdi", SDK_2_20, "neuronx-distributed-inference does not import"),
        ("tnx", SDK_2_26, "transformers-neuronx does not import"),
        ("vllm", SDK_2_26, "vllm-neuron does not import"),
    ],
)
def test_model_loader_that_cannot_run(loader, probe, missing) -> None:
    with pytest.raises(BackendUnavailableError, match=missing):
        choose_backend("neuron", probe, loader)


def test_unknown_model_loader_names_the_value() -> None:
    with pytest.raises(ValueError, match="'nxd-inference'"):
        choose_backend("auto", SDK_2_26, "nxd-inference")


def test_model_loader_is_ignored_without_neuron_devices() -> None:
    choice = choose_backend("auto", LAPTOP, "nxdi")
    assert choice.name == "cpu" and "model_loader=nxdi ignored" in choice.reason


def test_vllm_on_a_neuron_host_is_vllm_neuron_never_cuda() -> None:
    for requested in (requested_from_lmi(rolling_batch="vllm"), requested_from_lmi(backend="vllm")):
        choice = choose_backend(requested, VLLM_NEURON_HOST)
        assert choice.name == "vllm-neuron" and choice.version == "0.2.0"
    # Even a Neuron host where some CUDA-looking vLLM is installed: still not the CUDA path.
    with pytest.raises(BackendUnavailableError, match="vllm-neuron") as info:
        choose_backend("vllm", BackendProbe(neuron_devices=1, nxdi_version="0.9", vllm_importable=True))
    assert "backend 'vllm-neuron'" in str(info.value)
    with pytest.raises(ValueError, match="NxD Inference only"):
        choose_backend("vllm", VLLM_NEURON_HOST, "tnx")


@pytest.mark.parametrize(
    ("requested", "probe", "missing"),
    [
        ("neuron", LAPTOP, "no Neuron devices"),
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
    ("requested", "probe", "expected"),
    [
        ("cpu", SDK_2_26, "cpu"),
        ("cpu", CUDA_HOST, "cpu"),
        ("neuron", SDK_2_26, "neuron-nxdi"),
        ("vllm", CUDA_HOST, "vllm"),
        ("vllm", VLLM_CPU_BUILD, "vllm"),
        ("VLLM", CUDA_HOST, "vllm"),
    ],
)
def test_forced_backend_that_can_run(requested: str, probe: BackendProbe, expected: str) -> None:
    choice = choose_backend(requested, probe)
    assert choice.name == expected
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


# -- tensor_parallel_degree=max ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "cores"),
    [("0-7", tuple(range(8))), ("0,1,2", (0, 1, 2)), ("0-3, 8-11", (0, 1, 2, 3, 8, 9, 10, 11)), ("5", (5,))],
)
def test_visible_cores_list(value, cores) -> None:
    assert parse_core_list(value) == cores


@pytest.mark.parametrize("value", ["0-", "a,b", "7-3", "0;1"])
def test_visible_cores_list_rejects_garbage(value) -> None:
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
        parse_core_list(value)


@pytest.mark.parametrize(
    ("visible", "devices", "per_device", "lnc", "num_cores", "expected"),
    [
        ("0-7", 12, 2, None, None, 8),  # the runtime's own restriction wins
        ("0,1,2", 12, 2, None, None, 3),
        (None, 12, 2, None, None, 24),  # inf2.48xlarge
        (None, 16, 2, None, None, 32),  # trn1.32xlarge
        (None, 1, 2, None, None, 2),  # inf2.xlarge
        (None, 16, 8, None, None, 64),  # trn2.48xlarge at the default LNC=2
        (None, 16, 8, 1, None, 128),  # trn2 with NEURON_LOGICAL_NC_CONFIG=1
        (None, 12, 2, None, "4", 4),  # NEURON_RT_NUM_CORES
        ("", 12, 2, None, None, 24),  # set but empty means unset
    ],
)
def test_visible_neuron_cores(visible, devices, per_device, lnc, num_cores, expected) -> None:
    assert visible_neuron_cores(visible, devices, per_device, lnc, num_cores) == expected


def test_resolve_tp_degree() -> None:
    inf2 = BackendProbe(neuron_devices=12, nxdi_version="0.9.0")
    assert resolve_tp_degree(8, "neuron-nxdi", inf2, {}) == (8, "configured")
    tp, how = resolve_tp_degree("max", "neuron-nxdi", inf2, {})
    assert tp == 24 and "12 devices x 2 cores" in how
    tp, how = resolve_tp_degree("max", "neuron-tnx", inf2, {"NEURON_RT_VISIBLE_CORES": "0-7"})
    assert tp == 8 and "NEURON_RT_VISIBLE_CORES=0-7" in how
    trn2 = BackendProbe(neuron_devices=16, neuron_cores_per_device=8, nxdi_version="0.9.0")
    assert resolve_tp_degree("max", "vllm-neuron", trn2, {})[0] == 64
    assert resolve_tp_degree("max", "neuron-nxdi", trn2, {"NEURON_LOGICAL_NC_CONFIG": "1"})[0] == 128
    assert resolve_tp_degree("max", "neuron-nxdi", trn2, {}, logical_nc_config=1)[0] == 128
    assert resolve_tp_degree("max", "vllm", CUDA_HOST, {})[0] == 4
    assert resolve_tp_degree("max", "cpu", LAPTOP, {})[0] == 1
    with pytest.raises(BackendUnavailableError, match="no NeuronCores"):
        resolve_tp_degree("max", "neuron-nxdi", BackendProbe(), {})


# -- the host probe ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("physical", "visible", "expected"),
    [
        (4, None, 4),
        (4, "", 0),
        (4, "-1", 0),
        (4, "1,3", 2),
        (4, "0,7,1", 1),
        (2, "GPU-abc,1", 2),
        (0, "0", 0),
    ],
)
def test_visible_gpu_count(physical, visible, expected) -> None:
    assert visible_gpu_count(physical, visible) == expected


@pytest.fixture()
def cuda_never_touched(monkeypatch: pytest.MonkeyPatch):
    """``torch.cuda`` calls that would initialise CUDA (or query the driver) raise if made."""
    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("dispatch must not call torch.cuda (vLLM's forked engine core would fail)")

    for name in ("is_available", "device_count", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    yield torch
    assert not torch.cuda.is_initialized()


def _fake_nvml(monkeypatch: pytest.MonkeyPatch, count: int) -> list[str]:
    calls: list[str] = []
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return calls


def test_probe_counts_gpus_through_nvml_without_initialising_cuda(cuda_never_touched, monkeypatch, tmp_path):
    calls = _fake_nvml(monkeypatch, 4)
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # an earlier test in the vLLM tier imported it
    probe = probe_host(dev_glob=str(tmp_path / "neuron*"), env=env, nvidia_glob=str(tmp_path / "nvidia*"))
    assert probe.cuda_devices == 2 and calls == ["init", "shutdown"]
    assert "vllm" not in sys.modules  # vLLM is not imported to find the platform
    assert cuda_device_count({}, str(tmp_path / "nvidia*")) == (4, "NVML")


def test_probe_without_nvml_counts_device_nodes(cuda_never_touched, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    for i in range(3):
        (tmp_path / f"nvidia{i}").touch()
    (tmp_path / "nvidiactl").touch()  # the control node is no GPU
    glob = str(tmp_path / "nvidia[0-9]*")
    assert cuda_device_count({}, glob) == (3, "device nodes")
    assert cuda_device_count({"CUDA_VISIBLE_DEVICES": ""}, glob) == (0, "device nodes")
    probe = probe_host(dev_glob=str(tmp_path / "neuron*"), env={}, nvidia_glob=glob)
    assert probe.cuda_devices == 3


def test_probe_host_never_raises_and_reads_device_glob(cuda_never_touched, tmp_path) -> None:
    (tmp_path / "neuron0").touch()
    (tmp_path / "neuron1").touch()
    sysfs = tmp_path / "sys"
    (sysfs / "neuron0").mkdir(parents=True)
    (sysfs / "neuron0" / "core_count").write_text("8\n")
    probe = probe_host(dev_glob=str(tmp_path / "neuron*"), env={}, sysfs_root=str(sysfs))
    assert probe.neuron_devices == 2 and probe.neuron_cores_per_device == 8
    # No Neuron library in this environment: a Neuron host without one fails naming both.
    if probe.nxdi_version is None and probe.tnx_version is None:
        with pytest.raises(BackendUnavailableError, match="neither Neuron library imports"):
            choose_backend("auto", probe)
    assert not probe_host(dev_glob=str(tmp_path / "nothing*"), env={}).neuron_devices_present


def test_probe_reports_a_neuron_library_that_fails_to_import(cuda_never_touched, monkeypatch, tmp_path):
    """A placeholder or broken install is 'not importable', with the error in the probe's notes."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "neuronx_distributed_inference" else real(name, *a),
    )
    monkeypatch.setitem(sys.modules, "neuronx_distributed_inference", None)  # import raises
    (tmp_path / "neuron0").touch()
    probe = probe_host(dev_glob=str(tmp_path / "neuron*"), env={}, sysfs_root=str(tmp_path))
    assert probe.nxdi_version is None
    assert any("neuronx-distributed-inference check failed" in note for note in probe.notes)
