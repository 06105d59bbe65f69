"""Ahead-of-time compilation per bucket, stored in the compile cache (``compile_cache``).

* ``cpu_aot``: target ``cpu``: ``torch.export`` + AOTInductor packages, one per context bucket
  (prefill) and token-generation bucket (decode); weights are not embedded but shared at load.
* ``graphs``: the static-shape prefill/decode modules those packages are traced from.
``neuron_lmi.runners.compiled`` runs the cpu artifacts; ``neuron-lmi compile`` drives them and the
``neuron`` target, whose compile lives with its backend (``backends.tnx.compile``,
``backends.nxdi.artifacts``).
Submodules import torch (and the Neuron SDK) only when used, so importing this package is cheap.
"""
