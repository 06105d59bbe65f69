"""The synchronous rolling-batch engine: scheduler decisions applied to a runner, one step at a time.

Single-threaded by design: only the engine thread (or ``LLM.generate``) calls ``step``; requests
and aborts from other threads go through ``AsyncEngine``'s queues. The core works on token ids
only: every text (the printable text, each token's own, stop sequences) is the fronts'
(``engine.detokenizer.TextSink``, ``ProcessEngine``), off the step's critical path.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from neuron_lmi.config.options import DEFAULT_MAX_PREFILL_TOKENS
from neuron_lmi.config.speculative import DRAFT_MODEL, SpeculativeConfig
from neuron_lmi.engine.admission import Admission, AdmissionLimits, ValidRequest
from neuron_lmi.engine.device_sampling import host_field, line_sampling
from neuron_lmi.engine.draft_model import DraftModelProposer
from neuron_lmi.engine.grammar import GrammarCompiler
from neuron_lmi.engine.lora import AdapterTable
from neuron_lmi.engine.prefix import PrefixIndex
from neuron_lmi.engine.request import EventSink, Request, Status
from neuron_lmi.engine.scheduler import (
    DEFAULT_MIN_CHUNK,
    DEFAULT_STEP_TOKENS,
    ChunkedPrefill,
    PrefillPolicy,
    Scheduler,
    WholePrompts,
)
from neuron_lmi.engine.speculation import (
    SpecCounters,
    Speculator,
    check_fused_speculation,
    check_speculation,
    verify_tokens,
)
from neuron_lmi.engine.step_clock import ForwardTimer
from neuron_lmi.engine.step_output import LineSampler, closing_event, scored_prompt, speculative_lines
from neuron_lmi.engine.types import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    PromptToken,
    SamplingParams,
    TokenEvent,
    TopToken,
)
from neuron_lmi.models import ops
from neuron_lmi.runners.base import GREEDY_LINE, BatchKind, ModelRunner, StepBatch, capabilities_of

log = logging.getLogger(__name__)


class EngineCore:
    """Owns requests, the scheduler and the runner.

    Invariants: a RUNNING request holds exactly one KV row and a finished one holds none; every
    request ends with exactly one event whose ``finish_reason`` is set.

    The runner's ``RunnerCapabilities`` are read once, here. With ``extend`` the defaults are
    chunked prefill (``ChunkedPrefill``: ``DEFAULT_STEP_TOKENS`` per step shared with the decodes)
    and prefix reuse (a finished row retains its K/V until reallocated); elsewhere whole prompts
    within ``max_prefill_tokens``. The scheduler turns the capabilities into the step's batches
    (one mixed batch, or one per kind). With ``speculative`` (``option.speculative_config``),
    decoding rows verify n-gram drafts, or a draft model's (``draft_runner``, built by the backend:
    ``engine.draft_model``); a runner that cannot verify several tokens per row
    (``RunnerCapabilities.max_verify_tokens``) is refused here, at start-up.
    A runner that drafts on the device (``fused_speculation``: NxD Inference's fused speculation)
    gets no drafts: its DECODE lines come back with several accepted tokens each
    (``SampledStep.runs``), which are applied as a verified line's are.

    ``adapters`` (with a runner whose ``capabilities.lora``): the LoRA adapters it serves. A request
    holds its adapter from ``request_of`` until it finishes; the scheduler gives it a slot when it
    gets a row, and the slot writes that takes are applied before the step's batches.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefill: PrefillPolicy | None = None,
        prefix_reuse: bool = True,
        adapters: AdapterTable | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_runner: ModelRunner | None = None,
    ) -> None:
        self.runner = runner
        self.capabilities = capabilities = capabilities_of(runner)
        self.forward_timer = ForwardTimer()  # the model's share of each step (``StepClock``)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        # For synchronous users (``make_request``); capacity is the fronts' to check (they own the
        # queues): no queue bound here.
        self.admission = Admission(tokenizer.encode, self.admission_limits(0))
        if adapters is not None and not capabilities.lora:
            raise ValueError(f"{type(runner).__name__} has no LoRA slots for the adapters it was given")
        self.adapters = adapters
        if adapters is not None:
            self.admission.adapters = adapters.served
        self._stop_ids = sorted(self.eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, self._stop_ids)
        self.line_sampler = LineSampler(capabilities.device_sampling, type(runner).__name__, self._stop_ids)
        # The sampler's draw is a native kernel: built (once per host) or loaded now, at start-up,
        # rather than on the first sampled request.
        ops.kernels()
        extend = capabilities.extend
        if prefill is None:
            step = min(DEFAULT_STEP_TOKENS, max_prefill_tokens)
            prefill = ChunkedPrefill(step, min(DEFAULT_MIN_CHUNK, step)) if extend else None
        if prefill is not None and prefill.splits and not extend:
            raise ValueError(
                f"{type(prefill).__name__} splits prompts, which {type(runner).__name__} cannot extend"
            )
        prefix = PrefixIndex(runner.rows) if extend and prefix_reuse else None
        prefill = prefill or WholePrompts(max_prefill_tokens)
        self.speculator: Speculator | None = None
        # The device's drafts (fused speculation): counted here, as the speculator counts its own.
        self.fused_counters: SpecCounters | None = None
        if capabilities.fused_speculation:
            if speculative is not None:
                check_fused_speculation(speculative, capabilities, type(runner).__name__)
            self.fused_counters = SpecCounters(capabilities.fused_speculation - 1)
        elif speculative is not None:
            check_speculation(speculative, capabilities, type(runner).__name__, draft_runner is not None)
            proposer = None
            if speculative.method == DRAFT_MODEL and draft_runner is not None:
                n_rows, n_positions = runner.rows.n_rows, runner.n_positions
                proposer = DraftModelProposer(
                    draft_runner, runner.vocab_size, n_rows, n_positions, speculative.key
                )
            verifies = verify_tokens(capabilities)
            self.speculator = Speculator(speculative, verifies, runner.n_positions, proposer)
        self.scheduler = Scheduler(
            max_prefill_tokens, prefill, prefix, runner.rows, capabilities, adapters, self.speculator
        )
        self.requests: dict[str, Request] = {}
        self.steps = 0

    # -- requests -----------------------------------------------------------------------------
    def admission_limits(self, max_queue_size: int) -> AdmissionLimits:
        """What admission checks a request against, for a front whose queue holds ``max_queue_size``."""
        runner = self.runner
        return AdmissionLimits(
            runner.n_positions,
            runner.vocab_size,
            runner.rows.n_rows,
            max_queue_size,
            self.capabilities,
            type(runner).__name__,
        )

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        sink: EventSink | None = None,
    ) -> Request:
        """Admit and build a request, for a synchronous user (``LLM``, the benchmarks); raises
        ``InvalidRequestError`` naming the field. The fronts admit in the API process and call
        ``request_of``."""
        return self.request_of(self.admission.admit(prompt, params, request_id, self.requests), sink)

    def request_of(self, valid: ValidRequest, sink: EventSink | None = None) -> Request:
        """The request for an admitted ``valid``; trusts it (admission checked everything a
        request can get wrong). A grammar this tokenizer cannot serve still raises."""
        params = valid.params
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
        grammar = self.grammars.state(params.grammar) if params.grammar is not None else None
        adapter_id = None
        if params.adapter is not None:  # unloaded since admission: refused here (404)
            if self.adapters is None:
                raise InvalidRequestError("this engine serves no LoRA adapters", "adapter")
            adapter_id = self.adapters.hold(params.adapter)
        return Request(
            request_id=valid.request_id,
            prompt_ids=valid.prompt_ids,
            params=params,
            generator=generator,
            sink=sink,
            grammar=grammar,
            adapter_id=adapter_id,
        )

    # -- adapters -----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> None:
        """Register a LoRA adapter (read and checked now; raises ``InvalidRequestError`` naming it)."""
        if self.adapters is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (option.enable_lora)", "lora_name")
        self.adapters.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter (``UnknownAdapterError`` if not served); its running requests finish."""
        if self.adapters is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (option.enable_lora)", "lora_name")
        self.adapters.unregister(name)

    def adapter_names(self) -> dict[str, str]:
        """Served adapters: name -> path."""
        return self.adapters.names() if self.adapters is not None else {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT, emit=True)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule (the scheduler places rows and cuts batches), run each batch, apply its tokens."""
        plan = self.scheduler.next_step()
        if self.adapters is not None:  # adapters moving into slots no running line uses
            for slot, weights in self.adapters.take_writes():
                self.runner.set_adapter(slot, weights)
        events = [self._fail(request, exc, "placing") for request, exc in plan.failed]
        for request, hit in plan.copies:
            try:
                self.runner.copy(hit.row, request.row, hit.length)  # type: ignore[arg-type]
            except Exception as exc:  # a failed copy fails its request only
                events.append(self._fail(request, exc, "copying a prefix for"))
        for batch, requests in plan.batches:
            events += self._run(batch, requests)
        self.steps += 1
        return events

    def _run(self, batch: StepBatch, requests: list[Request]) -> list[TokenEvent]:
        """One forward, then sampling. A failed batch other than a decode is retried line by line
        (such a batch writes its rows from their starts), so one bad request cannot fail the rest."""
        if any(r.status is Status.FINISHED for r in requests):  # failed before the batch ran
            lines = [i for i, r in enumerate(requests) if r.status is not Status.FINISHED]
            if not lines:
                return []
            return [e for i in lines for e in self._run(batch.line(i), [requests[i]])]
        try:
            logits, tokens, runs = self._forward(batch, requests)
            logits, spans = speculative_lines(batch, logits)
            sampled = requests
            if spans or not all(batch.samples):  # a non-final prompt chunk samples nothing
                keep = [i for i, s in enumerate(batch.samples) if s and i not in spans]
                sampled = [requests[i] for i in keep]
                logits = logits[keep] if logits is not None else None
                tokens = tokens[keep] if tokens is not None else None
            out = self.line_sampler.sample(logits, tokens, sampled) if sampled else None
            kept = self.line_sampler.device_runs(runs, requests) if runs is not None else {}
            speculator = self.speculator  # set wherever a batch has verify lines (spans)
            drawn = {
                i: speculator.verify(span, batch.chunks[i][1:], requests[i])  # type: ignore[union-attr]
                for i, span in spans.items()
            }
        except Exception as exc:  # one failed batch must not take the engine down
            if batch.kind is not BatchKind.DECODE and len(batch) > 1:
                return [e for i, r in enumerate(requests) for e in self._run(batch.line(i), [r])]
            log.exception("model step failed for %d request(s)", len(requests))
            return [self._fail(r, exc) for r in requests]
        events = [
            e
            for i, emitted in drawn.items()
            for e in self._accept_draft(requests[i], batch.starts[i], batch.chunks[i][1:], emitted, spans[i])
        ]
        if out is None:
            return events
        for i, request in enumerate(sampled):
            if i in kept:  # a DECODE line (every line samples), its tokens the device's run
                events += self._accept_run(request, batch.starts[i], kept[i])
                continue
            top = tuple(
                TopToken(t, "", lp) for t, lp in zip(out.top_ids[i], out.top_logprobs[i], strict=True)
            )
            try:
                prompt = scored_prompt(request, self._prompt_logits)
            except Exception as exc:  # scoring fails this request only
                log.exception("scoring the prompt of %s failed", request.request_id)
                events.append(self._fail(request, exc))
                continue
            events.append(self._accept(request, out.tokens[i], out.logprobs[i], top, prompt))
        return events

    def _accept_draft(
        self, request: Request, start: int, drafts: Sequence[int], emitted: list[int], logits: torch.Tensor
    ) -> list[TokenEvent]:
        """Apply a verified line: its row keeps the last token and the accepted drafts (the rejected
        ones' K/V is cut off), then each emitted token is accepted in turn, so an EOS, a stop id or
        ``max_new_tokens`` inside the run ends it exactly there."""
        accepted = len(emitted) - 1
        self.speculator.observe(request, len(drafts), accepted)  # type: ignore[union-attr]
        self.runner.rows.set_length(request.row, start + 1 + accepted)  # type: ignore[arg-type]
        if request.params.logprobs:
            chosen = torch.tensor(emitted)[:, None]
            logprobs = torch.log_softmax(logits[: len(emitted)], dim=-1).gather(1, chosen)[:, 0].tolist()
        else:
            logprobs = [0.0] * len(emitted)
        events = []
        for token, logprob in zip(emitted, logprobs, strict=True):
            events.append(self._accept(request, token, logprob, ()))
            if request.status is Status.FINISHED:
                break
        return events

    def _forward(
        self, batch: StepBatch, requests: list[Request]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[tuple[int, ...], ...] | None]:
        """(logits, the device's tokens, its accepted runs): a runner that samples on the device
        gets each line's sampling inputs (``engine.device_sampling``), greedy for a line the host
        samples; runs only from a fused-speculation runner's DECODE batch."""
        device = self.capabilities.device_sampling
        timer, runner = self.forward_timer, self.runner
        began = timer.forward_s
        if device is None:
            logits, tokens, runs = timer.timed(lambda: runner.forward(batch), batch.decodes), None, None
        else:
            lines = [
                GREEDY_LINE if host_field(r.params, device) is not None else line_sampling(r.params, device)
                for r in requests
            ]
            step = timer.timed(lambda: runner.forward_sampled(batch, lines), batch.decodes)
            logits, tokens, runs = step.logits, step.tokens, step.runs
        if self.speculator is not None:  # what a draft token costs (the speculator's cost line)
            self.speculator.observe_forward(sum(map(len, batch.chunks)), timer.forward_s - began)
        return logits, tokens, runs

    def _accept_run(self, request: Request, start: int, run: tuple[int, ...]) -> list[TokenEvent]:
        """Apply a device-verified line (fused speculation): the row keeps the K/V of its input and
        the accepted drafts (``start + len(run)`` positions; what the device wrote past them is
        rewritten by the next step), then each token is accepted in turn, as ``_accept_draft`` does."""
        if self.fused_counters is not None:
            self.fused_counters.observe(self.fused_counters.k, len(run) - 1)
        self.runner.rows.set_length(request.row, start + len(run))  # type: ignore[arg-type]
        events = []
        for token in run:
            events.append(self._accept(request, token, 0.0, ()))
            if request.status is Status.FINISHED:
                break
        return events

    def _prompt_logits(self, ids: list[int]) -> torch.Tensor:
        return self.forward_timer.timed(lambda: self.runner.prompt_logits(ids))

    def _accept(
        self,
        request: Request,
        token: int,
        logprob: float,
        top: tuple[TopToken, ...],
        prompt: tuple[PromptToken, ...] | None = None,
    ) -> TokenEvent:
        request.output_ids.append(token)
        request.logprobs.append(logprob)
        if request.grammar is not None:
            request.grammar.accept(token)
        params = request.params
        finish: FinishReason | None = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            finish = FinishReason.EOS_TOKEN
        elif len(request.output_ids) >= params.max_new_tokens:
            finish = FinishReason.LENGTH
        event = TokenEvent(
            request_id=request.request_id,
            index=len(request.output_ids) - 1,
            token_id=token,
            token_text="",  # texts are the front's (TokenTexts, TextStream): stop sequences too
            text="",
            logprob=logprob,
            special=token in self.special_ids,
            prompt_tokens=len(request.prompt_ids),
            top_tokens=top,
            finish_reason=finish,
            prompt=prompt,
        )
        if finish is not None:
            self._finish(request, finish, emit=False)
        self._emit(request, event)
        return event

    def _fail(self, request: Request, exc: Exception, doing: str | None = None) -> TokenEvent:
        if doing is not None:
            log.error("%s request %s failed", doing, request.request_id, exc_info=exc)
        event = closing_event(request, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        self._finish(request, FinishReason.ERROR, emit=False)
        self._emit(request, event)
        return event

    def _finish(self, request: Request, reason: FinishReason, emit: bool) -> None:
        if request.status is Status.FINISHED:
            return
        self.scheduler.finish(request, keep_prefix=reason is not FinishReason.ERROR)
        if request.adapter_id is not None and self.adapters is not None:
            self.adapters.release(request.adapter_id)
            request.adapter_id = None
        self.requests.pop(request.request_id, None)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if emit:
            self._emit(request, closing_event(request, reason))

    @staticmethod
    def _emit(request: Request, event: TokenEvent) -> None:
        if request.sink is not None:
            request.sink(event)

    def stats(self, alive: bool = True) -> EngineStats:
        occupancy = self.runner.rows.occupancy()
        counters = self.speculator.counters if self.speculator is not None else self.fused_counters
        return EngineStats(
            rows_total=occupancy.rows_total,
            rows_used=occupancy.rows_used,
            positions_used=occupancy.positions_used,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            alive=alive,
            extra=counters.extra() if counters is not None else {},
        )
