"""``option.speculative_config`` passed through to vLLM (#39 item 3), on vLLM's CPU build: n-gram
prompt lookup from the typed configuration, greedy tokens equal to transformers' (what vLLM gives
without speculation, ``test_vllm_real.py``), and vLLM's ``spec_decode`` counters show drafts were
proposed and accepted."""

from __future__ import annotations

import dataclasses

import pytest
import pytest_asyncio

from tests.gpu_fallback.conftest import vllm_skip_reason

_reason = vllm_skip_reason()
pytestmark = [
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
]

from gpu_fallback.config import vllm_config_from_resolved  # noqa: E402
from neuron_lmi.config.loader import load_config  # noqa: E402
from neuron_lmi.engine.types import SamplingParams  # noqa: E402
from tests.engine.conftest import hf_greedy  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# A prompt whose continuation copies from it, so that n-gram drafts are accepted.
COUNT = "one two three four five six seven eight nine ten."
COPY = f"{COUNT} {COUNT} one two"
NEW = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(vllm_env, smollm2_safetensors):
    from gpu_fallback.engine import VllmEngine

    model = str(smollm2_safetensors)
    resolved = load_config({"model_id": model, "speculative_config": SPEC}, None, {})
    config = vllm_config_from_resolved(resolved, model, "smollm2")  # vLLM's own field types
    assert config.extra_engine_args["speculative_config"] == SPEC
    extra = {**config.extra_engine_args, "enable_prefix_caching": False}
    eng = VllmEngine(
        dataclasses.replace(
            config,
            max_rolling_batch_size=2,
            n_positions=256,
            dtype="fp32",
            enforce_eager=True,
            extra_engine_args=extra,
        )
    )
    await eng.start()
    yield eng
    await eng.stop(grace_s=1.0)


def spec_counter(name: str) -> float:
    from gpu_fallback.metrics import VllmMetricsCollector

    return sum(
        sample.value
        for metric in VllmMetricsCollector().collect()
        for sample in metric.samples
        if sample.name == name
    )


async def test_ngram_greedy_equals_transformers(engine, smollm2_safetensors) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert engine._llm.vllm_config.speculative_config.method == "ngram"
    prompt = engine.tokenizer.encode(COPY)
    params = SamplingParams(max_new_tokens=NEW)
    events = [e async for e in engine.generate(engine.admit(prompt, params))]
    ids = [e.token_id for e in events if e.token_id >= 0]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_safetensors), dtype=torch.float32).eval()
    assert ids == hf_greedy(model, prompt, NEW)[0]
    assert spec_counter("vllm:spec_decode_num_drafts_total") > 0
    assert spec_counter("vllm:spec_decode_num_accepted_tokens_total") > 0
