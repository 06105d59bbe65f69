"""NxD Inference artifacts: the compile-cache key of a plan, and building the application
(``backend.NxdiBackend`` compiles and loads it).

    NxdiPlan --new_application--> NeuronXForCausalLM(model_path, XInferenceConfig(NeuronConfig(**kwargs),
                                                      load_config=load_pretrained_config(model_path)))
    miss: app.compile(staging)   writes neuron_config.json, model.pt (+ weights/ when sharded)
          the store renames staging into the entry; the same app then loads it
    hit:  app.load(entry)

The key (``nxdi_key_inputs``) hashes the architecture config, every NeuronConfig keyword actually
passed (``NxdiPlan.key_args``: classes included, file locations excluded), the versions of
neuronx-cc and neuronx-distributed-inference, and the weights' content fingerprint when the sharded
weights are saved into the entry (otherwise the entry holds graphs only and weights are sharded at
load). Library imports happen only in ``new_application``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from compile_cache import CacheKeyInputs, architecture_config, fingerprint_weights
from neuron_lmi.backends.host import installed_version
from neuron_lmi.backends.nxdi.applications import LIBRARY_MODULE
from neuron_lmi.backends.nxdi.plan import CONFIG_MODULE, HF_ADAPTER_MODULE, LIBRARY, NxdiPlan

log = logging.getLogger(__name__)

COMPILER = "neuronx-cc"
ARTIFACT_FILES = ("neuron_config.json", "model.pt")
NEURON_PACKAGES = ("neuronx-distributed-inference", "neuronx-distributed", "torch-neuronx", "neuronx-cc")
NEURON_PIP_REPOSITORY = "https://pip.repos.neuron.amazonaws.com"
NOT_INSTALLED = "not-installed"


def is_artifact_dir(path: Path) -> bool:
    """A folder written by ``compile(dir)``: ``neuron_config.json`` and ``model.pt``."""
    return path.is_dir() and all((path / name).is_file() for name in ARTIFACT_FILES)


def nxdi_key_inputs(
    plan: NxdiPlan,
    model_config: Mapping[str, Any],
    compiler_version: str | None = None,
    library_version: str | None = None,
) -> CacheKeyInputs:
    """The compile-cache key inputs for ``plan``. Versions default to the installed ones; where a
    package is absent (a dry run off a Neuron host) the version reads ``not-installed``."""
    compiler_version = compiler_version or installed_version(COMPILER) or NOT_INSTALLED
    library_version = library_version or installed_version(LIBRARY) or NOT_INSTALLED
    sharded = bool(plan.neuron_config.get("save_sharded_checkpoint"))
    return CacheKeyInputs(
        architecture=architecture_config(dict(model_config)),
        target="neuron",
        compiler=COMPILER,
        compiler_version=compiler_version,
        n_positions=plan.n_positions,
        context_buckets=plan.context_buckets,
        token_buckets=plan.token_buckets,
        dtype=plan.dtype,
        batch_size=plan.batch_size,
        tensor_parallel_degree=plan.tp_degree,
        weights_fingerprint=fingerprint_weights(plan.model_path, mode="content") if sharded else None,
        library_args={**plan.key_args(), "library_version": library_version},
    )


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"the NxD Inference backend needs the AWS Neuron SDK ({', '.join(NEURON_PACKAGES)}), which "
            f"could not be imported ({exc}); on an inf2/trn1/trn2 host use the Neuron Deep Learning AMI "
            f"or install them from AWS's Neuron pip repository: pip install --extra-index-url "
            f"{NEURON_PIP_REPOSITORY} {' '.join(NEURON_PACKAGES)}"
        ) from exc


def new_application(plan: NxdiPlan, quantized_dir: Path | None = None) -> Any:
    """Build the application object (no compile, no load). ``quantized_dir`` replaces the placeholder
    ``quantized_checkpoints_path`` when the plan quantizes. With ``plan.speculation`` the inference
    config carries the draft (``FusedSpecNeuronConfig``, as the library's ``inference_demo.py`` builds
    it; ``backends.nxdi.speculation``)."""
    config_module = _import(CONFIG_MODULE)
    app_module = _import(plan.application.module)
    kwargs = plan.kwargs()
    if kwargs.get("quantized"):
        kwargs["quantized_checkpoints_path"] = str(quantized_dir or Path(plan.model_path) / "quantized")
    if plan.lora is not None:  # modules/lora_serving: the adapters compiled in
        lora_serving = _import(f"{LIBRARY_MODULE}.modules.lora_serving")
        kwargs["lora_config"] = lora_serving.LoraServingConfig(**plan.lora.kwargs)
    neuron_config = _neuron_config(config_module, plan.application.neuron_config_cls, kwargs)
    inference_cls = getattr(app_module, plan.application.inference_config)
    extra: dict[str, Any] = {}
    spec = plan.speculation
    if spec is not None:
        draft_kwargs = dict(spec.draft_kwargs)
        draft_kwargs["torch_dtype"] = kwargs["torch_dtype"]
        draft = _neuron_config(config_module, plan.application.neuron_config_cls, draft_kwargs)
        for name, value in spec.draft_after.items():  # what the constructor would not leave as given
            setattr(draft, name, value)
        draft_config = inference_cls(draft, load_config=_config_loader(spec.draft_path))
        application = getattr(app_module, plan.application.application)
        extra["fused_spec_config"] = config_module.FusedSpecNeuronConfig(
            application._model_cls, draft_config=draft_config, draft_model_path=spec.draft_path
        )
    inference_config = inference_cls(neuron_config, load_config=_config_loader(plan.model_path), **extra)
    return getattr(app_module, plan.application.application)(plan.model_path, inference_config)


def _neuron_config(config_module: Any, cls_name: str, kwargs: dict[str, Any]) -> Any:
    sampling = kwargs.get("on_device_sampling_config")
    if isinstance(sampling, dict):
        kwargs = {**kwargs, "on_device_sampling_config": config_module.OnDeviceSamplingConfig(**sampling)}
    return getattr(config_module, cls_name)(**kwargs)


def _config_loader(model_path: str) -> Any:
    load_hf_config = _import(HF_ADAPTER_MODULE).load_pretrained_config(model_path)

    def load_config(config: Any) -> None:
        load_hf_config(config)
        # transformers keeps a Mistral's head_dim None when config.json has none (the model derives
        # it); NxD Inference reads getattr(config, "head_dim", default) and would get None. A
        # vision-language Gemma 3 keeps both in text_config, which its InferenceConfig reads itself.
        if getattr(config, "head_dim", None) is None and hasattr(config, "hidden_size"):
            config.head_dim = config.hidden_size // config.num_attention_heads

    return load_config
