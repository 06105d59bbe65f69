"""Turn a GGUF checkpoint into the Hugging Face safetensors layout vLLM loads.

vLLM's CPU build does not run GGUF's quantized kernels, so a GGUF model (the built-in ``smollm2``
among them) is dequantized once by transformers and written as safetensors plus tokenizer. Some
transformers releases refuse ``save_pretrained`` on a model loaded from GGUF, so the weights are
copied into a freshly built model of the same config, which saves normally.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# transformers' GGUF conversion picks <|im_start|> as SmolLM2's EOS; the GGUF metadata says <|im_end|>.
EOS_FIXES = {"<|im_start|>": "<|im_end|>"}


def default_cache_dir() -> Path:
    """Converted checkpoints live with the other fetched models (``NEURON_LMI_MODEL_CACHE``, the variable
    the manifests and the systemd unit set); ``NEURON_LMI_CACHE`` is this module's older name for it."""
    models = os.environ.get("NEURON_LMI_MODEL_CACHE")
    if models:
        return Path(models) / "vllm-models"
    root = os.environ.get("NEURON_LMI_CACHE") or os.path.join(Path.home(), ".cache", "neuron-lmi")
    return Path(root) / "vllm-models"


# Bumped whenever the written layout changes, so that stale cache entries are rebuilt.
LAYOUT_VERSION = 3
# transformers 5.x writes its own class name (TokenizersBackend), which 4.x cannot load; this one
# both read, so a converted directory serves the main environment and the vLLM one alike.
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _fingerprint(gguf: Path) -> str:
    st = gguf.stat()
    key = f"v{LAYOUT_VERSION}:{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def gguf_to_safetensors(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``gguf_path`` as ``config.json`` + ``model.safetensors`` + tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    torch_dtype = getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(**src, dtype=torch_dtype)
    config = AutoConfig.from_pretrained(**src)
    config.dtype = torch_dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head shows up as missing in some versions; anything else is a real mismatch.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
    tokenizer = AutoTokenizer.from_pretrained(**src)
    if tokenizer.eos_token in EOS_FIXES:
        tokenizer.eos_token = EOS_FIXES[tokenizer.eos_token]
        fresh.config.eos_token_id = tokenizer.eos_token_id
        if fresh.generation_config is not None:
            fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    _add_legacy_rope_theta(out / "config.json")
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return out


def _add_legacy_rope_theta(config_path: Path) -> None:
    """transformers 5.x nests rope_theta in rope_parameters; 4.x reads only the top-level key and
    would silently fall back to 10000. Write both so every reader builds the same model."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling {rope!r} has no portable spelling here")
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def ensure_safetensors_dir(model: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A directory vLLM can load for ``model``: a HF directory as is, a ``.gguf`` converted once (cached)."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"the vLLM backend needs a model directory or a .gguf file, got {model!r}")
    target = Path(cache_dir or default_cache_dir()) / f"{path.stem}-{_fingerprint(path)}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    log.info("converting %s to safetensors in %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        gguf_to_safetensors(path, tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic on one filesystem: a half-written cache entry is never used
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
