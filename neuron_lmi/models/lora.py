"""LoRA adapters on the torch model: PEFT checkpoints read into the model's fused projections, the
slots they are served from, and the grouped low-rank update a projection adds per line.

The model fuses q|k|v and gate|up, so an adapter's modules are fused the same way: the A matrices of
one projection's modules are stacked along the rank, and each B lands in its module's rows of the
fused output, in its own rank columns (block-diagonal), with the PEFT scale folded in::

    wqkv:  A = [A_q; A_k; A_v]  [r_q + r_k + r_v, hidden]     B = | s_q B_q    0       0    |  q rows
                                                                  |   0     s_k B_k    0    |  k rows
                                                                  |   0       0     s_v B_v |  v rows

so ``y = x W^T + (x A^T) B^T`` is the merged weight's output ``x (W + s B A)^T`` for every module
at once. ``s`` is PEFT's ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

``LoraSlots`` holds ``n_slots`` adapters per projection as ``A [layers, slots, R, in]``, ``B^T
[layers, slots, R, out]``, zero-padded to the projection's rank room ``R`` (``max_lora_rank`` times its module
count), so a slot is overwritten in place when another adapter moves in. A forward with adapted
lines gets a ``LoraBatch``: which lines use which slot; each adapted projection then adds, for each
slot in the batch, one ``(x[lines] A^T) B^T`` over that slot's lines (``add_lora``, through the op
``neuron_lmi::lora_delta``): one small matmul pair per adapter present, never a forward per adapter,
and nothing at all where no line is adapted. The compiled step graph takes the stacked slots and
the line slots as inputs and calls the same op, so adapted batches stay compiled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from neuron_lmi.models import lora_delta as _lora_delta  # noqa: F401  (defines the op add_lora calls)
from neuron_lmi.models.args import ModelArgs

T = TypeVar("T")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (our fused projection, its index among that projection's modules).
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
ATTENTION_PROJECTIONS = frozenset({"qkv", "o"})
# ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``lora_A.default.weight``
# where the adapter name was kept).
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter this model cannot serve; ``adapter`` names it and the message says why."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"adapter {adapter!r}: {reason}")
        self.adapter = adapter
        self.reason = reason


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What ``adapter_config.json`` says that serving needs."""

    rank: int
    alpha: float
    rslora: bool
    base_model: str | None
    target_modules: tuple[str, ...]

    def scale(self, rank: int) -> float:
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


def read_adapter_config(name: str, path: Path) -> AdapterConfig:
    """``path/adapter_config.json``, refusing what the CPU engine does not serve (bias training,
    saved base modules, per-module alphas, DoRA), each refusal naming the adapter."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(name, f"no {CONFIG_FILE} in {path}")
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(name, f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(name, f"peft_type {raw.get('peft_type')!r} is not LORA")
    for key, neutral in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if raw.get(key, neutral) not in (neutral, None):
            raise AdapterError(name, f"{key}={raw[key]!r} is not supported (only {neutral!r})")
    for key in ("modules_to_save", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(name, f"{key} is not supported")
    targets = raw.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    rank = int(raw.get("r", 8))
    return AdapterConfig(
        rank=rank,
        alpha=float(raw.get("lora_alpha", rank)),
        rslora=bool(raw.get("use_rslora", False)),
        base_model=raw.get("base_model_name_or_path") or None,
        target_modules=targets,
    )


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter in host memory, fused as the model is: per layer, per projection, ``(A, B)`` with
    ``A [r, in]`` and ``B [out, r]`` (scale folded into B), ``r <= rank_room(projection)``."""

    name: str
    rank: int  # the largest module rank
    layers: tuple[Mapping[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(p for layer in self.layers for p in layer)


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Projection -> (its input size, its modules' output sizes in fused order)."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    inter = args.intermediate_size
    return {
        "qkv": (args.hidden_size, (q, kv, kv)),
        "o": (q, (args.hidden_size,)),
        "gate_up": (args.hidden_size, (inter, inter)),
        "down": (inter, (args.hidden_size,)),
    }


def adaptable_modules(projections: frozenset[str]) -> frozenset[str]:
    """The PEFT module names a model whose adaptable fused projections are ``projections`` takes."""
    return frozenset(m for m, (projection, _) in MODULES.items() if projection in projections)


def check_adapter(
    name: str,
    path: str | Path,
    args: ModelArgs,
    modules: frozenset[str],
    max_rank: int,
    base_names: Sequence[str] = (),
) -> AdapterConfig:
    """The checks every backend makes before it serves the PEFT adapter at ``path`` for a model of
    ``args`` that adapts the PEFT ``modules`` (``q_proj``...): the format (``read_adapter_config``),
    a rank within ``max_rank``, the base model's name (``base_names``, compared by last path part),
    a safetensors file of LoRA weights for modules in ``modules`` whose shapes are this model's.
    Reads the weights' header only (no tensor); raises ``AdapterError`` naming the adapter and why."""
    from safetensors import safe_open  # only where adapters are served

    path = Path(path)
    config = read_adapter_config(name, path)
    if config.rank > max_rank:
        raise AdapterError(name, f"rank {config.rank} exceeds max_lora_rank={max_rank}")
    _check_base(name, config.base_model, base_names)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(name, f"no {WEIGHTS_FILE} in {path} (only safetensors adapters are read)")
    with safe_open(str(file), framework="pt") as weights:
        shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118 (not a dict)
    pairs = _module_pairs(name, shapes, args.n_layers)
    projections = projection_shapes(args)
    top_rank = 0
    for layer, by_module in enumerate(pairs):
        for module, (a, b) in by_module.items():
            if module not in modules:
                raise AdapterError(name, f"target module {module} cannot be adapted on this model")
            projection, index = MODULES[module]
            d_in, outs = projections[projection]
            rank = a[0]
            if a != (rank, d_in) or b != (outs[index], rank):
                raise AdapterError(
                    name,
                    f"layer {layer} {module}: lora_A {a} / lora_B {b} do not fit "
                    f"the base model's {module} ({outs[index]} x {d_in}): another base model?",
                )
            if rank > max_rank:
                raise AdapterError(name, f"{module} rank {rank} exceeds max_lora_rank={max_rank}")
            top_rank = max(top_rank, rank)
    if top_rank == 0:
        raise AdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    return config


def load_adapter(
    name: str,
    path: str | Path,
    args: ModelArgs,
    supported: frozenset[str],
    max_rank: int,
    base_names: Sequence[str] = (),
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Read a PEFT adapter directory for a model of ``args`` whose adaptable projections are
    ``supported``, after ``check_adapter``'s checks (an ``AdapterError`` naming the adapter and the
    reason), fused as the model's projections are."""
    from safetensors.torch import load_file  # only where adapters are served

    path = Path(path)
    config = check_adapter(name, path, args, adaptable_modules(supported), max_rank, base_names)
    pairs = _module_pairs(name, load_file(str(path / WEIGHTS_FILE)), args.n_layers)
    shapes = projection_shapes(args)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(args.n_layers)]
    top_rank = 0
    for layer, by_module in enumerate(pairs):
        grouped: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in by_module.items():
            projection, index = MODULES[module]
            rank = a.shape[0]
            top_rank = max(top_rank, rank)
            grouped.setdefault(projection, {})[index] = (a.float(), b.float() * config.scale(rank))
        for projection, modules in grouped.items():
            layers[layer][projection] = _fuse(modules, shapes[projection], dtype)
    return LoraAdapter(name, top_rank, tuple(layers))


def _check_base(name: str, base: str | None, base_names: Sequence[str]) -> None:
    """Names are compared by their last path part (``org/Model`` and a local ``.../Model`` are the
    same). Nothing to compare (no name on either side) is no mismatch; shapes are checked whatever
    the names say."""
    known = {Path(str(n).rstrip("/")).name for n in base_names if n}
    if base and known and Path(base.rstrip("/")).name not in known:
        message = f"base_model_name_or_path {base!r} is not the served model ({sorted(known)})"
        raise AdapterError(name, message)


def _module_pairs(name: str, tensors: Mapping[str, T], n_layers: int) -> list[dict[str, tuple[T, T]]]:
    """Per layer, module -> (its lora_A, its lora_B): tensors, or their shapes (``check_adapter``)."""
    halves: list[dict[str, dict[str, T]]] = [{} for _ in range(n_layers)]
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(name, f"weight {key} is not a LoRA weight of a module this engine adapts")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in MODULES:
            reason = f"target module {module} cannot be adapted (q, k, v, o, gate, up, down only)"
            raise AdapterError(name, reason)
        if layer >= n_layers:
            raise AdapterError(name, f"weight {key} is for layer {layer}; the base model has {n_layers}")
        halves[layer].setdefault(module, {})[half] = tensor
    pairs: list[dict[str, tuple[T, T]]] = []
    for layer, modules in enumerate(halves):
        pairs.append({})
        for module, ab in modules.items():
            if set(ab) != {"A", "B"}:
                raise AdapterError(name, f"layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
            pairs[layer][module] = (ab["A"], ab["B"])
    return pairs


def _fuse(
    modules: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, tuple[int, ...]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's modules as one (A, B): A's stacked along the rank, B's block-diagonal."""
    d_in, outs = shape
    rank = sum(a.shape[0] for a, _ in modules.values())
    a_all = torch.zeros(rank, d_in)
    b_all = torch.zeros(sum(outs), rank)
    col = 0
    for index in sorted(modules):
        a, b = modules[index]
        row, r = sum(outs[:index]), a.shape[0]
        a_all[col : col + r] = a
        b_all[row : row + outs[index], col : col + r] = b
        col += r
    return a_all.to(dtype), b_all.to(dtype)


class LoraSlots:
    """``n_slots`` adapters resident beside the model: per adaptable projection, every layer's slots
    stacked, ``A [layers, n_slots, R, in]`` and ``B^T [layers, n_slots, R, out]``, ``R = max_rank x``
    the projection's module count (``stacked``: what the compiled step graph takes as inputs).

    Invariant: a slot holds one adapter's weights zero-padded to ``R``, or zeros (free); writing a
    slot touches no other, in place, so lines of the other slots run unchanged while an adapter
    moves in, and a compiled graph handed these tensors sees the new adapter on its next call.
    """

    def __init__(
        self, args: ModelArgs, projections: frozenset[str], n_slots: int, max_rank: int, dtype: torch.dtype
    ) -> None:
        if n_slots < 1 or max_rank < 1:
            raise ValueError(f"LoRA needs max_loras >= 1 and max_lora_rank >= 1, got {n_slots}, {max_rank}")
        self.n_slots, self.max_rank, self.projections = n_slots, max_rank, projections
        self.n_layers = args.n_layers
        shapes = projection_shapes(args)
        self.stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for projection in sorted(projections):
            d_in, outs = shapes[projection]
            room = max_rank * len(outs)
            self.stacked[projection] = (
                torch.zeros(args.n_layers, n_slots, room, d_in, dtype=dtype),
                torch.zeros(args.n_layers, n_slots, room, sum(outs), dtype=dtype),
            )

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter`` into ``slot`` (None: clear it)."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"LoRA slot {slot} outside [0, {self.n_slots})")
        for projection, (a_slots, b_slots) in self.stacked.items():
            a_slots[:, slot].zero_()
            b_slots[:, slot].zero_()
            if adapter is None:
                continue
            for i, given in enumerate(adapter.layers):
                if projection in given:
                    a, b = given[projection]
                    a_slots[i, slot, : a.shape[0]] = a
                    b_slots[i, slot, : b.shape[1]] = b.T

    def line_slots(self, slots: Sequence[int | None]) -> torch.Tensor | None:
        """``slots`` as the op's int64 line index (-1: no adapter), or None where no line is adapted
        (the model then does no LoRA work at all)."""
        if all(slot is None for slot in slots):
            return None
        return torch.tensor([-1 if slot is None else slot for slot in slots], dtype=torch.long)

    def batch(self, slots: Sequence[int | None]) -> LoraBatch | None:
        """The forward's adapter inputs for lines using ``slots`` (None: no adapter); None when
        no line is adapted."""
        lines = self.line_slots(slots)
        return None if lines is None else LoraBatch(lines, self.stacked)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The stacked weights in ``LoraBatch.from_inputs``'s order (sorted projections, A then B)."""
        return tuple(t for projection in sorted(self.stacked) for t in self.stacked[projection])


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which lines (dim 0 of every activation) use which slot (``lines``, int64, -1: none), and the
    slots' stacked weights by projection, for one forward."""

    lines: torch.Tensor
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    @staticmethod
    def from_inputs(
        projections: Sequence[str], lines: torch.Tensor, weights: Sequence[torch.Tensor]
    ) -> LoraBatch:
        """The batch a compiled graph rebuilds from its inputs (``LoraSlots.inputs``' order)."""
        ordered = sorted(projections)
        if len(weights) != 2 * len(ordered):
            raise ValueError(f"LoRA inputs: {len(weights)} tensors for projections {ordered}")
        return LoraBatch(lines, {p: (weights[2 * i], weights[2 * i + 1]) for i, p in enumerate(ordered)})

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self.lines, {p: (a[index], b[index]) for p, (a, b) in self.weights.items()})

    def select(self, lines: torch.Tensor) -> LoraBatch:
        """This batch for the lines at ``lines`` only (a graph's last layer over its output tokens)."""
        return LoraBatch(self.lines[lines], self.weights)


@dataclass(frozen=True, slots=True)
class LayerLora:
    """One layer's share of a ``LoraBatch``: each line's slot and that layer's slot weights."""

    lines: torch.Tensor
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def add_lora(y: torch.Tensor, x: torch.Tensor, lora: LayerLora | None, projection: str) -> torch.Tensor:
    """``y`` (``[lines, T, out]``, the base projection of ``x`` ``[lines, T, in]``) plus each adapted
    line's ``(x A^T) B^T`` for its slot (``neuron_lmi::lora_delta``, in eager and compiled graphs
    alike, its kernel registered by ``ops.kernels``, as the engine does before its first step);
    ``y`` itself where nothing is adapted."""
    if lora is None or projection not in lora.weights:
        return y
    a_slots, b_slots = lora.weights[projection]
    return torch.ops.neuron_lmi.lora_delta(y, x, lora.lines, a_slots, b_slots)
