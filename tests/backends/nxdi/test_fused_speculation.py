"""NxD Inference's fused speculation: the plan's keywords and refusals, and the runner in the engine
against the contract model's ``NeuronFusedSpecModel`` (read from the library's source only: its CPU
mode refuses speculation, so nothing here ran on the library's code; docs/verification.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.common import eos_ids_for
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.nxdi.backend import build_nxdi_runner
from neuron_lmi.backends.nxdi.plan import ON_DEVICE_SAMPLING, plan_nxdi
from neuron_lmi.backends.nxdi.runner import NxdiRunner
from neuron_lmi.backends.registry import BuildRequest
from neuron_lmi.config import load_config
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.runners.base import DeviceSampling
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from neuron_lmi.testing.nxdi_contract import ContractSpeculation, NxdiContractModel
from tests.backends.conftest import run_schedule
from tests.backends.nxdi.test_plan import LLAMA_3_8B, MISTRAL_7B, model_dir

N_ROWS, N_POSITIONS, K = 4, 64, 3
SCHEDULE = [(0, 5, 9), (0, 20, 11), (2, 1, 7), (3, 9, 12), (3, 3, 4), (6, 12, 8)]
RELEASES = ("0.8.0", "0.9.0")

pytestmark = pytest.mark.usefixtures("one_thread")


def spec(method: str, model: Path | None, k: int = K) -> str:
    value: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if model is not None:
        value["model"] = str(model)
    return f"option.speculative_config={json.dumps(value)}\n"


def plan(tmp_path: Path, config: dict[str, Any], extra: str, version: str = "0.9.0") -> Any:
    folder = model_dir(tmp_path, config)
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={folder}\noption.model_loader=nxdi\noption.tensor_parallel_degree=8\n"
        f"option.max_rolling_batch_size=8\noption.n_positions=1024\n{extra}",
        encoding="utf-8",
    )
    resolved = load_config(properties_path=props, env={})
    platform = "trn1" if version == "0.8.0" else "trn2"
    return plan_nxdi(resolved.config, config, str(folder), None, version, platform)


def draft_dir(tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / "draft"
    folder.mkdir()
    config = {**LLAMA_3_8B, "hidden_size": 2048, "num_hidden_layers": 16, **changes}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize("version", RELEASES)
def test_a_draft_model_is_fused_with_speculation_length_k_plus_1(tmp_path: Path, version: str) -> None:
    draft = draft_dir(tmp_path)
    p = plan(tmp_path, LLAMA_3_8B, spec("draft_model", draft), version)
    kwargs = p.neuron_config
    assert kwargs["speculation_length"] == K + 1 and kwargs["enable_fused_speculation"] is True
    assert "enable_eagle_speculation" not in kwargs
    s = p.speculation
    assert s.draft_path == str(draft) and s.speculation_length == K + 1 and s.drafts == K
    assert s.draft_kwargs["speculation_length"] == 0 and s.draft_kwargs["enable_fused_speculation"] is False
    assert s.draft_kwargs["tp_degree"] == 8 and s.draft_after == {}
    key = p.key_args()["speculation"]
    assert "draft_model_path" not in key and key["draft_architecture"]["hidden_size"] == 2048
    assert p.describe()["speculation"]["speculation_length"] == K + 1
    assert "speculation_length" not in str(p.ignored)


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_sets_the_draft_as_the_library_s_demo_does(tmp_path: Path, version: str, method: str) -> None:
    p = plan(tmp_path, LLAMA_3_8B, spec(method, draft_dir(tmp_path)), version)
    kwargs, draft = p.neuron_config, p.speculation.draft_kwargs
    assert kwargs["enable_eagle_speculation"] is True and kwargs["enable_fused_speculation"] is True
    assert kwargs.get("is_eagle3", False) is (method == "eagle3")
    assert draft["is_eagle_draft"] is True and draft["speculation_length"] == K + 1
    assert p.speculation.draft_after == {"enable_fused_speculation": False}


def test_lmi_s_draft_model_keys_map_onto_a_draft_model(tmp_path: Path) -> None:
    draft = draft_dir(tmp_path)
    p = plan(tmp_path, LLAMA_3_8B, f"option.speculative_draft_model={draft}\noption.speculative_length=4\n")
    assert p.speculation.method == "draft_model" and p.neuron_config["speculation_length"] == 5


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (spec("ngram", None), "takes one token per row and makes its own drafts"),
        (spec("medusa", None), "NxD Inference fuses draft_model and eagle"),
        (spec("draft_model", Path("/nowhere")), "local folder with config.json"),
        ("option.on_device_sampling=false\n", "samples on the device"),
    ],
)
def test_what_is_refused_names_the_key(tmp_path: Path, extra: str, says: str) -> None:
    if "on_device_sampling" in extra:
        extra += spec("draft_model", draft_dir(tmp_path))
    with pytest.raises(ValueError, match=r"option\.speculative_config") as err:
        plan(tmp_path, LLAMA_3_8B, extra)
    assert says in str(err.value)


def test_speculation_by_override_is_refused(tmp_path: Path) -> None:
    """The runner must know what each call returns: speculation comes from the key, not an override."""
    with pytest.raises(ValueError, match=r"override_neuron_config\.enable_fused_speculation"):
        plan(tmp_path, LLAMA_3_8B, 'option.override_neuron_config={"enable_fused_speculation": true}\n')


@pytest.mark.parametrize(
    ("changes", "says"),
    [({"vocab_size": 32000}, "share the target's tokenizer"), ({"model_type": "qwen2"}, "of that family")],
)
def test_a_draft_unlike_the_target_is_refused(tmp_path: Path, changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        plan(tmp_path, LLAMA_3_8B, spec("draft_model", draft_dir(tmp_path, **changes)))


def test_a_sliding_window_under_the_sequence_is_refused(tmp_path: Path) -> None:
    mistral = {**MISTRAL_7B, "sliding_window": 512}
    draft = draft_dir(tmp_path, model_type="mistral", vocab_size=32000)
    with pytest.raises(ValueError, match="sliding window of 512"):
        plan(tmp_path, mistral, spec("draft_model", draft))


# -- the runner in the engine, against the contract model ----------------------------------------------


def load(folder: Path) -> tuple[Any, Any, list[int]]:
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    tokenizer = load_tokenizer(ckpt)
    return model, tokenizer, eos_ids_for(ckpt.config, tokenizer)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), arch="llama")


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft of the same shape and vocabulary with other weights: it is often wrong."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("other"), arch="llama", seed=7)


def noisy(folder: Path, scale: float) -> Any:
    """The model at ``folder`` with every weight moved by ``scale`` of its spread: a draft that is
    right often, not always."""
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    weights = {
        name: w + scale * w.std() * torch.randn(w.shape, generator=generator) if w.numel() > 1 else w
        for name, w in ckpt.state_dict.items()
    }
    return build_model(ckpt.config, weights, n_positions=N_POSITIONS)


def fused_runner(
    tmp_path: Path, target: Path, draft: Path, logits: bool = False, noise: float = 0.0
) -> tuple[NxdiRunner, NxdiContractModel]:
    model, _, _ = load(target)
    draft_model = noisy(draft, noise) if noise else load(draft)[0]
    contract = NxdiContractModel(
        model,
        N_ROWS,
        N_POSITIONS,
        context_length_estimate=(8, 16),
        on_device_sampling=dict(ON_DEVICE_SAMPLING),
        output_logits=logits,
        speculation=ContractSpeculation(draft_model, K + 1),
    )
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={target}\noption.model_loader=nxdi\noption.max_rolling_batch_size={N_ROWS}\n"
        f"option.n_positions={N_POSITIONS}\noption.dtype=fp32\noption.tensor_parallel_degree=1\n"
        f"option.context_length_estimate=8,16\n{spec('draft_model', draft)}",
        encoding="utf-8",
    )
    resolved = load_config(properties_path=props, env={})
    runner = build_nxdi_runner(BuildRequest(resolved, {}, "neuron-nxdi", 1), target, model=contract)
    if not logits:  # the plan asks output_logits; this contract returns none, as a device without it
        runner.device_sampling = DeviceSampling(True, 256, False)
    return runner, contract


def cpu_engine_tokens(target: Path) -> dict[str, list[int]]:
    model, tokenizer, eos = load(target)
    return run_schedule(EngineCore(CpuRunner(model, N_ROWS, N_POSITIONS), tokenizer, eos), SCHEDULE)


@pytest.mark.parametrize("draft", ["same", "noisy", "other"])
def test_greedy_output_with_fused_speculation_is_the_cpu_engine_s(
    tmp_path: Path, target: Path, other: Path, draft: str
) -> None:
    """A draft that is always right (the target's own weights), one that is right part of the time
    (those weights moved) and one that is always wrong (other weights): the engine's tokens are the
    CPU engine's without speculation each time; the device's runs are applied whole, rows near their
    end cut by max_new_tokens, and the counters count them."""
    expected = cpu_engine_tokens(target)
    noise = 0.15 if draft == "noisy" else 0.0
    runner, contract = fused_runner(tmp_path, target, other if draft == "other" else target, noise=noise)
    assert runner.capabilities.fused_speculation == K + 1
    assert runner.n_positions == N_POSITIONS - K and runner.rows.n_positions == N_POSITIONS
    _, tokenizer, eos = load(target)
    spec_config = load_config(
        properties_path=tmp_path / "serving.properties", env={}
    ).config.batching.speculative_config
    core = EngineCore(runner, tokenizer, eos, speculative=spec_config)
    assert core.speculator is None  # nothing drafted on the host
    got = run_schedule(core, SCHEDULE, logprobs=False)
    assert got == expected
    extra = core.stats().extra
    drafts, accepted = extra["spec_decode_num_drafts"], extra["spec_decode_num_accepted_tokens"]
    assert drafts > 0 and extra["spec_decode_num_draft_tokens"] == K * drafts
    if draft == "same":  # every draft accepted: K + 1 tokens per decode step
        assert accepted == K * drafts
    if draft == "noisy":  # some accepted, some not
        assert 0 < accepted < K * drafts
    tokens = [shape for kind, shape in contract.calls if kind == "token"]
    generated = sum(new for _, _, new in SCHEDULE) - len(SCHEDULE)  # after each first token
    assert len(tokens) < generated if draft == "same" else len(tokens) <= generated
    assert runner.rows.in_use() == []


def generate(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Any, int]:
    """Run ``core`` until idle; (the requests, the steps it took)."""
    requests = [
        core.make_request(p, sp, request_id=str(i))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for request in requests:
        core.add(request)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    return requests, steps


def test_a_row_the_host_samples_takes_one_token_from_the_first_position(tmp_path: Path, target: Path) -> None:
    """Log-probabilities go to the host: such a row emits one token per step from the target's logits
    at its first position, beside rows that keep the device's runs; all give the CPU engine's tokens."""
    runner, _ = fused_runner(tmp_path, target, target, logits=True)
    _, tokenizer, eos = load(target)
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=h) for h in (True, False, False)]
    got, steps = generate(EngineCore(runner, tokenizer, eos), prompts, params)
    reference, _, _ = load(target)
    cpu, _ = generate(EngineCore(CpuRunner(reference, N_ROWS, N_POSITIONS), tokenizer, eos), prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in cpu]
    assert all(lp != 0.0 for lp in got[0].logprobs)  # the host's, from the logits
    assert steps >= 10  # the host's row steps one token at a time; the others are done sooner


def test_the_cpu_path_s_tensor_form_of_fused_outputs_reads_the_same(target: Path) -> None:
    """In the library's CPU path (``logits_or_next_tokens, *_ = outputs``) ``fused_outputs`` is the
    accepted tensor alone; on a device, a list. The runner reads both."""
    model, _, _ = load(target)
    device = DeviceSampling(True, 256, False)
    runner = NxdiRunner(model, N_ROWS, N_POSITIONS, 64, device, speculation_length=3)
    out = type("Out", (), {"fused_outputs": torch.tensor([[4, 5, -1], [6, -1, -1]], dtype=torch.int32)})()
    step = runner._fused(out, 2, context=False)
    assert step.runs == ((4, 5), (6,)) and step.tokens.tolist() == [4, 6]
    listed = type("Out", (), {"fused_outputs": [torch.tensor([[4, 5, -1], [6, -1, -1]])] * 4})()
    assert runner._fused(listed, 2, context=False).runs == ((4, 5), (6,))
