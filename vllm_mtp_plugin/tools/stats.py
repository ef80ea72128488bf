"""How sure an acceptance figure is: 95 % Wilson intervals over the drafts counted.

A draft position is accepted or not, so the acceptance at position i over n drafts is a
proportion; Wilson's interval stays inside [0, 1] and is honest for small n and for rates near 0
or 1, where the normal approximation is not. Drafts of one request are not independent (a hard
passage rejects many in a row), so these intervals are if anything too narrow: "better" is only
claimed where they do not overlap.

Engine processes and passes of one configuration replay the same requests (greedy, or seeded
when sampling), so their counters repeat each other: the drafts that count are one pass's.

Timings are ratios of paired passes; their median gets a distribution-free interval from order
statistics (``median_interval``), as a pass that a busy machine slowed is an outlier, not a
normal draw.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

Z95 = 1.959964


def median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def wilson(accepted: float, drafts: float, z: float = Z95) -> tuple[float, float] | None:
    """The 95 % interval of ``accepted / drafts`` (None without drafts)."""
    if drafts <= 0:
        return None
    p = accepted / drafts
    centre = (p + z * z / (2 * drafts)) / (1 + z * z / drafts)
    half = z * math.sqrt(p * (1 - p) / drafts + z * z / (4 * drafts * drafts)) / (1 + z * z / drafts)
    return max(0.0, centre - half), min(1.0, centre + half)


def separated(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    """True when two intervals do not overlap: only then is one figure called higher."""
    return a is not None and b is not None and (a[1] < b[0] or b[1] < a[0])


def comparison(a: tuple[float, float] | None, b: tuple[float, float] | None) -> str:
    """"higher", "lower" or "within noise" for figure a against figure b, by their intervals."""
    if not separated(a, b):
        return "within noise"
    return "higher" if a[0] > b[1] else "lower"


def distinct_drafts(row: dict) -> tuple[float, list[float]]:
    """A bench row's drafts and accepted per position counted once, not once per engine process
    and pass (each replays the same requests)."""
    counters = row.get("spec_decode") or {}
    replays = max(1, int(row.get("processes") or 1)) * max(1, int(row.get("repeats") or 1))
    return ((counters.get("num_drafts") or 0) / replays,
            [a / replays for a in counters.get("accepted_per_position") or []])


def median_interval(values, z: float = Z95) -> tuple[float, float] | None:
    """95 % interval of the median from order statistics (the sign test's): the sorted values
    at ranks floor((n - z sqrt n) / 2) and ceil(1 + (n + z sqrt n) / 2), 1-based. None below
    6 values, where no pair of ranks covers 95 %."""
    xs = sorted(values)
    n = len(xs)
    if n < 6:
        return None
    low = math.floor((n - z * math.sqrt(n)) / 2)
    high = math.ceil(1 + (n + z * math.sqrt(n)) / 2)
    return xs[max(low, 1) - 1], xs[min(high, n) - 1]
