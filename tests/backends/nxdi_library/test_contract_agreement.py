"""(b) ``NxdiContractModel``, the stand-in CI runs, agrees with the real application call by call.

Random call sequences over four cache rows: context encodings of 1..20 tokens into any row (a row
re-encoded while others hold sequences), token-generation calls over any subset of the filled rows in
any order (partial batches, full batches out of seq_id order), at each row's next position or at an
earlier one (a rider rewriting a slot), with random tokens. Each call's logits must agree within
1e-4, so every later call also checks the cache both left behind: padding writes, ring-buffer slots,
the pad slot a one-token prompt returns.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.nxdi.runner import on_cpu_application
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint
from neuron_lmi.testing.nxdi_contract import NxdiContractModel
from tests.backends.nxdi.test_families import tiny_checkpoint
from tests.backends.nxdi_library.conftest import ARCHES, nxdi_plan

ROWS, N_POSITIONS, CALLS = 4, 32, 48
pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")


@pytest.fixture(scope="module", params=ARCHES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, N_POSITIONS)


def call_sequence(seed: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    rng = random.Random(seed)
    lengths = [0] * ROWS
    calls = []
    for _ in range(CALLS):
        filled = [r for r in range(ROWS) if 0 < lengths[r] < N_POSITIONS]
        if not filled or rng.random() < 0.3:
            row, n = rng.randrange(ROWS), rng.choice([1, 2, 3, rng.randint(4, 20)])
            calls.append(
                {
                    "input_ids": torch.tensor([[rng.randrange(3, vocab) for _ in range(n)]]),
                    "attention_mask": torch.ones(1, n, dtype=torch.long),
                    "position_ids": torch.arange(n)[None],
                    "seq_ids": torch.tensor([row]),
                }
            )
            lengths[row] = n
            continue
        rows = rng.sample(filled, rng.randint(1, len(filled)))
        positions = [lengths[r] if rng.random() < 0.8 else rng.randint(1, lengths[r]) for r in rows]
        for r, p in zip(rows, positions, strict=True):
            lengths[r] = max(lengths[r], p + 1)
        pos = torch.tensor(positions)[:, None]
        calls.append(
            {
                "input_ids": torch.tensor([[rng.randrange(3, vocab)] for _ in rows]),
                "attention_mask": (torch.arange(int(pos.max()))[None, :] < pos).long(),
                "position_ids": pos,
                "seq_ids": torch.tensor(rows),
            }
        )
    return calls


def completed(call: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A partial token call completed with copies of its first line for the missing seq_ids, sorted."""
    present = call["seq_ids"].tolist()
    if int(call["position_ids"].min()) == 0 or len(present) == ROWS:  # a context call, a full batch
        return call
    every = present + [r for r in range(ROWS) if r not in present]
    first = [i if i < len(present) else 0 for i in sorted(range(ROWS), key=every.__getitem__)]
    return {
        "input_ids": call["input_ids"][first],
        "attention_mask": call["attention_mask"][first],
        "position_ids": call["position_ids"][first],
        "seq_ids": torch.tensor(sorted(every)),
    }


@pytest.mark.parametrize("sampling", ["host", "on-device"])
@pytest.mark.parametrize("seed", [0, 1])
def test_contract_model_agrees_with_the_library_call_by_call(
    checkpoint: Path, seed: int, sampling: str
) -> None:
    """On the device's path (the default) greedy ``sampling_params`` go with every call and the tokens
    must agree too. Token calls go as full batches, completed as the library completes them on a
    device and as ``NxdiRunner`` sends them (its CPU mode fails on a partial one with logits:
    ``test_device_sampling.py``)."""
    device = sampling == "on-device"
    plan, _ = nxdi_plan(
        checkpoint, ROWS, N_POSITIONS, extra="" if device else "option.on_device_sampling=false\n"
    )
    real = on_cpu_application(plan)
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    contract = NxdiContractModel(
        model,
        ROWS,
        N_POSITIONS,
        (N_POSITIONS,),
        ignores_sliding_window=plan.sliding_window is None,
        pad_token_id=int(getattr(real.config, "pad_token_id", None) or 0),
        on_device_sampling=plan.neuron_config.get("on_device_sampling_config"),
        output_logits=bool(plan.neuron_config.get("output_logits")),
    )
    kinds = set()
    for i, call in enumerate(call_sequence(seed, model.args.vocab_size)):
        if device:
            call = completed(call)
            call["sampling_params"] = torch.ones(len(call["seq_ids"]), 3)  # greedy: top_k 1
        with torch.inference_mode():
            out = real(**call)
        answer = contract(**call)
        want, got = out.logits, answer.logits
        if device:
            assert torch.equal(answer.tokens, out.tokens), f"call {i}"
        kinds.add(contract.calls[-1][0])
        assert got.shape == want.shape, f"call {i}"
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-4, msg=lambda m, i=i: f"call {i}: {m}")
    assert kinds == {"context", "token"}


def test_a_one_token_prompt_returns_a_padding_slot(checkpoint: Path) -> None:
    """The library's own behaviour, which the contract keeps and the runner works around."""
    plan, _ = nxdi_plan(checkpoint, ROWS, N_POSITIONS, extra="option.on_device_sampling=false\n")
    real = on_cpu_application(plan)
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    with torch.inference_mode():
        one = real(
            input_ids=torch.tensor([[77]]),
            attention_mask=torch.ones(1, 1, dtype=torch.long),
            position_ids=torch.zeros(1, 1, dtype=torch.long),
            seq_ids=torch.tensor([0]),
        ).logits[0, 0]
    pad_token = int(getattr(real.config, "pad_token_id", None) or 0)
    want_token, _, _ = model.prefill(torch.tensor([[77]]), [1])
    want_pad, _, _ = model.prefill(torch.tensor([[77, pad_token]]), [2])
    assert not torch.allclose(one, want_token[0], atol=1e-3)
    torch.testing.assert_close(one, want_pad[0], rtol=0, atol=1e-4)
