"""NxD Inference's causal-LM applications this backend builds, by ``config.json`` model_type and release.

``utils/constants.py`` ``MODEL_TYPES[model_type]["causal-lm"]`` in the library maps a model type to its
class; 0.8.0 has no ``models/mistral``, so a Mistral runs on the Llama application there (same
weights and layers; it reads ``sliding_window`` as 0.9's Mistral does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

LIBRARY = "neuronx-distributed-inference"
LIBRARY_MODULE = "neuronx_distributed_inference"
CONFIG_MODULE = f"{LIBRARY_MODULE}.models.config"
HF_ADAPTER_MODULE = f"{LIBRARY_MODULE}.utils.hf_adapter"


@dataclass(frozen=True, slots=True)
class Application:
    """One NxD Inference causal-LM application: its module and the three classes built from it."""

    module: str
    application: str
    inference_config: str
    neuron_config_cls: str

    def path(self, name: str) -> str:
        return f"{self.module}.{name}"


LLAMA = Application(
    f"{LIBRARY_MODULE}.models.llama.modeling_llama",
    "NeuronLlamaForCausalLM",
    "LlamaInferenceConfig",
    "NeuronConfig",
)
MISTRAL = Application(
    f"{LIBRARY_MODULE}.models.mistral.modeling_mistral",
    "NeuronMistralForCausalLM",
    "MistralInferenceConfig",
    "NeuronConfig",
)
MIXTRAL = Application(
    f"{LIBRARY_MODULE}.models.mixtral.modeling_mixtral",
    "NeuronMixtralForCausalLM",
    "MixtralInferenceConfig",
    "MoENeuronConfig",
)
# config.json model_type -> application (NxD Inference's utils/constants.py MODEL_TYPES), per release:
# 0.8 has no models/mistral, so a Mistral runs on the Llama application (same weights and layers).
APPLICATIONS: Mapping[str, Application] = MappingProxyType(
    {"llama": LLAMA, "mistral": MISTRAL, "mixtral": MIXTRAL}
)
APPLICATIONS_0_8: Mapping[str, Application] = MappingProxyType({**APPLICATIONS, "mistral": LLAMA})
# Applications whose attention reads config.sliding_window (a ring cache of that many slots).
WINDOWED_APPLICATIONS = frozenset({LLAMA.application, MISTRAL.application})
