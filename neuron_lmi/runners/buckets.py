"""Static shape buckets, as Neuron compiles them: powers of two from 128 up to ``n_positions``."""

from __future__ import annotations

import bisect

MIN_BUCKET = 128


def power_of_two_buckets(n_positions: int, start: int = MIN_BUCKET) -> list[int]:
    """``[128, 256, ..., n_positions]``; the last bucket is ``n_positions`` itself."""
    if n_positions <= 0:
        raise ValueError(f"n_positions must be positive, got {n_positions}")
    buckets, size = [], start
    while size < n_positions:
        buckets.append(size)
        size *= 2
    buckets.append(n_positions)
    return buckets


def pick_bucket(buckets: list[int], length: int) -> int:
    """The smallest bucket holding ``length`` tokens."""
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
