"""The compiled step and extend (``compiled_decode``, ``compiled_extend``): the same greedy tokens
and cache contents as the eager runner, one forward per engine step where the step graph covers it,
one compile per model and shape (then a cache hit), eager wherever a package does not reach."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu import compiled_decode, compiled_extend, graphs
from neuron_lmi.backends.cpu.engine import CpuEngineOptions
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import ops, packed_linear
from neuron_lmi.runners.base import BatchKind, StepBatch
from tests.backends.cpu.conftest import load_tiny
from tests.conftest import cpu_options

pytestmark = pytest.mark.slow

N_ROWS, N_POSITIONS = 4, 128


def _options(model_dir: Path, **keys: object) -> CpuEngineOptions:
    """``N_ROWS`` x ``N_POSITIONS`` from configuration keys: fp32 and eager unless ``keys`` say
    otherwise (``enforce_eager=False``: the compiled step and extend, as served)."""
    return cpu_options(model_dir, max_rolling_batch_size=N_ROWS, n_positions=N_POSITIONS, **keys)


def _llm(model_dir: Path, **keys: object) -> LLM:
    return LLM.from_options(_options(model_dir, **keys))


def on_library(model: str, library: str, pair_limit: int | None = None) -> object:
    missing = not packed_linear.available(library)
    skip = pytest.mark.skipif(missing, reason=f"no {library} packed GEMM")
    return pytest.param(model, library, None, pair_limit, marks=skip)


@pytest.mark.parametrize(
    ("model", "library", "attention", "pair_limit"),
    [
        on_library("tiny_llama_dir", "mkl", pair_limit=100),
        on_library("tiny_llama_dir", "onednn"),
        ("tiny_mistral_dir", None, None, None),
        ("tiny_mistral_dir", None, "inductor", 100),  # the form CPUs without AVX-512 get
    ],
)
def test_compiled_graphs_equal_eager_token_for_token(
    model: str,
    library: str | None,
    attention: str | None,
    pair_limit: int | None,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six requests on four rows join and leave mid-batch, so steps mix prompt chunks with the
    decodes of rows anywhere in the cache; Mistral's 16-token sliding window is crossed; one row
    fills all 128 positions, so its last step (attention over the whole cache) runs eagerly.
    Prompts sharing a 16-token prefix with a running or retained row extend after a copied prefix.
    Where the step graph covers a step it runs it whole: no step calls the runner twice. With a low
    ``CHUNK_PAIR_LIMIT`` the longer chunks go to the extend graph and their step's decodes to the
    step graph apart. The fp32 GEMMs run on MKL's and on oneDNN's packs (Mistral: the host's
    library); the decode attention is the host's form, and for Mistral the Inductor form too."""
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    if library is not None:
        monkeypatch.setenv(packed_linear.LIBRARY_ENV, library)
    if attention is not None:
        monkeypatch.setenv(graphs.ATTENTION_ENV, attention)
    if pair_limit is not None:
        monkeypatch.setattr(compiled_decode, "CHUNK_PAIR_LIMIT", pair_limit)
    model_dir = request.getfixturevalue(model)
    eager, compiled = _llm(model_dir), _llm(model_dir, enforce_eager=False)
    runner = compiled.core.runner
    package, extend = runner.compiled_decode, runner.compiled_extend
    assert eager.core.runner.compiled_decode is None and eager.core.runner.compiled_extend is None
    assert package is not None and extend is not None
    # What one forward takes goes to the scheduler, which cuts each step to it (no runner re-routes).
    capabilities = runner.capabilities
    assert capabilities.mixed_steps and capabilities.prefill_as_extend
    assert capabilities.mixed_limits == package.limits and capabilities.max_chunk_tokens == N_POSITIONS
    assert not eager.core.runner.capabilities.prefill_as_extend
    forwards_per_step = _count_forwards(compiled)
    ids = list(range(300, 420))
    prompts = [ids[:3], ids[:40], ids[:100], ids[5:6], ids[10:30], ids[:64]]
    new = (12, 5, 28, 9, 40, 7)  # the 100-token prompt plus 28 tokens fills 128 positions
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in new]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == want
    assert [len(t) for t in got] == list(new)
    assert package.steps > 30  # the decode steps ran in the package, not eagerly
    if packed_linear.host_library() is not None:  # fp32 GEMMs on packs of the package's own weights
        assert packed_linear.cached_packs() >= len(compiled_decode.matmul_weights(runner.model))
    # The first step's 144 prompt tokens fit the step graph (4 rows + a 512-token step): every step
    # is one call (none: the eager last position), unless a low pair limit sends long chunks to the
    # extend graph beside the decodes.
    assert extend.steps >= (3 if pair_limit else 0) and forwards_per_step.count(1) > 30
    assert (max(forwards_per_step[1:]) > 1) == bool(pair_limit)
    assert not package.covers_chunks([N_POSITIONS - 1], [1])  # the full-cache step: eager
    assert runner.rows.in_use() == []


def _count_forwards(llm: LLM) -> list[int]:
    """A list that fills, as ``llm`` runs, with the number of package calls each engine step made."""
    runner, core = llm.core.runner, llm.core
    counts: list[int] = []
    step = core.step

    def counted_step() -> object:
        before = runner.compiled_decode.steps + runner.compiled_extend.steps
        events = step()
        counts.append(runner.compiled_decode.steps + runner.compiled_extend.steps - before)
        return events

    core.step = counted_step  # type: ignore[method-assign]
    return counts


def test_the_step_graph_takes_what_it_runs_well() -> None:
    """Any rows (no window), up to its token limit; chunks while their attention pairs stay within
    ``CHUNK_PAIR_LIMIT`` (past it SDPA in the extend graph does better); never the last position."""
    step = compiled_decode.CompiledDecode.__new__(compiled_decode.CompiledDecode)
    step.limit, step.n_positions = 40, 128
    assert step.covers_chunks([10, 11, 12], [1, 1, 1]) and step.covers_chunks([126], [1])  # decodes
    assert not step.covers_chunks([10] * 41, [1] * 41)  # over the token limit
    assert not step.covers_chunks([127], [1])  # the full-cache step: eager
    assert step.covers_chunks([0, 50, 7], [30, 1, 1]) and not step.covers_chunks([0, 0], [30, 11])
    assert not step.covers_chunks([120, 5], [8, 2]) and step.covers_chunks([119, 5], [8, 2])  # 128 > 127
    wide = compiled_decode.CompiledDecode.__new__(compiled_decode.CompiledDecode)
    wide.limit, wide.n_positions = 1000, 2048
    assert wide.covers_chunks([0] * 4, [60] * 4)  # four 60-token prompts: 7,320 pairs
    assert not wide.covers_chunks([1000], [200])  # 220,100 pairs: the extend graph


def test_second_start_loads_from_the_cache_without_compiling(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    first = _llm(tiny_llama_dir, enforce_eager=False)
    assert first.core.runner.compiled_decode is not None
    assert list(tmp_path.rglob(compiled_decode.PACKAGE_FILE)) and list(
        tmp_path.rglob(compiled_extend.PACKAGE_FILE)
    )

    def fail(*_: object) -> None:
        raise AssertionError("compiled again on a cache hit")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "compile_package", staticmethod(fail))
    monkeypatch.setattr(compiled_extend.CompiledExtend, "compile_package", staticmethod(fail))
    second = _llm(tiny_llama_dir, enforce_eager=False)
    assert second.core.runner.compiled_decode is not None and second.core.runner.compiled_extend is not None
    prompt, params = [list(range(50, 70))], [SamplingParams(max_new_tokens=6, temperature=0.0)]
    assert [c.token_ids for c in second.generate(prompt, params)] == [
        c.token_ids for c in first.generate(prompt, params)
    ]
    # With no_compile and an empty store the miss is an error, not a silent compile.
    from compile_cache import CacheMissError

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(CacheMissError):
        LLM.from_options(replace(_options(tiny_llama_dir, enforce_eager=False), no_compile=True))


def test_models_and_caches_without_a_decode_graph(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuron_lmi.models.quantize import quantize_model
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    dense = load_tiny(tiny_llama_dir)
    assert compiled_decode.decode_unsupported(dense, N_ROWS, N_POSITIONS) is None
    assert "too small" in (compiled_decode.decode_unsupported(dense, 1, N_POSITIONS) or "")
    quantized = load_tiny(tiny_llama_dir)
    quantize_model(quantized, "int8")
    assert compiled_decode.decode_unsupported(quantized, N_ROWS, N_POSITIONS) is None
    # torch's int8 kernel runs row by row: from 40 tokens on the eager GEMM wins, so the step stops.
    assert (
        compiled_decode.token_limit(quantized, 64, 128) == 39
        and compiled_decode.token_limit(dense, 64, 128) == 64 + 512  # every row + a step's prompt tokens
        and compiled_decode.token_limit(dense, 64, 4096) == 64 + 4096
    )
    quantized_key = compiled_decode.decode_key_inputs(quantized, tiny_llama_dir, N_ROWS, N_POSITIONS)
    assert "weights=int8" in quantized_key.compiler_flags and "max_autotune=True" not in str(quantized_key)
    moe = load_tiny(make_tiny_checkpoint(tmp_path / "mixtral", "mixtral"))
    assert "DecoderLayer" in (compiled_decode.decode_unsupported(moe, N_ROWS, N_POSITIONS) or "")
    key = compiled_decode.decode_key_inputs(dense, tiny_llama_dir, N_ROWS, N_POSITIONS)
    # Frozen weights: the key hashes their values, not only their names and shapes.
    assert key.weights_fingerprint is not None and key.weights_fingerprint.startswith("content:")
    assert (
        key.key() != compiled_decode.decode_key_inputs(dense, tiny_llama_dir, N_ROWS + 1, N_POSITIONS).key()
    )
    extend_key = compiled_decode.decode_key_inputs(dense, tiny_llama_dir, N_ROWS, N_POSITIONS, "extend")
    assert extend_key.key() != key.key()  # two graphs, two entries
    assert quantized_key.key() != key.key() and "weights=dense" in key.compiler_flags
    # fp32 decode GEMMs run the host's packed GEMM, the fp32 extend only oneDNN's, bf16 graphs only
    # oneDNN's where it runs bf16 (with MKL the host's, Intel: Inductor's templates; on an AVX2-only
    # CPU oneDNN refuses bf16 weights: Inductor's too); the keys say which.
    bf16 = load_tiny(tiny_llama_dir, torch.bfloat16)
    onednn_bf16 = torch.bfloat16 in packed_linear.dtypes("onednn")
    for library, fp32_extend, bf16_graphs in (("mkl", False, False), ("onednn", True, onednn_bf16)):
        if not packed_linear.available(library):
            continue
        monkeypatch.setenv(packed_linear.LIBRARY_ENV, library)
        flag = f"packed_gemm=neuron_lmi::{library}_linear"

        def flags(model: object, graph: str = "step") -> tuple[str, ...]:
            key = compiled_decode.decode_key_inputs(model, tiny_llama_dir, N_ROWS, N_POSITIONS, graph)
            return key.compiler_flags

        assert flag in flags(dense) and (flag in flags(dense, "extend")) == fp32_extend
        assert (flag in flags(bf16)) == bf16_graphs and (flag in flags(bf16, "extend")) == bf16_graphs
        assert not any(f.startswith("packed_gemm=") for f in flags(quantized))


def test_compiled_extend_writes_the_cache_and_logits_eager_does(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row by row against ``LlamaForCausalLM.extend``: one row and one token (the smallest sizes
    the graph takes), and three rows of different lengths after different prefixes (padding
    writes leave the slots after each chunk as they were)."""
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    runner = _llm(tiny_llama_dir, enforce_eager=False).core.runner
    extend = runner.compiled_extend
    assert extend is not None
    k, v = runner.cache.k, runner.cache.v
    torch.manual_seed(0)
    k.normal_()
    v.normal_()
    for rows, chunks, starts in (([2], [[7]], [5]), ([0, 1, 3], [[5, 6, 7], [9] * 11, [11, 12]], [0, 40, 9])):
        before_k, before_v = k.clone(), v.clone()
        got = extend(rows, chunks, starts, k, v)
        got_k, got_v = k.clone(), v.clone()
        k.copy_(before_k)
        v.copy_(before_v)
        lengths = [len(c) for c in chunks]
        tokens = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        for i, c in enumerate(chunks):
            tokens[i, : len(c)] = torch.tensor(c)
        want = runner.model.extend(
            tokens, torch.tensor(rows), torch.tensor(starts), lengths, k, v, N_POSITIONS
        )  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_k, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, v, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got_k, before_k)  # it wrote something
    assert extend.covers([0, 100], [27, 3]) and not extend.covers([0, 100], [28, 3])


def _teacher_forced(runner: CpuRunner, lone_row_step: bool = False) -> torch.Tensor:
    """Logits ``[steps, 3, vocab]`` of one prefill of three prompts into fresh rows (0, 1, 2) and four
    decode steps over them; with ``lone_row_step``, then one step of row 0 alone (one token),
    broadcast over the three. The rows are freed after. The prompts go in the batch the scheduler
    sends (an EXTEND from position 0 where the runner has graphs: ``prefill_as_extend``)."""
    prompts = [list(range(300, 310)), list(range(400, 437)), [5, 6]]
    rows = [runner.rows.allocate() for _ in prompts]
    kind = BatchKind.EXTEND if runner.capabilities.prefill_as_extend else BatchKind.PREFILL
    n = len(rows)
    logits = [runner.forward(StepBatch(kind, tuple(rows), (0,) * n, tuple(map(tuple, prompts)), (True,) * n))]
    for step in range(4):
        logits.append(runner.decode(rows, [7 + step + i for i in range(len(rows))]))
    if lone_row_step:
        logits.append(runner.decode(rows[:1], [99]).expand(len(rows), -1))
    for row in rows:
        runner.rows.remove(row)
    return torch.stack(logits)


def test_bf16_graphs_follow_the_eager_bf16_engine(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bf16 the decode graph's GEMMs are Inductor's autotuned CPU templates
    (``compiled_decode.BF16_DECODE_CONFIGS``): teacher-forced through one prefill of three prompts and
    four decode steps, its logits stay within bf16 rounding of the eager bf16 runner's."""
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    eager = _llm(tiny_llama_dir, dtype="bf16").core.runner
    compiled = _llm(tiny_llama_dir, dtype="bf16", enforce_eager=False).core.runner
    decode, extend = compiled.compiled_decode, compiled.compiled_extend
    assert decode is not None and extend is not None
    assert (
        "max_autotune=True"
        in compiled_decode.decode_key_inputs(
            compiled.model, tiny_llama_dir, N_ROWS, N_POSITIONS
        ).compiler_flags
    )
    want, got = _teacher_forced(eager), _teacher_forced(compiled)
    assert decode.steps == 5 and extend.steps == 0  # 49 prompt tokens: the step graph's too
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_graphs_follow_the_eager_quantized_engine(
    method: str, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``option.quantize``: the decode graph keeps the weights quantized and runs torch's packed
    kernels, as the eager step does below ``gemm_min_rows``; the extend graph traces a copy with them
    dequantized to the model's dtype. Teacher-forced through a prefill of three prompts (49 tokens,
    past the step graph's 39), four decode steps over their rows and one step of the lowest row
    alone (one token), the logits stay within bf16 rounding of the eager quantized runner's."""
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    eager = _llm(tiny_llama_dir, quantize=method).core.runner
    compiled = _llm(tiny_llama_dir, quantize=method, enforce_eager=False).core.runner
    decode, extend = compiled.compiled_decode, compiled.compiled_extend
    assert decode is not None and extend is not None
    formats = compiled_decode.weight_formats(compiled.model)
    assert formats == ("int4g32+int8" if method == "int4" else "int8")  # lm_head: int8 in both
    want, got = _teacher_forced(eager, lone_row_step=True), _teacher_forced(compiled, lone_row_step=True)
    assert decode.steps == 5 and extend.steps >= 1
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # Top-1 agreement, not equality: bf16 rounding may flip a near-tie of this random model.
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_the_decode_attention_form_follows_the_cpu_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(graphs.ATTENTION_ENV, raising=False)
    avx512 = str(torch.backends.cpu.get_cpu_capability()).startswith("AVX512")
    assert graphs.decode_attention_form() == ("op" if avx512 else "inductor")
    for forced in ("op", "inductor"):
        monkeypatch.setenv(graphs.ATTENTION_ENV, forced)
        assert graphs.decode_attention_form() == forced
    monkeypatch.setenv(graphs.ATTENTION_ENV, "sdpa")
    with pytest.raises(ValueError, match="NEURON_LMI_DECODE_ATTENTION='sdpa': expected op or inductor"):
        graphs.decode_attention_form()


def test_the_pair_limit_follows_the_ops_chunk_path(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pair limit (and no extend graph) only where the op's chunk path runs: its form on an
    AVX-512 host, head dim 64 or 128, fp32 or (with AVX512-BF16) bf16. The test models' head dim 16
    keeps the limit; a step package takes any chunk without one."""
    from neuron_lmi.models.native import host_cpu_flags
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    monkeypatch.delenv(graphs.ATTENTION_ENV, raising=False)
    avx512 = graphs.avx512_host()
    bf16_dot = "avx512_bf16" in host_cpu_flags()
    head16 = load_tiny(tiny_llama_dir)
    head64_dir = make_tiny_checkpoint(tmp_path / "head64", "llama", hidden_size=128, num_attention_heads=2)
    head64, head64_bf16 = load_tiny(head64_dir), load_tiny(head64_dir, torch.bfloat16)
    limit = compiled_decode.CHUNK_PAIR_LIMIT
    assert head16.args.head_dim == 16 and head64.args.head_dim == 64
    assert compiled_decode.chunk_pair_limit(head16) == limit
    assert compiled_decode.chunk_pair_limit(head64) == (None if avx512 else limit)
    assert compiled_decode.chunk_pair_limit(head64_bf16) == (None if avx512 and bf16_dot else limit)
    assert compiled_decode.extend_graph_needed(head64, N_ROWS, N_POSITIONS) == (not avx512)
    monkeypatch.setenv(graphs.ATTENTION_ENV, "inductor")
    assert compiled_decode.chunk_pair_limit(head64) == limit
    step = compiled_decode.CompiledDecode.__new__(compiled_decode.CompiledDecode)
    step.limit, step.n_positions, step.pair_limit = 1000, 2048, None
    assert step.covers_chunks([1000], [200]) and step.covers_chunks([0, 0], [500, 499])
    assert not step.covers_chunks([0, 0], [500, 501]) and not step.covers_chunks([2000], [48])


def test_with_the_ops_chunk_path_the_step_graph_runs_every_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head-dim-64 model on a host with the chunk path: no extend graph; prompts of 100 and 60
    tokens (past the old pair limit together) and a prompt joining running decodes run in the step
    graph, one call a step, with the eager engine's greedy tokens."""
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(graphs.ATTENTION_ENV, raising=False)
    model_dir = make_tiny_checkpoint(tmp_path / "head64", "llama", hidden_size=128, num_attention_heads=2)
    eager, compiled = _llm(model_dir), _llm(model_dir, enforce_eager=False)
    runner = compiled.core.runner
    if compiled_decode.chunk_pair_limit(runner.model) is not None:
        pytest.skip("this host's op has no chunk path (AVX-512 needed)")
    assert runner.compiled_decode is not None and runner.compiled_extend is None
    ids = list(range(300, 420))
    prompts = [ids[:100], ids[10:70], ids[:3], ids[50:90]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 30, 40, 12)]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    before = runner.compiled_decode.steps
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == want
    assert runner.compiled_decode.steps - before == compiled.core.steps  # every step, one call
    assert runner.rows.in_use() == []


def test_the_step_graphs_last_layer_runs_for_the_logits_tokens_only(tiny_llama_dir: Path) -> None:
    """A 20-token prompt chunk and two decodes in one step: the last layer's MLP sees the three
    tokens whose logits are wanted, not all 22, and the logits and every K/V written are those of
    running every token through every layer."""
    ops.kernels()  # the op's CPU kernel, as the engine loads it at start-up
    model = load_tiny(tiny_llama_dir)
    graph = graphs.StepGraph(model)
    args = model.args
    shape = (args.n_layers, 4, args.n_kv_heads, 64, args.head_dim)
    tokens = torch.randint(3, 200, (22,), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([1] * 20 + [0, 3])
    positions = torch.tensor([*range(5, 25), 9, 30])
    last, key_pos = torch.tensor([19, 20, 21]), torch.arange(40)
    prefix = torch.Generator().manual_seed(1)
    k_full, v_full = torch.randn(shape, generator=prefix), torch.randn(shape, generator=prefix)
    k_step, v_step = k_full.clone(), v_full.clone()

    x = model.embed[tokens][:, None]
    hidden = graphs.token_layers(graph, x, rows, positions, key_pos, None, k_full, v_full)
    want = model.logits(hidden[last, 0])
    seen: list[int] = []
    final = model.layers[-1]
    real_mlp = final.mlp
    final.mlp = lambda x, lora=None: (seen.append(x.shape[0]), real_mlp(x, lora))[1]
    try:
        got = graph(tokens, rows, positions, last, key_pos, k_step, v_step)
    finally:
        del final.mlp
    assert seen == [3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_step, k_full, rtol=0, atol=0)
    torch.testing.assert_close(v_step, v_full, rtol=0, atol=0)


def test_speculation_with_compiled_graphs_is_token_identical_to_eager_without(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n-gram speculation on the served runner (compiled graphs, ``option.speculative_config`` as
    a configuration key): rows that join mid-batch make steps whose one mixed batch holds prompt
    chunks, plain decodes and drafts to verify (``mixed_verify``: the step graph returns the logits
    of every position of a verify line), and no verify runs the eager extend. Greedy tokens equal
    the eager engine's without speculation, drafts are accepted, and every row is freed."""
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path))
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    eager, compiled = _llm(tiny_llama_dir), _llm(tiny_llama_dir, enforce_eager=False, speculative_config=spec)
    runner, core = compiled.core.runner, compiled.core
    assert core.speculator is not None and runner.capabilities.mixed_verify
    eager_verifies: list[int] = []
    extend_eager = runner._extend_eager

    def recorded_extend_eager(
        rows: Sequence[int], chunks: Sequence[Sequence[int]], adapters: object = None, last: object = None
    ) -> torch.Tensor:
        if last is not None:
            eager_verifies.append(len(rows))
        return extend_eager(rows, chunks, adapters, last)

    runner._extend_eager = recorded_extend_eager  # type: ignore[method-assign]
    phrase = list(range(300, 307))
    prompts = [
        phrase * 4,
        list(range(400, 430)),
        list(range(350, 353)) * 6,
        phrase[2:] * 3,
        list(range(500, 560)),
    ]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 12, 25, 20, 9)]
    kinds: list[list[tuple[BatchKind, tuple[int, ...]]]] = []
    step = core.scheduler.next_step

    def recorded_step() -> object:
        plan = step()
        kinds.append([(b.kind, b.logit_counts) for b, _ in plan.batches])
        return plan

    core.scheduler.next_step = recorded_step  # type: ignore[method-assign]
    want = [c.token_ids for c in eager.generate(prompts, params)]
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == want
    counters = core.speculator.counters
    assert counters.drafts > 0 and 0 < counters.accepted_tokens <= counters.draft_tokens
    mixed_verifies = [
        counts
        for step_kinds in kinds
        for kind, counts in step_kinds
        if kind is BatchKind.EXTEND and max(counts, default=1) > 1 and min(counts) == 1
    ]
    assert mixed_verifies  # verify lines rode beside plain decodes or prompt chunks in one batch
    assert all(len(step_kinds) == 1 for step_kinds in kinds)  # one forward per step
    assert eager_verifies == []  # every verify ran in the step graph
    assert runner.compiled_decode.steps == len(kinds)
    assert runner.rows.in_use() == []
