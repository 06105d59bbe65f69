"""The synchronous rolling-batch engine: scheduler decisions applied to a runner, one step at a time.

Single-threaded by design: only the engine thread (or ``LLM.generate``) calls ``step``; requests
and aborts from other threads go through ``AsyncEngine``'s queues.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

from neuron_lmi.engine.admission import Admission, AdmissionLimits
from neuron_lmi.engine.detokenizer import IncrementalDetokenizer
from neuron_lmi.engine.grammar import GrammarCompiler
from neuron_lmi.engine.prefix import PrefixIndex
from neuron_lmi.engine.request import EventSink, Request, Status
from neuron_lmi.engine.sampling import prompt_logprobs, sample
from neuron_lmi.engine.scheduler import (
    DEFAULT_MIN_CHUNK,
    DEFAULT_STEP_TOKENS,
    ChunkedPrefill,
    JoinPolicy,
    PrefillChunk,
    PrefillPolicy,
    Scheduler,
    SchedulerOutput,
    WholePrompts,
)
from neuron_lmi.engine.stops import StopMatcher
from neuron_lmi.engine.types import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    PromptToken,
    SamplingParams,
    TokenEvent,
    TopToken,
)
from neuron_lmi.runners.base import ModelRunner, runner_needs, supports_extend, supports_mixed_steps

log = logging.getLogger(__name__)


class EngineCore:
    """Owns requests, the scheduler and the runner.

    Invariants: a RUNNING request holds exactly one KV row and a finished one holds none; every
    request ends with exactly one event whose ``finish_reason`` is set.

    On a runner that supports ``extend`` the defaults are chunked prefill (``ChunkedPrefill``:
    ``DEFAULT_STEP_TOKENS`` per step shared with the decodes) and prefix reuse (a finished row
    retains its K/V until reallocated); elsewhere whole prompts within ``max_prefill_tokens``. On a
    runner with ``mixed_steps`` (``runners.base.supports_mixed_steps``) a step is one ``extend``
    call: its prompt chunks, and each decoding request's last token as a chunk of one.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        max_prefill_tokens: int = 4096,
        policy: JoinPolicy | None = None,
        prefill: PrefillPolicy | None = None,
        prefix_reuse: bool = True,
    ) -> None:
        self.runner = runner
        self.needs = runner_needs(runner)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        # Capacity is the fronts' to check (they own the queues): no queue bound here.
        limits = AdmissionLimits(runner.n_positions, runner.vocab_size, runner.rows.n_rows, 0)
        self.admission = Admission(tokenizer.encode, limits)
        self.grammars = GrammarCompiler(tokenizer, runner.vocab_size, sorted(self.eos_token_ids))
        extend = supports_extend(runner)
        if prefill is None:
            step = min(DEFAULT_STEP_TOKENS, max_prefill_tokens)
            prefill = ChunkedPrefill(step, min(DEFAULT_MIN_CHUNK, step)) if extend else None
        if prefill is not None and prefill.splits and not extend:
            raise ValueError(
                f"{type(prefill).__name__} splits prompts, which {type(runner).__name__} cannot extend"
            )
        prefix = PrefixIndex(runner.rows) if extend and prefix_reuse else None
        prefill = prefill or WholePrompts(max_prefill_tokens)
        self.scheduler = Scheduler(max_prefill_tokens, policy, prefill, prefix)
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self._texts: dict[int, str] = {}  # token id -> its text alone (decoded once)

    # -- requests -----------------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        sink: EventSink | None = None,
    ) -> Request:
        """Validate (``Admission``, then what only this runner can tell) and build a request; raises
        ``InvalidRequestError`` naming the field."""
        valid = self.admission.admit(prompt, params, request_id, self.requests)
        self._check_backend_support(params)
        ids, request_id = valid.prompt_ids, valid.request_id
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
        return Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, None, params.skip_special_tokens),
            stops=StopMatcher(params.stop, params.stop_text),
            generator=generator,
            sink=sink,
            grammar=self.grammars.state(params.grammar) if params.grammar is not None else None,
        )

    def _check_backend_support(self, params: SamplingParams) -> None:
        bad = [t for t, _ in params.logit_bias if t >= self.runner.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary", "logit_bias")
        if params.prompt_logprobs is not None and not hasattr(self.runner, "prompt_logits"):
            message = f"{type(self.runner).__name__} cannot score prompts (prompt log-probabilities)"
            raise InvalidRequestError(message, "prompt_logprobs")

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
        decision = self.scheduler.schedule(self.runner.rows.occupancy().rows_free)
        events = self._place(decision.prefill, decision.chunks)
        spans = {c.request: c for c in decision.chunks if c.request.status is Status.RUNNING}
        if supports_mixed_steps(self.runner) and not decision.recompute and (spans or decision.decode):
            stepping = [*spans, *decision.decode]
            events += self._forward(stepping, lambda rs: self._mixed(rs, spans), isolate=True)
        else:
            events += self._forwards_apart(decision, spans)
        self.steps += 1
        return events

    def _forwards_apart(
        self, decision: SchedulerOutput, spans: dict[Request, PrefillChunk]
    ) -> list[TokenEvent]:
        """A step as one forward per kind: fresh prompts, continued chunks, recomputed rows, decodes
        (decodes first where every live row must step together: see ``RunnerNeeds``)."""
        events = []
        fresh = [r for r, c in spans.items() if c.start == 0]
        more = [r for r, c in spans.items() if c.start > 0]
        decode_first = self.needs.live_rows_step_together
        if decode_first and decision.decode:
            events += self._decode(decision.decode)
        if fresh:
            events += self._forward(fresh, lambda rs: self._prefill_chunks(rs, spans), isolate=True)
        if more:
            events += self._forward(more, lambda rs: self._extend_chunks(rs, spans), isolate=True)
        if decision.recompute:
            events += self._forward(decision.recompute, lambda rs: self._prefill(rs, full=True), isolate=True)
        if decision.decode and not decode_first:
            events += self._decode(decision.decode)
        return events

    def _decode(self, requests: list[Request]) -> list[TokenEvent]:
        return self._forward(
            requests, lambda rs: self.runner.decode([r.row for r in rs], [r.last_token for r in rs])
        )

    def _place(self, admitted: list[Request], chunks: list[PrefillChunk]) -> list[TokenEvent]:
        """Give each admitted request a row: a retained source row is claimed whole (first, so no
        other allocation takes it), a live source's prefix is copied into a fresh row."""
        hits = {c.request: c.source for c in chunks if c.source is not None}
        claims_first = sorted(admitted, key=lambda r: not (r in hits and hits[r].retained))
        events = []
        for request in claims_first:
            hit = hits.get(request)
            try:
                if hit is not None and hit.retained:
                    request.row = self.runner.rows.allocate(hit.row, keep=hit.length)
                else:
                    request.row = self.runner.rows.allocate()
                    if hit is not None:
                        self.runner.copy(hit.row, request.row, hit.length)  # type: ignore[attr-defined]
            except Exception as exc:  # a failed placement fails its request only
                log.exception("placing request %s failed", request.request_id)
                events.append(self._fail(request, exc))
        return events

    def _prefill_chunks(self, requests: list[Request], spans: dict[Request, PrefillChunk]) -> torch.Tensor:
        prompts = [r.prompt_ids[: spans[r].end] for r in requests]
        return self.runner.prefill([r.row for r in requests], prompts)

    def _extend_chunks(self, requests: list[Request], spans: dict[Request, PrefillChunk]) -> torch.Tensor:
        for r in requests:  # idempotent, so a failed batch can be retried one request at a time
            self.runner.rows.set_length(r.row, spans[r].start)
        return self.runner.extend([r.row for r in requests], [spans[r].tokens for r in requests])  # type: ignore[attr-defined]

    def _mixed(self, requests: list[Request], spans: dict[Request, PrefillChunk]) -> torch.Tensor:
        """The whole step as one ``extend``: each span's chunk, and each decoding request's last
        token after the positions its row holds."""
        chunks = []
        for r in requests:  # idempotent, as _extend_chunks
            span = spans.get(r)
            start = span.start if span is not None else len(r.prompt_ids) + len(r.output_ids) - 1
            self.runner.rows.set_length(r.row, start)
            chunks.append(span.tokens if span is not None else [r.last_token])
        return self.runner.extend([r.row for r in requests], chunks)  # type: ignore[attr-defined]

    def _prefill(self, requests: list[Request], full: bool) -> torch.Tensor:
        prompts = [r.all_ids if full else r.prompt_ids for r in requests]
        return self.runner.prefill([r.row for r in requests], prompts)

    def _forward(self, requests: list[Request], run: Any, isolate: bool = False) -> list[TokenEvent]:
        """Run one batch and sample. A failed prefill batch is retried one request at a time
        (a prefill only overwrites its own rows), so one bad request cannot fail the others."""
        try:
            logits = run(requests)
            if not all(r.prompt_done for r in requests):  # a non-final prompt chunk samples nothing
                keep = [i for i, r in enumerate(requests) if r.prompt_done]
                logits, requests = logits[keep], [requests[i] for i in keep]
                if not requests:
                    return []
            out = sample(
                logits,
                [r.params for r in requests],
                [r.all_ids for r in requests],
                [r.generator for r in requests],
                outputs=[r.output_ids for r in requests],
                grammars=[r.grammar for r in requests],
                stop_ids=sorted(self.eos_token_ids),
            )
        except Exception as exc:  # one failed batch must not take the engine down
            if isolate and len(requests) > 1:
                return [event for r in requests for event in self._forward([r], run)]
            log.exception("model step failed for %d request(s)", len(requests))
            return [self._fail(r, exc) for r in requests]
        events = []
        for i, request in enumerate(requests):
            top = tuple(
                TopToken(t, self._token_text(t), lp)
                for t, lp in zip(out.top_ids[i], out.top_logprobs[i], strict=True)
            )
            try:
                prompt = self._scored_prompt(request)
            except Exception as exc:  # scoring fails this request only
                log.exception("scoring the prompt of %s failed", request.request_id)
                events.append(self._fail(request, exc))
                continue
            events.append(self._accept(request, out.tokens[i], out.logprobs[i], top, prompt))
        return events

    def _scored_prompt(self, request: Request) -> tuple[PromptToken, ...] | None:
        """The prompt with its log-probabilities, for the first event of a request that asked."""
        top_n = request.params.prompt_logprobs
        if top_n is None or request.output_ids:
            return None
        ids, text = request.prompt_ids, self._token_text
        chosen, top_ids, top_lps = prompt_logprobs(self.runner.prompt_logits(ids), ids, top_n)  # type: ignore[attr-defined]
        rest = (
            PromptToken(t, text(t), lp, tuple(TopToken(a, text(a), v) for a, v in zip(ti, tv, strict=True)))
            for t, lp, ti, tv in zip(ids[1:], chosen, top_ids, top_lps, strict=True)
        )
        return (PromptToken(ids[0], text(ids[0]), None), *rest)

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

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
            finish, text = FinishReason.EOS_TOKEN, ""
        else:
            text, hit = request.stops.add(request.detokenizer.add(token))
            finish = FinishReason.STOP_SEQUENCE if hit else None
        if finish is None and len(request.output_ids) >= params.max_new_tokens:
            finish = FinishReason.LENGTH
        if finish in (FinishReason.EOS_TOKEN, FinishReason.LENGTH):
            tail, hit = request.stops.add(request.detokenizer.flush())
            text += tail if hit else tail + request.stops.flush()
            finish = FinishReason.STOP_SEQUENCE if hit else finish
        event = TokenEvent(
            request_id=request.request_id,
            index=len(request.output_ids) - 1,
            token_id=token,
            token_text=self._token_text(token),
            text=text,
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

    def _fail(self, request: Request, exc: Exception) -> TokenEvent:
        event = _closing_event(request, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        self._finish(request, FinishReason.ERROR, emit=False)
        self._emit(request, event)
        return event

    def _finish(self, request: Request, reason: FinishReason, emit: bool) -> None:
        if request.status is Status.FINISHED:
            return
        if request.row is not None:
            self._release(request, keep_prefix=reason is not FinishReason.ERROR)
            request.row = None
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if emit:
            self._emit(request, _closing_event(request, reason))

    def _release(self, request: Request, keep_prefix: bool) -> None:
        """Free the request's row; with prefix reuse on, the row retains its K/V for later prompts."""
        prefix, rows = self.scheduler.prefix, self.runner.rows
        keep = rows.length(request.row) if prefix is not None and keep_prefix else 0
        if keep < (prefix.min_tokens if prefix is not None else 1):
            keep = 0
        rows.remove(request.row, keep)
        if keep:
            prefix.retain(request.row, request.all_ids[:keep])  # type: ignore[union-attr]

    @staticmethod
    def _emit(request: Request, event: TokenEvent) -> None:
        if request.sink is not None:
            request.sink(event)

    def stats(self, alive: bool = True) -> EngineStats:
        occupancy = self.runner.rows.occupancy()
        return EngineStats(
            rows_total=occupancy.rows_total,
            rows_used=occupancy.rows_used,
            positions_used=occupancy.positions_used,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            alive=alive,
        )


def _closing_event(request: Request, reason: FinishReason, error: str | None = None) -> TokenEvent:
    """The last event of a request that ends without a token (abort, error): ``token_id == -1``."""
    return TokenEvent(
        request_id=request.request_id,
        index=len(request.output_ids),
        token_id=-1,
        token_text="",
        text="",
        logprob=0.0,
        special=False,
        prompt_tokens=len(request.prompt_ids),
        finish_reason=reason,
        error=error,
    )
