"""Units shared by every layer: the session clock counts int64 nanoseconds."""

from __future__ import annotations

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
