"""Every sampling field on the engine, checked against a reference computation on the logits.

A fake runner returns known random logits each step (and records them), so each generated token can
be recomputed by hand from OpenAI's definitions: penalties over the generated tokens, logit_bias,
min_tokens, min_p, top-k/top-p, the grammar mask.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from cache_api import RowTable
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.sampling import filter_logits, sample
from neuron_lmi.engine.types import GrammarSpec, InvalidRequestError, SamplingParams, TokenEvent
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

VOCAB = 64
EOS = 1


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir):
    """SmolLM2's tokenizer (saved with the tiny checkpoint)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


class RecordingRunner(ForwardByKind):
    capabilities = RunnerCapabilities()

    """Random logits from a fixed generator; ``seen[row]`` keeps every logits row it returned."""

    def __init__(self, seed: int = 0, n_rows: int = 4, n_positions: int = 128, scale: float = 3.0) -> None:
        self.rows = RowTable(n_rows, n_positions)
        self.vocab_size, self.n_positions = VOCAB, n_positions
        self.generator = torch.Generator().manual_seed(seed)
        self.scale = scale
        self.seen: dict[int, list[torch.Tensor]] = {}

    def _logits(self, rows: Sequence[int]) -> torch.Tensor:
        out = torch.randn(len(rows), VOCAB, generator=self.generator) * self.scale
        out[:, EOS] -= 4.0  # make EOS rare, so runs are long enough to penalize something
        for row, logits in zip(rows, out, strict=True):
            self.seen.setdefault(row, []).append(logits.clone())
        return out

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        for row, prompt in zip(rows, prompts, strict=True):
            self.seen[row] = []
            self.rows.set_length(row, len(prompt))
        return self._logits(rows)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self.rows.reserve_next(rows)
        return self._logits(rows)


def run(params: SamplingParams, prompt: Sequence[int] = (5, 6, 7), seed: int = 0):
    runner = RecordingRunner(seed)
    core = EngineCore(runner, tokenizer=_Tok(), eos_token_ids=[EOS])
    events: list[TokenEvent] = []
    core.add(core.make_request(list(prompt), params, sink=events.append))
    while core.has_work():
        core.step()
    return [e.token_id for e in events if e.token_id >= 0], runner.seen[0], events


class _Tok:
    """Enough of a tokenizer for the engine: token i prints as a letter."""

    all_special_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [2 + (ord(c) % 60) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: object) -> str:
        return "".join("" if i == EOS else chr(ord("a") + i % 26) for i in ids)

    def __len__(self) -> int:
        return VOCAB


def test_presence_frequency_penalties_and_logit_bias_match_the_reference() -> None:
    bias = ((3, 5.0), (9, -100.0), (12, 2.5))
    params = SamplingParams(
        max_new_tokens=40, presence_penalty=1.5, frequency_penalty=0.7, logit_bias=bias, ignore_eos=True
    )
    tokens, logits, events = run(params)
    assert len(tokens) == 40
    counts = torch.zeros(VOCAB)
    for step, token in enumerate(tokens):
        ref = logits[step] - 1.5 * (counts > 0) - 0.7 * counts
        for t, b in bias:
            ref[t] += b
        assert token == int(ref.argmax()), f"step {step}"
        # Reported log-probabilities stay the model's own distribution.
        assert events[step].logprob == pytest.approx(float(torch.log_softmax(logits[step], -1)[token]))
        counts[token] += 1
    assert 9 not in tokens
    assert len(set(tokens)) > 10  # the penalties really spread the choices


def test_negative_penalties_favour_repetition() -> None:
    tokens, logits, _ = run(SamplingParams(max_new_tokens=20, frequency_penalty=-2.0, ignore_eos=True))
    counts = torch.zeros(VOCAB)
    for step, token in enumerate(tokens):
        assert token == int((logits[step] + 2.0 * counts).argmax())
        counts[token] += 1
    plain, same_logits, _ = run(SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert torch.equal(torch.stack(same_logits), torch.stack(logits))
    assert len(set(tokens)) < len(set(plain))


def test_penalties_count_generated_tokens_not_the_prompt() -> None:
    plain, logits, _ = run(SamplingParams(max_new_tokens=1), prompt=list(range(2, 60)))
    penalized, _, _ = run(SamplingParams(max_new_tokens=1, presence_penalty=2.0), prompt=list(range(2, 60)))
    assert penalized == plain == [int(logits[0].argmax())]


def test_min_tokens_masks_eos_until_reached() -> None:
    bias = ((EOS, 100.0),)  # EOS would win every step
    tokens, _, events = run(SamplingParams(max_new_tokens=20, min_tokens=6, logit_bias=bias))
    assert len(tokens) == 7 and tokens[-1] == EOS and EOS not in tokens[:6]
    assert events[-1].finish_reason == "eos_token"


def test_min_p_keeps_tokens_within_a_fraction_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    kept = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [True] * 4]


def test_batched_filters_equal_one_row_at_a_time() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    top_k = torch.tensor([0, 3, 10, 0, 40])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.7, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.2, 0.05])
    batched = filter_logits(logits, top_k, top_p, min_p)
    for i in range(5):
        alone = filter_logits(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1])
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(alone[0]))


def test_seeded_rows_sample_the_same_tokens_whatever_else_is_batched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.8, top_k=20, min_p=0.02, presence_penalty=0.5, seed=1),
        SamplingParams(temperature=1.3, top_p=0.9, frequency_penalty=1.0, logit_bias=((4, 3.0),)),
        SamplingParams(),
    ]

    def draw(rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(7) for _ in rows]
        outs: list[list[int]] = [[] for _ in rows]
        for _ in range(15):
            got = sample(logits[rows], [params[r] for r in rows], [[]] * len(rows), gens, outputs=outs).tokens
            for o, t in zip(outs, got, strict=True):
                o.append(t)
        return outs[0]

    assert draw([0]) == draw([0, 1, 2]) == draw([0, 2])


def test_grammar_mask_is_applied_per_row_and_min_tokens_yields_to_a_finished_grammar(tiny_tokenizer) -> None:
    from neuron_lmi.engine.grammar import GrammarCompiler

    vocab = len(tiny_tokenizer)
    compiler = GrammarCompiler(tiny_tokenizer, vocab, [tiny_tokenizer.eos_token_id])
    state = compiler.state(GrammarSpec.regex("ab"))
    for token in tiny_tokenizer.encode("ab"):
        assert state.accept(token)
    logits = torch.zeros(2, vocab)
    params = [SamplingParams(min_tokens=5, max_new_tokens=8), SamplingParams()]
    grammars = [state, None]
    out = sample(logits, params, [[], []], [None, None], outputs=[[0], []], grammars=grammars, stop_ids=[2])
    assert out.tokens[0] == tiny_tokenizer.eos_token_id  # the grammar is complete: only EOS
    assert out.tokens[1] == 0  # the row without a grammar is untouched


def test_compiled_grammars_are_cached_per_spec(tiny_tokenizer) -> None:
    from neuron_lmi.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), [2])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    a = compiler.state(GrammarSpec.json_schema(schema))
    b = compiler.state(GrammarSpec.json_schema(json.dumps(schema)))
    assert compiler.compiled == 1 and a.matcher is not b.matcher
    with pytest.raises(InvalidRequestError) as info:
        compiler.state(GrammarSpec.json_schema({"type": "nonsense"}))
    assert info.value.field == "grammar" and "nonsense" in str(info.value)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3.0}),
        ("logit_bias", {"logit_bias": ((3, 101.0),)}),
        ("logit_bias", {"logit_bias": ((-1, 1.0),)}),
        ("min_tokens", {"min_tokens": 200}),
        ("min_p", {"min_p": 1.5}),
        ("prompt_logprobs", {"prompt_logprobs": 99}),
    ],
)
def test_out_of_range_fields_are_named(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.field == field


def test_engine_refuses_logit_bias_outside_the_vocabulary() -> None:
    core = EngineCore(RecordingRunner(), tokenizer=_Tok(), eos_token_ids=[EOS])
    with pytest.raises(InvalidRequestError) as info:
        core.make_request([5], SamplingParams(max_new_tokens=4, logit_bias=((VOCAB, 1.0),)))
    assert info.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError) as info:
        core.make_request(
            [5], SamplingParams(max_new_tokens=4, prompt_logprobs=0)
        )  # this runner cannot score prompts
    assert info.value.field == "prompt_logprobs"


def test_grammar_reads_byte_level_tokens_as_bytes(tiny_tokenizer) -> None:
    """SmolLM2's GGUF-converted tokenizer: "Ġ" is a space to the grammar, as to the tokenizer."""
    from neuron_lmi.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), [2])
    state = compiler.state(GrammarSpec.regex(r"no, [0-9]{3} ünï 日本"))
    assert all(state.accept(t) for t in tiny_tokenizer.encode("no, 123 ünï 日本"))
    assert state.matcher.is_accepting()


def _sorted_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k then top_p over the whole vocabulary sorted (what the candidate path must reproduce)."""
    vocab = logits.shape[-1]
    kept = torch.full_like(logits, float("-inf"))
    for r in range(logits.shape[0]):
        k = int(top_k[r]) if 0 < int(top_k[r]) < vocab else vocab
        if k == vocab and float(top_p[r]) >= 1.0:
            kept[r] = logits[r]
            continue
        values, order = torch.sort(logits[r], descending=True)
        probs = torch.softmax(values[:k], dim=-1)
        n = int(((probs.cumsum(-1) - probs) < float(top_p[r])).sum().clamp(min=1))
        kept[r, order[:n]] = values[:n]
    return kept


def test_top_k_top_p_on_candidates_match_a_full_sort() -> None:
    """Random batches mixing top_k, top_p, both and neither, flat and peaked rows (a flat row's
    top_p mass lies past the candidates: the whole vocabulary is sorted then)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        b, vocab = int(torch.randint(1, 7, (1,), generator=g)), 3000
        logits = torch.randn(b, vocab, generator=g) * float(torch.rand(1, generator=g) * 6)
        logits[:, :20] += float(torch.rand(1, generator=g) * 10)  # some rows concentrate their mass
        top_k = torch.randint(0, 3, (b,), generator=g) * torch.randint(1, 1500, (b,), generator=g)
        top_p = torch.where(torch.rand(b, generator=g) < 0.6, torch.rand(b, generator=g), torch.ones(b))
        got = filter_logits(logits, top_k, top_p, torch.zeros(b))
        want = _sorted_reference(logits, top_k, top_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
