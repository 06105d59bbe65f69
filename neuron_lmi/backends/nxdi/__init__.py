"""The NxD Inference backend (``neuronx-distributed-inference``, Neuron SDK 2.2x and later).

``plan`` maps our configuration to NxD Inference's constructor arguments (pure, no Neuron import),
``support`` is the Neuron SDK matrix (which release runs where), ``artifacts`` builds, compiles and
loads the application through the compile cache (lazy imports), ``runner`` drives its
continuous-batching forward behind the ``ModelRunner`` protocol, and ``build`` makes the engine. The
CPU stand-in tests drive it with is ``neuron_lmi.testing.nxdi_contract``, checked against the
library itself in ``tests/backends/nxdi_library``.
"""
