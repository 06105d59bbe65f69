"""One small module per backend, each registering its engine builder (``neuron_lmi.backends.registry``)."""
