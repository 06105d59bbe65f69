"""The NxD Inference backend (``neuronx-distributed-inference``, Neuron SDK 2.2x and later).

``plan`` maps our configuration to NxD Inference's constructor arguments (pure, no Neuron import),
starting from AWS's serving defaults and tuned set (``defaults``) and the keyword table (``fields``)
for an application (``applications``); ``support`` is the Neuron SDK matrix (which release runs
where, and the platform), ``artifacts`` builds, compiles and loads the application through the
compile cache (lazy imports), ``cpu_mode`` supplies what a release's CPU mode lacks, ``runner``
drives its continuous-batching forward behind the ``ModelRunner`` protocol, and ``build`` makes the
engine. The
CPU stand-in tests drive it with is ``neuron_lmi.testing.nxdi_contract``, checked against the
library itself in ``tests/backends/nxdi_library``.
"""
