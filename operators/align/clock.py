"""Exact integer mapping of a source's local clock onto the session clock.

``t_session = offset_ns + t_local + t_local * skew_ppb / 1e9`` with the skew held as an
integer number of parts per billion, so an hour of media converts with no float drift.
Local times come from container PTS (``pts * time_base``, a Fraction) or sample indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from schemas.manifest import ClockMapping

NS_PER_S = 1_000_000_000


@dataclass(frozen=True)
class SessionClock:
    """A source's clock domain: ``offset_ns`` and skew in integer ppb."""

    offset_ns: int = 0
    skew_ppb: int = 0

    @classmethod
    def from_mapping(cls, m: ClockMapping) -> "SessionClock":
        return cls(offset_ns=int(m.offset_ns), skew_ppb=int(round(m.skew_ppm * 1000)))

    def to_session(self, local_ns: int) -> int:
        """Session ns of one local ns (floor division keeps it monotonic)."""
        return self.offset_ns + local_ns + (local_ns * self.skew_ppb) // NS_PER_S

    def to_session_array(self, local_ns: np.ndarray) -> np.ndarray:
        """Vectorised ``to_session`` for int64 arrays (exact while |local_ns| * |skew_ppb| < 9.2e18)."""
        local = np.asarray(local_ns, dtype=np.int64)
        if self.skew_ppb == 0:
            return local + np.int64(self.offset_ns)
        return self.offset_ns + local + (local * np.int64(self.skew_ppb)) // NS_PER_S


def pts_to_ns(pts: int, time_base: Fraction) -> int:
    """Container PTS to local ns, rounded to nearest, exact rational arithmetic."""
    v = pts * time_base * NS_PER_S
    return int(v.numerator * 2 + v.denominator) // (2 * v.denominator)


def samples_to_ns(index: int, sample_rate_hz: int) -> int:
    """Sample index to local ns, rounded to nearest."""
    return (index * NS_PER_S * 2 + sample_rate_hz) // (2 * sample_rate_hz)
