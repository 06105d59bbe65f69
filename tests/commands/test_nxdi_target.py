"""``--platform`` / ``--nxdi-version``: which release a review or a compile is for."""

from __future__ import annotations

import argparse

import pytest

from neuron_lmi.backends.nxdi import backend as nxdi_backend
from neuron_lmi.backends.nxdi.backend import nxdi_target
from neuron_lmi.commands import nxdi_target as target


@pytest.mark.parametrize("text", ["0.8", "0.9.0", " 0.10.1 "])
def test_a_release_from_0_8_on_is_taken(text: str) -> None:
    assert target.nxdi_version(text) == text.strip()


@pytest.mark.parametrize(
    ("text", "message"), [("0.7", "written for 0.8 and later"), ("latest", "such as 0.8")]
)
def test_anything_else_is_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        target.nxdi_version(text)


def test_a_compile_runs_the_installed_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nxdi_backend, "installed_version", lambda name: "0.9.0")
    platform, version, source = nxdi_target("trn2", "--platform", None, {})
    assert (platform.name, version, source) == ("trn2", "0.9.0", "installed")
    assert nxdi_target("inf2", "--platform", "0.8", {})[1:] == ("0.8", "--nxdi-version")  # a review
    with pytest.raises(ValueError, match=r"--nxdi-version 0\.8: NxD Inference 0\.9\.0 is installed"):
        nxdi_target("inf2", "--platform", "0.8", {}, compiling=True)
    assert nxdi_target("trn2", "--platform", "0.9", {}, compiling=True)[1] == "0.9"
