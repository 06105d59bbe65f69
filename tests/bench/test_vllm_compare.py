"""``bench/vllm_compare.py``'s own arithmetic: the streams' inter-token gaps while long prompts arrive
(the servers it compares run in the vLLM tier and in the benchmarks, not here)."""

from __future__ import annotations

import pytest

from bench.vllm_compare import gaps_while_arriving


def test_only_the_gaps_ending_between_the_first_arrival_and_the_last_first_token_count() -> None:
    arrivals = [
        {"sent_at": 100.0, "token_times": [2.0, 2.5]},  # first token at 102.0
        {"sent_at": 100.5, "token_times": [3.0]},  # first token at 103.5: the window ends here
        {"sent_at": 101.0, "token_times": []},  # failed: no first token, opens nothing
    ]
    streams = [
        # tokens at 99.0, 99.5 (before), 100.2, 101.0, 103.5 (inside), 104.0 (after)
        {"sent_at": 98.0, "token_times": [1.0, 1.5, 2.2, 3.0, 5.5, 6.0]},
        {"sent_at": 100.8, "token_times": [0.1, 0.3]},  # first token inside: its gap counts
    ]
    gaps = gaps_while_arriving(streams, arrivals)
    assert gaps == pytest.approx([0.7, 0.8, 2.5, 0.2])


def test_the_window_needs_an_arrival_with_a_first_token() -> None:
    with pytest.raises(ValueError):
        streams = [{"sent_at": 0.0, "token_times": [1.0, 2.0]}]
        gaps_while_arriving(streams, [{"sent_at": 0.0, "token_times": []}])
