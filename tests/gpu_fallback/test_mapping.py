"""The vLLM adapter's pure translations and its engine wrapper, without vLLM (stand-in objects)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from gpu_fallback.config import engine_args_kwargs, load_chat_template
from gpu_fallback.mapping import NO_TOKEN_ID, delta_to_events, map_finish_reason, sampling_kwargs, top_tokens
from neuron_lmi.engine.types import FinishReason, SamplingParams, StopText
from tests.gpu_fallback.conftest import engine_config


def test_importing_gpu_fallback_does_not_import_vllm() -> None:
    # In a fresh interpreter: in the vLLM tier this session has imported vLLM already.
    code = (
        "import sys, gpu_fallback, gpu_fallback.engine, gpu_fallback.serve\n"
        "assert gpu_fallback.VllmEngine.backend_name == 'vllm'\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        (None, None, None),
        ("length", None, FinishReason.LENGTH),
        ("stop", None, FinishReason.EOS_TOKEN),
        ("stop", 2, FinishReason.EOS_TOKEN),  # a stop token id is an end-of-sequence token
        ("stop", "\n\n", FinishReason.STOP_SEQUENCE),
        ("abort", None, FinishReason.ABORT),
        ("error", None, FinishReason.ERROR),
    ],
)
def test_finish_reason(reason, stop_reason, expected) -> None:
    assert map_finish_reason(reason, stop_reason) is expected


def test_sampling_kwargs() -> None:
    params = SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_k=40,
        top_p=0.9,
        repetition_penalty=1.2,
        stop=("\n", "END"),
        seed=3,
        top_n_tokens=4,
        ignore_eos=True,
    )
    kw = sampling_kwargs(params)
    assert kw["max_tokens"] == 7 and kw["temperature"] == 0.5 and kw["top_k"] == 40 and kw["top_p"] == 0.9
    assert kw["repetition_penalty"] == 1.2 and kw["seed"] == 3 and kw["ignore_eos"] is True
    assert kw["stop"] == ["\n", "END"] and kw["logprobs"] == 4 and kw["n"] == 1
    assert kw["include_stop_str_in_output"] is False and kw["skip_special_tokens"] is True
    assert "stop_token_ids" not in kw
    kept = SamplingParams(
        stop=("x",), stop_text=StopText.TOKEN, skip_special_tokens=False, stop_token_ids=(5,)
    )
    kw = sampling_kwargs(kept)
    assert kw["include_stop_str_in_output"] is True and kw["skip_special_tokens"] is False
    assert kw["stop_token_ids"] == [5]
    greedy = sampling_kwargs(SamplingParams())
    # Greedy and no alternatives still ask for the chosen token's log-probability (logprobs=0).
    assert greedy["temperature"] == 0.0 and greedy["logprobs"] == 0 and greedy["stop"] is None
    assert greedy["top_k"] == 0 and greedy["top_p"] == 1.0 and greedy["seed"] is None
    # A caller that reads no log-probabilities does not make vLLM compute them.
    assert sampling_kwargs(SamplingParams(logprobs=False))["logprobs"] is None
    assert sampling_kwargs(SamplingParams(logprobs=False, top_n_tokens=2))["logprobs"] == 2


def lp(value, text=None, rank=None):
    return NS(logprob=value, rank=rank, decoded_token=text)


def completion(ids, text, logprobs=None, finish=None, stop_reason=None):
    return NS(token_ids=ids, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)


def test_top_tokens_sorted_and_cut() -> None:
    # Sampled token 9 has rank 5: with top_n=2 it is not an alternative.
    pos = {9: lp(-3.0, "x"), 4: lp(-0.1, "a"), 5: lp(-0.5, "b")}
    assert [(t.id, t.text) for t in top_tokens(pos, 2)] == [(4, "a"), (5, "b")]
    assert top_tokens(pos, 0) == () and top_tokens(None, 3) == ()


def test_delta_to_events_one_token_per_event() -> None:
    decode = {7: "Hel", 8: "lo"}.__getitem__
    first = delta_to_events("r", 0, 5, completion([7], "Hel", [{7: lp(-0.2, "Hel")}]), 0, {2}, decode)
    last = delta_to_events(
        "r", 1, 5, completion([2], "", [{2: lp(-0.01, "<|im_end|>")}], "stop"), 0, {2}, decode
    )
    assert [(e.index, e.token_id, e.text, e.token_text, e.special) for e in first + last] == [
        (0, 7, "Hel", "Hel", False),
        (1, 2, "", "<|im_end|>", True),
    ]
    assert first[0].finish_reason is None and last[0].finish_reason is FinishReason.EOS_TOKEN
    assert first[0].logprob == -0.2 and first[0].prompt_tokens == 5


def test_delta_with_several_tokens_keeps_text_whole() -> None:
    # A lagging consumer gets merged deltas: the text rides on the last token, nothing is lost.
    logprobs = [{7: lp(-0.1, "Hel"), 3: lp(-2.0, "Hi")}, {8: lp(-0.3, "lo")}]
    events = delta_to_events("r", 4, 2, completion([7, 8], "Hello", logprobs, "length"), 1, set(), str)
    assert [e.index for e in events] == [4, 5]
    assert [e.text for e in events] == ["", "Hello"]
    assert [e.finish_reason for e in events] == [None, FinishReason.LENGTH]
    assert [t.id for t in events[0].top_tokens] == [7]


def test_delta_without_logprobs_decodes_token_text() -> None:
    events = delta_to_events("r", 0, 1, completion([5], " the"), 0, set(), lambda t: f"<{t}>")
    assert events[0].token_text == "<5>" and events[0].logprob == 0.0


def test_tokenless_final_delta_closes_the_stream() -> None:
    (event,) = delta_to_events("r", 3, 1, completion([], "", None, "abort"), 0, set(), str)
    assert event.token_id == NO_TOKEN_ID and event.finish_reason is FinishReason.ABORT and event.index == 3
    assert delta_to_events("r", 3, 1, completion([], ""), 0, set(), str) == []


def test_stop_string_final_delta() -> None:
    (event,) = delta_to_events(
        "r", 0, 1, completion([11], "", [{11: lp(-1.0, " END")}], "stop", "END"), 0, set(), str
    )
    assert event.finish_reason is FinishReason.STOP_SEQUENCE and event.text == ""


def test_engine_args_mapping(tmp_path) -> None:
    cfg = engine_config(
        "ignored-by-args",
        tensor_parallel_degree=2,
        max_rolling_batch_size=16,
        n_positions=2048,
        dtype="bf16",
        enforce_eager=True,
        gpu_memory_utilization=0.8,
    )
    kw = engine_args_kwargs(cfg, tmp_path)
    assert kw["model"] == kw["tokenizer"] == str(tmp_path)
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 16 and kw["max_model_len"] == 2048
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == 0.8
    assert "served_model_name" not in kw  # None is left to vLLM's default
    tp_max = engine_config("m", tensor_parallel_degree="max", dtype="fp32")
    assert engine_args_kwargs(tp_max, tmp_path, device_count=4)["tensor_parallel_size"] == 4
    assert engine_args_kwargs(tp_max, tmp_path)["dtype"] == "float32"
    assert "max_model_len" not in engine_args_kwargs(tp_max, tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_degree": 0}, "tensor_parallel_degree"),
        ({"dtype": "int3"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_rolling_batch_size": 0}, "max_rolling_batch_size"),
        ({"model": ""}, "model"),
    ],
)
def test_config_errors_name_the_field(fields, message) -> None:
    """The Python API's own checks; from LMI keys, the loader names the key (test_vllm_config.py)."""
    with pytest.raises(ValueError, match=message):
        engine_config("m", **fields)


def test_chat_template_inline_or_file(tmp_path) -> None:
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(inline) == inline
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert load_chat_template(str(path)) == inline
    assert load_chat_template(None) is None
