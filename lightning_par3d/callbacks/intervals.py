"""Interval arithmetic on time ranges (microseconds), for attributing a step's time without counting any twice."""

from __future__ import annotations

from collections.abc import Iterable

Span = tuple[float, float]


def merge(spans: Iterable[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(spans: Iterable[Span]) -> float:
    """Total time covered by ``spans`` (overlaps counted once)."""
    return sum(end - start for start, end in merge(spans))


def intersect(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Where both ``a`` and ``b`` hold."""
    a, b = merge(a), merge(b)
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Where ``a`` holds and ``b`` does not."""
    out: list[Span] = []
    cuts = merge(b)
    for start, end in merge(a):
        cursor = start
        for c_start, c_end in cuts:
            if c_end <= cursor or c_start >= end:
                continue
            if c_start > cursor:
                out.append((cursor, c_start))
            cursor = max(cursor, c_end)
        if cursor < end:
            out.append((cursor, end))
    return out
