"""Static shape buckets, as Neuron compiles them: powers of two from 128 up to ``n_positions``."""

from __future__ import annotations

import bisect

from compile_cache.key import token_generation_buckets

MIN_BUCKET = 128


def power_of_two_buckets(n_positions: int, start: int = MIN_BUCKET) -> list[int]:
    """``[128, 256, ..., n_positions]``; the last bucket is ``n_positions`` itself (tnx's convention,
    kept in one place: ``compile_cache.key.token_generation_buckets``)."""
    return list(token_generation_buckets(n_positions, start))


def chunk_buckets(largest: int, step: int = 64) -> list[int]:
    """Lengths an ``extend`` chunk is padded to on the eager CPU path: the powers of two below
    ``step``, then every multiple of ``step`` up to ``largest`` (itself the last). Nothing is
    compiled per shape there, so fine steps only save padding: a decode line (an adapted batch's,
    one token) costs one position, not 16; a verify line of five tokens eight; a 24-token prompt
    tail 32, not 128; and a 192-token chunk (a 256-token step less 64 decodes) exactly 192."""
    buckets = [1 << i for i in range(step.bit_length()) if (1 << i) < min(step, largest)]
    buckets += range(step, largest, step)
    return [*buckets, largest]


def pick_bucket(buckets: list[int], length: int) -> int:
    """The smallest bucket holding ``length`` tokens."""
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def pack_into_bins(lengths: list[int], capacity: int) -> list[list[tuple[int, int]]]:
    """First-fit-decreasing packing of sequences into rows of ``capacity`` tokens.

    Returns one list per row of ``(sequence index, offset)``; every sequence appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[tuple[int, int]]] = []
    used: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"sequence of {lengths[i]} tokens does not fit a row of {capacity}")
        for b, filled in enumerate(used):
            if filled + lengths[i] <= capacity:
                bins[b].append((i, filled))
                used[b] += lengths[i]
                break
        else:
            bins.append([(i, 0)])
            used.append(lengths[i])
    return bins
