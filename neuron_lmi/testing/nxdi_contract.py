"""An in-repo stand-in for an NxD Inference causal-LM application, on the CPU reference model.

``NxdiContractModel(input_ids=…, attention_mask=…, position_ids=…, seq_ids=…)`` behaves as
``NeuronBaseForCausalLM.forward`` does with ``is_continuous_batching=True`` and no on-device sampling
(neuronx-distributed-inference 0.9: ``model_base.py`` forward/_is_prefill, ``model_wrapper.py``
``_forward_with_pad``/``_get_seq_bucket``, ``kv_cache_manager.py`` update), so ``NxdiRunner`` is driven
here against the contract it drives on a device:

* context encoding when ``position_ids.min() == 0``: prompts run one at a time (``ctx_batch_size=1``);
  each is padded right to the smallest context bucket longer than it (or the largest, when it fills
  it; longer is an error, as without ``allow_input_truncation``) with position_ids 1
  (``model_wrapper.pad_inputs``), its whole bucket is written into cache row ``seq_ids[j]``, and the
  logits come back of the token at ``argmax(position_ids)`` (``model_base.py``, first index on ties):
  the last real token from three tokens on, a padding token for a prompt of one token;
* token generation otherwise: a partial batch is completed with copies of its *first* line for the
  missing seq_ids, sorted by seq_id, and mapped back; a full batch is run as given; either way line
  *i* of what runs writes cache row *i* at ``position_ids[i]`` — so a full batch out of seq_id order
  corrupts rows, exactly as on the device; a partial batch's logits come back in the order asked, a
  full batch's line by line;
* a sliding window W (an application that honours it: Mistral on 0.9; ``ignores_sliding_window``
  for Mixtral, and for a Mistral on 0.8's Llama) is a ring of W-1 live slots per row, position p
  written into slot ``p % (W-1)`` after attention (``kv_cache_manager.py``), and a context encoding
  keeps only the W-1 indices ending at its last position (``get_last_kv_window``): here the cache is
  the ring unrolled, every position ``q`` holding what slot ``q % (W-1)`` holds, so a write at p lands
  on every such q and a query's window reads exactly the ring's slots;
* returns an object whose ``logits`` is float32 ``[n, 1, vocab]``;
* with on-device sampling (``on_device_sampling``: ``OnDeviceSamplingConfig``'s keys) each call takes
  ``sampling_params`` ``[n, 3]`` (top_k, top_p, temperature; omitted: greedy), validated as
  ``validate_sampling_params`` does (top_k an integer in [-1, global_topk], top_p in (0, 1],
  temperature >= 0, temperature 0 only with top_k 1), and returns ``tokens`` int32 ``[n]``: with
  ``dynamic`` or ``do_sample`` each row draws from its own ``global_topk`` most likely tokens cut to
  its top_k (the rest set to -3000), divided by its temperature, cut to its top_p (the first token
  always kept), by inverse CDF (``deterministic``: at 0.5); otherwise the argmax. ``logits`` is then
  None unless ``output_logits`` (``modules/generation/sampling.py``, ``model_base.py``
  ``_sample_on_device``/``_get_constructed_outputs``);
* with fused speculation (``speculation``: a draft model and ``speculation_length`` L, which needs
  on-device sampling), as ``NeuronFusedSpecModel`` (``model_base.py``) reads: a context call encodes
  the prompt into the target's cache and the draft's; a token call runs the draft greedily L times
  (line i's token at its position, then each draft at the next, L K/V writes into the draft's row), the
  target once over the input and the first L - 1 drafts (L writes), samples the target's token at each
  of the L positions with the line's ``sampling_params``, and accepts the target's tokens up to and
  including the first whose draft differs (``_tkg_postprocessor``: 1 to L per line, then -1); the
  call's bucket must fit the mask's width + L (``_get_seq_bucket``). It returns ``fused_outputs`` as a
  device does, ``[accepted [n, L], next_input_ids, next_attention_mask, next_position_ids]`` (+ draft
  and target logits ``[n, L, vocab]`` with ``output_logits``); a context call's ``accepted`` is its
  token then -1 (``_cte_postprocessor``). Read from the source only: NxD Inference's CPU mode refuses
  speculation, so this part is not checked against the library (``docs/verification.md``).

Every one of these was checked against the library's own code on the CPU, call by call
(``tests/backends/nxdi_library/test_contract_agreement.py``), for every family the backend maps: Llama,
Mistral (a window of 8), Mixtral, Qwen2, Qwen3, Qwen3-MoE and Gemma 3 (text and vision-language, within
its window: the only way NxD Inference serves it, ``backends/nxdi/model_checks``), over the CPU
engine's model of each (``LlamaForCausalLM`` and its registered subclasses).

Anything the library would reject (a position past ``seq_len``, a seq_id out of range, a mask that is
not right padding) raises ``ValueError`` here. ``calls`` records each call's kind and shape.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_cache.key import token_generation_buckets
from neuron_lmi.backends.nxdi.plan import nxdi_context_buckets
from neuron_lmi.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class CausalLMOutput:
    """The part of ``CausalLMOutputWithPast`` the runner reads."""

    logits: torch.Tensor | None
    tokens: torch.Tensor | None = None
    fused_outputs: list[torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class ContractSpeculation:
    """A draft fused into the graph: ``draft`` (same vocabulary) and ``speculation_length`` L >= 2."""

    draft: LlamaForCausalLM
    speculation_length: int


IGNORED_LOGIT = -3000.0  # what the library's sampler puts past a row's top_k and top_p


def validate_sampling_params(params: torch.Tensor, global_topk: int) -> None:
    """What the library refuses (``modules/generation/sampling.py`` ``validate_sampling_params``)."""
    if params.dim() != 2 or params.shape[1] != 3:
        raise ValueError(f"Expected tensor of shape (batch_size, 3), but got {tuple(params.shape)}")
    top_k, top_p, temperature = params.float().unbind(1)
    if not bool(((top_k == -1) | ((top_k >= 0) & (top_k <= global_topk))).all()):
        raise ValueError(f"Invalid top-k values found (global_topk={global_topk}): {top_k.tolist()}")
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(f"top-k values must be integers: {top_k.tolist()}")
    if not bool(((top_p > 0.0) & (top_p <= 1.0)).all()):
        raise ValueError(f"Invalid top-p values found: {top_p.tolist()}")
    if not bool((temperature >= 0.0).all()):
        raise ValueError(f"Invalid temperature values found: {temperature.tolist()}")
    if bool(((temperature == 0.0) & (top_k <= 0)).any()):
        raise ValueError("Temperature = 0 enables greedy sampling. Please set top_k to 1")


def draw(logits: torch.Tensor, params: torch.Tensor, global_topk: int, rand: torch.Tensor) -> torch.Tensor:
    """Each row's token from its (top_k, top_p, temperature) and a uniform number ``rand`` [n]."""
    top_k, top_p, temperature = params.float()[:, :, None].unbind(1)
    values, index = torch.topk(logits.float(), min(global_topk, logits.shape[-1]), dim=-1)
    ranks = torch.arange(values.shape[-1])[None, :]
    values = values.masked_fill(ranks >= top_k, IGNORED_LOGIT) / temperature
    mass = torch.softmax(values, dim=-1).cumsum(dim=-1)
    cut = (mass > torch.maximum(mass.min(), top_p)) & (ranks > 0)
    cdf = torch.softmax(values.masked_fill(cut, IGNORED_LOGIT), dim=-1).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    chosen = (rand[:, None] > cdf).sum(dim=-1, keepdim=True).clamp(max=values.shape[-1] - 1)
    return index.gather(-1, chosen)[:, 0]


class NxdiContractModel:
    """NxD Inference's continuous-batching forward over ``LlamaForCausalLM`` (or a registered subclass).

    Invariants: the cache has exactly ``batch_size`` rows, all permanently allocated (the device has no
    free list) and written only by calls.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        batch_size: int,
        seq_len: int,
        context_length_estimate: Sequence[int] | None = None,
        ignores_sliding_window: bool = False,
        pad_token_id: int = 0,
        on_device_sampling: dict[str, Any] | None = None,
        output_logits: bool = False,
        seed: int = 0,
        speculation: ContractSpeculation | None = None,
    ) -> None:
        if seq_len > model.n_positions:
            raise ValueError(f"seq_len={seq_len} exceeds the model's rotary table ({model.n_positions})")
        if ignores_sliding_window and model.args.sliding_window is not None:
            model = model.without_window()
        window = model.args.sliding_window
        self.ring = window - 1 if window is not None and window < seq_len else None
        self.model = model
        self.pad_token_id = pad_token_id  # config.pad_token_id; the library pads with 0 without one
        self.batch_size = batch_size
        self.seq_len = seq_len
        estimate = tuple(context_length_estimate) if context_length_estimate else None
        self.context_buckets = list(nxdi_context_buckets(seq_len, estimate))
        self.token_buckets = list(token_generation_buckets(seq_len, 128))
        self.cache = model.make_cache(batch_size, seq_len)
        for _ in range(batch_size):
            self.cache.rows.allocate()
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.on_device_sampling = on_device_sampling
        self.output_logits = output_logits
        self.generator = torch.Generator().manual_seed(seed)  # the device's own draws
        self.sampling_params: list[torch.Tensor] = []  # each call's, as validated
        self.speculation = speculation
        self.draft_cache = None
        if speculation is not None:
            if on_device_sampling is None:
                raise ValueError("fused speculation needs on_device_sampling_config (the library asserts it)")
            if self.ring is not None or speculation.draft.args.vocab_size != model.args.vocab_size:
                raise ValueError("fused speculation is modelled without a window, over one vocabulary")
            self.draft_cache = speculation.draft.make_cache(batch_size, seq_len)
            for _ in range(batch_size):
                self.draft_cache.rows.allocate()

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor | None = None,
        sampling_params: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        if input_ids.dim() != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be [batch, tokens]; got {tuple(input_ids.shape)} "
                f"and {tuple(position_ids.shape)}"
            )
        n = input_ids.shape[0]
        seq = torch.arange(n) if seq_ids is None else seq_ids.long()
        if seq.dim() != 1 or len(seq) != n:
            raise ValueError(f"seq_ids must be [{n}], got {tuple(seq.shape)}")
        if len(set(seq.tolist())) != n or int(seq.min()) < 0 or int(seq.max()) >= self.batch_size:
            raise ValueError(f"seq_ids must be distinct rows in [0, {self.batch_size}), got {seq.tolist()}")
        if int(position_ids.max()) >= self.seq_len:
            raise ValueError(f"position {int(position_ids.max())} is past seq_len={self.seq_len}")
        params = self._sampling_params(sampling_params, n)
        if int(position_ids.min()) == 0:
            self.calls.append(("context", tuple(input_ids.shape)))
            logits = self._context(input_ids, attention_mask, position_ids, seq)
            if self.speculation is not None:
                return self._fused_context(logits, input_ids, attention_mask, position_ids, seq, params)
            return self._output(logits, params)
        if input_ids.shape[1] != 1:
            raise ValueError("several tokens at positions > 0 is speculation/chunked prefill: not modelled")
        self.calls.append(("token", tuple(input_ids.shape)))
        if self.speculation is not None:
            return self._fused_token(input_ids, attention_mask, position_ids, seq, params)  # type: ignore[arg-type]
        return self._output(self._token(input_ids, attention_mask, position_ids, seq), params)

    def _sampling_params(self, params: torch.Tensor | None, n: int) -> torch.Tensor | None:
        if self.on_device_sampling is None:
            return None  # the library ignores them without on-device sampling
        if params is None:  # default_sampling_params: greedy, batch_size rows (a shorter call fails)
            params = torch.tensor([[1.0, 1.0, 1.0]]).expand(self.batch_size, 3)
        validate_sampling_params(params, int(self.on_device_sampling.get("global_topk", 256)))
        if params.shape[0] != n:
            raise ValueError(f"sampling_params has {params.shape[0]} rows for {n} lines")
        params = params.float().clone()
        params[params[:, 2] == 0.0, :2] = 1.0  # infer_sampling_params: temperature 0 is greedy
        self.sampling_params.append(params)
        return params

    def _output(self, logits: torch.Tensor, params: torch.Tensor | None) -> CausalLMOutput:
        config = self.on_device_sampling
        if config is None or params is None:
            return CausalLMOutput(logits)
        last = logits[:, -1, :]
        if config.get("dynamic") or config.get("do_sample"):
            n = last.shape[0]
            rand = torch.rand(n, generator=self.generator)
            if config.get("deterministic"):
                rand = torch.full((n,), 0.5)
            tokens = draw(last, params, int(config.get("global_topk", 256)), rand)
        else:
            tokens = last.argmax(dim=-1)
        return CausalLMOutput(logits if self.output_logits else None, tokens.to(torch.int32))

    def _context(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        seq: torch.Tensor,
        draft: bool = False,
    ) -> torch.Tensor:
        n, t = input_ids.shape
        model, cache = self.model, self.cache
        if draft and self.speculation is not None:
            model, cache = self.speculation.draft, self.draft_cache
        out = torch.empty(n, 1, self.model.args.vocab_size)
        for j in range(n):  # ctx_batch_size=1: one prompt at a time
            length = int(mask[j].sum()) if mask is not None else t
            if mask is not None and not torch.equal(mask[j, :length], torch.ones(length, dtype=mask.dtype)):
                raise ValueError(f"attention_mask row {j} is not right padding: {mask[j].tolist()}")
            if not torch.equal(positions[j, :length], torch.arange(length)):
                raise ValueError(f"position_ids row {j} must start 0..{length - 1}")
            bucket = self._context_bucket(t)
            padded = torch.ones(bucket, dtype=torch.long)  # the library pads position_ids with 1
            padded[:t] = positions[j]
            last = int(torch.max(padded, dim=0).indices)  # first index on ties, as torch.max on the CPU
            tokens = torch.full((1, bucket), self.pad_token_id, dtype=torch.long)
            tokens[0, :t] = input_ids[j]
            logits, keys, values = model.prefill_at(tokens, padded, last)
            keys, values = keys[:, 0], values[:, 0]
            if self.ring is not None:  # the ring unrolled: the W-1 indices ending at the last position
                end = max(int(padded.max()) + 1, self.ring)
                start = end - self.ring
                index = start + (torch.arange(self.seq_len) - start) % self.ring
                keys, values = keys[:, :, index], values[:, :, index]
            cache.insert(int(seq[j]), keys, values)  # the whole bucket, padding included
            out[j, 0] = logits[0].float()
        return out

    def _context_bucket(self, length: int) -> int:
        """``_get_seq_bucket(strategy="first_fit")``: smallest bucket > length, or the largest if equal."""
        i = bisect.bisect_right(self.context_buckets, length)
        if i < len(self.context_buckets):
            return self.context_buckets[i]
        if length == self.context_buckets[-1]:
            return length
        raise ValueError(f"Input len {length} exceeds largest bucket ({self.context_buckets[-1]})")

    def _token(
        self, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, seq: torch.Tensor
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        if mask is not None:
            expected = (torch.arange(mask.shape[1])[None, :] < positions).to(mask.dtype)
            if not torch.equal(mask, expected):
                raise ValueError("token-generation attention_mask must be ones below each row's position")
        ids, pos = input_ids[:, 0].long(), positions[:, 0].long()
        if n < self.batch_size:  # _forward_with_pad: complete with the first line, sort by seq_id
            missing = [r for r in range(self.batch_size) if r not in set(seq.tolist())]
            padded_seq = torch.tensor(seq.tolist() + missing)
            ids = torch.cat([ids, ids[:1].expand(len(missing))])
            pos = torch.cat([pos, pos[:1].expand(len(missing))])
            _, order = torch.sort(padded_seq)
            ids, pos = ids[order], pos[order]
        attn_len = self.token_buckets[bisect.bisect_left(self.token_buckets, int(pos.max()) + 1)]
        # Line i writes cache row i (kv_cache_manager under continuous batching token generation).
        rows = torch.arange(self.batch_size)
        logits = self.model.decode(ids, rows, pos, self.cache.k, self.cache.v, attn_len)
        if self.ring is not None:  # slot p % (W-1) is every position q of that residue
            for line, p in enumerate(pos.tolist()):
                same_slot = torch.arange(p % self.ring, self.seq_len, self.ring)
                for cache in (self.cache.k, self.cache.v):
                    cache[:, line, :, same_slot] = cache[:, line, :, p : p + 1]
        # A partial batch's outputs are gathered back by seq_id; a full batch's come back line by line.
        return (logits.float() if n == self.batch_size else logits.float()[seq])[:, None, :]

    # -- fused speculation (NeuronFusedSpecModel, read from the source) --------------------------------
    def _draw(self, logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """The target sampler's tokens for ``logits`` [n, vocab] and each line's ``params`` [n, 3]."""
        config = self.on_device_sampling or {}
        if not (config.get("dynamic") or config.get("do_sample")):
            return logits.argmax(dim=-1)
        n = logits.shape[0]
        rand = torch.rand(n, generator=self.generator)
        if config.get("deterministic"):
            rand = torch.full((n,), 0.5)
        return draw(logits, params, int(config.get("global_topk", 256)), rand)

    def _fused_context(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        seq: torch.Tensor,
        params: torch.Tensor | None,
    ) -> CausalLMOutput:
        """Both models encode the prompt; ``[target token, -1, ...]`` per line (_cte_postprocessor)."""
        draft_logits = self._context(input_ids, mask, positions, seq, draft=True)
        length = self.speculation.speculation_length  # type: ignore[union-attr]
        n = input_ids.shape[0]
        token = self._draw(logits[:, -1, :], params)  # type: ignore[arg-type]
        accepted = torch.full((n, length), -1, dtype=torch.int32)
        accepted[:, 0] = token.to(torch.int32)
        cur = (mask.sum(dim=1) if mask is not None else torch.full((n,), input_ids.shape[1])).to(torch.int32)
        outputs = [accepted, accepted[:, :1], self._next_mask(cur), cur[:, None]]
        if self.output_logits:
            outputs += [draft_logits, logits]
        return CausalLMOutput(None, None, outputs)

    def _next_mask(self, next_positions: torch.Tensor) -> torch.Tensor:
        return (torch.arange(self.seq_len)[None, :] < next_positions.long().reshape(-1, 1)).to(torch.int32)

    def _fused_token(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        seq: torch.Tensor,
        params: torch.Tensor,
    ) -> CausalLMOutput:
        spec = self.speculation
        length = spec.speculation_length  # type: ignore[union-attr]
        n = input_ids.shape[0]
        width = mask.shape[1] if mask is not None else int(positions.max())
        if width + length > self.token_buckets[-1]:  # _get_seq_bucket: mask width + speculation_length
            raise ValueError(f"Input len {width} exceeds largest bucket ({self.token_buckets[-1]})")
        ids, pos, lines = input_ids[:, 0].long(), positions[:, 0].long(), params
        if n < self.batch_size:  # _forward_with_pad: complete with the first line, sort by seq_id
            missing = [r for r in range(self.batch_size) if r not in set(seq.tolist())]
            _, order = torch.sort(torch.tensor(seq.tolist() + missing))
            first = torch.tensor(list(range(n)) + [0] * len(missing))[order]
            ids, pos, lines = ids[first], pos[first], lines[first]
        rows = torch.arange(self.batch_size)
        attn_len = self.token_buckets[bisect.bisect_left(self.token_buckets, int(pos.max()) + length)]
        candidates, draft_logits = [ids], []
        draft, cache = spec.draft, self.draft_cache  # type: ignore[union-attr]
        for i in range(length):  # the draft, greedy: L decodes, each writing its input at pos + i
            logits = draft.decode(candidates[-1], rows, pos + i, cache.k, cache.v, attn_len)  # type: ignore[union-attr]
            draft_logits.append(logits.float())
            candidates.append(logits.argmax(dim=-1))
        tokens = torch.stack(candidates[:length], dim=1)  # the input and the first L - 1 drafts
        target = self.model.extend(
            tokens, rows, pos, [length] * self.batch_size, self.cache.k, self.cache.v, attn_len,
            last=[length] * self.batch_size,
        ).float().view(self.batch_size, length, -1)  # fmt: skip
        chosen = self._draw(target.reshape(-1, target.shape[-1]), lines.repeat_interleave(length, 0))
        chosen = chosen.view(self.batch_size, length)
        matches = ((tokens[:, 1:] != chosen[:, :-1]).cumsum(dim=-1) < 1).sum(dim=-1, keepdim=True) + 1
        accepted = torch.where(torch.arange(length)[None, :] < matches, chosen, -1).to(torch.int32)
        next_ids = accepted.gather(1, matches - 1)
        outputs = [accepted, next_ids, self._next_mask(pos + matches[:, 0]), (pos[:, None] + matches)]
        if self.output_logits:
            outputs += [torch.stack(draft_logits, dim=1), target]
        if n < self.batch_size:  # a partial batch's outputs gathered back by seq_id
            outputs = [o[seq] for o in outputs]
        return CausalLMOutput(None, None, [o.to(torch.int32) if i < 4 else o for i, o in enumerate(outputs)])
