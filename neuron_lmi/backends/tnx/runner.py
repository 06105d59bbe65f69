"""The Neuron runner: a ``ModelRunner`` on transformers-neuronx's continuous-batching ``forward``.

The contract it drives (aws-neuron/transformers-neuronx v0.13, ``base.py``
``_prepare_for_continuous_batching`` / ``_postprocess``, ``llama/model.py`` ``forward``)::

    logits = model.forward(input_ids, cache_ids, start_ids)         # fp32 [n, vocab]
      start_ids  [n]     seq_ids = KV-cache batch rows (our RowTable rows)
      prefill    input_ids [n, T] right-padded, cache_ids [n, T] = 0..len-1 then 0 (2-D: continuous
                 batching forces use_2d_cache_ids); context encoding because T > 1 and
                 cache_ids[0, 0] == 0; T <= the largest context bucket; logits of each last real token.
                 Context graphs are compiled for batch 1 under continuous batching, so the runner
                 sends one prompt per call (n = 1), each padded by the library to its own bucket
      decode     input_ids [n, 1], cache_ids [n, 1] = positions; the library scatters the n rows into
                 the full [max_num_seqs, 1] batch (absent rows get token 0 at position 0), runs it
                 and gathers the logits back by seq_id

Two consequences the runner handles: (1) a decode call writes *every* row of the compiled batch, so
in-use rows that are not decoding this step ride along as passengers at their next (unwritten)
position and their logits are dropped; otherwise a row prefilled this step would lose position 0;
(2) there is no free on the device: ``RowTable`` frees a row and its next prefill overwrites it.
Prompts longer than the largest context bucket are context-encoded up to it and the rest fed one
token per call, as the library's own ``context`` does.

What ran where: this module's logic runs in the test suite against
``neuron_lmi.testing.tnx_contract.ContractModel`` (the same forward contract on the CPU reference
model); the calls into transformers-neuronx (``from_pretrained``, ``to_neuron``, ``save``/``load``
through the compile cache) are written against the library's API and checked with stand-in classes,
not run on a Neuron device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cache_api import RowTable
from compile_cache import CompileCache, architecture_config
from neuron_lmi.backends.row_batch import check_prompts, token_batch
from neuron_lmi.backends.tnx.args import (
    MappedNeuronArgs,
    NeuronCompileSpec,
    build_neuron_config,
    map_compile_spec,
)
from neuron_lmi.backends.tnx.compile import (
    compile_neuron_entry,
    load_neuron_model,
    neuron_key_inputs,
    plan_neuron_compile,
)
from neuron_lmi.config import default_n_positions
from neuron_lmi.config.hf_config import read_hf_config
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

if TYPE_CHECKING:
    from compile_cache import CompileCache
    from neuron_lmi.config.options import ServingConfig

log = logging.getLogger(__name__)


class SamplingModel(Protocol):
    """What the runner needs of ``LlamaForSampling``/``MistralForSampling`` (or ``ContractModel``)."""

    def forward(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor: ...


class NeuronRunner(ForwardByKind):
    """``ModelRunner`` over a compiled continuous-batching model of ``n_rows`` x ``n_positions``.

    Invariants: ``rows`` is the only record of which device rows hold what (the device keeps no
    free list); every in-use row with room is part of every decode call, so a call never writes a
    position an in-use row has already filled; logits come back fp32 ``[len(rows), vocab_size]``
    in the order asked.  ``context_buckets`` are the compiled context-encoding lengths (the runner
    leaves padding up to a bucket to the library).
    """

    capabilities = RunnerCapabilities()  # whole prompts and decodes; the rows it leaves out it fills itself

    def __init__(
        self,
        model: SamplingModel,
        n_rows: int,
        n_positions: int,
        vocab_size: int,
        context_buckets: Sequence[int],
    ) -> None:
        if not context_buckets or min(context_buckets) < 1 or max(context_buckets) > n_positions:
            raise ValueError(
                f"context_buckets must be positive and <= n_positions={n_positions}, got {context_buckets}"
            )
        self.model = model
        self.rows = RowTable(n_rows, n_positions)
        self.n_positions = n_positions
        self.vocab_size = vocab_size
        self.max_context = max(context_buckets)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        check_prompts(self.rows, rows, prompts, self.n_positions)
        logits = torch.empty(len(rows), self.vocab_size)
        single = []
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            head = list(prompt[: self.max_context])
            if len(head) > 1:  # context encoding, one prompt per call (its own bucket; batch 1 compiled)
                logits[i] = self._context(row, head)[0]
            else:
                self.rows.set_length(row, 0)
                single.append(i)
        if single:  # a one-token prompt is a decode at position 0
            logits[single] = self._token_step([rows[i] for i in single], [prompts[i][0] for i in single])
        # Tokens past the largest context bucket go through token generation, one per call.
        pending = [i for i, p in enumerate(prompts) if len(p) > self.max_context]
        while pending:
            step_rows = [rows[i] for i in pending]
            step_tokens = [prompts[i][self.rows.length(rows[i])] for i in pending]
            logits[pending] = self._token_step(step_rows, step_tokens)
            pending = [i for i in pending if self.rows.length(rows[i]) < len(prompts[i])]
        return logits

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._token_step(list(rows), list(tokens))

    def _context(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Context encoding of one prompt into ``row``: ids ``[1, T]``, 2-D cache ids ``0..T-1``."""
        input_ids = torch.tensor([prompt], dtype=torch.long)
        cache_ids = torch.arange(len(prompt))[None, :]
        out = self.model.forward(input_ids, cache_ids, torch.tensor([row], dtype=torch.long))
        self.rows.set_length(row, len(prompt))
        return self._check_logits(out, 1)

    def _token_step(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of ``rows`` at its next position (``row_batch.token_batch``: every
        other live row rides along, lines in ascending seq_id order)."""
        batch = token_batch(self.rows, rows, tokens, self.n_positions)
        out = self.model.forward(batch.tokens[:, None], batch.positions[:, None], batch.seq_ids)
        return batch.restore(self._check_logits(out, len(batch.order)))

    def _check_logits(self, out: torch.Tensor, n: int) -> torch.Tensor:
        if out.dim() != 2 or out.shape[0] != n or out.shape[1] < self.vocab_size:
            raise RuntimeError(f"model returned logits {tuple(out.shape)}, expected [{n}, {self.vocab_size}]")
        return out[:, : self.vocab_size].float()


# -- building the runner from the configuration --------------------------------------------------


def compile_spec_from_config(
    config: ServingConfig,
    model_path: str,
    tp_degree: int | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> NeuronCompileSpec:
    """The one ``NeuronCompileSpec`` for a ``ServingConfig``, used by ``serve`` and by
    ``neuron-lmi compile --target neuron`` alike, so both compute the same cache key.

    LMI's names map one to one (dtype, context_length_estimate, group_query_attention, fuse_qkv,
    quantize, neuron_optimize_level, enable_saturate_infinity, enable_mixed_precision_accumulation,
    compiled_graph_path); the rolling batch size is the compiled batch (continuous batching needs
    ``batch_size_for_shared_caches == batch_size``); ``n_positions`` unset is LMI's default
    ``min(max_position_embeddings, 4096)``; the attention geometry comes from ``config.json``
    (``model_config``, read from ``model_path`` when not given; weights are not needed).
    ``tp_degree`` resolves ``tensor_parallel_degree=max`` (the caller counts the visible NeuronCores).
    """
    parallel, batching, neuron = config.parallel, config.batching, config.neuron
    tp = parallel.tensor_parallel_degree
    if tp == "max":
        if tp_degree is None:
            raise ValueError("tensor_parallel_degree=max needs the number of visible NeuronCores")
        tp = tp_degree
    hf = dict(model_config) if model_config is not None else read_model_config(model_path)
    n_positions = batching.n_positions or default_n_positions(_positive(hf.get("max_position_embeddings")))
    n_query = _positive(hf.get("num_attention_heads"))
    n_kv = _positive(hf.get("num_key_value_heads")) or n_query
    hidden = _positive(hf.get("hidden_size"))
    head_dim = _positive(hf.get("head_dim")) or (hidden // n_query if hidden and n_query else None)
    return NeuronCompileSpec(
        model_path=model_path,
        tp_degree=int(tp),
        batch_size=batching.max_rolling_batch_size,
        n_positions=n_positions,
        dtype=config.model.dtype,
        context_length_estimate=batching.context_length_estimate,
        group_query_attention=parallel.group_query_attention,
        fuse_qkv=neuron.fuse_qkv,
        quantize=neuron.quantize,
        neuron_optimize_level=neuron.neuron_optimize_level,
        enable_saturate_infinity=neuron.enable_saturate_infinity,
        enable_mixed_precision_accumulation=neuron.enable_mixed_precision_accumulation,
        compiled_graph_path=neuron.compiled_graph_path,
        n_query_heads=n_query,
        n_kv_heads=n_kv if n_query else None,
        head_dim=head_dim,
    )


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_model_config(model_path: str) -> dict[str, Any]:

    return read_hf_config(model_path, "the Neuron backend")


def load_compiled_model(
    spec: NeuronCompileSpec,
    model_config: Mapping[str, Any],
    cache: CompileCache | None,
    env: Mapping[str, str] | None = None,
    no_compile: bool = False,
    compiler_version: str | None = None,
) -> Any:
    """The ready ``<Arch>ForSampling``, built once: on a hit ``from_pretrained`` + ``load(entry)`` +
    ``to_neuron``; on a miss the model compiled into the entry (``from_pretrained`` + ``to_neuron`` +
    ``save``) is the one served, never built a second time. ``compiler_version`` defaults to the
    installed neuronx-cc's (it is part of the cache key)."""
    if cache is None:
        cache = CompileCache()
    architecture = _architecture(model_config)
    mapped = plan_neuron_compile(spec, cache, os.environ if env is None else env)
    for note in mapped.notes:
        log.warning("transformers-neuronx: %s", note)
    build_neuron_config(mapped)  # fails first, naming the missing Neuron packages
    inputs = neuron_key_inputs(spec, mapped, architecture_config(dict(model_config)), compiler_version)
    compiled: list[Any] = []
    entry = cache.get_or_compile(
        inputs,
        lambda out: compiled.append(compile_neuron_entry(mapped, architecture, out)),
        no_compile=no_compile,
    )
    if compiled:
        log.info(
            "Neuron artifacts: compiled into cache entry %s (%s); serving that model", entry.key, entry.path
        )
        return compiled[0]
    log.info("Neuron artifacts: compile cache entry %s (%s)", entry.key, entry.path)
    return load_neuron_model(mapped, architecture, entry.path)


def build_neuron_runner(
    config: ServingConfig,
    model_path: str,
    cache: CompileCache | None,
    tp_degree: int | None = None,
    model: SamplingModel | None = None,
    compiler_version: str | None = None,
) -> NeuronRunner:
    """Start-up: map the configuration, load (or compile) the model, wrap it in a ``NeuronRunner``.

    ``model`` replaces the transformers-neuronx model (tests pass a ``ContractModel``).  Without the
    Neuron SDK this raises ``RuntimeError`` naming the packages and AWS's pip repository.
    """
    model_config = read_model_config(model_path)
    spec = compile_spec_from_config(config, model_path, tp_degree, model_config)
    mapped = map_compile_spec(spec)
    if model is None:
        model = load_compiled_model(spec, model_config, cache, compiler_version=compiler_version)
    return runner_for(model, spec, mapped, int(model_config["vocab_size"]))


def runner_for(
    model: SamplingModel, spec: NeuronCompileSpec, mapped: MappedNeuronArgs, vocab_size: int
) -> NeuronRunner:
    return NeuronRunner(model, spec.batch_size, spec.n_positions, vocab_size, mapped.context_buckets)


def _architecture(model_config: Mapping[str, Any]) -> str:
    names = model_config.get("architectures") or []
    if not names:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return str(names[0])
