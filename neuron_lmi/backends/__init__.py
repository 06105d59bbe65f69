"""Which backend serves a model on this host (``dispatch``, ``host``), the builder registry
(``registry``), what the builders share (``common``), and one folder per backend: ``cpu``, ``nxdi``,
``tnx`` (vLLM's is the top-level ``gpu_fallback`` package)."""
