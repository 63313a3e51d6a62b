"""Node ranks as short text for logs and messages (pure).

A rack of 1,000 nodes declared gone must not print 1,000 numbers on one line:
runs of consecutive ranks are written as ``first-last``.
"""

from __future__ import annotations

from collections.abc import Iterable


def rank_ranges(ranks: Iterable[int]) -> str:
    """``ranks`` sorted, consecutive runs of three or more as ``a-b``, in brackets.

    >>> rank_ranges([9, 3, 4, 5, 7, 8])
    '[3-5, 7-9]'
    >>> rank_ranges(range(9000, 10000))
    '[9000-9999]'
    >>> rank_ranges([])
    '[]'
    """
    items = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{items[i]}-{items[j]}")
        else:
            parts.extend(str(r) for r in items[i : j + 1])
        i = j + 1
    return "[" + ", ".join(parts) + "]"
