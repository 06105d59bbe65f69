"""The NxD Inference backend (``neuronx-distributed-inference``, Neuron SDK 2.2x and later).

``plan`` maps our configuration to NxD Inference's constructor arguments (pure, no Neuron import),
starting from AWS's serving defaults and tuned set (``defaults``) and the keyword table (``fields``)
for an application (``applications``: by model type and release, with what each does not honour of a
checkpoint's config.json and its sliding window in ``model_checks``); ``support`` is the Neuron SDK
matrix (which release runs
where, and the platform), ``artifacts`` keys a plan and builds the application (lazy imports),
``cpu_mode`` supplies what a release's CPU mode lacks, ``runner`` drives its continuous-batching
forward behind the ``ModelRunner`` protocol, and ``backend`` is the registered object: plan ->
compile (through the compile cache) -> load -> runner, and the engine ``serve`` runs. The
CPU stand-in tests drive it with is ``neuron_lmi.testing.nxdi_contract``, checked against the
library itself in ``tests/backends/nxdi_library``.
"""
