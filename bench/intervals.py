"""How sure a median over interleaved rounds is: shared by the benches."""

from __future__ import annotations

import math


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median of ``values`` (order
    statistics: no assumption about how the rounds are distributed)."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * math.sqrt(n)  # 1.96 * sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half) - 1)
    return ordered[low], ordered[min(n - 1, math.ceil(n / 2 + half))]
