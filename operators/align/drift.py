"""Clock-drift signal and drift alarms of the tick aligner.

Called by ``modalign.operators.align.aligner`` for each decided chunk of ticks; the
``out_of_tolerance`` CTAL rows it leads to are built in ``modalign.operators.align.rows``,
and alarm rows go to the ``drift_alarms`` table (``DriftAlarmRow``).

Tolerance matching bounds residuals by the tolerance, so drift is measured from the
sources' audio: ``TickAligner.observe_offsets`` takes per-window observed clock offsets
(from ``modalign.operators.align.offset``); per tick, a source's *residual offset* is the
observed offset (linearly interpolated between windows, held beyond them) minus the offset
its clock mapping applies there (0 for a source without observations). The drift signal
is the largest pairwise difference of these residuals. A positive residual means the
source's events belong later on the session clock than the mapping put them. An alarm is
the signal above the threshold for N consecutive ticks.
"""

from __future__ import annotations

import numpy as np

from modalign.operators.align.clock import SessionClock
from modalign.operators.align.source_state import SourceState


def residual_offsets(s: SourceState, ticks: np.ndarray) -> np.ndarray | None:
    """Observed minus mapped clock offset of ``s`` at ``ticks`` (ns, float), None without data."""
    if not s.obs_raw:
        return None
    if s.obs_cache is None:
        t = np.array([w[0] for w in s.obs_raw], np.float64)
        assumed = SessionClock.from_mapping(s.clock).assumed_offset_ns(t)
        r = np.array([w[1] for w in s.obs_raw], np.float64) - assumed
        h = s.median_of // 2
        if h and len(r) >= s.median_of:  # running median; the h windows at each end kept as they are
            med = np.median(np.lib.stride_tricks.sliding_window_view(r, 2 * h + 1), axis=1)
            r = np.concatenate([r[:h], med, r[len(r) - h:]])
        s.obs_cache = (t, r)
    t, r = s.obs_cache
    return np.interp(ticks.astype(np.float64), t, r)


def drift_signal(srcs: list[SourceState], ticks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(residual offsets, ticks x sources; their spread per tick), None when no source has observations."""
    res = [residual_offsets(s, ticks) for s in srcs]
    if all(r is None for r in res):
        return None
    mat = np.stack([r if r is not None else np.zeros(len(ticks)) for r in res], axis=1)
    return mat, mat.max(axis=1) - mat.min(axis=1)


class DriftRuns:
    """Runs of ticks whose drift signal is over the threshold, carried across decided chunks.

    A run that ends (or is closed at the session end) becomes an alarm row if it lasted at
    least ``min_ticks`` ticks; the row names the pair of sources at the run's peak.
    """

    def __init__(self, session_id: str, threshold_ms: float, min_ticks: int) -> None:
        self.session_id = session_id
        self.threshold_ns = threshold_ms * 1e6
        self.min_ticks = min_ticks
        self._run: dict | None = None  # open run: start, max, peak pair

    def update(self, k0: int, ticks: np.ndarray, spread: np.ndarray, mat: np.ndarray,
               source_ids: list[str]) -> list[dict]:
        """Extend or close runs over ticks ``k0 ..``; returns the alarm rows closed here."""
        closed: list[dict] = []
        over = spread > self.threshold_ns
        K = len(ticks)
        i = 0
        while i < K:
            if not over[i]:
                if self._run is not None:
                    closed += self.close()
                nxt = np.flatnonzero(over[i:])
                if len(nxt) == 0:
                    return closed
                i += int(nxt[0])
                continue
            stop = np.flatnonzero(~over[i:])
            j = K if len(stop) == 0 else i + int(stop[0])
            seg = spread[i:j]
            p = i + int(np.argmax(seg))
            pair = [source_ids[int(mat[p].argmax())], source_ids[int(mat[p].argmin())]]
            if self._run is None:
                self._run = dict(start=k0 + i, start_t=int(ticks[i]), max=float(seg.max()), pair=pair)
            elif seg.max() > self._run["max"]:
                self._run.update(max=float(seg.max()), pair=pair)
            self._run.update(end=k0 + j - 1, end_t=int(ticks[j - 1]))
            i = j
        return closed

    @property
    def open_run(self) -> dict | None:
        """The run still open (JSON-able), part of the aligner's state."""
        if self._run is None:
            return None
        r = self._run
        return dict(start=int(r["start"]), start_t=int(r["start_t"]), end=int(r["end"]), end_t=int(r["end_t"]),
                    max=float(r["max"]), pair=[str(x) for x in r["pair"]])

    @open_run.setter
    def open_run(self, run: dict | None) -> None:
        self._run = None if run is None else dict(run)

    def close(self) -> list[dict]:
        """Close the open run: its alarm row if long enough (none otherwise)."""
        run, self._run = self._run, None
        if run is None or run["end"] - run["start"] + 1 < self.min_ticks:
            return []
        return [dict(session_id=self.session_id, start_tick=run["start"], end_tick=run["end"],
                     start_t_ns=run["start_t"], end_t_ns=run["end_t"], max_residual_ms=run["max"] / 1e6,
                     sources=run["pair"])]


def drift_segments(
    session_id: str, ticks: np.ndarray, spread_ns: np.ndarray, threshold_ns: float, min_ticks: int, sources: list[str]
) -> list[dict]:
    """Alarm rows for runs of at least ``min_ticks`` ticks with ``spread_ns`` above threshold (batch helper)."""
    over = np.nan_to_num(spread_ns, nan=0.0) > threshold_ns
    rows = []
    k, n = 0, len(over)
    while k < n:
        if not over[k]:
            k += 1
            continue
        j = k
        while j < n and over[j]:
            j += 1
        if j - k >= min_ticks:
            rows.append(dict(
                session_id=session_id, start_tick=k, end_tick=j - 1, start_t_ns=int(ticks[k]),
                end_t_ns=int(ticks[j - 1]), max_residual_ms=float(np.max(spread_ns[k:j]) / 1e6), sources=sources,
            ))
        k = j
    return rows
