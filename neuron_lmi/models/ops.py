"""Every ``neuron_lmi::`` op's CPU kernel, registered once per process: the native library where it
builds (``native``), else each op module's Python kernels.

This module sits above both. The op modules (``decode_attention``, ``lora_delta``,
``packed_linear``, ``token_draw``) define the ops' schemas and fake kernels on import, and the
library implements those ops, so they are imported before it loads. ``native`` builds and loads
the library and knows no op; no op module imports this one.
"""

from __future__ import annotations

import threading

from neuron_lmi.models import decode_attention, host_isa, lora_delta, native, packed_linear, token_draw

OP_MODULES = (decode_attention, lora_delta, packed_linear, token_draw)
BUILD_THREAD = "neuron-lmi-native-build"

_kernels: str | None = None  # "native" or "python", once registered
_builder: threading.Thread | None = None  # build_in_background's thread, started once a process
_lock = threading.Lock()


def kernels() -> str:
    """Register the CPU kernels of every op once per process and say which run: ``native`` (the
    library, built or taken from the cache), else ``python`` (each op module's
    ``register_python_kernels``, with a warning from the failed build)."""
    global _kernels
    if _kernels is not None:  # called per step by the sampler: registered once, nothing to ask
        return _kernels
    host_isa.request_amx()  # before any native kernel or package runs (host_isa says why)
    with _lock:
        if _kernels is None:
            if native.load_library():
                _kernels = "native"
            else:
                for module in OP_MODULES:
                    module.register_python_kernels()
                _kernels = "python"
    return _kernels


def build_in_background() -> None:
    """Start ``kernels`` on a thread. A first start on a host builds the library (about 10 s, one
    core) while the model loads and the graphs trace and compile, which keep one core busy most of
    that time; tracing needs the ops' schemas and fake kernels only (defined on import), and whatever
    must run an op calls ``kernels``, which waits for the build under its lock."""
    global _builder
    host_isa.request_amx()
    if _kernels is None and _builder is None:
        # Not a daemon: an interpreter exiting mid-build waits for it, since torch's builder would
        # otherwise leave its lock file in the build directory and the next build wait on it forever.
        _builder = threading.Thread(target=kernels, name=BUILD_THREAD)
        _builder.start()


def registered() -> str | None:
    """What ``kernels`` registered (``native``, ``python``), or None before its first call."""
    return _kernels
