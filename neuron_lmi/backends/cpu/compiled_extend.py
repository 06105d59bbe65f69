"""The CPU engine's compiled prefill and extend: one AOTInductor package of ``ExtendGraph`` with the
weights frozen in, beside the compiled decode (``compiled_decode``) and keyed the same way.

Prefill is an extend from position 0, so one graph, exported with a dynamic number of rows
(``1 <= n <= n_rows``), chunk length (``1 <= T < n_positions``) and attention length
(``2 <= L < n_positions``), serves prompts, chunks of long prompts and the rest of a prompt after a
reused prefix. Freezing lets Inductor pack the weights for oneDNN and fuse the elementwise work
(norms, rotary, SiLU, residuals, masks) that dominates short eager prefills (docs/measurements.md).
A compile takes minutes, once per model, dtype and cache shape; later starts load it from the
compile cache. It is compiled only where the step graph leaves prompt chunks to it
(``compiled_decode.extend_graph_needed``): hosts whose decode attention is Inductor's form, and
quantized models.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from neuron_lmi.backends.cpu.compiled_decode import (
    MIN_ATTN_LEN,
    FrozenPackage,
    export_package,
    inductor_configs,
    is_quantized,
    packed_gemm_library,
)
from neuron_lmi.backends.cpu.graphs import ExtendGraph, right_padded
from neuron_lmi.models import packed_linear
from neuron_lmi.models.llama import LlamaForCausalLM
from neuron_lmi.models.quant import QuantizedLinear, matmul_weight_slots, replace_weight

PACKAGE_FILE = "extend.pt2"
# Rows and chunk length start at 1 (tested); the attention length at compiled_decode's MIN_ATTN_LEN.


def compile_extend_package(model: LlamaForCausalLM, n_rows: int, n_positions: int, out_dir: Path) -> None:
    """Export ``ExtendGraph`` with dynamic rows, chunk length and attention length; compile it into
    ``out_dir``."""
    a = model.args
    shape = (a.n_layers, n_rows, a.n_kv_heads, n_positions, a.head_dim)
    example = (
        torch.zeros(2, 4, dtype=torch.long),
        torch.tensor([0, 1]),
        torch.zeros(2, dtype=torch.long),
        torch.tensor([3, 4]),
        torch.arange(5),
        torch.zeros(shape, dtype=model.dtype),
        torch.zeros(shape, dtype=model.dtype),
    )
    rows = torch.export.Dim("rows", min=1, max=n_rows)
    chunk = torch.export.Dim("chunk", min=1, max=n_positions - 1)
    attn = torch.export.Dim("attn_len", min=MIN_ATTN_LEN, max=n_positions - 1)
    dynamic = ({0: rows, 1: chunk}, {0: rows}, {0: rows}, {0: rows}, {0: attn}, None, None)
    configs = inductor_configs(model.dtype, CompiledExtend.graph, is_quantized(model))
    # Quantized weights are traced dense (a second copy, in the package): prompts run oneDNN GEMMs
    # instead of row-by-row kernels or a dequantization per call. Dense fp32 ones may multiply on
    # packs (decided on ``model``, as its key is).
    library = packed_gemm_library(model, CompiledExtend.graph)
    graph = ExtendGraph(dequantized_copy(model))
    with packed_linear.tracing_packed_linears(library, model.dtype):
        export_package(graph, example, dynamic, out_dir / PACKAGE_FILE, configs)


def dequantized_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` itself when dense; else a copy whose quantized matmul weights are dense tensors of
    the model's dtype. Dequantized here, not in the traced graph: Inductor (torch 2.13, CPU) miscompiles
    the int4 unpacking read through a transpose (NaNs in the weight)."""
    if not is_quantized(model):
        return model
    dense = copy.deepcopy(model)
    for owner, name in matmul_weight_slots(dense):
        weight = getattr(owner, name)
        if isinstance(weight, QuantizedLinear):
            dequantized = weight.dequantize().to(model.dtype)
            replace_weight(owner, name, nn.Parameter(dequantized, requires_grad=False))
    return dense


class CompiledExtend(FrozenPackage):
    """A loaded extend package. ``covers`` says whether a step fits it; ``__call__`` runs one."""

    graph = "extend"
    package_file = PACKAGE_FILE
    compile_package = staticmethod(compile_extend_package)

    def covers(self, starts: Sequence[int], lengths: Sequence[int]) -> bool:
        """Every chunk is padded to the longest, and a padding token writes (back) the slot after
        its row's chunk, so each row's ``start + T`` must stay within the cache; the attention
        length must stay under ``n_positions`` (the whole cache is a case the graph specialises on)."""
        return max(starts) + max(lengths) < self.n_positions

    def __call__(
        self,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        starts: Sequence[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Write ``chunks[i]`` into ``rows[i]`` after its ``starts[i]`` positions; logits of each
        chunk's last token ``[n, vocab]``. The caller sets the rows' lengths."""
        lengths = [len(c) for c in chunks]
        tokens = right_padded(chunks, max(lengths))
        attn_len = max(MIN_ATTN_LEN, max(s + n for s, n in zip(starts, lengths, strict=True)))
        inputs = [
            tokens,
            torch.tensor(list(rows), dtype=torch.long),
            torch.tensor(list(starts), dtype=torch.long),
            torch.tensor(lengths, dtype=torch.long),
            torch.arange(attn_len),
        ]
        (out,) = self._run([*inputs, k_cache, v_cache])
        self.steps += 1
        return out
