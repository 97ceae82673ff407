"""Tick aligner: puts every source's events of one session on one tick timeline.

Sits after ingest+de-identification and before embedding. Input is metadata only (event
ids and session-clock ``t_ns``; payload stays in the de-identified segments), output is:

- ``records``: one row per tick x source with the matched event (or a gap) and its
  residual ``event_t_ns - tick_t_ns``;
- ``ctal``: one row per non-clean decision (a gap today; late/interpolated when streaming);
- ``ctal_summary``: residual percentiles and gap counts per source;
- ``drift_alarms``: max pairwise residual above the threshold for N consecutive ticks.

Matching rules (DESIGN.md "Alignment"): point events (video frames, MFCC frames) match
the nearest event within the modality's tolerance, each event at most once (the nearest
tick wins, ties to the earlier tick); outside tolerance is a gap, never a silent nearest
match. PDF pages are intervals held until the next page (residual 0 inside); a tick that
no page covers sees a page starting within the tolerance (residual = start - tick).

This version accumulates a session's event times and decides at ``finish()``; the
memory is ~16 bytes per event (metadata only).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from operators.base import Operator
from pipeline.errors import InputError
from schemas.arrow import rows_to_table
from schemas.config import AlignConfig
from schemas.manifest import ClockMapping
from schemas.tables import CtalRow, CtalSummaryRow, DriftAlarmRow, RecordRow

NS_PER_S = 1_000_000_000


@dataclass
class _Stream:
    source_id: str
    modality: str
    lineage: dict[str, Any]
    clock: ClockMapping
    latency_ms: float = 0.0
    t: list[np.ndarray] = field(default_factory=list)
    end: list[np.ndarray] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)


@dataclass
class AlignResult:
    records: pa.Table
    ctal: pa.Table
    summary: pa.Table
    alarms: pa.Table
    ticks: int


def tick_times(n_ticks: int, tick_hz: float) -> np.ndarray:
    """Exact tick times ``floor(k * 1e9 / tick_hz)`` for k in [0, n_ticks)."""
    rate = Fraction(tick_hz).limit_denominator(1_000_000)
    k = np.arange(n_ticks, dtype=np.int64)
    return (k * (NS_PER_S * rate.denominator)) // rate.numerator


def match_points(ticks: np.ndarray, events: np.ndarray, tol_ns: int) -> np.ndarray:
    """Index of the event matched to each tick, or -1; each event matched at most once.

    ``events`` must be sorted. A tick takes its nearest event if within ``tol_ns``; if
    several ticks want one event, the nearest tick (earliest on a tie) keeps it.
    """
    out = np.full(len(ticks), -1, dtype=np.int64)
    if len(events) == 0 or len(ticks) == 0:
        return out
    pos = np.searchsorted(events, ticks)
    left = np.clip(pos - 1, 0, len(events) - 1)
    right = np.clip(pos, 0, len(events) - 1)
    dl = np.abs(ticks - events[left])
    dr = np.abs(events[right] - ticks)
    nearest = np.where(dr < dl, right, left)
    dist = np.minimum(dl, dr)
    ok = dist <= tol_ns
    cand = np.flatnonzero(ok)
    if len(cand) == 0:
        return out
    # Uniqueness: sort candidates by (event, distance, tick) and keep the first per event.
    order = np.lexsort((cand, dist[cand], nearest[cand]))
    cand = cand[order]
    ev = nearest[cand]
    first = np.ones(len(cand), dtype=bool)
    first[1:] = ev[1:] != ev[:-1]
    out[cand[first]] = ev[first]
    return out


def match_intervals(ticks: np.ndarray, starts: np.ndarray, ends: np.ndarray, tol_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample-and-hold pages: (page index or -1, residual_ns) per tick.

    A tick inside [start, end) sees that page with residual 0. A tick shown no page (before
    the first page, or in a hole of the schedule) sees the next page if it starts within
    ``tol_ns``, with residual ``start - tick``; otherwise it is a gap.
    """
    idx = np.full(len(ticks), -1, dtype=np.int64)
    res = np.zeros(len(ticks), dtype=np.int64)
    if len(starts) == 0:
        return idx, res
    held = np.searchsorted(starts, ticks, side="right") - 1
    p = np.clip(held, 0, len(starts) - 1)
    inside = (held >= 0) & (ticks < ends[p])
    idx[inside] = p[inside]
    nxt = np.clip(held + 1, 0, len(starts) - 1)
    early = ~inside & (held + 1 < len(starts)) & (starts[nxt] - ticks <= tol_ns)
    idx[early] = nxt[early]
    res[early] = starts[nxt[early]] - ticks[early]
    return idx, res


class TickAligner(Operator[AlignConfig]):
    """One per session: ``add`` event batches per source, then ``finish``."""

    kind = "tick_aligner"
    version = "0.1.0"
    config_model = AlignConfig

    def __init__(self, session_id: str, config: AlignConfig | None = None) -> None:
        super().__init__(config)
        self.session_id = session_id
        self.trace_id = uuid.uuid4().hex
        self._streams: dict[str, _Stream] = {}

    def register(self, source_id: str, modality: str, lineage: dict[str, Any], clock: ClockMapping) -> None:
        """Declare a source before its events arrive; ``lineage`` fills RecordRow's lineage columns."""
        if modality not in self.config.tolerance_ms:
            raise InputError(f"no tolerance configured for modality {modality!r}", source_uri=lineage.get("source_uri"))
        self._streams[source_id] = _Stream(source_id, modality, dict(lineage), clock)

    def add(self, source_id: str, events: pa.Table, latency_ms: float = 0.0) -> None:
        """Add events (columns ``event_id``, ``t_ns``, and ``end_t_ns`` for pdf) of a registered source."""
        s = self._streams[source_id]
        s.latency_ms = max(s.latency_ms, latency_ms)
        if events.num_rows == 0:
            return
        s.t.append(events.column("t_ns").to_numpy().astype(np.int64, copy=False))
        s.ids.append(np.asarray(events.column("event_id").to_pylist(), dtype=object))
        if s.modality == "pdf":
            end = pc.fill_null(events.column("end_t_ns"), np.iinfo(np.int64).max)  # last page: held to the end
            s.end.append(end.to_numpy().astype(np.int64, copy=False))

    def _collect(self, s: _Stream) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if not s.t:
            return np.zeros(0, np.int64), np.zeros(0, object), (np.zeros(0, np.int64) if s.modality == "pdf" else None)
        t = np.concatenate(s.t)
        ids = np.concatenate(s.ids)
        end = np.concatenate(s.end) if s.modality == "pdf" else None
        if s.modality == "pdf":
            # One interval per page: blocks of a page share (t_ns, end_t_ns); keep the first block's id.
            _, first = np.unique(t, return_index=True)
            t, ids, end = t[first], ids[first], end[first]
        order = np.argsort(t, kind="stable")
        return t[order], ids[order], (end[order] if end is not None else None)

    def session_end_ns(self) -> int:
        """End of the session timeline: the last point event (pages do not extend it)."""
        ends = [int(np.max(np.concatenate(s.t))) + 1 for s in self._streams.values() if s.t and s.modality != "pdf"]
        if not ends:
            ends = [int(np.max(np.concatenate(s.t))) + 1 for s in self._streams.values() if s.t]
        return max(ends, default=0)

    def finish(self) -> AlignResult:
        cfg = self.config
        end_ns = self.session_end_ns()
        rate = Fraction(cfg.tick_hz).limit_denominator(1_000_000)
        n_ticks = int(-(-end_ns * rate.numerator // (NS_PER_S * rate.denominator))) if end_ns > 0 else 0
        ticks = tick_times(n_ticks, cfg.tick_hz)

        records: dict[str, list] = {name: [] for name in RecordRow.model_fields}
        residuals: dict[str, np.ndarray] = {}
        matched_masks: dict[str, np.ndarray] = {}
        summary_rows = []
        for s in self._streams.values():
            tol = int(round(cfg.tolerance_ms[s.modality] * 1_000_000))
            t, ids, end = self._collect(s)
            if s.modality == "pdf":
                idx, res = match_intervals(ticks, t, end, tol)
            else:
                idx = match_points(ticks, t, tol)
                res = np.where(idx >= 0, t[np.clip(idx, 0, max(len(t) - 1, 0))] - ticks if len(t) else 0, 0)
            ok = idx >= 0
            residuals[s.source_id] = res
            matched_masks[s.source_id] = ok
            ev_t = np.where(ok, ticks + res, 0)
            for col, val in s.lineage.items():
                records[col].extend([val] * n_ticks)
            records["tick_index"].extend(range(n_ticks))
            records["t_ns"].extend(ticks.tolist())
            records["modality"].extend([s.modality] * n_ticks)
            records["event_id"].extend([ids[i] if i >= 0 else None for i in idx.tolist()])
            records["event_t_ns"].extend([int(e) if m else None for e, m in zip(ev_t.tolist(), ok.tolist())])
            records["residual_ns"].extend([int(r) if m else None for r, m in zip(res.tolist(), ok.tolist())])
            records["decision"].extend(["matched" if m else "gap" for m in ok.tolist()])
            summary_rows.append(self._summary(s, res[ok], int(ok.sum()), n_ticks))

        ctal_rows = self._ctal(ticks, residuals, matched_masks)
        alarm_rows = self._drift(ticks, residuals, matched_masks)
        return AlignResult(
            records=pa.Table.from_pydict(records, schema=RecordRow.schema()),
            ctal=rows_to_table(CtalRow, ctal_rows),
            summary=rows_to_table(CtalSummaryRow, summary_rows),
            alarms=rows_to_table(DriftAlarmRow, alarm_rows),
            ticks=n_ticks,
        )

    def _summary(self, s: _Stream, res: np.ndarray, matched: int, n_ticks: int) -> dict:
        ms = np.abs(res) / 1e6
        return dict(
            session_id=self.session_id, source_id=s.source_id, modality=s.modality, ticks=n_ticks,
            matched=matched, gaps=n_ticks - matched,
            residual_p50_ms=float(np.percentile(ms, 50)) if len(ms) else None,
            residual_p95_ms=float(np.percentile(ms, 95)) if len(ms) else None,
            residual_max_ms=float(ms.max()) if len(ms) else None,
            offset_ns=s.clock.offset_ns, skew_ppm=s.clock.skew_ppm,
            offset_method="estimated" if s.clock.estimated else "manifest",
        )

    def _ctal(self, ticks: np.ndarray, residuals: dict, masks: dict) -> list[dict]:
        streams = list(self._streams.values())
        mods = [f"{s.modality}:{s.source_id}" for s in streams]
        lat = [float(s.latency_ms) for s in streams]
        rows = []
        if not streams:
            return rows
        ok = np.stack([masks[s.source_id] for s in streams])
        res = np.stack([residuals[s.source_id] for s in streams])
        for k in np.flatnonzero(~ok.all(axis=0)).tolist():
            missing = [streams[i].source_id for i in range(len(streams)) if not ok[i, k]]
            rows.append(dict(
                event_id=f"{self.session_id}/ctal/{k}", trace_id=self.trace_id, session_id=self.session_id,
                stage="align", tick_index=k, aligned_t_ns=int(ticks[k]), modalities=mods,
                observed_offsets_ns=[int(res[i, k]) if ok[i, k] else None for i in range(len(streams))],
                decision="gap", reason="no event within tolerance: " + ",".join(missing), latency_ms=lat,
            ))
        return rows

    def _drift(self, ticks: np.ndarray, residuals: dict, masks: dict) -> list[dict]:
        cfg = self.config
        ids = list(residuals)
        if len(ids) < 2 or len(ticks) == 0:
            return []
        res = np.stack([residuals[i] for i in ids]).astype(np.float64)
        ok = np.stack([masks[i] for i in ids])
        res[~ok] = np.nan
        spread = np.nanmax(res, axis=0) - np.nanmin(res, axis=0)  # max pairwise |a - b|
        spread = np.where(ok.sum(axis=0) >= 2, spread, 0.0)
        return drift_segments(
            self.session_id, ticks, spread, cfg.drift_threshold_ms * 1e6, cfg.drift_consecutive_ticks, ids
        )


def drift_segments(
    session_id: str, ticks: np.ndarray, spread_ns: np.ndarray, threshold_ns: float, min_ticks: int, sources: list[str]
) -> list[dict]:
    """Alarm rows for runs of at least ``min_ticks`` ticks with ``spread_ns`` above threshold."""
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
