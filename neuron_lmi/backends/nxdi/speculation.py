"""NxD Inference's fused speculation, planned from ``option.speculative_config``: plain data, no import.

NxD Inference 0.8.0 (cd3abf3) and 0.9.0 (4bcdc54) fuse a draft into the token-generation graph
(``NeuronFusedSpecModel``, ``models/model_base.py``): each token-generation call runs the draft
``speculation_length`` times, the target once over the input and the first ``speculation_length - 1``
drafts, and returns the accepted tokens per row (1 to ``speculation_length``). So ``k`` draft tokens,
vLLM's ``num_speculative_tokens``, are ``speculation_length = k + 1``::

    option.speculative_config                 target NeuronConfig            draft NeuronConfig
    {"method": "draft_model", "model": DIR,   speculation_length=k+1         the target's keywords with
     "num_speculative_tokens": k}             enable_fused_speculation=True  speculation_length=0,
    (LMI: option.speculative_draft_model=DIR,                                enable_fused_speculation=False
     option.speculative_length=k)
    {"method": "eagle", ...}                  + enable_eagle_speculation     speculation_length=k+1,
                                                (which sets fused itself)    is_eagle_draft=True; then
                                                                             enable_fused_speculation=False
    {"method": "eagle3", ...}                 + is_eagle3=True               + is_eagle3=True

    InferenceConfig(neuron_config, fused_spec_config=FusedSpecNeuronConfig(<application>._model_cls,
        draft_config=<XInferenceConfig>(draft NeuronConfig, load_config=load_pretrained_config(DIR)),
        draft_model_path=DIR), load_config=...)

which is what the library's own ``inference_demo.py`` builds (``--draft-model-path``,
``--enable-fused-speculation``, ``--enable-eagle-speculation``): the draft's config is the target's
``NeuronConfig`` copied, with speculation off (EAGLE: kept, ``is_eagle_draft``) and, set after
construction because ``enable_eagle_speculation`` forces it on, ``enable_fused_speculation=False``.
The draft runs the target's application class (``worker_cls``), so it must be the same family.

Refused, naming the key: ``ngram`` (and every other method): the fused graph makes its own drafts and
takes one token per row, so drafts from the host have nowhere to go; the library's host-draft path
(``speculation_length`` without fusing: a ``speculation_length``-wide graph verifying given tokens)
is a different graph this backend does not drive, and none of it runs in the library's CPU mode
(``to_cpu``: "Speculation is not yet supported for CPU inference"). Also refused: host sampling only
(the fused model asserts ``on_device_sampling_config``), a sliding window shorter than the sequence
(the library sizes the ring for drafts, which is not checked here), the CPU mode, and a draft whose
vocabulary or family differs from the target's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_lmi.config.speculative import KEY, SpeculativeConfig

FUSED = frozenset({"draft_model", "eagle", "eagle3"})
EAGLE = frozenset({"eagle", "eagle3"})
NGRAM_REFUSAL = (
    "NxD Inference fuses its drafts into the compiled token-generation graph (a draft model or an "
    "EAGLE head: NeuronFusedSpecModel), which takes one token per row and makes its own drafts, so "
    "n-gram drafts from the host have nowhere to go; use method draft_model (with model) or eagle"
)


# NeuronConfig keywords that change what a token-generation call returns: set only by this plan, from
# option.speculative_config (the runner must know what the graph does).
SPECULATION_KEYWORDS = frozenset(
    """speculation_length enable_fused_speculation enable_eagle_speculation is_eagle3 is_eagle_draft
    is_medusa medusa_speculation_length num_medusa_heads medusa_tree token_tree_config""".split()  # noqa: SIM905
)


def check_overrides(overrides: Mapping[str, Any] | None) -> None:
    """Refuse speculation set through ``override_neuron_config``, naming the key."""
    given = sorted(SPECULATION_KEYWORDS & set(overrides or {}))
    if given:
        raise ValueError(
            f"override_neuron_config.{given[0]}: speculation changes what each call returns, so it is "
            f"set from {KEY} (draft_model, eagle, eagle3), not by override"
        )


@dataclass(frozen=True, slots=True)
class FusedSpeculation:
    """The draft fused into the graph. Invariants: ``speculation_length == drafts + 1 >= 2``;
    ``draft_kwargs`` are JSON values (``torch_dtype`` by name, as ``NxdiPlan.neuron_config``);
    ``draft_after`` are attributes set on the draft ``NeuronConfig`` once built."""

    method: str
    draft_path: str
    speculation_length: int
    draft_kwargs: dict[str, Any]
    draft_after: dict[str, Any] = field(default_factory=dict)
    draft_config: dict[str, Any] = field(default_factory=dict)  # its config.json (the cache key's)

    @property
    def drafts(self) -> int:
        return self.speculation_length - 1

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "draft_model_path": self.draft_path,
            "speculation_length": self.speculation_length,
            "draft_neuron_config_kwargs": dict(self.draft_kwargs),
            "draft_neuron_config_set_after": dict(self.draft_after),
        }


def target_kwargs(method: str, speculation_length: int) -> dict[str, Any]:
    """The keywords added to the target's ``NeuronConfig``."""
    out: dict[str, Any] = {"speculation_length": speculation_length, "enable_fused_speculation": True}
    if method in EAGLE:
        out["enable_eagle_speculation"] = True
    if method == "eagle3":
        out["is_eagle3"] = True
    return out


def draft_kwargs(method: str, target: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keywords, attributes set after construction) of the draft's ``NeuronConfig``: the target's
    own, as ``inference_demo.py`` copies them."""
    kwargs = dict(target)
    if method in EAGLE:
        kwargs["is_eagle_draft"] = True
        return kwargs, {"enable_fused_speculation": False}
    kwargs["speculation_length"] = 0
    kwargs["enable_fused_speculation"] = False
    return kwargs, {}


def _draft_config(spec: SpeculativeConfig) -> tuple[str, dict[str, Any]]:
    if not spec.model:
        raise ValueError(f"{KEY}: method {spec.method!r} needs model (the draft's local folder)")
    path = Path(spec.model)
    try:
        return str(path), json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{KEY}: model={spec.model!r}: NxD Inference reads the draft from a local folder with "
            f"config.json ({exc})"
        ) from exc


def plan_speculation(
    spec: SpeculativeConfig | None,
    kwargs: dict[str, Any],
    model_config: Mapping[str, Any],
    same_application: Any,
    window: int | None,
) -> FusedSpeculation | None:
    """Add the fused-speculation keywords to ``kwargs`` (in place) and return the draft's part; None
    without ``spec``. ``same_application(model_type)`` says whether a draft of that model type runs
    on the target's application. Raises ``ValueError`` naming the key."""
    if spec is None:
        return None
    if spec.method not in FUSED:
        why = NGRAM_REFUSAL if spec.method == "ngram" else "NxD Inference fuses draft_model and eagle"
        raise ValueError(f"{KEY}: method {spec.method!r} is not run by the NxD Inference backend: {why}")
    if kwargs.get("on_device_sampling_config") is None:
        raise ValueError(
            f"{KEY}: NxD Inference's fused speculation samples on the device (NeuronFusedSpecModel "
            "asserts on_device_sampling_config): leave option.on_device_sampling on"
        )
    if kwargs.get("on_cpu") is True:
        raise ValueError(
            f"{KEY} with override_neuron_config.on_cpu=true: NxD Inference's CPU mode refuses "
            'speculation (to_cpu: "Speculation is not yet supported for CPU inference")'
        )
    if window is not None and window < int(kwargs["seq_len"]):
        raise ValueError(
            f"{KEY}: a sliding window of {window} under n_positions={kwargs['seq_len']} with fused "
            "speculation is not supported here (the ring the library keeps for drafts is not checked)"
        )
    path, draft = _draft_config(spec)
    draft_type, vocab = str(draft.get("model_type", "")), model_config.get("vocab_size")
    if not same_application(draft_type):
        raise ValueError(
            f"{KEY}: model={spec.model!r} is a {draft_type!r}; NxD Inference runs the draft on the "
            f"target's application ({model_config.get('model_type')!r}), so it must be of that family"
        )
    if draft.get("vocab_size") != vocab:
        raise ValueError(
            f"{KEY}: model={spec.model!r} has vocab_size {draft.get('vocab_size')}, the target "
            f"{vocab}: the draft must share the target's tokenizer"
        )
    length = spec.num_speculative_tokens + 1
    if length >= int(kwargs["seq_len"]):
        raise ValueError(f"{KEY}: num_speculative_tokens={length - 1} leaves no room in n_positions")
    kwargs.update(target_kwargs(spec.method, length))
    draft_keywords, after = draft_kwargs(spec.method, kwargs)
    return FusedSpeculation(spec.method, path, length, draft_keywords, after, dict(draft))
