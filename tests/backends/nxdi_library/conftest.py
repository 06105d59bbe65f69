"""The real NxD Inference tier: the library's own modeling code on the CPU (see ``library``).

Skipped, naming the variables, unless ``NEURON_LMI_NXDI_SRC`` and ``NEURON_LMI_NXD_SRC`` point at
source trees; ``make test-nxdi`` runs it. The main tier never installs the import hook (its
Makefile target unsets both variables), so no other test sees stand-in hardware packages.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.backends.nxdi.test_families import TINY
from tests.backends.nxdi_library import library

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = library.skip_reason()
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def nxdi_library() -> str | None:
    """Installs the trees and the stand-ins once (a fixture of this folder's tests alone); returns
    the NxD Inference version under test."""
    if library.skip_reason() is not None:
        return None
    library.install()
    return library.library_version()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; the box has two cores shared with other jobs
    yield
    torch.set_num_threads(before)


def _tree_release() -> tuple[int, int] | None:
    """The release of the tree under test, read before anything imports it (None: the tier skips)."""
    from neuron_lmi.backends.nxdi.support import release

    return None if library.skip_reason() is not None else release(library.tree_version())


def _starts_later(model_type: str, found: tuple[int, int] | None) -> bool:
    from neuron_lmi.backends.nxdi.support import LAST_INF2_TRN1, STARTS_AT_0_9

    return model_type in STARTS_AT_0_9 and found is not None and found <= LAST_INF2_TRN1


# The families the release under test has an application for (0.8.0 has no Gemma 3:
# ``test_model_checks.py`` checks its refusal).
ARCHES = tuple(a for a in TINY if not _starts_later(a, _tree_release()))


def platform() -> str:
    import os

    return os.environ[library.PLATFORM_VAR]


def served(model_type: str) -> bool:
    """Whether the release under test serves ``model_type``; where the SDK matrix says it does not
    (Mixtral on 0.9+), the plan must refuse it, naming the release to pin."""
    from neuron_lmi.backends.nxdi.support import ENDS_AT_0_8, release

    return model_type not in ENDS_AT_0_8 or (release(library.library_version()) or (0, 9)) <= (0, 8)


def start_up_refusal(model_type: str) -> str | None:
    """What ``serve`` in the CPU mode says when it refuses ``model_type`` on the release under test: the
    release to pin (Mixtral on 0.9+), or why the CPU mode cannot run the application (Qwen3-MoE)."""
    from neuron_lmi.backends.nxdi.applications import APPLICATIONS

    if not served(model_type):
        return "pin Neuron SDK 2.28"
    return "cannot run on the CPU" if APPLICATIONS[model_type].no_cpu_mode else None


# Mixtral's modeling file is the same in 0.8.0 and 0.9.0 (models/mixtral/modeling_mixtral.py); where
# the product refuses it on 0.9+ (the SDK matrix: a device kernel it needs is gone), the tier still
# runs that code on the CPU under the 0.8 mapping, the release that serves it.
SERVING_RELEASE = "0.8.0"


def nxdi_plan(checkpoint: Path, rows: int, n_positions: int, extra: str = "", overrides: str = "") -> Any:
    """Our plan for ``checkpoint`` in the library's CPU mode, for the release under test; for a model
    the release does not serve, the refusal is checked and the 0.8 plan returned instead."""
    from neuron_lmi.backends.nxdi.support import UnsupportedReleaseError

    model_type = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["model_type"]
    if served(model_type):
        return cpu_check(checkpoint, rows, n_positions, extra, overrides)
    with pytest.raises(UnsupportedReleaseError, match=r"pin Neuron SDK 2\.28"):
        _plan(checkpoint, rows, n_positions, extra, overrides)
    return cpu_check(checkpoint, rows, n_positions, extra, overrides, SERVING_RELEASE, None)


# Where the product refuses the CPU mode (``Application.no_cpu_mode``: Qwen3-MoE's module markers, XLA
# custom calls), the tier still runs the application's code here: the stand-ins give the markers the
# value a device gives them, their operand (``library``), and the plan is the device plan with the one
# bucket ``to_cpu`` builds, as the product's CPU mode would plan it.
def cpu_check(
    checkpoint: Path, rows: int, n_positions: int, extra: str, overrides: str, *release: Any
) -> tuple[Any, Any]:
    from neuron_lmi.backends.nxdi.applications import APPLICATIONS

    model_type = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["model_type"]
    refusal = APPLICATIONS[model_type].no_cpu_mode
    if not refusal:
        return _plan(checkpoint, rows, n_positions, extra, overrides, *release)
    with pytest.raises(ValueError, match=r"on_cpu=true: .* cannot run on the CPU: its decoder layers"):
        _plan(checkpoint, rows, n_positions, extra, overrides, *release)
    device, config = _plan(checkpoint, rows, n_positions, extra, overrides, *release, on_cpu=False)
    one = [n_positions]
    kwargs = {**device.neuron_config, "on_cpu": True, "context_encoding_buckets": one}
    kwargs["token_generation_buckets"] = one
    return dataclasses.replace(
        device,
        neuron_config=kwargs,
        on_cpu=True,
        context_buckets=(n_positions,),
        token_buckets=(n_positions,),
    ), config


def _plan(
    checkpoint: Path,
    rows: int,
    n_positions: int,
    extra: str,
    overrides: str,
    version: str | None = None,
    chip: str | None = "",
    on_cpu: bool = True,
) -> Any:
    from neuron_lmi.backends.nxdi.plan import plan_nxdi
    from neuron_lmi.config import load_config
    from neuron_lmi.config.hf_config import read_hf_config

    props = checkpoint.parent / f"{checkpoint.name}-{rows}x{n_positions}.properties"
    props.write_text(
        f"option.model_id={checkpoint}\noption.model_loader=nxdi\noption.max_rolling_batch_size={rows}\n"
        f"option.n_positions={n_positions}\noption.dtype=fp32\noption.tensor_parallel_degree=1\n"
        f'option.override_neuron_config={{"on_cpu": {str(on_cpu).lower()}{overrides}}}\n{extra}',
        encoding="utf-8",
    )
    config = load_config(properties_path=props, env={}).config
    return plan_nxdi(
        config,
        read_hf_config(checkpoint, "the tier"),
        str(checkpoint),
        None,
        version or library.library_version(),
        platform() if chip == "" else chip,
    ), config


# NxD Inference 0.8.0's CPU mode: ``NeuronBaseForCausalLM._copy_past_key_values`` (model_base.py, run
# after every forward that is not on a device) calls ``_get_captured_tensors_offset``, which that
# release defines only on its image-to-text base; 0.9.0 defines it on the causal-LM base. The product
# supplies it (``neuron_lmi.backends.nxdi.cpu_mode``); ``test_cpu_mode.py`` checks why and where.
KNOWN_CPU_FAILURE = "_get_captured_tensors_offset"


def probe_forward(app: Any) -> Any:
    """One three-token context encoding into row 0."""
    with torch.inference_mode():
        return app(
            input_ids=torch.tensor([[5, 6, 7]]),
            attention_mask=torch.ones(1, 3, dtype=torch.long),
            position_ids=torch.arange(3)[None],
            seq_ids=torch.tensor([0]),
            # with on-device sampling (the default) the library's own default has batch_size rows,
            # which a one-line call cannot use; without it the library ignores them
            sampling_params=torch.tensor([[1.0, 1.0, 1.0]]),
        )


@pytest.fixture(scope="session")
def cpu_forward(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The product's CPU mode runs a forward on the release under test: the tests after it run the
    release's own code and nothing of the tier's besides the hardware stand-ins."""
    from neuron_lmi.backends.nxdi.runner import on_cpu_application
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("probe"), arch="llama")
    plan, _ = nxdi_plan(checkpoint, 2, 32)
    out = probe_forward(on_cpu_application(plan))
    assert out.logits.shape[0] == 1
