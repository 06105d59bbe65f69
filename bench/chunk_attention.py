"""Prompt-chunk attention and prefill: the decode op's chunk path against SDPA, and the step graph
against the extend graph on the CPU runner (issue 28).

``--op``: ``neuron_lmi::decode_attention`` over one chunk of a row's tokens (each a query at its own
position, SmolLM2's 9 query and 3 KV heads of 64) against ``F.scaled_dot_product_attention`` with the
causal mask over the same keys, as the extend graph ran it; ms per layer.

``--runner``: the CPU runner's ``extend`` on SmolLM2 with compiled graphs, each case once through
the step graph (the op's attention) and once through the extend graph (SDPA): ms per call and
prompt tokens/s. The extend package is opened even where the engine would not need it.

    python -m bench.chunk_attention --op
    python -m bench.chunk_attention --runner --dtype bf16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

CASES = ((0, 256), (768, 256), (0, 512), (512, 512), (0, 1024))  # (start, chunk tokens)


def timed(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, after two warm-up calls."""
    fn()
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def op_against_sdpa(reps: int) -> None:
    from neuron_lmi.models import ops

    print(f"decode_attention kernel: {ops.kernels()}")
    for dtype in (torch.bfloat16, torch.float32):
        k = torch.randn(4, 3, 2048, 64).to(dtype)  # rows, KV heads, positions, head dim
        v = torch.randn(4, 3, 2048, 64).to(dtype)
        for start, n in CASES:
            op, sdpa, flops = op_case(k, v, start, n, reps)
            print(
                f"{dtype!s:15} {n:5} tokens after {start:4}: op {op * 1e3:6.2f} ms "
                f"({flops / op / 1e9:4.0f} GFLOP/s), SDPA {sdpa * 1e3:6.2f} ms, {sdpa / op:4.1f}x"
            )


def op_case(k: torch.Tensor, v: torch.Tensor, start: int, n: int, reps: int) -> tuple[float, float, int]:
    """(op seconds, SDPA seconds, FLOPs) for ``n`` queries of cache row 1 after ``start`` positions."""
    from neuron_lmi.models import decode_attention as da

    heads, dim = 9, k.shape[-1]
    q = torch.randn(n, heads, 1, dim).to(k.dtype)
    row, positions = torch.full((n,), 1), torch.arange(start, start + n)
    op = timed(lambda: da.decode_attention(q, k, v, row, positions, dim**-0.5, 0), reps)
    keys, values = k[1:2, :, : start + n], v[1:2, :, : start + n]
    mask = (torch.arange(start + n)[None, :] <= positions[:, None])[None, None]
    grouped = q.view(1, n, heads, dim).transpose(1, 2)
    scale = dim**-0.5

    def sdpa_call() -> torch.Tensor:
        sdpa_out = F.scaled_dot_product_attention
        return sdpa_out(grouped, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    sdpa = timed(sdpa_call, reps)
    return op, sdpa, 4 * dim * heads * sum(p + 1 for p in positions.tolist())


def runner_paths(dtype: str, reps: int) -> None:
    from neuron_lmi.backends.cpu import compiled_decode
    from neuron_lmi.backends.cpu.llm import LLM

    compiled_decode.extend_graph_needed = lambda *_: True  # open the extend package too
    llm = LLM(model="smollm2", dtype=dtype, enforce_eager=False, max_rolling_batch_size=32, n_positions=2048)
    runner, rows = llm.core.runner, llm.core.runner.rows
    step = runner.compiled_decode
    generator = torch.Generator().manual_seed(0)
    cases = [[(n, start)] for start, n in CASES] + [[(256, 0)] * 4, [(512, 0)] * 2]
    for case in cases:
        for row in list(rows.in_use()):
            rows.remove(row, 0)
        taken = [rows.allocate() for _ in case]
        prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n, _ in case]

        def extend(taken: list[int] = taken, case: list = case, prompts: list = prompts) -> None:
            for row, (_, start) in zip(taken, case, strict=True):
                rows.set_length(row, start)
            runner.extend(taken, prompts)

        tokens = sum(n for n, _ in case)
        by_path = {}
        for path, pair_limit in (("extend graph", compiled_decode.CHUNK_PAIR_LIMIT), ("step graph", None)):
            step.pair_limit = pair_limit
            by_path[path] = timed(extend, reps)
        label = " + ".join(f"{n} after {start}" for n, start in case)
        print(
            f"{label:32}: "
            + ", ".join(f"{p} {s * 1e3:6.1f} ms ({tokens / s:5.0f} tok/s)" for p, s in by_path.items())
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", action="store_true", help="the op against SDPA")
    ap.add_argument("--runner", action="store_true", help="the step graph against the extend graph")
    ap.add_argument("--dtype", default="bf16", help="--runner's dtype")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if not (args.op or args.runner):
        ap.error("give --op, --runner or both")
    if args.op:
        op_against_sdpa(max(args.reps, 10))
    if args.runner:
        runner_paths(args.dtype, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
