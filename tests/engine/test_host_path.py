"""The host path's parts on their own: batched delivery, the draw (native and Python kernels), the step
clock, text."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.engine.detokenizer import TextStream
from neuron_lmi.engine.step_clock import ForwardTimer, StepClock
from neuron_lmi.engine.streams import Mailbox, post, read_stream
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent
from neuron_lmi.models import ops, token_draw
from neuron_lmi.runners.base import BatchKind, StepBatch
from neuron_lmi.server.metrics import ServerMetrics


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _event(i: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("r", i, 5, "x", "x", -1.0, False, 3, finish_reason=finish)


class _CountingLoop:
    """Stands in for an event loop: counts the hops and runs them later, in order."""

    def __init__(self) -> None:
        self.hops: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.hops.append((fn, args))

    def run(self) -> None:
        for fn, args in self.hops:
            fn(*args)


def test_a_step_reaches_its_event_loop_in_one_hop() -> None:
    loop = _CountingLoop()
    boxes = [Mailbox(loop) for _ in range(64)]  # type: ignore[arg-type]
    post([(box, _event(0)) for box in boxes])
    assert len(loop.hops) == 1
    loop.run()
    assert all(len(box.events) == 1 for box in boxes)


async def test_a_mailbox_stream_ends_with_its_finish_and_an_early_close_abandons() -> None:
    box = Mailbox(asyncio.get_running_loop())
    post([(box, _event(0)), (box, _event(1, FinishReason.LENGTH)), (box, _event(2))])
    events = [e async for e in read_stream(box, lambda: pytest.fail("abandoned"), lambda: True)]
    assert [e.index for e in events] == [0, 1]  # nothing after the finish

    abandoned: list[bool] = []
    box = Mailbox(asyncio.get_running_loop())
    post([(box, _event(0))])
    stream = read_stream(box, lambda: abandoned.append(True), lambda: True)
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert abandoned == [True]


async def test_a_failed_mailbox_raises_after_the_events_before_it() -> None:
    box = Mailbox(asyncio.get_running_loop())
    post([(box, _event(0)), (box, ValueError("refused"))])
    stream = read_stream(box, lambda: None, lambda: True)
    assert (await anext(stream)).index == 0
    with pytest.raises(ValueError, match="refused"):
        await anext(stream)


def _draw(kernel: str, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    if kernel == "python":
        return token_draw.reference(logits, uniform)
    assert ops.kernels() == "native"
    return torch.ops.neuron_lmi.draw_from_logits(logits, uniform)


@pytest.mark.parametrize("kernel", ["native", "python"])
@pytest.mark.parametrize("vocab", [4096, 1000])  # whole blocks, and a last block cut short
def test_draw_follows_the_distribution_and_never_picks_zero_mass(kernel: str, vocab: int) -> None:
    probs = torch.zeros(vocab)
    support = torch.tensor([0, 255, 256, 511, vocab - 1])  # block edges included
    weights = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    probs[support] = weights
    n = 4000
    logits = (probs.log() + 3.0).expand(n, vocab).contiguous()  # masked tokens: -inf
    picked = _draw(kernel, logits, torch.rand(n, generator=torch.Generator().manual_seed(0)))
    assert set(picked.tolist()) <= set(support.tolist())
    freq = torch.bincount(picked, minlength=vocab)[support].float() / n
    assert torch.allclose(freq, weights, atol=0.03)


def test_the_native_draw_picks_what_softmax_and_the_cdf_pick() -> None:
    """Same logits, same uniform numbers: the same tokens, but where a number falls within rounding of
    a boundary between two tokens (the kernels' exp and sums differ in the last bits)."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(512, 1000, generator=generator) * 3
    logits[:, ::7] = float("-inf")
    uniform = torch.rand(512, generator=generator)
    native_picks, python_picks = _draw("native", logits, uniform), _draw("python", logits, uniform)
    assert (native_picks == python_picks).float().mean() >= 0.99
    assert not bool((native_picks % 7 == 0).any())


def test_draw_is_reproducible_per_row_whatever_the_batch() -> None:
    ops.kernels()  # the op's kernel, as the engine registers it at start-up
    torch.manual_seed(1)
    logits = torch.randn(3, 512)
    alone = token_draw.draw_from_logits(logits[1:2], [torch.Generator().manual_seed(7)])
    batched = token_draw.draw_from_logits(logits, [torch.Generator().manual_seed(s) for s in (3, 7, 9)])
    assert batched[1] == alone[0]


def _decode_batch(rows: list[int]) -> StepBatch:
    n = len(rows)
    return StepBatch(BatchKind.DECODE, tuple(rows), (9,) * n, ((5,),) * n, (True,) * n, decodes=n)


def _forward(timer: ForwardTimer, batch: StepBatch) -> str:
    return timer.timed(lambda: "logits", batch.decodes)  # as the core times its runner's forward


def test_step_clock_splits_host_from_model_time() -> None:
    timer = ForwardTimer()
    clock = StepClock(timer, n_rows=4, window=2)
    for _ in range(3):
        clock.begin()
        assert _forward(timer, _decode_batch([0, 1, 2])) == "logits"
        clock.end()
    clock.begin()
    clock.end()  # an iteration without a decode is counted, not averaged
    snap = clock.snapshot()
    assert snap["steps"] == 4 and snap["decode_batch"] == 3
    assert snap["host_ms_per_step"] >= 0 and snap["model_ms_per_step"] >= 0
    assert snap["host_ms_per_full_step"] == 0  # 3 of 4 rows is not a full batch (90%)


def test_a_mixed_steps_decodes_are_its_one_token_chunks() -> None:
    """A step sent as one EXTEND batch (``mixed_steps``) decodes the rows whose line is a decode:
    four of them make a full batch, the 30-token prompt chunk beside them does not count."""
    timer = ForwardTimer()
    clock = StepClock(timer, n_rows=4, window=2)
    clock.begin()
    chunks = ((5,), (6,), (7,), (8,), tuple(range(30)))
    mixed = StepBatch(BatchKind.EXTEND, (0, 1, 2, 3, 4), (9, 9, 9, 9, 0), chunks, (True,) * 5, decodes=4)
    assert _forward(timer, mixed) == "logits"
    clock.end()
    snap = clock.snapshot()
    assert timer.decoded_rows == 4 and snap["decode_batch"] == 4
    assert snap["host_ms_per_full_step"] + snap["model_ms_per_full_step"] > 0  # in the full-batch window


def test_the_core_times_every_forward_it_makes(tiny_llm: Any) -> None:
    """Prefill, decodes and prompt scoring all count as model time (the core times them itself)."""
    core = tiny_llm.core
    timer = core.forward_timer
    before = (timer.forward_s, timer.decoded_rows)
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=0, ignore_eos=True)
    core.add(core.make_request([5, 6, 7], params))
    while core.has_work():
        core.step()
    assert timer.forward_s > before[0] and timer.decoded_rows - before[1] == 2


def test_text_stream_holds_a_possible_stop_and_cuts_a_real_one(tokenizer: Any) -> None:
    ids = tokenizer.encode(" Hello world. Goodbye now.")
    text = TextStream(tokenizer, tokenizer.encode("Say:"), ("Good",))
    out, finish = "", None
    for token in ids:
        piece, finish = text.add(token, None)
        out += piece
        if finish is not None:
            break
    assert finish is FinishReason.STOP_SEQUENCE
    assert out == " Hello world. "
    # Length and EOS flush what was held; EOS prints nothing itself.
    text = TextStream(tokenizer, [], ())
    assert text.add(ids[0], FinishReason.LENGTH)[1] is FinishReason.LENGTH
    assert TextStream(tokenizer, [], ()).add(ids[0], FinishReason.EOS_TOKEN) == ("", FinishReason.EOS_TOKEN)


class _Engine:
    def stats(self) -> Any:
        from neuron_lmi.engine.types import EngineStats

        return EngineStats(4, 1, 10, 0, 1, True, {"host_ms_per_step": 1.5, "decode_batch": 1.0})

    def prometheus_collectors(self) -> list[Any]:
        return []


def test_metrics_export_the_engines_own_step_times() -> None:
    from prometheus_client import generate_latest

    text = generate_latest(ServerMetrics(_Engine()).registry).decode()  # type: ignore[arg-type]
    assert "neuron_lmi_engine_host_ms_per_step 1.5" in text
    assert "neuron_lmi_engine_decode_batch 1.0" in text
    assert "neuron_lmi_engine_model_ms_per_step" not in text  # absent from this engine's stats
