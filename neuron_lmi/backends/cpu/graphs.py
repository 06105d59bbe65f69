"""The graphs that ``torch.export`` traces for the cpu target: static-shape ones, one per bucket
(``DecodeGraph``, ``PrefillGraph``: ``neuron-lmi compile --target cpu``), and the CPU engine's
dynamic ones: ``StepGraph`` (a flat batch of decode and prompt tokens, each at its own row and
position) and ``ExtendGraph`` (rows of right-padded prompt chunks).

All reuse the eager model's layer code (``DecoderLayer.qkv/attn_out/mlp``, ``apply_rotary``) so
compiled and eager compute the same thing; decode attention is the eager ``grouped_decode_attention``
done by one C++ op (``models.decode_attention``: the same values, summed in another order, each row
reading only its own positions) on AVX-512 CPUs, and elsewhere written in a form Inductor compiles
itself (``compiled_decode_attention``; ``decode_attention_form`` chooses). Differences from eager,
all forced by static shapes:

* weights and rotary tables are *constants* of the graph (the wrapper's parameters and buffers,
  named by ``constant_tensors``); for the bucket graphs AOTInductor is told not to embed them, and
  the loader hands it the live tensors, so every bucket's artifact shares one copy of the weights
  (the engine's step and extend graphs freeze them instead: ``compiled_decode.py``);
* the KV cache ``[layers, rows, kvh, n_positions, D]`` is an explicit *mutated input*, so prefill and
  decode artifacts write into the same ``cache_api.KVCache`` tensors;
* ``DecodeGraph`` runs all ``n_rows`` rows (batch = max_rolling_batch_size). A row that is not part of
  the step (``active[r]`` False) is padding: it computes on token 0 at position 0 and writes back the
  value already stored at that slot, so its cache is bit-for-bit unchanged whatever it holds (a free
  row, a paused row, a full row). Its logits are discarded by the runner;
* prefill handles one prompt right-padded to a context bucket ``T`` and writes all ``T`` positions of
  its row; positions at or past the prompt's length hold padding that attention never reads (the
  row's length in ``RowTable`` says where valid data ends).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from neuron_lmi.models.decode_attention import compiled_decode_attention, decode_attention
from neuron_lmi.models.llama import DecoderLayer, LlamaForCausalLM
from neuron_lmi.models.lora import LoraBatch
from neuron_lmi.models.rope import apply_rotary


def check_compilable(model: LlamaForCausalLM) -> None:
    """Raise ``ValueError`` for models these graphs cannot trace: per-sequence rope tables, layers
    other than the plain ``DecoderLayer`` (a tensor-parallel shard, experts, Gemma's), or layers
    that differ in window or rotary table (the graphs hold one of each)."""
    if not all(type(layer) is DecoderLayer for layer in model.layers):
        raise ValueError(
            "compiled cpu graphs trace the plain DecoderLayer only (tensor_parallel_degree=1, no "
            "mixture of experts, no Gemma norms); this model's layers are sharded, MoE or Gemma's"
        )
    if len(model.attention_kinds) > 1:
        raise ValueError(
            "compiled cpu graphs hold one sliding window and one rotary table; this model's layers "
            "differ in them (per-layer sliding windows)"
        )
    if model.args.rope.kind == "dynamic":
        raise ValueError(
            "rope_scaling type 'dynamic' recomputes rotary tables per sequence length, which a "
            "static compiled graph cannot do; serve this model with the eager CPU engine"
        )


class _Graph(nn.Module):
    """Holds the model (its parameters become graph constants) and the rotary tables as buffers."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        check_compilable(model)
        self.model = model
        rotary = model.attention_kinds[0].rotary  # the only kind (check_compilable)
        self.register_buffer("rope_cos", rotary.cos.contiguous(), persistent=True)
        self.register_buffer("rope_sin", rotary.sin.contiguous(), persistent=True)


class DecodeGraph(_Graph):
    """One decode step over every row; ``attn_len`` (the token-generation bucket) is baked in.

    Inputs: ``tokens``/``positions`` int64 ``[n_rows]``, ``active`` bool ``[n_rows]``, ``k_cache``/
    ``v_cache`` (mutated). Output: fp32 logits ``[n_rows, vocab]``.
    """

    def __init__(self, model: LlamaForCausalLM, attn_len: int) -> None:
        super().__init__(model)
        self.attn_len = attn_len

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        key_pos = torch.arange(self.attn_len)
        return decode_rows(self, tokens, positions, active, key_pos, k_cache, v_cache)


def padded_decode_inputs(
    n: int, rows: Sequence[int], tokens: Sequence[int], positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode graph's first inputs for a step of ``rows`` (each < ``n``): ``tokens``, ``positions``
    and ``active`` over rows ``0..n-1``, the other rows padding; and ``rows`` as an index, to pick
    the stepping rows' logits out of the graph's ``[n, vocab]``."""
    index = torch.tensor(list(rows), dtype=torch.long)
    all_tokens = torch.zeros(n, dtype=torch.long)
    all_positions = torch.zeros(n, dtype=torch.long)
    active = torch.zeros(n, dtype=torch.bool)
    all_tokens[index] = torch.tensor(list(tokens), dtype=torch.long)
    all_positions[index] = positions
    active[index] = True
    return all_tokens, all_positions, active, index


def right_padded(chunks: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Token chunks as one int64 ``[len(chunks), width]`` tensor, each right-padded with 0."""
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)
    for i, chunk in enumerate(chunks):
        tokens[i, : len(chunk)] = torch.tensor(list(chunk), dtype=torch.long)
    return tokens


ATTENTION_ENV = "NEURON_LMI_DECODE_ATTENTION"  # "op" or "inductor": instead of the CPU's rule


def decode_attention_form() -> str:
    """Which attention the decode graphs trace: ``op`` (``models.decode_attention``, whose AVX-512
    code is written by hand) on CPUs with AVX-512, ``inductor`` (``compiled_decode_attention``, which
    Inductor compiles into its own loops) elsewhere, where the op's plain loops were the slower
    (docs/measurements.md).
    ``NEURON_LMI_DECODE_ATTENTION`` overrides the rule; the form is part of the compile-cache keys."""
    forced = os.environ.get(ATTENTION_ENV)
    if forced:
        if forced not in ("op", "inductor"):
            raise ValueError(f"{ATTENTION_ENV}={forced!r}: expected op or inductor")
        return forced
    return "op" if avx512_host() else "inductor"


def avx512_host() -> bool:
    """Whether torch runs this CPU's AVX-512 kernels (what the native build's ``-march=native``
    finds too)."""
    return str(torch.backends.cpu.get_cpu_capability()).startswith("AVX512")


def decode_rows(
    graph: _Graph,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    active: torch.Tensor,
    key_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """``DecodeGraph``'s step: cache rows ``0..n-1`` step at ``positions`` (rows not ``active``
    rewrite what their slot holds) and attend over the first ``len(key_pos)`` positions."""
    m = graph.model
    rows = torch.arange(tokens.shape[0])
    x = m.embed_tokens(tokens[:, None])
    x = token_layers(graph, x, rows, positions, key_pos, active[:, None, None], k_cache, v_cache)
    return m.logits(x[:, 0])


def step_rows(
    graph: _Graph,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    last: torch.Tensor,
    key_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lora: LoraBatch | None = None,
) -> torch.Tensor:
    """``StepGraph``'s step: token i goes into cache row ``rows[i]`` at ``positions[i]`` and attends
    over that row up to its own position, so a row's decode token or a prompt chunk's consecutive
    tokens are all one batch of queries; returns the logits of the tokens at ``last``. ``lora``:
    each token's adapter slot and the slots' weights (``LoraStepGraph``)."""
    m = graph.model
    x = m.embed_tokens(tokens[:, None])
    x = token_layers(graph, x, rows, positions, key_pos, None, k_cache, v_cache, outputs=last, lora=lora)
    return m.logits(x[:, 0])


def token_layers(
    graph: _Graph,
    x: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    key_pos: torch.Tensor,
    keep: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    outputs: torch.Tensor | None = None,
    lora: LoraBatch | None = None,
) -> torch.Tensor:
    """Every layer over ``x`` ``[n, 1, hidden]``, one token per query: its K/V written to ``rows`` at
    ``positions`` (where ``keep`` is False the slot is rewritten with what it holds), then attention
    over its row's first ``len(key_pos)`` positions up to its own. Returns the last hidden state,
    of the tokens at ``outputs`` only where it is given. ``lora``: each token's adapter slot (a token
    is a line of the update) and the slots' weights.

    The last layer's attention output and MLP feed nothing but the final hidden state, so with
    ``outputs`` they run for those tokens alone: every token's K/V is still written, and the rows
    kept are computed as before. A prompt chunk then skips them for all its tokens but the last
    (about 1/30 of a chunk's FLOPs on SmolLM2), as llama.cpp's output-id selection does."""
    m, n, length = graph.model, x.shape[0], key_pos.shape[0]
    cos, sin = graph.rope_cos[positions][:, None], graph.rope_sin[positions][:, None]
    window = m.args.sliding_window or 0
    op = decode_attention_form() == "op"
    mask = None if op else m.window_mask(positions[:, None], key_pos[None, :]).view(n, 1, 1, length)
    final = len(m.layers) - 1
    for i, layer in enumerate(m.layers):
        adapted = None if lora is None else lora.layer(i)
        q, k, v = layer.qkv(x, adapted)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Index the 5-D cache itself (layer as an index tensor, not a view): a write through
        # ``k_cache[i]`` would be functionalised into a copy of the whole cache per layer.
        slot = (torch.full_like(rows, i), rows, slice(None), positions)
        new_k, new_v = k[:, :, 0], v[:, :, 0]
        if keep is not None:
            new_k, new_v = torch.where(keep, new_k, k_cache[slot]), torch.where(keep, new_v, v_cache[slot])
        k_cache[slot], v_cache[slot] = new_k, new_v
        if i == final and outputs is not None:
            q, x, rows, positions = q[outputs], x[outputs], rows[outputs], positions[outputs]
            mask = None if mask is None else mask[outputs]
            adapted = None if lora is None else lora.select(outputs).layer(i)
        if op:
            keys, values = k_cache[i, :, :, :length], v_cache[i, :, :, :length]
            attn = decode_attention(q, keys, values, rows, positions, m.scale, window)
        else:
            keys, values = k_cache[i, rows, :, :length], v_cache[i, rows, :, :length]
            attn = compiled_decode_attention(q, keys, values, mask, m.scale)
        x = x + layer.attn_out(attn, adapted)
        x = x + layer.mlp(x, adapted)
    return x


class StepGraph(_Graph):
    """One engine step as a flat batch of tokens: decodes (one token of a row) and prompt chunks
    (consecutive tokens of a row) together, so a step that admits prompts while others decode runs
    one forward, unpadded (``compiled_decode.py``). The token count, the number of
    logits and the attention length come from the inputs' shapes, so one graph exported with all
    three dynamic serves every step.

    Inputs: ``tokens``/``rows``/``positions`` int64 ``[n]`` (a row's tokens at consecutive
    positions, its cached prefix before them), ``last`` int64 ``[b]`` (the tokens whose logits are
    wanted), ``key_pos`` int64 ``[L]`` (``arange(L)``, ``L`` above every position, below the cache's
    ``n_positions``: at equal sizes the slice would be the whole tensor, a case the exported graph
    specialises on), ``k_cache``/``v_cache`` (mutated). Output: fp32 logits ``[b, vocab]``.
    """

    forward = step_rows


class LoraStepGraph(_Graph):
    """``StepGraph`` with LoRA adapters as inputs, for an engine that serves them: the base weights
    stay frozen constants, the adapters are the runner's ``LoraSlots`` tensors (rewritten in place as
    adapters move in and out, so one compile serves every adapter), and every adapted projection
    adds its lines' updates through ``neuron_lmi::lora_delta``, as the eager model does.

    Inputs: ``StepGraph``'s, then ``token_slots`` int64 ``[n]`` (each token's slot, -1: the base
    model) and ``weights`` (``LoraSlots.inputs``: per projection in sorted order, ``A [layers, slots,
    R, in]`` then ``B^T [layers, slots, R, out]``).
    """

    def __init__(self, model: LlamaForCausalLM, projections: Sequence[str]) -> None:
        super().__init__(model)
        self.projections = tuple(sorted(projections))

    def forward(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        key_pos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_slots: torch.Tensor,
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        lora = LoraBatch.from_inputs(self.projections, token_slots, weights)
        return step_rows(self, tokens, rows, positions, last, key_pos, k_cache, v_cache, lora)


def extend_rows(
    graph: _Graph,
    tokens: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    key_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Append right-padded chunks ``tokens`` ``[n, T]`` to cache ``rows``, which hold ``starts``
    positions; ``lengths`` real tokens each. Every token attends causally over its row's first
    ``len(key_pos)`` positions (cached prefix + chunk). Padding token j of a row sits at position
    ``start + j`` and rewrites what that slot holds, so the caller keeps ``start + T`` within the
    cache. Returns the logits of each chunk's last real token, ``[n, vocab]`` fp32."""
    m = graph.model
    n, t = tokens.shape
    length = key_pos.shape[0]
    offsets = torch.arange(t)
    positions = starts[:, None] + offsets[None, :]
    keep = (offsets[None, :] < lengths[:, None])[:, :, None, None]
    cos, sin = graph.rope_cos[positions], graph.rope_sin[positions]
    mask = m.window_mask(positions[:, :, None], key_pos[None, None, :]).unsqueeze(1)
    x = m.embed_tokens(tokens)
    for i, layer in enumerate(m.layers):
        q, k, v = layer.qkv(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        slot = (torch.full_like(positions, i), rows[:, None], slice(None), positions)
        k_cache[slot] = torch.where(keep, k.transpose(1, 2), k_cache[slot])
        v_cache[slot] = torch.where(keep, v.transpose(1, 2), v_cache[slot])
        k_all, v_all = k_cache[i, rows, :, :length], v_cache[i, rows, :, :length]
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=m.scale, enable_gqa=True)
        x = x + layer.attn_out(attn)
        x = x + layer.mlp(x)
    return m.logits(x[torch.arange(n), lengths - 1])


class ExtendGraph(_Graph):
    """One extend step (prefill is an extend from position 0): ``n`` rows, each given a chunk of up
    to ``T`` tokens, attending over ``L`` positions; ``n``, ``T`` and ``L`` come from the inputs'
    shapes, so one graph exported with all three dynamic serves every prompt batch and chunk.

    Inputs: ``tokens`` int64 ``[n, T]``, ``rows``/``starts``/``lengths`` int64 ``[n]``, ``key_pos``
    int64 ``[L]`` (``arange(L)``, ``L >= start + length`` for every row, ``L < n_positions``),
    ``k_cache``/``v_cache`` (mutated). Output: fp32 logits ``[n, vocab]``.
    """

    forward = extend_rows


class PrefillGraph(_Graph):
    """Encode one prompt right-padded to ``length`` = the context bucket, into cache row ``row``.

    Inputs: ``tokens`` int64 ``[1, T]``, ``last`` int64 ``[1]`` (prompt length - 1), ``row`` int64
    ``[1]``, ``k_cache``/``v_cache`` (mutated: positions ``0..T-1`` of ``row``). Output: fp32 logits
    ``[1, vocab]`` of the last real token.
    """

    def __init__(self, model: LlamaForCausalLM, length: int) -> None:
        super().__init__(model)
        self.length = length

    def forward(
        self,
        tokens: torch.Tensor,
        last: torch.Tensor,
        row: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        m, t = self.model, self.length
        positions = torch.arange(t)
        cos, sin = self.rope_cos[:t][None], self.rope_sin[:t][None]
        mask = m.window_mask(positions[:, None], positions[None, :])
        x = m.embed_tokens(tokens)
        for i, layer in enumerate(m.layers):
            q, k, v = layer.qkv(x)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            slot = (torch.full_like(row, i)[:, None], row[:, None], slice(None), positions[None, :])
            k_cache[slot] = k.transpose(1, 2)
            v_cache[slot] = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.scale, enable_gqa=True)
            x = x + layer.attn_out(attn)
            x = x + layer.mlp(x)
        return m.logits(x[0, last])


def constant_tensors(graph: _Graph) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its qualified name, tied ones under each of their names."""
    out = dict(graph.named_parameters(remove_duplicate=False))
    out.update(graph.named_buffers(remove_duplicate=False))
    return out
