"""The CPU backend (``cpu``): our torch models behind the rolling-batch engine, eager or compiled.

* ``backend``: the backend object the registry holds: ``plan`` (the model as served and the graphs
  it runs, one compile-cache unit per package) -> ``compile`` -> ``load`` (the runner, complete);
  ``engine`` (``neuron-lmi serve``): resolved configuration -> ``CpuEngineOptions`` -> the engine in
  its own process, which walks that path;
* ``engine``: ``CpuEngineOptions`` (the CPU engine's view of the configuration, and the Python API's
  options) and the assembly of an ``EngineCore`` from them: checkpoint, model, tensor parallelism,
  quantization;
* ``runner``: ``CpuRunner``, the eager runner (buckets, padding, prompt packing) that also runs the
  compiled step and extend when loaded; ``buckets``: its shape policy;
* ``compiled_decode``, ``compiled_extend``: the step and extend graphs with frozen weights, compiled
  once into the compile cache (the default unless ``option.enforce_eager``);
* ``aot``, ``aot_runner``: the AOTInductor package per bucket (``neuron-lmi compile --target cpu``)
  and ``CompiledCpuRunner`` over them (``option.compiled_graph_path``);
* ``graphs``: the modules those packages are traced from.

Submodules import torch only when used; importing this package is cheap.
"""
