"""The keys vLLM reads itself when it serves, as LMI passes them to it.

Every ``option.<name>`` properties key and ``OPTION_<NAME>`` variable that the key table does not
claim is a candidate ``AsyncEngineArgs`` field, and two shared keys are vLLM's own
(``VLLM_RELEASED_FIELDS``). The loader collects them once, whatever backend was asked for
(``ResolvedConfig.vllm_options``); ``gpu_fallback.config`` types them against vLLM's annotations.
"""

from __future__ import annotations

from collections.abc import Mapping

from neuron_lmi.config.keys import BY_LMI, KEYS
from neuron_lmi.config.options import ROLLING_BATCH_REQUESTS
from neuron_lmi.config.sources import Origin

# Shared keys vLLM reads itself when it serves: LMI's option.quantize is vLLM's quantization, and
# option.enforce_eager is vLLM's own switch (ours turns off the CPU engine's compiled graphs). The
# LoRA keys and option.speculative_config are not released: they stay typed in ``config.lora`` and
# ``config.batching.speculative_config``, and ``gpu_fallback.config`` maps them onto vLLM's
# engine arguments (one parse of each key, whichever backend serves).
VLLM_RELEASED_FIELDS = ("quantize", "enforce_eager")
OPTION_PREFIX = "option."
OPTION_ENV_PREFIX = "OPTION_"


def backend_option_origins(
    properties: Mapping[str, str], label: str, env: Mapping[str, str], release: tuple[str, ...] = ()
) -> dict[str, Origin]:
    """Every ``option.<name>`` properties key and ``OPTION_<NAME>`` variable the key table does not
    claim (or whose field ``release`` names), by bare lower-case name; serving.properties wins over
    the environment, as in LMI. Empty environment values count as unset."""
    claimed_env = {var for spec in KEYS if spec.field not in release for var in spec.env_names}
    found: dict[str, Origin] = {}
    for var, value in env.items():
        if var.startswith(OPTION_ENV_PREFIX) and var not in claimed_env and value.strip():
            found[var.removeprefix(OPTION_ENV_PREFIX).lower()] = Origin(var, value, f"env:{var}")
    for key, value in properties.items():
        lower = key.strip().lower()
        spec = BY_LMI.get(lower)
        if lower.startswith(OPTION_PREFIX) and (spec is None or spec.field in release):
            found[lower.removeprefix(OPTION_PREFIX)] = Origin(key, value, label)
    return found


def asks_for_vllm(origins: Mapping[str, Origin]) -> bool:
    """Whether the vLLM backend was asked for (``backend`` or LMI's ``rolling_batch``), so the
    unclaimed ``option.*`` keys are its engine arguments rather than unsupported keys."""

    def raw(name: str) -> str:
        return str(origins[name].value).strip().lower() if name in origins else ""

    return raw("backend") == "vllm" or ROLLING_BATCH_REQUESTS.get(raw("rolling_batch")) == "vllm"


def bare_option(key: str) -> str | None:
    """``option.Foo_Bar`` / ``OPTION_FOO_BAR`` -> ``foo_bar``; None for any other key."""
    lower = key.strip().lower()
    if lower.startswith(OPTION_PREFIX):
        return lower.removeprefix(OPTION_PREFIX)
    return key.removeprefix(OPTION_ENV_PREFIX).lower() if key.startswith(OPTION_ENV_PREFIX) else None
