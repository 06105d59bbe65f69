"""The ``ModelRunner`` protocol (``base``): one model step on one backend. Each backend's runner lives
in its own folder (``backends/cpu/runner.py``, ``backends/tnx/runner.py``, ``backends/nxdi/runner.py``)
and owns its bucketing, padding and KV tensors."""
