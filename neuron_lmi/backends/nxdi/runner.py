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
                         on-device sampling ``logits`` is None and ``tokens`` hold ids

Consequences handled here:

* A prompt of one or two tokens would lose (or tie) the ``argmax`` to the library's padding positions
  of 1, and come back with a pad slot's logits. It is sent already padded to the largest bucket, its
  padding at position 0, so the library pads nothing and its last real token holds the maximum.
* Rows are always sent sorted by seq_id.
* Every live row must be written harmlessly. The engine decodes every live row in each call
  (``RunnerCapabilities.live_rows_step_together``); a live row not asked all the same rides along: at its
  next, unwritten position where that slot holds nothing it needs (no window, or fewer than W-1
  positions), else by writing its last token again at its last position, which recomputes the same
  K/V while the ring has not wrapped. A row of length 0 never rides: position 0 would turn the call
  into a context encoding. There is no free on the device: ``RowTable`` frees a row and its next
  context encoding overwrites it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cache_api import RowTable
from neuron_lmi.backends.nxdi.defaults import apply_environment
from neuron_lmi.backends.row_batch import PAD_TOKEN_ID, check_prompts, token_batch
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

if TYPE_CHECKING:
    from compile_cache import CompileCache
    from neuron_lmi.backends.nxdi.plan import NxdiPlan
    from neuron_lmi.backends.nxdi.support import Platform
    from neuron_lmi.config.options import ServingConfig

log = logging.getLogger(__name__)

# The library pads context position_ids with 1: a prompt whose last position is below 2 must bring
# its own padding (at position 0) so that argmax(position_ids) is its last token.
SELF_PADDED_BELOW = 3


class CausalLMApplication(Protocol):
    """What the runner needs of ``NeuronLlamaForCausalLM`` & co. (or ``NxdiContractModel``)."""

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_ids: torch.Tensor,
    ) -> Any: ...


class NxdiRunner(ForwardByKind):
    """``ModelRunner`` over an NxD Inference application of ``n_rows`` x ``n_positions``.

    Invariants: ``rows`` is the only record of which device rows hold what; every token-generation call
    lists seq_ids in ascending order; no call writes a slot a live row still reads; logits come back
    fp32 ``[len(rows), vocab_size]`` in the order asked. With ``on_device_sampling`` the device
    returns only its (greedy) token, which becomes a one-hot logits row: the host sampler then takes
    that token, and log-probabilities are not available.
    """

    capabilities = RunnerCapabilities(live_rows_step_together=True)

    def __init__(
        self,
        model: CausalLMApplication,
        n_rows: int,
        n_positions: int,
        vocab_size: int,
        on_device_sampling: bool = False,
        largest_context_bucket: int | None = None,
        sliding_window: int | None = None,
        dtype: str | None = None,
    ) -> None:
        self.model = model
        self.rows = RowTable(n_rows, n_positions)
        self.n_positions = n_positions
        self.vocab_size = vocab_size
        self.on_device_sampling = on_device_sampling
        self.largest_context_bucket = largest_context_bucket or n_positions
        self.sliding_window = sliding_window
        self.dtype = dtype  # what the application computes in (reported as the model's dtype)
        self._last_token: dict[int, int] = {}  # row -> the token written at its last position

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        check_prompts(self.rows, rows, prompts, self.n_positions)
        logits = torch.empty(len(rows), self.vocab_size)
        for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
            logits[i] = self._context(row, list(prompt))[0]
        return logits

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._token_step(list(rows), list(tokens))

    def _context(self, row: int, prompt: list[int]) -> torch.Tensor:
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
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, seq_ids=torch.tensor([row])
            )
        self.rows.set_length(row, length)
        self._last_token[row] = prompt[-1]
        return self._logits(out, 1)

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

    def _token_step(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        batch = token_batch(self.rows, rows, tokens, self.n_positions, rider=self._rider)
        position_ids = batch.positions[:, None]
        attention_mask = (torch.arange(int(position_ids.max()))[None, :] < position_ids).long()
        with torch.inference_mode():
            out = self.model(
                input_ids=batch.tokens[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                seq_ids=batch.seq_ids,
            )
        self._last_token.update(zip(rows, tokens, strict=True))
        return batch.restore(self._logits(out, len(batch.order)))

    def _logits(self, out: Any, n: int) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        if logits is None:
            return self._one_hot(out, n)
        if logits.dim() == 3:
            logits = logits[:, -1, :]
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < self.vocab_size:
            raise RuntimeError(
                f"model returned logits {tuple(logits.shape)}, expected [{n}, 1, {self.vocab_size}]"
            )
        return logits[:, : self.vocab_size].float()

    def _one_hot(self, out: Any, n: int) -> torch.Tensor:
        tokens = getattr(out, "tokens", None)
        if tokens is None:
            tokens = getattr(out, "hidden_states", None)
        if tokens is None:
            raise RuntimeError("model returned neither logits nor tokens")
        ids = torch.as_tensor(tokens).reshape(-1)[:n].long()
        logits = torch.full((n, self.vocab_size), float("-inf"))
        logits[torch.arange(n), ids] = 0.0
        return logits


# -- start-up: configuration -> plan -> artifacts -> runner -----------------------------------------


def build_nxdi_runner(
    config: ServingConfig,
    model_path: str,
    cache: CompileCache | None,
    tp_degree: int | None = None,
    model: CausalLMApplication | None = None,
    compiler_version: str | None = None,
    library_version: str | None = None,
    platform: str | Platform | None = None,
) -> NxdiRunner:
    """Map the configuration, load (or compile once, then load) the application, wrap it in a runner.

    ``model`` replaces the application (tests pass an ``NxdiContractModel``). Without the Neuron SDK the
    load raises ``RuntimeError`` naming the packages and AWS's pip repository. With
    ``override_neuron_config.on_cpu`` the library's modeling code runs here on the CPU (``to_cpu``).
    """
    from neuron_lmi.backends.nxdi.plan import plan_nxdi
    from neuron_lmi.config.hf_config import read_hf_config

    model_config = read_hf_config(model_path, "the NxD Inference backend")
    plan = plan_nxdi(config, model_config, model_path, tp_degree, library_version, platform)
    log.info(
        "NxD Inference %s (%s) on %s: %s, %s (%s)%s",
        plan.library_version,
        plan.version_source,
        plan.platform or "an unknown platform",
        plan.application.application,
        plan.dtype,
        plan.dtype_source,
        ", on the CPU (override_neuron_config.on_cpu): a check of the configuration, not a Neuron server"
        if plan.on_cpu
        else "",
    )
    for warning in plan.warnings:
        log.warning("%s", warning)
    for key, reason in plan.ignored.items():
        log.warning("NxD Inference backend ignores %s: %s", key, reason)
    if model is None:
        apply_environment(plan.environment, os.environ)
    if model is None and plan.on_cpu:
        model = on_cpu_application(plan)
    elif model is None:
        model = load_application(
            plan, model_config, cache, config.neuron.compiled_graph_path, compiler_version
        )
    return runner_for(model, plan, int(model_config["vocab_size"]))


def runner_for(model: CausalLMApplication, plan: NxdiPlan, vocab_size: int) -> NxdiRunner:
    return NxdiRunner(
        model,
        plan.batch_size,
        plan.n_positions,
        vocab_size,
        plan.on_device_sampling,
        largest_context_bucket=plan.context_buckets[-1],
        sliding_window=plan.sliding_window,
        dtype=plan.dtype,
    )


def on_cpu_application(plan: NxdiPlan) -> Any:
    """The application with NxD Inference's modeling code on the CPU: ``to_cpu()`` shards the
    checkpoint for one rank into torch modules instead of compiling or loading NEFFs."""
    import socket

    from neuron_lmi.backends.nxdi.artifacts import new_application
    from neuron_lmi.backends.nxdi.cpu_mode import supply_cpu_methods

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


def load_application(
    plan: NxdiPlan,
    model_config: dict[str, Any],
    cache: CompileCache | None,
    compiled_graph_path: str | None,
    compiler_version: str | None = None,
) -> Any:
    """An artifact directory given by the user loads as it is; otherwise the compile cache entry for
    the plan, compiled into it on a miss. Either way the application is built exactly once."""
    from neuron_lmi.backends.nxdi.artifacts import is_artifact_dir, load_or_compile, new_application

    if compiled_graph_path and is_artifact_dir(Path(compiled_graph_path)):
        log.info("NxD Inference artifacts: %s (given, not cached)", compiled_graph_path)
        app = new_application(plan)
        app.load(str(compiled_graph_path))
        return app
    if cache is None:
        from compile_cache import CompileCache

        cache = CompileCache()
    return load_or_compile(plan, model_config, cache, compiler_version=compiler_version)
