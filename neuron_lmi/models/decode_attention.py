"""``torch.ops.neuron_lmi.decode_attention``: the compiled decode step's attention, one C++ kernel.

A decode step attends one query per cache row over that row's cached keys and values. Inductor
compiles the products-and-sums form (``compiled_decode_attention`` below) into loops that recompute
the query's rotary per key, take a horizontal sum per score and run the softmax on one thread (an
``omp single`` region): on a 2-core AMD EPYC (Zen 5), SmolLM2's bf16 decode step at 32 rows spent 43%
of its time there. The kernel (``decode_attention.cpp``) reads each row's K block once for the query
heads that share it and its V block once, takes the softmax in fp32 on every thread, and reads only
the row's own positions ``first .. positions[r]`` (``first``: 0, or the sliding window's start), not
the whole slice the step's longest row needs. The graphs call it on CPUs with AVX-512, whose code
is written by hand; elsewhere its plain loops were slower than Inductor's form, which those CPUs keep
(``graphs.decode_attention_form``).

Inputs: ``q`` ``[n, H, 1, D]`` (rotary applied: one query per token), ``k``/``v`` ``[R, KVH, L, D]``
(one layer of the cache, strided), ``rows`` int64 ``[n]`` (query i's cache row), ``positions``
int64 ``[n]`` (query i's position, ``< L``), ``scale``, ``window`` (the sliding window, 0 for none).
Queries may share a row: the tokens of a prompt chunk, written into the cache before the call, each
attend up to their own position, which is causal attention over the chunk (``graphs.step_rows``).
With AVX-512 (and AVX512-BF16 for bf16), a run of such tokens at consecutive positions is taken as a
block: each block of keys is read once for all its tokens' query heads and the softmax is taken
online, flash-style, so a long chunk costs about what SDPA's matrix products would, not a read of
its row per token (docs/benchmarks.md). Where the build has AMX for bf16 (Intel Sapphire Rapids
and later), bf16 runs of 32 tokens or more go to ATen's ``scaled_dot_product_attention`` instead,
whose blocks run on oneDNN's AMX micro-kernels: twice the hand-written path's speed there
(docs/measurements.md). Output ``[n, H, 1, D]`` in ``q``'s dtype. The sums run in another order
than SDPA's: results differ in the last bits (greedy ids: ``tests/backends/cpu``).
"""

from __future__ import annotations

import torch

_library = torch.library.Library("neuron_lmi", "FRAGMENT")
_library.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor positions, float scale, int window)"
    " -> Tensor"
)


@torch.library.register_fake("neuron_lmi::decode_attention", lib=_library)
def _attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def compiled_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention as products and sums over the head dimension and the positions, in fp32:
    the form Inductor compiles into its own fused loops (the graphs' attention on CPUs without
    AVX-512), and the op's Python kernel. The eager model keeps SDPA, for which this form would
    materialise ``[B, KVH, G, L, D]`` products. q: [B, H, 1, D]; k, v: [B, KVH, L, D]; mask:
    [B, 1, 1, L] bool (True = attend)."""
    b, h, _, d = q.shape
    kvh = k.shape[1]
    grouped = q.view(b, kvh, h // kvh, 1, d)  # the G query heads that share each KV head
    scores = (grouped.float() * k[:, :, None].float()).sum(-1) * scale  # [B, KVH, G, L], fp32
    scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # fp32, and the products with V too (fused: no copy)
    out = (weights[..., None] * v[:, :, None].float()).sum(3)  # [B, KVH, G, D]
    return out.reshape(b, h, 1, d).to(q.dtype)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """What the op computes, in torch (fp32 inside): the Python kernel, and the tests' yardstick."""
    k, v = k[rows], v[rows]
    key_pos = torch.arange(k.shape[2])
    visible = key_pos[None, :] <= positions[:, None]
    if window > 0:
        visible &= key_pos[None, :] > positions[:, None] - window
    return compiled_decode_attention(q, k, v, visible, scale)


def register_python_kernels() -> None:
    """``reference`` as the op's kernel, where the native one did not build (``ops.kernels``)."""
    _library.impl("decode_attention", reference, "CPU")


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """The op (what a traced graph records); its kernel is registered by ``ops.kernels``."""
    return torch.ops.neuron_lmi.decode_attention(q, k, v, rows, positions, scale, window)
