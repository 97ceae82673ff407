"""Exact integer mapping of a source's local clock onto the session clock.

``t_session = offset_ns + t_local + floor(t_local * skew_ppb / 1e9)`` with the skew held
as an integer number of parts per billion (``round(skew_ppm * 1000)``), so hours of media
convert with no float drift: the scalar and the vectorised forms agree to the nanosecond
for any int64 local time and any skew ``ClockMapping`` allows (+-10,000 ppm). The product
``t_local * skew_ppb`` would overflow int64 past ~15 minutes at 10,000 ppm, so the array
form splits ``t_local`` into whole seconds and a remainder first. Local times come from
container PTS (``pts * time_base``, a Fraction) or sample indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from modalign.schemas.manifest import ClockMapping
from modalign.schemas.units import NS_PER_S


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
        """Vectorised ``to_session`` for int64 arrays, equal to it element by element.

        ``floor(t * p / 1e9) = q * p + floor(r * p / 1e9)`` with ``t = q * 1e9 + r``,
        ``0 <= r < 1e9``: both products stay far inside int64 for |p| <= 1e7 ppb."""
        local = np.asarray(local_ns, dtype=np.int64)
        if self.skew_ppb == 0:
            return local + np.int64(self.offset_ns)
        p = np.int64(self.skew_ppb)
        q, r = np.divmod(local, np.int64(NS_PER_S))
        return np.int64(self.offset_ns) + local + q * p + (r * p) // np.int64(NS_PER_S)

    def to_local(self, session_ns: int) -> int:
        """Inverse of ``to_session``: the largest local ns whose session time is <= ``session_ns``."""
        d = session_ns - self.offset_ns
        t = (d * NS_PER_S) // (NS_PER_S + self.skew_ppb)  # within a ns or two of the answer
        while self.to_session(t + 1) <= session_ns:
            t += 1
        while self.to_session(t) > session_ns:
            t -= 1
        return t

    def assumed_offset_ns(self, session_ns: np.ndarray) -> np.ndarray:
        """``T - t_local(T)`` at session times T: the offset this mapping applies there (float ns)."""
        t = np.asarray(session_ns, dtype=np.float64)
        return t - (t - self.offset_ns) / (1.0 + self.skew_ppb * 1e-9)


def pts_to_ns(pts: int, time_base: Fraction) -> int:
    """Container PTS to local ns, rounded to nearest, exact rational arithmetic."""
    v = pts * time_base * NS_PER_S
    return int(v.numerator * 2 + v.denominator) // (2 * v.denominator)


def samples_to_ns(index: int, sample_rate_hz: int) -> int:
    """Sample index to local ns, rounded to nearest."""
    return (index * NS_PER_S * 2 + sample_rate_hz) // (2 * sample_rate_hz)
