"""Shows vLLM's CPU LoRA "no adapter" bug (vllm-project/vllm#48421) through neuron-lmi's vLLM engine.

vLLM's CPU LoRA code marks a row without an adapter with index -1, which indexes the last LoRA
slot: a base-model request batched with adapter requests runs with the adapter in that slot once it
is filled. This starts vLLM's CPU build on SmolLM2 with two random adapters on two slots, runs each
request alone (the reference), then base + adapter requests together, and prints which rows differ.
A base row that prints DIFF shows the bug; exit status 1 then, 0 if every row matched.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        .venv-vllm/bin/python scripts/vllm_lora_slot_check.py      (30-90 s on 2 cores)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

PROMPT = "The capital of France is"


async def tokens(engine, adapter: str | None, new: int = 12) -> list[int]:
    from neuron_lmi.engine.types import SamplingParams

    params = SamplingParams(max_new_tokens=new, adapter=adapter)
    return [e.token_id async for e in engine.generate(engine.admit(PROMPT, params)) if e.token_id >= 0]


async def main() -> int:
    from gpu_fallback.config import vllm_config_from_resolved
    from gpu_fallback.convert import default_cache_dir, ensure_safetensors_dir
    from gpu_fallback.engine import VllmEngine
    from neuron_lmi.backends.lora import resolve_lora
    from neuron_lmi.config.loader import load_config
    from neuron_lmi.models.builtin import smollm2_gguf_path
    from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = ensure_safetensors_dir(smollm2_gguf_path(), default_cache_dir())
    root = Path(tempfile.mkdtemp(prefix="vllm_lora_slots_"))
    modules = [
        f"a={make_tiny_adapter(root / 'a', model, 8, ATTENTION, seed=1)}",
        f"b={make_tiny_adapter(root / 'b', model, 16, MLP, seed=2)}",
    ]
    cli = {"model_id": str(model), "enable_lora": True, "max_loras": 2, "lora_modules": modules}
    resolved = load_config(cli, None, {})
    config = vllm_config_from_resolved(resolved, str(model), "smollm2", lora=resolve_lora(resolved, model))
    extra = {**config.extra_engine_args, "enable_prefix_caching": False}
    sizes = {"max_rolling_batch_size": 4, "n_positions": 256, "dtype": "fp32", "enforce_eager": True}
    config = dataclasses.replace(config, **sizes, extra_engine_args=extra)
    engine = VllmEngine(config)
    await engine.start()
    try:
        alone = {name: await tokens(engine, name) for name in (None, "a", "b")}
        bad = False
        for batch in (["a", None], ["b", None], ["a", "b", None]):
            outs = await asyncio.gather(*(tokens(engine, name) for name in batch))
            rows = []
            for name, out in zip(batch, outs, strict=True):
                same = out == alone[name]
                bad |= not same
                rows.append(f"{name or 'base'}: {'ok' if same else 'DIFF'}")
            print(f"batched {batch}: " + ", ".join(rows), flush=True)
    finally:
        await engine.stop(grace_s=1.0)
    return 1 if bad else 0


if __name__ == "__main__":  # vLLM's CPU engine core is spawned: this module is imported again there
    sys.exit(asyncio.run(main()))
