"""The NxD Inference backend (``neuronx-distributed-inference``, Neuron SDK 2.2x and later).

``plan`` maps our configuration to NxD Inference's constructor arguments (pure, no Neuron import),
``artifacts`` builds, compiles and loads the application through the compile cache (lazy imports),
``runner`` drives its continuous-batching forward behind the ``ModelRunner`` protocol, and
``contract`` is the CPU stand-in that honours the same forward contract for tests.
"""
