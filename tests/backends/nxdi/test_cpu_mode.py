"""When the product supplies NxD Inference's missing CPU-path method: the decision, without the library.

Stand-in application classes take the two shapes the releases have (0.8.0 without
``_get_captured_tensors_offset`` on the causal-LM base, 0.9.0 with it); the real library runs the same
path in tests/backends/nxdi_library/test_cpu_mode.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from neuron_lmi.backends.nxdi.cpu_mode import (
    CAPTURED_TENSORS_OFFSET,
    captured_tensors_offset,
    missing_cpu_methods,
    supply_cpu_methods,
)


class Released08:
    """What 0.8.0's causal-LM application offers: a neuron_config, no offset method."""

    def __init__(self, capture: Any = None) -> None:
        self.neuron_config = SimpleNamespace(tensor_capture_config=capture)


class Released09(Released08):
    def _get_captured_tensors_offset(self) -> int:
        return 42  # its own answer: never replaced


class Capture:
    def get_offset(self) -> int:
        return 3


def test_supplied_in_cpu_mode_where_the_release_lacks_it(caplog: pytest.LogCaptureFixture) -> None:
    app = Released08()
    assert missing_cpu_methods(app, on_cpu=True) == (CAPTURED_TENSORS_OFFSET,)
    with caplog.at_level(logging.INFO, logger="neuron_lmi.backends.nxdi.cpu_mode"):
        assert supply_cpu_methods(app, True, "0.8.0") == (CAPTURED_TENSORS_OFFSET,)
    assert app._get_captured_tensors_offset() == 0  # type: ignore[attr-defined]
    assert missing_cpu_methods(app, on_cpu=True) == ()  # supplied once
    message = caplog.records[-1].getMessage()
    assert "NxD Inference 0.8.0 lacks Released08._get_captured_tensors_offset" in message
    assert "supplied as 0.9.0 defines it" in message
    assert not hasattr(Released08, CAPTURED_TENSORS_OFFSET)  # the class stays as released
    assert not hasattr(Released08(), CAPTURED_TENSORS_OFFSET)


def test_the_supplied_offset_counts_captured_tensors() -> None:
    app = Released08(capture=Capture())
    supply_cpu_methods(app, True, "0.8.0")
    assert app._get_captured_tensors_offset() == 3  # type: ignore[attr-defined]
    assert captured_tensors_offset(Released08()) == 0


@pytest.mark.parametrize(
    ("app", "on_cpu"), [(Released09(), True), (Released08(), False), (Released09(), False)]
)
def test_nothing_supplied_off_the_cpu_mode_or_where_the_release_has_it(
    app: Any, on_cpu: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="neuron_lmi.backends.nxdi.cpu_mode"):
        assert supply_cpu_methods(app, on_cpu, "0.9.0") == ()
    assert caplog.records == []
    assert hasattr(app, CAPTURED_TENSORS_OFFSET) is isinstance(app, Released09)
    if isinstance(app, Released09):
        assert app._get_captured_tensors_offset() == 42
