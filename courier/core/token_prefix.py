"""How many leading items two sequences share (token ids, or the characters of two texts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix_length(left: Sequence[T], right: Sequence[T]) -> int:
    """The length of the longest common prefix; slices are compared in C, halving the span on a mismatch and
    comparing only the part not yet known to be shared."""
    if type(left) is not type(right):  # a list never equals a tuple: compare like with like
        left, right = tuple(left), tuple(right)
    limit = min(len(left), len(right))
    if left[:limit] == right[:limit]:  # the usual case
        return limit
    low, high = 0, limit  # left[:low] == right[:low], left[:high] != right[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if left[low:middle] == right[low:middle]:
            low = middle
        else:
            high = middle
    return low
