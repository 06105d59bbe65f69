"""NxD Inference's causal-LM applications this backend builds, by ``config.json`` model_type and release.

``utils/constants.py`` ``MODEL_TYPES[model_type]["causal-lm"]`` in the library maps a model type to its
class. Per release (0.8.0 = cd3abf3, 0.9.0 = 4bcdc54)::

    model_type           0.8.0                               0.9.0
    llama                NeuronLlamaForCausalLM              NeuronLlamaForCausalLM
    mistral              NeuronLlamaForCausalLM (no mistral) NeuronMistralForCausalLM
    mixtral              NeuronMixtralForCausalLM            (refused: support.ENDS_AT_0_8)
    qwen2                NeuronQwen2ForCausalLM              NeuronQwen2ForCausalLM
    qwen3                NeuronQwen3ForCausalLM (q/k/v apart) NeuronQwen3ForCausalLM
    qwen3_moe            NeuronQwen3MoeForCausalLM           NeuronQwen3MoeForCausalLM
    gemma3, gemma3_text  none (its models/gemma3 is not in    NeuronGemma3ForCausalLM (gemma3 in
                         MODEL_TYPES; support.STARTS_AT_0_9)  MODEL_TYPES; it takes a text-only config)

What each application does with a checkpoint, read from its modeling file and checked on the CPU
(``tests/backends/nxdi_library``), is data here: whether its weight conversion fuses Q/K/V, whether its
attention keeps a sliding window and how, whether NxD Inference's CPU mode can run it, and which
``config.json`` fields it does not honour (``model_checks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from neuron_lmi.backends.nxdi import model_checks
from neuron_lmi.backends.nxdi.model_checks import Windows

LIBRARY = "neuronx-distributed-inference"
LIBRARY_MODULE = "neuronx_distributed_inference"
CONFIG_MODULE = f"{LIBRARY_MODULE}.models.config"
HF_ADAPTER_MODULE = f"{LIBRARY_MODULE}.utils.hf_adapter"

# What an application does not honour of config.json: {"config.json <field>": why}; raises ValueError
# where the checkpoint would not load. Takes the config and the release.
ConfigCheck = Callable[[Mapping[str, Any], str], dict[str, str]]


@dataclass(frozen=True, slots=True)
class Application:
    """One NxD Inference causal-LM application: its module, the three classes built from it, and what
    it does with a checkpoint.

    ``fuses_qkv``: its ``convert_hf_to_neuron_state_dict`` fuses q/k/v into ``Wqkv`` under
    ``fused_qkv`` (else the fused projection finds no weights). ``windows``: what it does with a
    sliding window (``model_checks.Windows``). ``no_cpu_mode``: why NxD Inference's CPU mode cannot run
    it ('' where it can). ``check``: the config.json fields it does not honour.
    """

    module: str
    application: str
    inference_config: str
    neuron_config_cls: str
    fuses_qkv: bool = False
    windows: Windows = Windows.NONE
    no_cpu_mode: str = ""
    check: ConfigCheck = model_checks.honours_all

    def path(self, name: str) -> str:
        return f"{self.module}.{name}"


def _models(name: str) -> str:
    return f"{LIBRARY_MODULE}.models.{name}.modeling_{name}"


LLAMA = Application(
    _models("llama"),
    "NeuronLlamaForCausalLM",
    "LlamaInferenceConfig",
    "NeuronConfig",
    fuses_qkv=True,
    windows=Windows.RING,
)
MISTRAL = Application(
    _models("mistral"),
    "NeuronMistralForCausalLM",
    "MistralInferenceConfig",
    "NeuronConfig",
    windows=Windows.RING,
)
MIXTRAL = Application(
    _models("mixtral"), "NeuronMixtralForCausalLM", "MixtralInferenceConfig", "MoENeuronConfig"
)
QWEN2 = Application(
    _models("qwen2"),
    "NeuronQwen2ForCausalLM",
    "Qwen2InferenceConfig",
    "NeuronConfig",
    fuses_qkv=True,  # its own convert_state_dict_to_fused_qkv, biases included
    check=model_checks.qwen,
)
QWEN3 = Application(
    _models("qwen3"),
    "NeuronQwen3ForCausalLM",
    "Qwen3InferenceConfig",
    "NeuronConfig",
    fuses_qkv=True,  # 0.9 imports the Llama conversion's convert_state_dict_to_fused_qkv
    check=model_checks.qwen,
)
QWEN3_0_8 = dataclasses.replace(QWEN3, fuses_qkv=False)  # 0.8's conversion keeps q/k/v apart
QWEN3_MOE = Application(
    _models("qwen3_moe"),
    "NeuronQwen3MoeForCausalLM",
    "Qwen3MoeInferenceConfig",
    "MoENeuronConfig",
    fuses_qkv=True,
    no_cpu_mode=model_checks.MODULE_MARKERS,
    check=model_checks.qwen3_moe,
)
GEMMA3 = Application(
    _models("gemma3"),
    "NeuronGemma3ForCausalLM",
    "Gemma3InferenceConfig",
    "NeuronConfig",
    fuses_qkv=True,
    windows=Windows.WITHIN,
    check=model_checks.gemma3,
)
# config.json model_type -> application (NxD Inference's utils/constants.py MODEL_TYPES), per release.
# gemma3_text is not in MODEL_TYPES, but the Gemma 3 application reads a text-only config as it is and
# strips its checkpoint's "model." prefix (convert_hf_to_neuron_state_dict).
APPLICATIONS: Mapping[str, Application] = MappingProxyType(
    {
        "llama": LLAMA,
        "mistral": MISTRAL,
        "mixtral": MIXTRAL,
        "qwen2": QWEN2,
        "qwen3": QWEN3,
        "qwen3_moe": QWEN3_MOE,
        "gemma3": GEMMA3,
        "gemma3_text": GEMMA3,
    }
)
# 0.8 has no models/mistral, so a Mistral runs on the Llama application (same weights and layers); its
# Qwen3 keeps q/k/v apart; its models/gemma3 is not in MODEL_TYPES (nor does it scale attention by
# query_pre_attn_scalar), so Gemma 3 is not served on 0.8.
APPLICATIONS_0_8: Mapping[str, Application] = MappingProxyType(
    {
        **{k: v for k, v in APPLICATIONS.items() if k not in ("gemma3", "gemma3_text")},
        "mistral": LLAMA,
        "qwen3": QWEN3_0_8,
    }
)
