"""Multi-LoRA on the CPU engine: greedy output per adapter equals transformers on the merged weights
(PEFT's ``merge_and_unload``), with adapted and base lines in one batch; a slot shortage makes
requests wait (and reloads evicted adapters); prefix reuse never shares K/V across adapters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.backends.cpu.lora import adapter_table
from neuron_lmi.config.speculative import SpeculativeConfig
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams, UnknownAdapterError
from neuron_lmi.testing.lora import ATTENTION, MLP, make_tiny_adapter, merge_adapter, other_base

from .conftest import hf_greedy, random_prompts

NEW_TOKENS = 12
# name -> (rank, targets, alpha, rslora): ranks and targets differ, so the fused layouts do too.
ADAPTERS = {
    "qv": (4, ("q_proj", "v_proj"), 8.0, False),
    "mlp": (8, MLP, 16.0, True),
    "all": (2, ATTENTION + MLP, 4.0, False),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_tiny_adapter(root / name, tiny_llama_dir, rank, targets, alpha, seed=i, rslora=rslora)
        for i, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def references(tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Adapter name (None: the base) -> transformers' model with that adapter merged in."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("merged")
    paths: dict[str | None, Path] = {None: tiny_llama_dir}
    paths.update({name: merge_adapter(tiny_llama_dir, path, root / name) for name, path in adapters.items()})
    return {
        name: AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval()
        for name, p in paths.items()
    }


def lora_llm(model: Path, adapters: dict[str, Path], **keys: object) -> LLM:
    modules = " ".join(f"{name}={path}" for name, path in adapters.items())
    options = dict(max_rolling_batch_size=8, n_positions=128, max_lora_rank=8, max_loras=3) | keys
    return LLM(
        str(model), dtype="fp32", enforce_eager=True, enable_lora=True, lora_modules=modules, **options
    )


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path, adapters: dict[str, Path]) -> LLM:
    """Three slots for the three adapters (each test leaves them served as it found them)."""
    return lora_llm(tiny_llama_dir, adapters)


def check(llm: LLM, references, jobs: list[tuple[list[int], str | None]]) -> None:
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, adapter=a) for _, a in jobs]
    results = llm.generate([p for p, _ in jobs], params)
    for (prompt, adapter), result in zip(jobs, results, strict=True):
        assert result.error is None, result.error
        expected, _ = hf_greedy(references[adapter], prompt, NEW_TOKENS)
        assert result.token_ids == expected, f"adapter {adapter}"
    assert llm.core.runner.rows.occupancy().rows_used == 0


def test_adapters_and_base_in_one_batch_match_merged_weights(llm: LLM, references) -> None:
    prompts = random_prompts([7, 20, 5, 33, 11], seed=5)
    jobs = list(zip(prompts, ["qv", "mlp", None, "all", "qv"], strict=True))
    # Each adapter changes the greedy tokens, or the parity below would prove nothing.
    base = [hf_greedy(references[None], p, NEW_TOKENS)[0] for p in prompts[:2]]
    assert base[0] != hf_greedy(references["qv"], prompts[0], NEW_TOKENS)[0]
    assert base[1] != hf_greedy(references["mlp"], prompts[1], NEW_TOKENS)[0]
    check(llm, references, jobs)


def test_one_slot_makes_requests_wait_and_reloads_evicted_adapters(
    tiny_llama_dir, adapters, references
) -> None:
    """One slot, one host copy: each adapter runs after the previous one's requests end, and an
    evicted adapter is read from disk again; the base model runs beside whichever is resident."""
    llm = lora_llm(tiny_llama_dir, adapters, max_loras=1, max_cpu_loras=1)
    prompts = random_prompts([9, 14, 6, 12], seed=6)
    check(llm, references, list(zip(prompts, ["qv", "all", None, "qv"], strict=True)))
    assert llm.core.adapters is not None and len(llm.core.adapters.resident()) == 1


def test_prefix_reuse_never_crosses_adapters(llm: LLM, references) -> None:
    """The same long prompt on the base model, then with an adapter: the retained row of the first
    must not seed the second (its K/V were computed without the adapter)."""
    prompt = random_prompts([40], seed=7)[0]
    check(llm, references, [(prompt, None)])
    check(llm, references, [(prompt, "all")])
    check(llm, references, [(prompt, "all")])  # and a row retained with the same adapter is reused


def test_unknown_adapter_and_unload_while_running(llm: LLM, adapters) -> None:
    with pytest.raises(UnknownAdapterError):
        llm.core.make_request([1, 2, 3], SamplingParams(max_new_tokens=4, adapter="nope"))
    request = llm.core.make_request(
        [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True, adapter="qv")
    )
    llm.core.add(request)
    llm.core.step()
    llm.core.unload_adapter("qv")  # refused from now on; the running request finishes
    with pytest.raises(UnknownAdapterError):
        llm.core.make_request([1, 2, 3], SamplingParams(max_new_tokens=4, adapter="qv"))
    while llm.core.has_work():
        llm.core.step()
    assert len(request.output_ids) == 4 and request.finish_reason.value == "length"
    assert "qv" not in llm.core.adapters.resident().values()  # type: ignore[union-attr]
    llm.core.load_adapter("qv", str(adapters["qv"]))  # the name can be used again
    assert "qv" in llm.core.adapter_names()


def test_refusals_name_the_adapter_and_reason(llm: LLM, tiny_llama_dir, adapters, tmp_path) -> None:
    big = make_tiny_adapter(tmp_path / "big", tiny_llama_dir, 16, ("q_proj",))
    with pytest.raises(InvalidRequestError, match=r"'big'.*rank 16 exceeds max_lora_rank=8"):
        llm.core.load_adapter("big", str(big))
    wide_base = other_base(tiny_llama_dir, tmp_path / "wide_base", hidden_size=128, head_dim=32)
    wide = make_tiny_adapter(tmp_path / "wide", wide_base, 4, ("q_proj",))
    with pytest.raises(InvalidRequestError, match=r"'wide': layer 0 q_proj.*another base model"):
        llm.core.load_adapter("wide", str(wide))
    llm.core.load_adapter("x", str(adapters["qv"]))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        llm.core.load_adapter("x", str(adapters["qv"]))
    llm.core.unload_adapter("x")
    lora = llm.options.lora
    assert lora is not None
    with pytest.raises(ValueError, match=r"option.lora_modules: adapter 'big'"):  # at start-up
        adapter_table(replace(lora, modules=(("big", str(big)),)), llm.core.runner.model)


def test_adapted_rows_verify_their_drafts_token_identical(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation beside adapters: a verify batch with adapted lines runs the eager extend with
    their slots and returns all their positions' logits, so greedy output is the output without
    speculation, adapted and base rows alike."""
    core = llm.core
    forward, sent = core.runner.forward, []
    monkeypatch.setattr(core.runner, "forward", lambda batch: sent.append(batch) or forward(batch))
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    speculating = EngineCore(
        core.runner, core.tokenizer, core.eos_token_ids, adapters=core.adapters, speculative=ngram
    )
    prompts = [p * 4 for p in random_prompts([7, 3, 5], seed=9)]  # the lookup drafts from the start
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, adapter=a) for a in ("qv", None, "all")]
    expected = llm.generate(prompts, params)
    got = LLM.from_core(speculating).generate(prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert a.error is None and b.error is None
        assert b.token_ids == a.token_ids
    counters = speculating.speculator.counters  # type: ignore[union-attr]
    assert counters.drafts > 0 and counters.accepted_tokens > 0
    assert any(b.adapters and b.logit_counts for b in sent)  # adapted verify lines were sent
    assert core.runner.rows.occupancy().rows_used == 0
