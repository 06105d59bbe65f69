"""Serving configuration: one validated object filled from CLI, serving.properties, environment, defaults.

Public API::

    resolved = load_config(cli_overrides(args), args.properties, os.environ)
    resolved = apply_model_defaults(resolved, max_position_embeddings)   # after the model is fetched
    print(format_config(resolved))                                        # --print-config
    write_properties(resolved, Path("model/serving.properties"))          # packaging
"""

from neuron_lmi.config.keys import KEYS, KeySpec, lookup
from neuron_lmi.config.loader import (
    ResolvedConfig,
    apply_model_defaults,
    cli_overrides,
    format_config,
    load_config,
    write_properties,
)
from neuron_lmi.config.options import (
    BackendOptions,
    BatchingOptions,
    ConfigError,
    ModelOptions,
    NeuronOptions,
    ParallelOptions,
    ServerOptions,
    ServingConfig,
    default_n_positions,
)
from neuron_lmi.config.sources import (
    parse_properties,
    read_properties,
    sagemaker_model_dir,
    sagemaker_root,
)

__all__ = [
    "KEYS",
    "BackendOptions",
    "BatchingOptions",
    "ConfigError",
    "KeySpec",
    "ModelOptions",
    "NeuronOptions",
    "ParallelOptions",
    "ResolvedConfig",
    "ServerOptions",
    "ServingConfig",
    "apply_model_defaults",
    "cli_overrides",
    "default_n_positions",
    "format_config",
    "load_config",
    "lookup",
    "parse_properties",
    "read_properties",
    "sagemaker_model_dir",
    "sagemaker_root",
    "write_properties",
]
