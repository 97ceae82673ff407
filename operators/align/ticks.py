"""The session's tick grid: exact integer tick times for a rational tick rate.

Used by ``modalign.operators.align.aligner`` (which ticks are decided, where a late event
falls) and by the matching rules in ``modalign.operators.align.matching``; times are int64
ns on the session clock.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from modalign.schemas.units import NS_PER_S

_INF = float("inf")


class TickGrid:
    """Exact tick times ``floor(k * 1e9 / tick_hz)`` with the rate as a fraction."""

    def __init__(self, tick_hz: float) -> None:
        rate = Fraction(tick_hz).limit_denominator(1_000_000)
        self.num, self.den = rate.numerator, rate.denominator

    def times(self, k0: int, k1: int) -> np.ndarray:
        k = np.arange(k0, k1, dtype=np.int64)
        return (k * (NS_PER_S * self.den)) // self.num

    def time(self, k: int) -> int:
        return (k * NS_PER_S * self.den) // self.num

    def count_below(self, t_ns: float) -> int:
        """Number of ticks (from k=0) with time < t_ns."""
        if t_ns == _INF:
            raise ValueError("unbounded")
        if t_ns <= 0:
            return 0
        t = int(t_ns) if float(t_ns).is_integer() else int(np.ceil(t_ns))
        return -(-t * self.num // (NS_PER_S * self.den))

    def nearest(self, t_ns: int) -> int:
        return max(0, int(round(t_ns * self.num / (NS_PER_S * self.den))))

    @property
    def period_ns(self) -> float:
        return NS_PER_S * self.den / self.num


def tick_times(n_ticks: int, tick_hz: float) -> np.ndarray:
    """Exact tick times ``floor(k * 1e9 / tick_hz)`` for k in [0, n_ticks)."""
    return TickGrid(tick_hz).times(0, n_ticks)
