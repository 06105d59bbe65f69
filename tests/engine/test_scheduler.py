"""The scheduler: its decision driven with hand-made requests, no model; then the rows it places
and the step batches it cuts from that decision for each set of runner capabilities."""

from __future__ import annotations

import pytest

from cache_api import RowTable
from neuron_lmi.config.speculative import SpeculativeConfig
from neuron_lmi.engine.prefix import PrefixHit, PrefixIndex, common_prefix
from neuron_lmi.engine.request import Request, Status
from neuron_lmi.engine.scheduler import ChunkedPrefill, Scheduler, StepPlan, WholePrompts
from neuron_lmi.engine.speculation import Speculator, check_speculation, verify_tokens
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.runners.base import BatchKind, MixedStepLimits, RunnerCapabilities


def req(name: str, n_prompt: int) -> Request:
    return Request(
        request_id=name,
        prompt_ids=list(range(n_prompt)),
        params=SamplingParams(),
        generator=None,
    )


def test_new_requests_fill_free_rows_fcfs_while_running_ones_decode():
    sched = Scheduler(max_prefill_tokens=1000)
    a, b, c = req("a", 10), req("b", 10), req("c", 10)
    for r in (a, b, c):
        sched.add(r)
    first = sched.schedule(free_rows=2)
    assert first.prefill == [a, b] and first.decode == []
    assert a.status is Status.RUNNING and list(sched.waiting) == [c]
    second = sched.schedule(free_rows=0)
    assert second.prefill == [] and second.decode == [a, b]
    sched.remove(a)
    third = sched.schedule(free_rows=1)
    assert third.prefill == [c] and third.decode == [b]


def test_prefill_token_budget_limits_admissions_but_never_starves():
    sched = Scheduler(max_prefill_tokens=100)
    big, small1, small2 = req("big", 300), req("s1", 60), req("s2", 60)
    for r in (big, small1, small2):
        sched.add(r)
    out = sched.schedule(free_rows=8)
    assert out.prefill == [big]  # over budget alone, but admitted so it cannot starve
    out = sched.schedule(free_rows=8)
    assert out.prefill == [small1]  # the second would exceed the budget
    assert sched.schedule(free_rows=8).prefill == [small2]


def test_remove_from_waiting_and_has_work():
    sched = Scheduler(max_prefill_tokens=10)
    a = req("a", 3)
    sched.add(a)
    assert sched.has_work()
    sched.remove(a)
    assert not sched.has_work()
    assert sched.schedule(free_rows=1).empty


# -- chunked prefill ---------------------------------------------------------------------------


def decoding(name: str, n_prompt: int = 4) -> Request:
    """A running request whose prompt is already in its row."""
    r = req(name, n_prompt)
    r.prefilled, r.status, r.row = n_prompt, Status.RUNNING, 0
    return r


def test_chunked_budget_is_shared_with_decodes_and_prompts_continue_across_steps():
    sched = Scheduler(max_prefill_tokens=4096, prefill=ChunkedPrefill(step_tokens=64, min_chunk=8))
    streams = [decoding(f"d{i}") for i in range(4)]
    sched.running.extend(streams)
    long = req("long", 100)
    sched.add(long)
    first = sched.schedule(free_rows=4)
    assert first.prefill == [long] and first.decode == streams
    assert [(c.request, c.start, c.end, c.final) for c in first.chunks] == [(long, 0, 60, False)]
    second = sched.schedule(free_rows=3)
    assert second.prefill == [] and second.decode == streams  # long is not decoded before its prompt is in
    assert [(c.start, c.end, c.final) for c in second.chunks] == [(60, 100, True)]
    assert sched.schedule(free_rows=3).decode == [*streams, long]


def test_chunked_prefill_progresses_under_any_decode_load_and_cuts_no_slivers():
    policy = ChunkedPrefill(step_tokens=16, min_chunk=8)
    sched = Scheduler(max_prefill_tokens=4096, prefill=policy)
    sched.running.extend(decoding(f"d{i}") for i in range(40))  # more decodes than the budget
    a, b, c = req("a", 30), req("b", 3), req("c", 50)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule(free_rows=8)
    assert [(x.request, x.end) for x in out.chunks] == [(a, 8)]  # the floor: min_chunk tokens
    assert len(out.decode) == 40
    sched.running = [r for r in sched.running if r.row is None]  # the streams end
    out = sched.schedule(free_rows=7)
    # a takes 16; b (3 tokens) fits nowhere, and c is not started with a 0-token sliver
    assert [(x.request, x.start, x.end) for x in out.chunks] == [(a, 8, 24)]
    out = sched.schedule(free_rows=7)
    assert [(x.request, x.start, x.end) for x in out.chunks] == [(a, 24, 30), (b, 0, 3)]
    assert policy.take(remaining=5, budget=5, first=False) == 5  # a short tail finishing a prompt
    assert policy.take(remaining=50, budget=7, first=False) == 0


def test_whole_prompts_policy_keeps_prompts_in_one_piece():
    sched = Scheduler(max_prefill_tokens=100, prefill=WholePrompts(100))
    big = req("big", 300)
    sched.add(big)
    out = sched.schedule(free_rows=2)
    assert [(c.start, c.end) for c in out.chunks] == [(0, 300)] and big.prompt_done


def test_chunked_prefill_rejects_a_floor_above_the_budget():
    with pytest.raises(ValueError, match="min_chunk"):
        ChunkedPrefill(step_tokens=8, min_chunk=16)


# -- prefix reuse ------------------------------------------------------------------------------


def test_prefix_index_matches_live_and_retained_rows_and_forgets_reallocated_ones():
    rows = RowTable(4, 64)
    index = PrefixIndex(rows, min_tokens=4)
    shared = list(range(100, 120))
    live = req("live", 0)
    live.prompt_ids, live.output_ids = [*shared[:12]], shared[12:15]
    live.row = rows.allocate()
    rows.set_length(live.row, 14)  # prompt + outputs but the last (not fed yet)
    retained = rows.allocate()
    rows.set_length(retained, 10)
    rows.remove(retained, keep=10)
    index.retain(retained, shared[:10])
    prompt = [*shared, 7]
    assert index.match(prompt, [live], claimed=()) == PrefixHit(live.row, 14, retained=False)
    live.row = None
    assert index.match(prompt, [live], claimed=()) == PrefixHit(retained, 10, retained=True)
    assert index.match(prompt, [], claimed={retained}) is None  # already taken this step
    assert index.match(shared[:10], [], claimed=()).length == 9  # never the prompt's last token
    assert index.match([*shared[:3], 1, 2, 3], [], claimed=()) is None  # shorter than min_tokens
    assert rows.allocate() != retained  # a clean row first: the retained one stays matchable
    rows.allocate()
    assert rows.allocate() == retained  # now it is reused for something else
    assert index.match(prompt, [], claimed=()) is None


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 31])
def test_common_prefix(n: int):
    a = list(range(40))
    b = a[:n] + [-1] * 5
    assert common_prefix(a, b, limit=100) == n
    assert common_prefix(a, b, limit=3) == min(n, 3)
    assert common_prefix(a, a, limit=12) == 12


# -- rows and step batches ----------------------------------------------------------------------
def stepping(capabilities: RunnerCapabilities, step_tokens: int = 64) -> tuple[Scheduler, RowTable]:
    rows = RowTable(4, 256)
    policy = ChunkedPrefill(step_tokens=step_tokens, min_chunk=8) if capabilities.extend else None
    return Scheduler(4096, prefill=policy, rows=rows, capabilities=capabilities), rows


def place_decoding(sched: Scheduler, rows: RowTable, request: Request, n_out: int = 1) -> None:
    """Put ``request`` in the running set as if its prompt were in its row and it had sampled."""
    sched.add(request)
    plan = sched.next_step()
    assert request in plan.decision.prefill and request.prompt_done
    rows.set_length(request.row, len(request.prompt_ids))  # what the runner's forward leaves
    request.output_ids.extend([7] * n_out)
    rows.set_length(request.row, len(request.prompt_ids) + n_out - 1)


def decode_continue_and_admit(capabilities: RunnerCapabilities) -> tuple[StepPlan, Request, Request]:
    """A step holding all three kinds of line: ``a`` decodes, ``b`` (60 tokens: 47 in the first step
    of 48) continues its prompt, ``c`` (5 tokens) is new. Returns that step's plan, ``b`` and ``c``."""
    sched, rows = stepping(capabilities, step_tokens=48)
    a = req("a", 10)
    place_decoding(sched, rows, a)
    b = req("b", 60)
    sched.add(b)
    sched.next_step()
    rows.set_length(b.row, 47)
    c = req("c", 5)
    sched.add(c)
    return sched.next_step(), b, c


def test_a_mixed_steps_runner_gets_the_step_as_one_extend_batch_decodes_as_one_token_lines():
    sched, rows = stepping(RunnerCapabilities(extend=True, mixed_steps=True))
    a = req("a", 10)
    place_decoding(sched, rows, a, n_out=3)
    long = req("long", 100)
    sched.add(long)
    plan = sched.next_step()
    ((batch, requests),) = plan.batches
    assert batch.kind is BatchKind.EXTEND and requests == [long, a]
    assert batch.rows == (long.row, a.row) and long.row != a.row
    assert batch.starts == (0, 12) and [len(c) for c in batch.chunks] == [63, 1]
    assert batch.chunks[1] == (7,) and batch.samples == (False, True) and batch.decodes == 1


@pytest.mark.parametrize("decode_first", [False, True])
def test_a_runner_without_mixed_steps_gets_one_batch_per_kind(decode_first: bool):
    capabilities = RunnerCapabilities(extend=True, live_rows_step_together=decode_first)
    plan, _, c = decode_continue_and_admit(capabilities)
    kinds = [batch.kind for batch, _ in plan.batches]
    expected = [BatchKind.PREFILL, BatchKind.EXTEND, BatchKind.DECODE]
    assert kinds == ([BatchKind.DECODE, *expected[:2]] if decode_first else expected)
    by_kind = {batch.kind: (batch, requests) for batch, requests in plan.batches}
    assert by_kind[BatchKind.PREFILL][1] == [c] and by_kind[BatchKind.PREFILL][0].samples == (True,)
    more, _ = by_kind[BatchKind.EXTEND]
    assert more.starts == (47,) and [len(c) for c in more.chunks] == [13] and more.samples == (True,)
    assert by_kind[BatchKind.DECODE][0].decodes == 1 and by_kind[BatchKind.DECODE][0].starts == (10,)


def repeating_req(name: str) -> Request:
    """A request whose prompt repeats, so the n-gram lookup drafts from the first decode."""
    return Request(name, [1, 2, 3, 4] * 3, SamplingParams(max_new_tokens=50), None)


def speculating(capabilities: RunnerCapabilities) -> tuple[Scheduler, RowTable, Request, Request]:
    """A scheduler whose step holds a decode with a 3-token draft (``drafting``: [1, 2, 3, 4] from
    position 12) and a plain decode (``plain``: its ids never recur)."""
    rows = RowTable(4, 256)
    speculator = Speculator(SpeculativeConfig("ngram", 3, 1, 2), verify_tokens(capabilities), 256)
    sched = Scheduler(4096, ChunkedPrefill(64, 8), None, rows, capabilities, speculator=speculator)
    drafting, plain = repeating_req("drafting"), req("plain", 6)  # 0..5: nothing recurs
    place_decoding(sched, rows, drafting, n_out=1)  # ids ... 3, 4, 7: [7] never occurred
    drafting.output_ids[-1] = 1  # ids ... 3, 4, 1: after the earliest [4, 1] come 2, 3, 4
    place_decoding(sched, rows, plain, n_out=1)
    return sched, rows, drafting, plain


@pytest.mark.parametrize("mixed", ["apart", "mixed", "mixed_verify"])
def test_speculative_decodes_verify_their_drafts_in_an_extend_batch(mixed: str):
    """A verify line rides in the mixed batch only where the runner's mixed forward returns the
    logits of all its positions (``mixed_verify``); otherwise the step's verify lines are an EXTEND
    batch of their own, after the plain decodes (a DECODE batch, or the mixed EXTEND batch)."""
    capabilities = RunnerCapabilities(
        extend=True, mixed_steps=mixed != "apart", max_verify_tokens=16, mixed_verify=mixed == "mixed_verify"
    )
    sched, _, drafting, plain = speculating(capabilities)
    plan = sched.next_step()
    assert plan.decision.drafts == {drafting: (2, 3, 4)}
    verifying = [(b, r) for b, r in plan.batches if b.logit_counts]
    ((batch, requests),) = verifying
    assert batch.kind is BatchKind.EXTEND
    line = requests.index(drafting)
    assert batch.chunks[line] == (1, 2, 3, 4) and batch.starts[line] == 12 and batch.logit_counts[line] == 4
    kinds = [b.kind for b, _ in plan.batches]
    if mixed == "mixed_verify":  # one batch: the plain decode wants its last position only
        assert len(plan.batches) == 1
        assert requests == [drafting, plain] and batch.logit_counts == (4, 1) and batch.decodes == 2
        return
    assert requests == [drafting] and batch.logit_counts == (4,) and batch.decodes == 1
    assert plan.batches[-1][0] is batch  # the verify lines come last
    (first, firsts), _ = plan.batches
    assert firsts == [plain] and first.chunks == ((7,),) and not first.logit_counts
    assert kinds == [BatchKind.DECODE if mixed == "apart" else BatchKind.EXTEND, BatchKind.EXTEND]


def test_verify_lines_in_a_mixed_step_keep_to_its_limits():
    """With ``mixed_verify``, a verify line counts in ``mixed_limits`` like a prompt chunk (its
    tokens and attention pairs): a step that fits is one batch; past them the plain decodes come as
    a DECODE batch, the verify lines as an EXTEND batch, then the prompt chunks."""
    limits = MixedStepLimits(tokens=12, pairs=None, end=256)
    capabilities = RunnerCapabilities(
        extend=True,
        mixed_steps=True,
        mixed_limits=limits,
        prefill_as_extend=True,
        max_verify_tokens=16,
        mixed_verify=True,
    )
    sched, rows, drafting, plain = speculating(capabilities)
    small = req("small", 7)  # 7 + 4 + 1 = 12 tokens: one forward
    sched.add(small)
    ((batch, requests),) = sched.next_step().batches
    assert requests == [small, drafting, plain] and batch.logit_counts == (1, 4, 1)
    assert batch.decodes == 2
    rows.set_length(drafting.row, 13)  # what the engine leaves once [2] is rejected
    drafting.output_ids.append(2)  # ids ... 3, 4, 1, 2: a draft again, [3, 4, 1]
    plain.output_ids.append(8)
    small.output_ids.append(9)
    rows.set_length(small.row, 7)
    rows.set_length(plain.row, len(plain.all_ids) - 1)
    big = req("big", 8)  # 8 + 4 + 1 + 1 (small's first decode) = 14 tokens: past the limit
    sched.add(big)
    plan = sched.next_step()
    assert [b.kind for b, _ in plan.batches] == [BatchKind.DECODE, BatchKind.EXTEND, BatchKind.EXTEND]
    (decode, decoders), (verify, verifiers), (chunk, chunked) = plan.batches
    assert set(decoders) == {plain, small} and decode.decodes == 2 and not decode.logit_counts
    assert verifiers == [drafting] and verify.chunks == ((2, 3, 4, 1),) and verify.logit_counts == (4,)
    assert chunked == [big] and not chunk.logit_counts and chunk.decodes == 0


def test_a_draft_is_no_longer_than_one_forward_takes():
    """``verify_tokens``: a verify line is within both ``max_verify_tokens`` and ``max_chunk_tokens``,
    and speculation asking for more is refused at start-up, naming the key."""
    capabilities = RunnerCapabilities(extend=True, max_chunk_tokens=3, max_verify_tokens=16)
    assert verify_tokens(capabilities) == 3
    rows = RowTable(2, 256)
    speculator = Speculator(SpeculativeConfig("ngram", 3, 1, 2), verify_tokens(capabilities), 256)
    sched = Scheduler(4096, ChunkedPrefill(64, 8), None, rows, capabilities, speculator=speculator)
    drafting = repeating_req("drafting")
    sched.add(drafting)
    while not drafting.prompt_done:  # in 3-token chunks
        sched.next_step()
    rows.set_length(drafting.row, 12)
    drafting.output_ids.append(1)  # ids ... 3, 4, 1: the lookup finds 2, 3, 4; 2 of them fit
    assert sched.next_step().decision.drafts == {drafting: (2, 3)}
    with pytest.raises(ValueError, match=r"speculative_config.*verifies at most 2"):
        check_speculation(SpeculativeConfig("ngram", 3, 1, 2), capabilities, "R")


def test_a_draft_never_runs_past_the_rows_positions_or_the_requests_tokens():
    rows = RowTable(2, 16)
    capabilities = RunnerCapabilities(extend=True, max_verify_tokens=16)
    speculator = Speculator(SpeculativeConfig("ngram", 8, 1, 2), 16, 16)
    sched = Scheduler(4096, ChunkedPrefill(64, 8), None, rows, capabilities, speculator=speculator)
    near_end = repeating_req("near_end")  # 12 prompt ids + 1 output in a 16-position row
    place_decoding(sched, rows, near_end, n_out=1)
    near_end.output_ids[-1] = 1
    assert sched.next_step().decision.drafts == {near_end: (2, 3, 4)}  # 13 ids + 3 = 16 positions


def test_placement_claims_a_retained_prefix_and_names_the_copy_for_a_live_one():
    rows = RowTable(4, 256)
    prefix = PrefixIndex(rows)
    sched = Scheduler(4096, prefill=ChunkedPrefill(64, 8), prefix=prefix, rows=rows,
                      capabilities=RunnerCapabilities(extend=True))  # fmt: skip
    done = req("done", 40)
    place_decoding(sched, rows, done)
    done_row = done.row
    sched.finish(done, keep_prefix=True)  # retains its 40 positions
    assert done.row is None and rows.retained(done_row) == 40
    again = req("again", 50)  # the same first 40 tokens
    sched.add(again)
    plan = sched.next_step()
    assert again.row == done_row and plan.copies == []
    (chunk,) = plan.decision.chunks
    assert (chunk.start, chunk.source.row) == (40, done_row)  # from the retained prefix on
    twin = req("twin", 60)  # a live row's prefix: a fresh row and a copy
    sched.add(twin)
    plan = sched.next_step()
    ((copied, hit),) = plan.copies
    assert copied is twin and hit.row == again.row and twin.row not in (again.row, done_row)


def test_a_failed_placement_is_reported_not_raised():
    sched, rows = stepping(RunnerCapabilities())
    a = req("a", 10)
    sched.add(a)
    rows.allocate(0), rows.allocate(1), rows.allocate(2)
    free = rows.allocate  # a row table that refuses the next allocation
    rows.allocate = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no row"))  # type: ignore[method-assign]
    plan = sched.next_step()
    rows.allocate = free  # type: ignore[method-assign]
    assert [(r, str(e)) for r, e in plan.failed] == [(a, "no row")]
    assert plan.batches == []


def test_capabilities_refuse_mixed_steps_without_extend():
    with pytest.raises(ValueError, match="mixed_steps needs extend"):
        RunnerCapabilities(mixed_steps=True)
    with pytest.raises(ValueError, match="need extend"):
        RunnerCapabilities(max_chunk_tokens=16)
    with pytest.raises(ValueError, match="need extend"):
        RunnerCapabilities(prefill_as_extend=True)
    with pytest.raises(ValueError, match="need mixed_steps"):
        RunnerCapabilities(extend=True, mixed_limits=MixedStepLimits(8, None, 256))
    with pytest.raises(ValueError, match="mixed_verify needs mixed_steps and max_verify_tokens"):
        RunnerCapabilities(extend=True, mixed_steps=True, mixed_verify=True)


def test_no_line_is_longer_than_one_forward_takes_whatever_the_policy():
    """``max_chunk_tokens``: a prompt past it goes on in later steps' chunks, under ChunkedPrefill
    and under WholePrompts alike, so the runner never cuts a line."""
    capabilities = RunnerCapabilities(extend=True, max_chunk_tokens=40)
    for policy in (ChunkedPrefill(step_tokens=64, min_chunk=8), WholePrompts(4096)):
        sched = Scheduler(4096, prefill=policy, rows=RowTable(4, 256), capabilities=capabilities)
        a = req("a", 100)
        sched.add(a)
        spans = []
        while not a.prompt_done:
            plan = sched.next_step()
            spans += [(batch.starts[0], len(batch.chunks[0])) for batch, _ in plan.batches]
        assert spans == [(0, 40), (40, 40), (80, 20)]


def test_a_mixed_step_past_the_runners_limits_comes_as_decodes_then_chunks():
    """``mixed_limits``: a step that fits is one EXTEND batch; one that does not is cut by the
    scheduler into a DECODE batch and an EXTEND batch, so the runner does not re-route lines."""
    limits = MixedStepLimits(tokens=30, pairs=None, end=256)
    mixed = RunnerCapabilities(extend=True, mixed_steps=True, mixed_limits=limits, prefill_as_extend=True)
    sched, rows = stepping(mixed)
    a = req("a", 10)
    place_decoding(sched, rows, a, n_out=3)
    small = req("small", 20)  # 20 + 1 decode <= 30: one forward
    sched.add(small)
    ((batch, requests),) = sched.next_step().batches
    assert batch.kind is BatchKind.EXTEND and requests == [small, a] and batch.decodes == 1
    rows.set_length(small.row, 20)
    big = req("big", 60)  # 60 tokens (the step's budget less the decodes) do not fit
    sched.add(big)
    plan = sched.next_step()
    assert [batch.kind for batch, _ in plan.batches] == [BatchKind.DECODE, BatchKind.EXTEND]
    (decode, decoders), (chunk, chunked) = plan.batches
    assert set(decoders) == {a, small} and decode.decodes == 2
    assert chunked == [big] and chunk.starts == (0,) and chunk.decodes == 0
    assert limits.fits([0, 12], [29, 1]) and not limits.fits([0, 12], [30, 1])
    assert not MixedStepLimits(tokens=30, pairs=None, end=13).fits([12], [1])  # the cache's last slot
    assert not MixedStepLimits(tokens=99, pairs=100, end=256).fits([10, 3], [8, 1])  # 8 * 10 + 36 pairs


def test_prefill_as_extend_sends_new_prompts_in_the_extend_batch():
    plan, b, c = decode_continue_and_admit(RunnerCapabilities(extend=True, prefill_as_extend=True))
    assert [batch.kind for batch, _ in plan.batches] == [BatchKind.EXTEND, BatchKind.DECODE]
    extend, requests = plan.batches[0]
    assert requests == [b, c] and extend.starts == (47, 0)
