"""``models.host_isa``: the features a compile-cache key names, and AMX's permission asked before
anything runs a package or a native kernel (a process that never asked dies with SIGILL on its first
AMX instruction)."""

from __future__ import annotations

from compile_cache.key import missing_isa_features
from neuron_lmi.models import host_isa
from tests.compile_cache.conftest import make_inputs
from tests.models.conftest import run_fresh

ASKED_BY_KERNELS = """
from neuron_lmi.models import host_isa, ops
before = host_isa._amx
ops.kernels()
print(before, host_isa._amx)
"""


def test_isa_features_are_the_hosts_less_what_may_not_run() -> None:
    caps = host_isa.host_capabilities()
    features = host_isa.isa_features()
    assert features == tuple(sorted(features)) and set(features) <= caps
    assert not {"cpu_name", "architecture", "num_logical_cores"} & caps  # machine facts, not features
    assert {"sse2", "avx"} <= caps  # any x86-64 host this project runs on
    if "amx_tile" in caps:
        assert host_isa.request_amx() and host_isa.AMX_FEATURES & caps <= set(features)
    else:
        assert not host_isa.request_amx() and not host_isa.AMX_FEATURES & set(features)
    # What ``cache verify`` asks of an entry: nothing missing for this host's own features.
    assert missing_isa_features(make_inputs(isa_features=features), host_isa.isa_features()) == ()
    made_up = make_inputs(isa_features=(*features, "made_up"))
    assert missing_isa_features(made_up, host_isa.isa_features()) == ("made_up",)


def test_the_native_kernels_ask_for_amx_first_in_a_fresh_process() -> None:
    before, after = run_fresh(ASKED_BY_KERNELS).split()
    assert before == "None"  # importing asks nothing
    assert after == str("amx_tile" in host_isa.host_capabilities())
