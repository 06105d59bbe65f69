"""Mixed prefill + decode steps and prefix reuse, driven through ``EngineCore`` with a fake runner.

The fake runner does no math: it keeps the real ``RowTable`` bookkeeping and records what each step
asked for, so these tests check the engine's decisions (chunking, row placement, copies, row
accounting), not the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from cache_api import RowTable
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.scheduler import ChunkedPrefill, WholePrompts
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

VOCAB = 400


class FakeRunner(ForwardByKind):
    """Records ``(kind, rows, token counts)`` per call; every logit row picks token 100 + row."""

    def __init__(self, n_rows: int = 8, n_positions: int = 1024, extend: bool = True) -> None:
        self.rows = RowTable(n_rows, n_positions)
        self.vocab_size, self.n_positions = VOCAB, n_positions
        self.capabilities = RunnerCapabilities(extend=extend)
        self.calls: list[tuple[str, list[int], list[int]]] = []

    def _logits(self, rows: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(len(rows), VOCAB)
        out[torch.arange(len(rows)), torch.tensor(list(rows)) + 100] = 1.0
        return out

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        for row, prompt in zip(rows, prompts, strict=True):
            self.rows.set_length(row, len(prompt))
        self.calls.append(("prefill", list(rows), [len(p) for p in prompts]))
        return self._logits(rows)

    def extend(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        for row, chunk in zip(rows, chunks, strict=True):
            self.rows.set_length(row, self.rows.length(row) + len(chunk))
        self.calls.append(("extend", list(rows), [len(c) for c in chunks]))
        return self._logits(rows)

    def copy(self, src: int, dst: int, n: int) -> None:
        self.rows.check_in_use(src)
        self.rows.set_length(dst, n)
        self.calls.append(("copy", [src, dst], [n]))

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self.rows.reserve_next(rows)
        self.calls.append(("decode", list(rows), [1] * len(rows)))
        return self._logits(rows)

    def step_calls(self) -> list[tuple[str, list[int], list[int]]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def add(core: EngineCore, prompt: list[int], new_tokens: int) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    core.add(core.make_request(prompt, params, sink=events.append))
    return events


def prompt(n: int, first: int = 3) -> list[int]:
    return [first + i % 90 for i in range(n)]


def test_long_prompts_arriving_never_freeze_the_running_streams(tokenizer) -> None:
    runner = FakeRunner()
    core = EngineCore(runner, tokenizer, [0], prefill=ChunkedPrefill(step_tokens=64, min_chunk=16))
    streams = [add(core, prompt(10, first=3 + i), 40) for i in range(4)]
    core.step()
    assert [k for k, *_ in runner.step_calls()] == ["prefill"]  # four short prompts, one call
    longs = [add(core, prompt(300, first=50 + i), 3) for i in range(2)]
    steps = 0
    while not all(events for events in longs):
        core.step()
        steps += 1
        calls = runner.step_calls()
        decoded = [rows for kind, rows, _ in calls if kind == "decode"]
        assert decoded and len(decoded[0]) >= 4  # every stream got a token in every step
        prompt_tokens = sum(sum(n) for kind, _, n in calls if kind in ("prefill", "extend"))
        assert prompt_tokens <= 64 - 4
    assert steps == 5 + 6  # 300 prompt tokens at 60 a step, then 300 at 59 (the first long one decodes)
    assert all(len(events) == 1 + steps for events in streams)
    while core.has_work():
        core.step()
    assert all(e[-1].finish_reason is FinishReason.LENGTH for e in [*streams, *longs])
    assert runner.rows.occupancy().rows_used == 0


def test_a_runner_without_extend_gets_whole_prompts_and_no_reuse(tokenizer) -> None:
    runner = FakeRunner(extend=False)
    with pytest.raises(ValueError, match="cannot extend"):
        EngineCore(runner, tokenizer, [0], prefill=ChunkedPrefill())
    core = EngineCore(runner, tokenizer, [0])
    shared = prompt(200)
    for tail in (7, 8):
        add(core, [*shared, tail], 2)
        while core.has_work():
            core.step()
    kinds = [(kind, n) for kind, _, n in runner.calls if kind != "decode"]
    assert kinds == [("prefill", [201]), ("prefill", [201])]
    assert runner.rows.occupancy().rows_used == 0 and not any(runner.rows.retained(r) for r in range(8))


def test_a_finished_rows_prefix_is_claimed_and_a_running_rows_prefix_is_copied(tokenizer) -> None:
    runner = FakeRunner()
    core = EngineCore(runner, tokenizer, [0], prefill=WholePrompts(4096))
    system = prompt(120)
    add(core, [*system, 1, 2], 2)
    while core.has_work():
        core.step()
    (first_row,) = {rows[0] for kind, rows, _ in runner.step_calls() if kind == "prefill"}
    assert runner.rows.retained(first_row) == 123  # 122 prompt tokens + the first output

    add(core, [*system, 3, 4, 5], 50)  # claims the retained row whole: no copy, 3 tokens computed
    core.step()
    assert runner.step_calls() == [("extend", [first_row], [3])]
    add(core, [*system, 6], 1)  # the claimed row is running now: its prefix is copied
    core.step()
    calls = runner.step_calls()
    copy, extend = calls[0], calls[1]
    assert copy[0] == "copy" and copy[1][0] == first_row and copy[2] == [120]
    assert extend == ("extend", [copy[1][1]], [1])
    while core.has_work():
        core.step()
    assert runner.rows.occupancy().rows_used == 0


def test_no_row_leaks_when_a_request_is_aborted_between_prompt_chunks(tokenizer) -> None:
    runner = FakeRunner(n_rows=2)
    core = EngineCore(runner, tokenizer, [0], prefill=ChunkedPrefill(step_tokens=32, min_chunk=16))
    events = add(core, prompt(100), 5)
    core.step()
    core.step()
    request_id = next(iter(core.requests))
    assert core.abort(request_id)
    assert events[-1].finish_reason is FinishReason.ABORT and events[-1].index == 0
    assert runner.rows.occupancy().rows_used == 0
    assert sorted(runner.rows.retained(r) for r in range(2)) == [0, 64]  # the computed part is kept
    again = add(core, prompt(100), 2)  # and reused: only the 36 remaining tokens are computed
    while core.has_work():
        core.step()
    assert sum(sum(n) for kind, _, n in runner.calls if kind in ("prefill", "extend")) == 64 + 36
    assert again[-1].finish_reason is FinishReason.LENGTH
    assert runner.rows.occupancy().rows_used == 0


def test_a_mixed_steps_runner_gets_each_step_as_one_extend(tokenizer) -> None:
    """``mixed_steps``: the decodes ride in the step's one ``extend`` call as one-token chunks (the
    row's last token after the positions it holds), beside the prompt chunks; the rows hold what
    the two-call engine leaves, and the streams get the same tokens."""
    events: dict[bool, list[list[TokenEvent]]] = {}
    for mixed in (False, True):
        runner = FakeRunner()
        runner.capabilities = RunnerCapabilities(extend=True, mixed_steps=mixed)
        core = EngineCore(runner, tokenizer, [0], prefill=ChunkedPrefill(step_tokens=64, min_chunk=16))
        streams = [add(core, prompt(10, first=3 + i), 12) for i in range(3)]
        core.step()
        runner.step_calls()
        streams.append(add(core, prompt(100, first=60), 4))  # joins while the three decode
        lengths_seen, checked = [], 0
        while core.has_work():
            core.step()
            calls = runner.step_calls()
            if mixed:
                assert len(calls) == 1 and calls[0][0] == "extend"
                lengths_seen.append(calls[0][2])
            for row, stream in enumerate(streams[:3]):  # a decoding row holds all but the newest token
                if row in runner.rows.in_use() and not stream[-1].finish_reason:
                    assert runner.rows.length(row) == 10 + len(stream) - 1
                    checked += 1
        events[mixed] = streams
        assert checked == 3 * 10 and runner.rows.occupancy().rows_used == 0
    assert lengths_seen[0] == [61, 1, 1, 1] and lengths_seen[1] == [39, 1, 1, 1]  # chunk, decodes
    assert [[e.token_id for e in s] for s in events[True]] == [[e.token_id for e in s] for s in events[False]]
