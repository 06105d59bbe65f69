"""The CPU reference runner: the torch model, a ``cache_api.KVCache`` and shape buckets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from cache_api import RowTable
from neuron_lmi.backends.cpu.buckets import chunk_buckets, pack_into_bins, pick_bucket, power_of_two_buckets
from neuron_lmi.backends.cpu.graphs import right_padded
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.models.lora import LoraAdapter, LoraBatch, LoraSlots
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities, StepBatch, ascending, in_asked_order

if TYPE_CHECKING:
    from neuron_lmi.backends.cpu.compiled_decode import CompiledDecode
    from neuron_lmi.backends.cpu.compiled_extend import CompiledExtend


class CpuRunner(ForwardByKind):
    """Runs ``LlamaForCausalLM`` over a static KV cache of ``n_rows`` x ``n_positions``.

    Each batch is computed as it comes; the capabilities tell the scheduler what one forward takes,
    so no batch is split or sent to another kind's path here. Prefill pads prompts to a context
    bucket, packing several short prompts into one bucket-sized row (block-diagonal attention) and
    batching the rows of one bucket; decode attends over the smallest token-generation bucket that
    covers every active row. ``extend`` (when the model supports it) appends chunks of at most the
    largest context bucket (``max_chunk_tokens``: a longer prompt comes in chunks) to rows that
    already hold a prefix. ``compiled_decode`` and ``compiled_extend`` (loaded by
    ``backend.CpuBackend.load`` from the modules of the same names, and given here) run the decode
    and extend batches whose shapes they take, the eager model the rest; with either, new prompts
    come as an extend from position 0 (``prefill_as_extend``: the graphs need no buckets or
    packing). With the compiled step graph (``compiled_decode``) an extend batch may mix decodes
    (chunks of one token) with prompt chunks (``mixed_steps``), within the graph's limits
    (``mixed_limits``).

    With ``lora_slots`` the runner holds that many LoRA adapters (``models.lora.LoraSlots``, ranks
    up to ``lora_rank``). A batch with adapted lines (``StepBatch.adapters``) runs the step graph
    where it was compiled with those slots as inputs (``compiled_decode.lora``, ``LoraStepGraph``)
    and covers the batch, every line written from its start; else (no such package, or past its
    limits) the eager ``extend``, its base lines too (a mixed step is one batch). The extend package
    takes no adapters. A batch without adapters takes the usual path unchanged.

    A batch with ``StepBatch.logit_counts`` (speculative decodes' verify lines) returns the logits
    of each line's last positions (``verify``). The step graph computes them for any set of a
    batch's tokens, so with it verify lines ride in the mixed step (``mixed_verify``) and a step
    with drafts stays one compiled forward; without it, or past its limits, they run the eager
    extend. A verify line is at most ``max_verify_tokens`` (the largest context bucket).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        n_rows: int,
        n_positions: int,
        context_buckets: list[int] | None = None,
        compiled_decode: CompiledDecode | None = None,
        compiled_extend: CompiledExtend | None = None,
        lora_slots: int = 0,
        lora_rank: int = 0,
    ) -> None:
        if n_positions > model.n_positions:
            raise ValueError(
                f"n_positions={n_positions} exceeds the model's rotary table ({model.n_positions})"
            )
        a = model.args
        self.model = model
        self.n_positions = n_positions
        self.vocab_size = a.vocab_size
        # The model lays out its own cache: one KVCache, or one per tensor-parallel rank.
        self.cache = model.make_cache(n_rows, n_positions)
        self.supports_extend = model.supports_extend
        self.context_buckets = (
            sorted(context_buckets) if context_buckets else power_of_two_buckets(n_positions)
        )
        if self.context_buckets[-1] < n_positions and not self.supports_extend:
            self.context_buckets.append(n_positions)
        self.token_buckets = power_of_two_buckets(n_positions)
        self.chunk_buckets = chunk_buckets(self.context_buckets[-1])
        self.compiled_decode = compiled_decode
        self.compiled_extend = compiled_extend
        # Fixed here: mixed steps only with the compiled step graph, which runs decodes and prompt
        # chunks in one forward, as far as its limits go (the scheduler cuts a step past them).
        extend = self.supports_extend
        mixed = extend and compiled_decode is not None
        self.lora: LoraSlots | None = None
        if lora_slots:
            projections = model.lora_projections()
            if not projections:
                name = type(model).__name__
                raise ValueError(f"option.enable_lora: {name} (as built here) cannot run LoRA adapters")
            self.lora = LoraSlots(model.args, projections, lora_slots, lora_rank, model.dtype)
        step_lora = compiled_decode.lora if compiled_decode is not None else None
        if step_lora is not None and (
            self.lora is None
            or (step_lora.slots, step_lora.max_rank) != (lora_slots, lora_rank)
            or step_lora.projections != tuple(sorted(self.lora.projections))
        ):
            flag = step_lora.flag
            raise ValueError(f"the step package's adapter inputs ({flag}) are not this runner's slots")
        # What a step package with adapter inputs is handed on every call (views, written in place).
        self._lora_inputs = self.lora.inputs() if step_lora is not None and self.lora is not None else ()
        self.capabilities = RunnerCapabilities(
            extend=extend,
            mixed_steps=mixed,
            prompt_logits=True,
            max_chunk_tokens=self.context_buckets[-1] if extend else None,
            mixed_limits=compiled_decode.limits if mixed and compiled_decode is not None else None,
            prefill_as_extend=extend and (compiled_decode is not None or compiled_extend is not None),
            lora_slots=lora_slots,
            lora_rank=lora_rank if lora_slots else 0,
            # A verify line is at most the longest chunk (the eager extend's bound); the step graph
            # returns the logits of any tokens, so verify lines ride in its mixed step.
            max_verify_tokens=self.context_buckets[-1] if extend else 0,
            mixed_verify=mixed,
        )

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.adapters is None:
            return ForwardByKind.forward(self, batch)
        for row, start in zip(batch.rows, batch.starts, strict=True):
            self.rows.set_length(row, start)
        counts = batch.logit_counts or None
        return self._extend_lines(batch.rows, batch.chunks, list(batch.starts), counts, batch.adapters)

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        if self.lora is None:
            raise ValueError("this runner was built without LoRA slots (option.enable_lora)")
        self.lora.write(slot, adapter)

    @property
    def rows(self) -> RowTable:
        return self.cache.rows

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        if len(rows) != len(prompts):
            raise ValueError("prefill: rows and prompts differ in length")
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prefill: prompt for row {rows[i]} is empty")
            by_bucket[pick_bucket(self.context_buckets, len(prompt))].append(i)
        logits = torch.empty(len(rows), self.vocab_size)
        for bucket, members in by_bucket.items():
            lengths = [len(prompts[i]) for i in members]
            if self.model.rotary.spec.kind == "dynamic":
                bins = [[(j, 0)] for j in range(len(members))]  # its rope depends on each length
            else:
                bins = pack_into_bins(lengths, bucket)
            order, out, keys, values = self._encode_bins(bucket, bins, [prompts[i] for i in members])
            for b, j, offset in order:
                i = members[j]
                span = slice(offset, offset + lengths[j])
                self.cache.insert(rows[i], keys[:, b, :, span], values[:, b, :, span])
            logits[[members[j] for _, j, _ in order]] = out
        return logits

    def _encode_bins(
        self, bucket: int, bins: list[list[tuple[int, int]]], prompts: list[Sequence[int]]
    ) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lay prompts out in ``[len(bins), bucket]`` rows, several per row when they fit, so short
        prompts do not pay for a whole bucket of padding each."""
        n = len(bins)
        tokens = torch.zeros(n, bucket, dtype=torch.long)
        positions = torch.zeros(n, bucket, dtype=torch.long)
        segments = torch.full((n, bucket), -1, dtype=torch.long)
        order: list[tuple[int, int, int]] = []
        for b, members in enumerate(bins):
            filled = 0
            for j, offset in members:
                length = len(prompts[j])
                tokens[b, offset : offset + length] = torch.tensor(list(prompts[j]), dtype=torch.long)
                positions[b, offset : offset + length] = torch.arange(length)
                segments[b, offset : offset + length] = j
                order.append((b, j, offset))
                filled = max(filled, offset + length)
            # Padding is its own causal segment, so no attention row is fully masked.
            positions[b, filled:] = torch.arange(bucket - filled)
        if all(len(members) == 1 for members in bins):
            lengths = [len(prompts[members[0][0]]) for members in bins]
            out, keys, values = self.model.prefill(tokens, lengths)
        else:
            rows_idx = torch.tensor([b for b, _, _ in order])
            cols_idx = torch.tensor([offset + len(prompts[j]) - 1 for _, j, offset in order])
            out, keys, values = self.model.prefill_packed(tokens, positions, segments, (rows_idx, cols_idx))
        return order, out, keys, values

    def extend(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append ``chunks[i]`` to ``rows[i]`` after the positions it holds; returns the logits of
        each chunk's last token. A chunk is at most the largest context bucket (``max_chunk_tokens``)."""
        return self._extend_lines(rows, chunks, self._check_lines("extend", rows, chunks))

    def _extend_lines(
        self,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        starts: list[int],
        logit_counts: Sequence[int] | None = None,
        adapters: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """The checked lines through the step graph where it covers them (adapted lines only where
        it takes adapters), else the eager extend."""
        step = self.compiled_decode
        takes = step is not None and (adapters is None or step.lora is not None)
        if takes and step is not None and step.covers_chunks(starts, [len(c) for c in chunks]):
            logits = self._step(rows, chunks, starts, logit_counts, adapters)
            for row, start, chunk in zip(rows, starts, chunks, strict=True):
                self.rows.set_length(row, start + len(chunk))
            return logits
        return self._extend_eager(rows, chunks, adapters, last=logit_counts)

    def _step(
        self,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        starts: Sequence[int],
        logit_counts: Sequence[int] | None = None,
        adapters: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """One call of the step package (with its adapter inputs where it takes them)."""
        step = self.compiled_decode
        if step is None:
            raise ValueError("no step package is loaded")
        k, v = self.cache.k, self.cache.v
        return step(rows, chunks, starts, k, v, logit_counts, adapters, self._lora_inputs)

    def _extend_eager(
        self,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        adapters: Sequence[int | None] | None = None,
        last: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The eager extend, padded to each chunk's bucket (several buckets: one model call each, so
        a short chunk does not pay for a long one's padding; a chunk past the largest is refused by
        pick_bucket). ``adapters``: each line's LoRA slot (an adapted batch). ``last``: the logits
        of each line's last ``last[i]`` positions, ``[sum(last), vocab]`` (a batch of verify lines)."""
        ends = list(accumulate(last)) if last else list(range(1, len(rows) + 1))
        logits = torch.empty(ends[-1], self.vocab_size)
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i, chunk in enumerate(chunks):
            by_bucket[pick_bucket(self.chunk_buckets, len(chunk))].append(i)
        for bucket, members in by_bucket.items():
            pieces = [list(chunks[i]) for i in members]
            lora = None
            if adapters is not None and self.lora is not None:
                lora = self.lora.batch([adapters[i] for i in members])
            counts = [last[i] for i in members] if last else None
            out = self._extend_bucket([rows[i] for i in members], pieces, bucket, lora, counts)
            if counts is None:
                logits[members] = out
            else:  # each member's last positions, in line order
                spans = zip(members, counts, strict=True)
                logits[[j for i, n in spans for j in range(ends[i] - n, ends[i])]] = out
        return logits

    def _check_lines(self, what: str, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> list[int]:
        """The rows' lengths (where each chunk goes), once the lines are checked to fit."""
        if not self.supports_extend:
            raise NotImplementedError(f"{type(self.model).__name__} has no extend step")
        if len(rows) != len(chunks):
            raise ValueError(f"{what}: rows and chunks differ in length")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{what}: rows {list(rows)} repeat a row")
        starts = self.rows.lengths(rows)
        for row, chunk, start in zip(rows, chunks, starts, strict=True):
            if not chunk:
                raise ValueError(f"{what}: chunk for row {row} is empty")
            if start + len(chunk) > self.n_positions:
                raise ValueError(
                    f"{what}: row {row} holds {start} positions, {len(chunk)} more "
                    f"exceed n_positions={self.n_positions}"
                )
        return starts

    def verify(
        self, rows: Sequence[int], chunks: Sequence[Sequence[int]], logit_counts: Sequence[int]
    ) -> torch.Tensor:
        """``extend``, returning the logits of each line's last ``logit_counts[i]`` positions in line
        order, ``[sum(logit_counts), vocab]`` (speculative decodes are verified from them).

        The batch (a mixed step's lines, the others' counts 1, or verify lines alone) runs the step
        graph where it covers the batch, else the eager extend; none is longer than
        ``max_verify_tokens``."""
        starts = self._check_lines("verify", rows, chunks)
        if len(logit_counts) != len(rows):
            raise ValueError("verify: rows and logit_counts differ in length")
        longest = self.capabilities.max_verify_tokens
        if any(len(chunk) > longest for chunk in chunks):
            raise ValueError(f"verify: a line of {max(map(len, chunks))} tokens exceeds {longest}")
        return self._extend_lines(rows, chunks, starts, logit_counts)

    def _extend_bucket(
        self,
        rows: list[int],
        pieces: list[list[int]],
        bucket: int,
        lora: LoraBatch | None = None,
        last: list[int] | None = None,
    ) -> torch.Tensor:
        starts = self.rows.lengths(rows)
        lengths = [len(p) for p in pieces]
        compiled = self.compiled_extend
        if lora is None and last is None and compiled is not None and compiled.covers(starts, lengths):
            out = compiled(rows, pieces, starts, self.cache.k, self.cache.v)
        else:
            tokens = right_padded(pieces, bucket)
            ends = max(s + n for s, n in zip(starts, lengths, strict=True))
            out = self.model.extend(
                tokens, torch.tensor(rows, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                lengths, self.cache.k, self.cache.v, pick_bucket(self.token_buckets, ends), lora, last,
            )  # fmt: skip
        for row, start, n in zip(rows, starts, lengths, strict=True):
            self.rows.set_length(row, start + n)
        return out

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` cached positions of row ``src`` into row ``dst`` (prefix reuse)."""
        self.cache.copy(src, dst, n)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        # Rows go to the model in ascending order: a run of rows is then a slice of the cache, which
        # attention reads in place (any other set of rows is gathered, a copy per layer).
        order = ascending(rows)
        ordered = [rows[i] for i in order]
        positions = self.cache.reserve_next(ordered)
        ordered_tokens = [tokens[i] for i in order]
        compiled = self.compiled_decode
        starts = positions.tolist()
        if compiled is not None and compiled.covers_chunks(starts, [1] * len(ordered)):
            chunks = [[t] for t in ordered_tokens]
            logits = self._step(ordered, chunks, starts)
            return in_asked_order(logits, order)
        # Each row's length bucket: the model may group rows by it, so a long row does not make the
        # others read its length.
        attn_lens = [pick_bucket(self.token_buckets, p + 1) for p in positions.tolist()]
        logits = self.model.decode(
            torch.tensor(ordered_tokens, dtype=torch.long),
            torch.tensor(ordered, dtype=torch.long),
            positions,
            self.cache.k,
            self.cache.v,
            max(attn_lens),
            attn_lens,
        )
        return in_asked_order(logits, order)

    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits at every position of ``prompt``, ``[len(prompt), vocab]`` fp32, for prompt
        log-probabilities (``echo`` with ``logprobs``, ``decoder_input_details``). A separate
        forward pass that touches no KV row, paid only by requests that score their prompt."""
        n = len(prompt)
        tokens = torch.tensor([list(prompt)], dtype=torch.long)
        positions = torch.arange(n)[None, :]
        segments = torch.zeros(1, n, dtype=torch.long)
        every = (torch.zeros(n, dtype=torch.long), torch.arange(n))
        logits, _, _ = self.model.prefill_packed(tokens, positions, segments, every)
        return logits
