"""The NxD Inference runner: a ``ModelRunner`` over a causal-LM application's continuous-batching forward.

The contract it drives (aws-neuron/neuronx-distributed-inference 0.8 and 0.9, ``models/model_base.py``
``NeuronBaseForCausalLM.forward``, ``models/model_wrapper.py`` ``_forward_with_pad``/``pad_inputs``,
``modules/kvcache/kv_cache_manager.py``), checked against the library's own code on the CPU
(``tests/backends/nxdi_library``)::

    out = app(input_ids=…, attention_mask=…, position_ids=…, seq_ids=…)
      context encoding   position_ids.min() == 0: one prompt per call (ctx_batch_size=1), ids [1, L],
                         seq_ids [row]; the library pads right up to the smallest bucket longer than L
                         (or the largest) with position_ids 1, takes the last token at
                         argmax(position_ids), and writes KV into row seq_ids[0]
      token generation   ids/position_ids [n, 1], attention_mask [n, max(pos)]; a partial batch is
                         completed with copies of its FIRST line for the missing seq_ids, sorted, run,
                         and mapped back; a FULL batch is run unchanged and line i writes cache row i,
                         so rows must go in seq_id order
      sliding window W   a ring of W-1 live slots per row: position p is written into slot p % (W-1)
      out.logits         float32 [n, 1, vocab] at the last real token (no on-device sampling); with
                         on-device sampling ``tokens`` hold int32 ids drawn from each line's
                         ``sampling_params`` [n, 3] (top_k, top_p, temperature), and ``logits`` is
                         None unless ``output_logits``

Consequences handled here:

* A prompt of one or two tokens would lose (or tie) the ``argmax`` to the library's padding positions
  of 1, and come back with a pad slot's logits. It is sent already padded to the largest bucket, its
  padding at position 0, so the library pads nothing and its last real token holds the maximum.
* Rows are always sent sorted by seq_id. With on-device sampling a partial token batch is completed
  here as the library completes it on a device (its CPU mode fails on one with ``output_logits``).
* Every live row must be written harmlessly. The engine decodes every live row in each call
  (``RunnerCapabilities.live_rows_step_together``); a live row not asked all the same rides along: at its
  next, unwritten position where that slot holds nothing it needs (no window, or fewer than W-1
  positions), else by writing its last token again at its last position, which recomputes the same
  K/V while the ring has not wrapped. A row of length 0 never rides: position 0 would turn the call
  into a context encoding. There is no free on the device: ``RowTable`` frees a row and its next
  context encoding overwrites it.

Fused speculation (``speculation_length`` L > 1: a draft model or an EAGLE head compiled into the
token-generation graph, ``NeuronFusedSpecModel``; read from the source, ``docs/verification.md``): the
same calls, but ``out.fused_outputs`` replaces ``tokens``/``logits``: on a device a list
``[accepted, next_input_ids, next_attention_mask, next_position_ids]`` (then draft and target logits
``[n, L, vocab]`` with ``output_logits``), in its CPU path the ``accepted`` tensor alone; ``accepted``
is int32 ``[n, L]``, each row's accepted tokens then -1 (a context call: its one token then -1). Each
line writes the K/V of its input and L - 1 drafts at ``position .. position + L - 1``, so a row's last
usable position is L - 1 before the sequence ends (``n_positions`` is ``seq_len - L + 1``; the row
table keeps ``seq_len``), and a rider, writing past its row's end, stays harmless. Each DECODE line
comes back as its run (``SampledStep.runs``); its row holds the first position only, and the engine
keeps the accepted rest (``EngineCore._accept_run``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cache_api import RowTable
from neuron_lmi.backends.nxdi.artifacts import new_application
from neuron_lmi.backends.nxdi.cpu_mode import supply_cpu_methods
from neuron_lmi.backends.row_batch import PAD_TOKEN_ID, check_prompts, token_batch
from neuron_lmi.runners.base import (
    GREEDY_LINE,
    BatchKind,
    DeviceSampling,
    ForwardByKind,
    LineSampling,
    RunnerCapabilities,
    SampledStep,
    StepBatch,
)

if TYPE_CHECKING:
    from neuron_lmi.backends.nxdi.plan import NxdiPlan

log = logging.getLogger(__name__)

# The library pads context position_ids with 1: a prompt whose last position is below 2 must bring
# its own padding (at position 0) so that argmax(position_ids) is its last token.
SELF_PADDED_BELOW = 3
# What NeuronFusedSpecModel puts after a row's accepted tokens (its acceptance_padding_token).
ACCEPTANCE_PADDING = -1


class CausalLMApplication(Protocol):
    """What the runner needs of ``NeuronLlamaForCausalLM`` & co. (or ``NxdiContractModel``)."""

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
        sampling_params: torch.Tensor | None = None,
    ) -> Any: ...


class NxdiRunner(ForwardByKind):
    """``ModelRunner`` over an NxD Inference application of ``n_rows`` x ``n_positions``.

    Invariants: ``rows`` is the only record of which device rows hold what; every token-generation call
    lists seq_ids in ascending order; no call writes a slot a live row still reads; logits come back
    fp32 ``[len(rows), vocab_size]`` in the order asked. With ``device_sampling`` every call carries
    ``sampling_params`` ``[n, 3]`` (top_k, top_p, temperature per line; a line riding along, greedy)
    and ``forward_sampled`` returns the device's tokens, with the logits where the application was
    built with ``output_logits``. ``forward`` alone asks greedy lines; without logits it returns the
    device's token as a one-hot logits row.
    """

    capabilities = RunnerCapabilities(live_rows_step_together=True)

    def __init__(
        self,
        model: CausalLMApplication,
        n_rows: int,
        n_positions: int,
        vocab_size: int,
        device_sampling: DeviceSampling | None = None,
        largest_context_bucket: int | None = None,
        sliding_window: int | None = None,
        dtype: str | None = None,
        speculation_length: int = 0,
    ) -> None:
        self.model = model
        self.rows = RowTable(n_rows, n_positions)
        self.speculation_length = speculation_length
        self.n_positions = n_positions - max(speculation_length - 1, 0)
        self.vocab_size = vocab_size
        self.device_sampling = device_sampling
        if device_sampling is not None:
            self.capabilities = dataclasses.replace(self.capabilities, device_sampling=device_sampling)
        if speculation_length > 1:  # refused in RunnerCapabilities without device sampling
            self.capabilities = dataclasses.replace(self.capabilities, fused_speculation=speculation_length)
        self.largest_context_bucket = largest_context_bucket or n_positions
        self.sliding_window = sliding_window
        self.dtype = dtype  # what the application computes in (reported as the model's dtype)
        self._last_token: dict[int, int] = {}  # row -> the token written at its last position

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._as_logits(self._prefill(rows, prompts, [GREEDY_LINE] * len(rows)))

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._as_logits(self._token_step(list(rows), list(tokens), [GREEDY_LINE] * len(rows)))

    def forward_sampled(self, batch: StepBatch, sampling: Sequence[LineSampling]) -> SampledStep:
        if self.device_sampling is None:
            raise RuntimeError("this NxD Inference application does not sample on the device")
        if len(sampling) != len(batch):
            raise ValueError(f"{len(sampling)} sampling lines for a batch of {len(batch)}")
        if batch.kind is BatchKind.DECODE:
            return self._token_step(list(batch.rows), [c[0] for c in batch.chunks], list(sampling))
        if batch.kind is BatchKind.PREFILL:
            return self._prefill(batch.rows, batch.chunks, list(sampling))
        raise ValueError("NxdiRunner has no EXTEND graph (capabilities.extend is False)")

    def _prefill(
        self, rows: Sequence[int], prompts: Sequence[Sequence[int]], lines: list[LineSampling]
    ) -> SampledStep:
        check_prompts(self.rows, rows, prompts, self.n_positions)
        steps = [self._context(row, list(p), line) for row, p, line in zip(rows, prompts, lines, strict=True)]
        logits = [s.logits for s in steps]
        return SampledStep(
            torch.cat([s.tokens for s in steps]),
            torch.cat(logits) if all(x is not None for x in logits) else None,  # type: ignore[arg-type]
        )

    def _context(self, row: int, prompt: list[int], line: LineSampling) -> SampledStep:
        length = len(prompt)
        width = length
        if length < SELF_PADDED_BELOW:
            width = max(length, self.largest_context_bucket)
        ids = torch.full((1, width), PAD_TOKEN_ID, dtype=torch.long)
        ids[0, :length] = torch.tensor(prompt)
        mask = torch.zeros(1, width, dtype=torch.long)
        mask[0, :length] = 1
        positions = torch.zeros(1, width, dtype=torch.long)
        positions[0, :length] = torch.arange(length)
        seq_ids = torch.tensor([row])
        out = self._call(ids, mask, positions, seq_ids, [line])
        self.rows.set_length(row, length)
        self._last_token[row] = prompt[-1]
        return self._outputs(out, seq_ids)

    def _rider(self, row: int) -> tuple[int, int] | None:
        """What a live row not asked to step writes (see the module docstring)."""
        length = self.rows.length(row)
        window = self.sliding_window
        if length < 1 or length >= self.n_positions:
            return None
        if window is None or length < window - 1:
            return PAD_TOKEN_ID, length
        if length >= window:
            log.error("row %d rides along past its sliding window: its ring cache is rewritten", row)
        return self._last_token[row], length - 1

    def _token_step(self, rows: list[int], tokens: list[int], lines: list[LineSampling]) -> SampledStep:
        batch = token_batch(self.rows, rows, tokens, self.n_positions, rider=self._rider)
        position_ids = batch.positions[:, None]
        laid_out = [lines[i] if i < batch.asked else GREEDY_LINE for i in batch.order]
        ids, seq_ids, kept = batch.tokens, batch.seq_ids, list(range(len(batch.seq_ids)))
        if self.device_sampling is not None and len(seq_ids) < self.rows.n_rows:
            ids, position_ids, seq_ids, laid_out, kept = self._completed(ids, position_ids, seq_ids, laid_out)
        attention_mask = (torch.arange(int(position_ids.max()))[None, :] < position_ids).long()
        out = self._call(ids[:, None], attention_mask, position_ids, seq_ids, laid_out)
        self._last_token.update(zip(rows, tokens, strict=True))
        step = self._outputs(out, seq_ids, context=False)
        logits = batch.restore(step.logits[kept]) if step.logits is not None else None
        runs = None
        if step.runs is not None:  # back in the order asked, as restore does for tensors
            line = batch.restore(torch.tensor(kept)[:, None])[:, 0].tolist()
            runs = tuple(step.runs[i] for i in line)
        return SampledStep(batch.restore(step.tokens[kept][:, None])[:, 0], logits, runs)

    def _completed(
        self, ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, lines: list[LineSampling]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[LineSampling], list[int]]:
        """A partial batch completed as the library completes it on a device (copies of its first line
        for the missing seq_ids, which hold no live row), so the library sees a full batch: in its CPU
        mode a partial batch with ``output_logits`` writes the logits into the KV cache
        (``model_wrapper.py`` unpacks ``logits, *kv_caches`` from three kinds of output) and fails.
        Returns the full call and where the asked lines sit in it."""
        present = seq_ids.tolist()
        every = present + [r for r in range(self.rows.n_rows) if r not in set(present)]
        order = sorted(range(len(every)), key=every.__getitem__)
        first = [i if i < len(present) else 0 for i in order]
        kept = [j for j, i in enumerate(order) if i < len(present)]
        lines = [lines[i] if i < len(present) else GREEDY_LINE for i in order]
        return ids[first], positions[first], torch.tensor(sorted(every)), lines, kept

    def _call(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        lines: list[LineSampling],
    ) -> Any:
        extra: dict[str, torch.Tensor] = {}
        if self.device_sampling is not None:  # the library's sampling_params: [n, 3] float32
            extra["sampling_params"] = torch.tensor(
                [[line.top_k, line.top_p, line.temperature] for line in lines], dtype=torch.float32
            )
        with torch.inference_mode():
            return self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, seq_ids=seq_ids, **extra
            )

    def _outputs(self, out: Any, seq_ids: torch.Tensor, context: bool = True) -> SampledStep:
        """(tokens, logits) of one call of ``n = len(seq_ids)`` lines. Without on-device sampling the
        tokens are the logits' argmax; with it, ``out.tokens`` (int32 ``[n]``) and ``out.logits`` only
        with ``output_logits``; with fused speculation, ``_fused``."""
        n = len(seq_ids)
        if self.speculation_length > 1:
            return self._fused(out, n, context)
        logits = getattr(out, "logits", out)
        if logits is not None:
            if logits.dim() == 3:
                logits = logits[:, -1, :]
            if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < self.vocab_size:
                raise RuntimeError(
                    f"model returned logits {tuple(logits.shape)}, expected [{n}, 1, {self.vocab_size}]"
                )
            logits = logits[:, : self.vocab_size].float()
        if self.device_sampling is None:
            if logits is None:
                raise RuntimeError("model returned no logits")
            return SampledStep(logits.argmax(-1), logits)
        tokens = getattr(out, "tokens", None)
        if tokens is None:
            raise RuntimeError("model returned no tokens (on-device sampling)")
        return SampledStep(torch.as_tensor(tokens).reshape(-1)[:n].long(), logits)

    def _fused(self, out: Any, n: int, context: bool) -> SampledStep:
        """A fused-speculation call's tokens, runs and (with ``output_logits``) the target's logits at
        each line's first position (a context call's last); see the module docstring."""
        fused = getattr(out, "fused_outputs", None)
        if fused is None:
            raise RuntimeError("model returned no fused_outputs (fused speculation)")
        parts = list(fused) if isinstance(fused, list | tuple) else [fused]
        accepted = torch.as_tensor(parts[0]).reshape(n, -1).long()
        counts = (accepted != ACCEPTANCE_PADDING).long().cumprod(dim=1).sum(dim=1)
        if bool((counts < 1).any()):
            raise RuntimeError(f"fused speculation accepted no token on a line: {accepted.tolist()}")
        runs = tuple(tuple(row[:c]) for row, c in zip(accepted.tolist(), counts.tolist(), strict=True))
        logits = None
        if self.device_sampling is not None and self.device_sampling.logits:
            if len(parts) < 6:
                raise RuntimeError("model returned no target logits in fused_outputs (output_logits)")
            target = torch.as_tensor(parts[-1])
            logits = target[:, -1 if context else 0, : self.vocab_size].float()
        return SampledStep(accepted[:, 0], logits, None if context else runs)

    def _as_logits(self, step: SampledStep) -> torch.Tensor:
        """``forward``'s logits: the device's token as a one-hot row where no logits came back."""
        if step.logits is not None:
            return step.logits
        n = len(step.tokens)
        logits = torch.full((n, self.vocab_size), float("-inf"))
        logits[torch.arange(n), step.tokens] = 0.0
        return logits


# -- start-up: configuration -> plan -> artifacts -> runner -----------------------------------------


def runner_for(model: CausalLMApplication, plan: NxdiPlan, vocab_size: int) -> NxdiRunner:
    return NxdiRunner(
        model,
        plan.batch_size,
        plan.n_positions,
        vocab_size,
        plan.device_sampling(),
        largest_context_bucket=plan.context_buckets[-1],
        sliding_window=plan.sliding_window,
        dtype=plan.dtype,
        speculation_length=plan.speculation.speculation_length if plan.speculation else 0,
    )


def on_cpu_application(plan: NxdiPlan) -> Any:
    """The application with NxD Inference's modeling code on the CPU: ``to_cpu()`` shards the
    checkpoint for one rank into torch modules instead of compiling or loading NEFFs."""
    import socket

    if "MASTER_PORT" not in os.environ and not torch.distributed.is_initialized():
        # to_cpu starts a one-process gloo group on MASTER_PORT, 29500 by default: a second server
        # (or anything else on that port) would make start-up fail with EADDRINUSE.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    app = new_application(plan)
    supply_cpu_methods(app, plan.on_cpu, plan.library_version)
    app.to_cpu()
    return app
