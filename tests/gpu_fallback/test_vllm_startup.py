"""How the vLLM engine is started, checked in a fresh interpreter against vLLM itself.

No GPU here, so the CUDA path is checked by its conditions: ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
is already set when ``vllm`` is first imported (so vLLM's engine core is spawned, never forked),
and no ``torch.cuda`` call comes from neuron-lmi's code, directly or through a library it calls
(such a call initialises the CUDA driver in the server process, and a forked child then cannot use
it); vLLM's own import-time probes, which ``vllm serve`` makes as well, are told apart.
``AsyncLLM.from_engine_args`` is replaced by a recorder that builds vLLM's real ``VllmConfig`` from
the arguments it receives, so the test also shows the usage context, LMI's defaults and the engine
arguments as vLLM resolves them, without starting an engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

SCRIPT = r"""
import asyncio, importlib.abc, json, os, sys, traceback
from types import SimpleNamespace

record = {"spawn_at_vllm_import": "vllm never imported"}


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" and record["spawn_at_vllm_import"] == "vllm never imported":
            record["spawn_at_vllm_import"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        return None


sys.meta_path.insert(0, Watch())
import torch

ours = []


def spy(name, real):
    def wrapper(*args, **kwargs):
        # The innermost caller that is neuron-lmi or vLLM decides whose call it is: vLLM's own
        # import (triton's driver probe) happens under `vllm serve` too; ours must not happen.
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = frame.filename
            if os.sep + "vllm" + os.sep in path:
                break
            if any(os.sep + pkg + os.sep in path for pkg in ("gpu_fallback", "neuron_lmi")):
                ours.append(f"{name} <- {path}:{frame.lineno}")
                break
        return real(*args, **kwargs)

    return wrapper


for name in ("is_available", "device_count", "init", "current_device", "_lazy_init"):
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))

from pathlib import Path

from gpu_fallback.config import vllm_config_from_resolved
from gpu_fallback.engine import VllmEngine
from neuron_lmi.backends.lora import resolve_lora
from neuron_lmi.config import load_config

model = sys.argv[1]
options = {
    "SM_MODEL_DIR": "/nonexistent",
    "OPTION_ENABLE_PREFIX_CACHING": "true",
    "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "1024",
    "OPTION_TOKENIZER_MODE": "hf",
    "OPTION_DTYPE": "fp32",
    # Typed by the loader, mapped onto vLLM's engine arguments (gpu_fallback.config.typed_engine_args).
    "OPTION_ENABLE_LORA": "true",
    "OPTION_MAX_LORAS": "2",
    "OPTION_MAX_LORA_RANK": "8",
    "OPTION_MAX_CPU_LORAS": "3",
    "OPTION_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}',
}
resolved = load_config({"model_id": model, "backend": "vllm"}, None, options)
lora = resolve_lora(resolved, Path(model), options)
config = vllm_config_from_resolved(resolved, model, "smollm2", tp_degree=1, lora=lora)
record["n_positions_configured"] = config.n_positions
record["loader_n_positions"] = resolved.config.batching.n_positions

from vllm.v1.engine.async_llm import AsyncLLM


def recorder(engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None):
    record["spawn_at_engine_build"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    record["usage_context"] = getattr(usage_context, "value", str(usage_context))
    vc = engine_args.create_engine_config(usage_context)
    record["max_num_seqs"] = vc.scheduler_config.max_num_seqs
    record["max_num_batched_tokens"] = vc.scheduler_config.max_num_batched_tokens
    record["max_model_len"] = vc.model_config.max_model_len
    record["enable_prefix_caching"] = vc.cache_config.enable_prefix_caching
    record["tokenizer_mode"] = vc.model_config.tokenizer_mode
    record["tensor_parallel_size"] = vc.parallel_config.tensor_parallel_size
    lc, sc = vc.lora_config, vc.speculative_config
    record["lora"] = [lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras] if lc is not None else None
    record["speculative"] = [sc.method, sc.num_speculative_tokens] if sc is not None else None

    async def no_op(*args):
        return True

    return SimpleNamespace(
        model_config=vc.model_config, errored=False, shutdown=lambda: None, add_lora=no_op, remove_lora=no_op
    )


AsyncLLM.from_engine_args = staticmethod(recorder)
engine = VllmEngine(config)
asyncio.run(engine.start())
record["sampling_defaults"] = engine.sampling_defaults
record["torch_cuda_calls_from_neuron_lmi"] = ours
record["cuda_initialized"] = torch.cuda.is_initialized()
print("RECORD " + json.dumps(record))
"""


@pytest.fixture(scope="module")
def startup(smollm2_safetensors: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # The model folder with a generation_config.json carrying sampling defaults, as Hub models do.
    model = tmp_path_factory.mktemp("smollm2_gen") / "model"
    shutil.copytree(smollm2_safetensors, model, symlinks=True)
    gen = (
        json.loads((model / "generation_config.json").read_text())
        if (model / "generation_config.json").is_file()
        else {}
    )
    gen.update({"temperature": 0.3, "top_p": 0.8, "top_k": 20})
    (model / "generation_config.json").write_text(json.dumps(gen))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RECORD ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RECORD "))


def test_spawn_is_set_before_vllm_is_imported(startup: dict) -> None:
    assert startup["spawn_at_vllm_import"] == "spawn"
    assert startup["spawn_at_engine_build"] == "spawn"


def test_no_cuda_initialisation_from_our_code(startup: dict) -> None:
    assert startup["torch_cuda_calls_from_neuron_lmi"] == []
    assert startup["cuda_initialized"] is False


def test_engine_is_built_as_vllms_openai_server_builds_it(startup: dict) -> None:
    assert startup["usage_context"] == "OPENAI_API_SERVER"
    assert startup["max_num_seqs"] == 256  # LMI on vLLM
    assert startup["tensor_parallel_size"] == 1  # tp "max" on a host with no GPU
    # The model's own length (SmolLM2: 8192), not the loader's min(8192, 4096) Neuron default.
    assert startup["loader_n_positions"] == 4096 and startup["n_positions_configured"] is None
    assert startup["max_model_len"] == 8192


def test_engine_arguments_reach_vllm(startup: dict) -> None:
    assert startup["enable_prefix_caching"] is True
    assert startup["max_num_batched_tokens"] == 1024  # LMI's max_rolling_batch_prefill_tokens
    assert startup["tokenizer_mode"] == "hf"
    assert startup["lora"] == [2, 8, 3]  # option.enable_lora and its kin, from the typed config
    assert startup["speculative"] == ["ngram", 3]


def test_generation_config_defaults_are_read(startup: dict) -> None:
    defaults = startup["sampling_defaults"]
    assert (defaults["temperature"], defaults["top_p"], defaults["top_k"]) == (0.3, 0.8, 20)
