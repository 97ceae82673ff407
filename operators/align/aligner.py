"""Tick aligner: puts every source's events of one session on one tick timeline, streaming.

Sits after ingest+de-identification and before embedding (one stateful object per
session, inside the pipeline's aligner actor). Input is metadata only: event ids and
session-clock ``t_ns`` (and ``end_t_ns`` of PDF pages). The payload (frames, MFCCs, text)
stays in the de-identified segments and is never copied here: ``t_ns`` is read zero-copy
from the Arrow column, the id strings are the only thing held per event, and records
refer to events by id. Output:

- ``records``: one row per tick x source with the matched event (or a gap) and its
  residual ``event_t_ns - tick_t_ns``; rows in tick order, sources by id within a tick;
- ``ctal``: one row per non-clean decision: ``gap`` (a source has no event within its
  tolerance), ``late`` (an event arrived after the ticks it could belong to were
  emitted; it is logged and never matched), ``out_of_tolerance`` (matched, but the
  measured clock offsets of the sources disagree by more than the drift threshold);
- ``ctal_summary``: per source residual percentiles, gap counts, the clock mapping used
  and whether it came from the manifest or was estimated;
- ``drift_alarms``: the drift signal above the threshold for N consecutive ticks.

Matching rules (nearest point event within tolerance, each event once; PDF pages held
until the next page) are ``modalign.operators.align.matching``. Events with equal ``t_ns``
are ordered by id; blocks of one page are one page event (the smallest block id names it).

Streaming (event time): events arrive in batches, any source, any order. Each source has
a watermark, ``max t_ns seen - allowed_lateness`` (or raised by ``advance_watermark``,
or +inf after ``finish_source``). A tick's decision for a point source depends only on
that source's events within 3 tolerances of it (the nearest event lies within one
tolerance, and the ticks competing for that event look one more tolerance further), and
for a page source on the pages starting up to one tolerance after it. So tick ``k`` is
decided, emitted by ``poll()`` and never revised, once every registered source's
watermark is past ``t_k + horizon`` (``3 * tol`` for points, ``tol`` for pages). An event
that arrives inside the horizon of an already emitted tick is *late*: logged in CTAL,
not used. Every event that respects the lateness bound (``t_ns >=`` its source's
watermark when it arrives) is used, and then the output is identical, row for row, to
one in-order batch whatever the arrival order, batch sizes and ``poll`` timing. Only
events within the horizon of undecided ticks are kept (plus the page on show), so memory
is bounded by the lateness window and the batch size, not by the session length; with
``retain=False`` the emitted tables are handed out by ``poll()`` and not kept either.
Residual percentiles come from a fixed 10 us histogram per source for the same reason.
``state()`` / ``from_state()`` carry that streaming state (ids, times, counters; no payload)
as JSON-able values, so a caller can checkpoint after a ``poll()`` and continue elsewhere.

Drift (``modalign.operators.align.drift``): the largest pairwise difference of the
sources' measured-minus-mapped clock offsets, from ``observe_offsets``.

Around the ``TickAligner`` class: ``ticks`` (the tick grid), ``source_state`` (per-source
buffers, watermark and summary accumulators), ``rows`` (records, CTAL and summary tables).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from modalign.operators.align.drift import DriftRuns, drift_signal
from modalign.operators.align.matching import match_intervals, match_points
from modalign.operators.align.rows import CtalRows, RecordChunks, concat_tables, model_table, summary_row
from modalign.operators.align.source_state import SourceState
from modalign.operators.align.ticks import TickGrid
from modalign.operators.base import Operator
from modalign.schemas.errors import ConfigError, InputError
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import AlignConfig
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import CtalRow, CtalSummaryRow, DriftAlarmRow, RecordRow
from modalign.schemas.units import NS_PER_MS

DEFAULT_ALLOWED_LATENESS_MS = 2000.0
CHUNK_TICKS = 8192  # ticks decided per step: bounds temporary arrays
_INF = float("inf")
STATE_VERSION = 1  # of ``TickAligner.state()``


@dataclass
class AlignResult:
    """The whole session (or, with ``retain=False``, what ``poll()`` had not yet handed out)."""

    records: pa.Table
    ctal: pa.Table
    summary: pa.Table
    alarms: pa.Table
    ticks: int


@dataclass
class AlignBatch:
    """Ticks ``[tick_start, tick_end)`` decided since the previous ``poll()``, and closed alarms."""

    records: pa.Table
    ctal: pa.Table
    alarms: pa.Table
    tick_start: int
    tick_end: int


class TickAligner(Operator[AlignConfig]):
    """One per session: ``register`` sources, ``add`` event batches, ``poll`` decided ticks, ``finish``.

    Used as a batch aligner (register, add everything, finish) it gives the same output as
    any streamed arrival order within the lateness bound.
    """

    kind = "tick_aligner"
    version = "0.2.0"
    config_model = AlignConfig

    def __init__(
        self,
        session_id: str,
        config: AlignConfig | None = None,
        *,
        allowed_lateness_ms: float | None = None,
        retain: bool = True,
        idle_timeout_s: float | None = None,
        trace_id: str | None = None,
        expected_sources: Iterable[str] = (),
    ) -> None:
        """``allowed_lateness_ms``: default ``config.allowed_lateness_ms`` if the config has it,
        else 2000 ms. ``retain``: keep emitted tables so ``finish()`` returns the whole
        session (False: ``finish()`` returns only what ``poll()`` has not handed out).
        ``idle_timeout_s``: a source that adds nothing for this long (wall clock, checked by
        ``poll``) is treated as finished; this trades determinism for liveness, so it is off
        by default. ``expected_sources``: see ``expect_sources``."""
        super().__init__(config)
        self.session_id = session_id
        self.trace_id = trace_id or uuid.uuid4().hex
        lateness = allowed_lateness_ms if allowed_lateness_ms is not None else getattr(
            self.config, "allowed_lateness_ms", DEFAULT_ALLOWED_LATENESS_MS)
        if lateness < 0:
            raise ConfigError(f"allowed_lateness_ms must be >= 0, got {lateness}")
        self.allowed_lateness_ns = int(round(lateness * NS_PER_MS))
        self.retain = retain
        self.idle_timeout_s = idle_timeout_s
        self.grid = TickGrid(self.config.tick_hz)
        self._sources: dict[str, SourceState] = {}
        self._expected: set[str] = set(expected_sources)
        self._next_tick = 0  # first tick not yet emitted
        self._pending_ctal: list[pa.Table] = []  # CTAL tables since the last poll
        self._pending_records: list[pa.Table] = []
        self._pending_alarms: list[dict] = []
        self._pending_start = 0
        self._kept_records: list[pa.Table] = []
        self._kept_ctal: list[pa.Table] = []
        self._kept_alarms: list[dict] = []
        self._records = RecordChunks(session_id, CHUNK_TICKS)
        self._ctal = CtalRows(session_id, self.trace_id)
        self._drift_runs = DriftRuns(session_id, self.config.drift_threshold_ms, self.config.drift_consecutive_ticks)
        self._finished = False

    # --- set-up ----------------------------------------------------------------------------

    def expect_sources(self, source_ids: Iterable[str]) -> None:
        """Declare the session's sources up front: no tick is emitted until all are registered.

        A source registered after ticks were emitted would miss rows for them, so streaming
        callers declare the manifest's sources before the first ``poll``."""
        self._expected.update(source_ids)

    def register(self, source_id: str, modality: str, lineage: dict[str, Any], clock: ClockMapping) -> None:
        """Declare a source before its events arrive; ``lineage`` fills RecordRow's lineage columns.

        Registering again (a retried call) updates lineage and clock; the modality must match."""
        uri = lineage.get("source_uri")
        if modality not in self.config.tolerance_ms:
            raise InputError(f"no tolerance configured for modality {modality!r}", source_uri=uri, stage="align")
        old = self._sources.get(source_id)
        if old is not None:
            if old.modality != modality:
                raise InputError(f"source {source_id!r} registered as {old.modality} and {modality}",
                                 source_uri=uri, stage="align", code="source_conflict")
            old.lineage, old.clock, old.obs_cache = dict(lineage), clock, None
            self._records.reset()
            return
        if self._next_tick > 0:
            raise InputError(
                f"source {source_id!r} registered after ticks 0..{self._next_tick - 1} were emitted; "
                "declare every source first with expect_sources()", source_uri=uri, stage="align", code="late_source")
        tol = int(round(self.config.tolerance_ms[modality] * NS_PER_MS))
        self._sources[source_id] = SourceState.new(source_id, modality, lineage, clock, tol_ns=tol,
                                                   tick_period_ns=self.grid.period_ns, last_add=time.monotonic())
        self._sources = dict(sorted(self._sources.items()))  # output order: by source id
        self._records.reset()

    # --- input -----------------------------------------------------------------------------

    def add(self, source_id: str, events: pa.Table, latency_ms: float = 0.0) -> int:
        """Add events (columns ``event_id``, ``t_ns``, and ``end_t_ns`` for pdf) of a registered source.

        Returns how many were accepted; the others were late (logged in CTAL)."""
        s = self._source(source_id)
        s.latency_ms = max(s.latency_ms, float(latency_ms))
        s.last_add = time.monotonic()
        n = events.num_rows
        if n == 0:
            return 0
        if self._finished:
            raise InputError("events added after finish()", source_uri=s.lineage.get("source_uri"), stage="align")
        t = _int64(events.column("t_ns"))
        ids = events.column("event_id").to_numpy(zero_copy_only=False)
        if s.is_pdf:
            end = _int64(pc.fill_null(events.column("end_t_ns"), np.iinfo(np.int64).max))  # last page: held to the end
        else:
            end = None
        tmax = int(t.max())
        s.max_t = tmax if s.max_t is None else max(s.max_t, tmax)
        accepted = n
        if self._next_tick > 0:
            # Inside the horizon of an emitted tick: using it could change a decision already out.
            late = t <= self.grid.time(self._next_tick - 1) + s.horizon_ns
            if late.any():
                logged = late & ~np.isin(t, s.t) if s.is_pdf else late  # more blocks of a page on show: not events
                if logged.any():
                    self._log_late(s, t[logged], ids[logged])
                keep = ~late
                t, ids = t[keep], ids[keep]
                end = end[keep] if end is not None else None
                accepted = int(keep.sum())
        if len(t):
            s.pend.append((t, ids, end))
        return accepted

    def advance_watermark(self, source_id: str, t_ns: int) -> None:
        """Promise that ``source_id`` sends no more events before ``t_ns`` (watermarks never go back)."""
        s = self._source(source_id)
        s.explicit_wm = max(s.explicit_wm, float(t_ns))

    def expect_until(self, source_id: str, end_ns: int) -> None:
        """The recording of ``source_id`` runs until ``end_ns`` (session time) although its events
        stop earlier (it was cut short): the timeline extends to there, and every tick after
        its last event is a gap of this source in the records and the CTAL log."""
        s = self._source(source_id)
        s.expected_end = max(s.expected_end or end_ns, end_ns)

    def finish_source(self, source_id: str) -> None:
        """No more events from ``source_id``: its watermark becomes +inf."""
        self._source(source_id).finished = True

    def observe_offsets(self, source_id: str, windows: Iterable[tuple[int, int, float]], *,
                        min_confidence: float = 0.0, median_of: int = 3) -> int:
        """Measured clock offsets of a source: ``(t_ns, observed_offset_ns, confidence)`` per window.

        ``t_ns`` is the session time of the window centre and ``observed_offset_ns`` the
        measured ``t_session - t_local`` there (``OffsetEstimate.windows``). Windows with
        confidence <= ``min_confidence`` are ignored; a running median over ``median_of``
        consecutive windows removes isolated wrong peaks (a linear drift passes unchanged).
        Ticks already emitted keep the drift they were decided with, so call this before
        the source's events flow (the estimate exists before ingest starts). Returns the
        number of windows kept."""
        kept = [(int(t), int(o)) for t, o, c in windows if c > min_confidence]
        self._source(source_id).add_offsets(kept, median_of)
        return len(kept)

    # --- output ----------------------------------------------------------------------------

    def watermark(self, source_id: str) -> float:
        """Current watermark of a source (ns; +inf when finished, -inf before any event)."""
        return self._watermark(self._source(source_id))

    def buffered_events(self) -> int:
        """Events held in memory across all sources (the streaming state)."""
        return sum(s.buffered() for s in self._sources.values())

    def poll(self, now: float | None = None) -> AlignBatch:
        """Decide every tick that all watermarks allow and return what was decided since the last poll."""
        if self.idle_timeout_s is not None:
            now = time.monotonic() if now is None else now
            for s in self._sources.values():
                if not s.finished and now - s.last_add > self.idle_timeout_s:
                    s.finished = s.timed_out = True
        self._emit(final=False)
        return self._take_pending()

    def ready_ticks(self) -> int:
        """How many ticks ``poll()`` would decide now (nothing is decided)."""
        return max(0, self._decidable(final=False)[0] - self._next_tick)

    @property
    def next_tick(self) -> int:
        """The first tick not yet decided (= ticks emitted so far)."""
        return self._next_tick

    def state(self) -> dict[str, Any]:
        """The streaming state as JSON-able values (ids, times, counters; no payload), taken
        right after a ``poll()``: what ``from_state`` needs to continue exactly from here.

        Only for ``retain=False`` aligners (kept tables are output, not state)."""
        if self.retain:
            raise ValueError("state() is for retain=False aligners: their output was handed out by poll()")
        if self._pending_records or self._pending_ctal or self._pending_alarms:
            raise ValueError("state() with decided ticks not yet handed out: call poll() first")
        return dict(
            version=STATE_VERSION, session_id=self.session_id, trace_id=self.trace_id,
            allowed_lateness_ns=self.allowed_lateness_ns, next_tick=self._next_tick, expected=sorted(self._expected),
            finished=self._finished, late_seq=self._ctal.late_seq, drift_run=self._drift_runs.open_run,
            sources=[s.state() for s in self._sources.values()],
        )

    @classmethod
    def from_state(cls, state: dict[str, Any], config: AlignConfig | None = None) -> "TickAligner":
        """A ``retain=False`` aligner continuing from ``state()`` (same config as when it was taken)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"aligner state version {state.get('version')!r}, expected {STATE_VERSION}")
        al = cls(state["session_id"], config, allowed_lateness_ms=state["allowed_lateness_ns"] / NS_PER_MS,
                 retain=False, trace_id=state["trace_id"], expected_sources=state["expected"])
        al.allowed_lateness_ns = int(state["allowed_lateness_ns"])
        now = time.monotonic()
        al._sources = {s["source_id"]: SourceState.from_state(s, last_add=now) for s in state["sources"]}
        al._next_tick = al._pending_start = int(state["next_tick"])
        al._finished = bool(state["finished"])
        al._ctal.late_seq = int(state["late_seq"])
        al._drift_runs.open_run = state["drift_run"]
        return al

    def finish(self) -> AlignResult:
        """Decide the remaining ticks (every source is treated as finished) and return the session."""
        if not self._finished:
            for s in self._sources.values():
                s.finished = True
            self._emit(final=True)
            self._push_alarms(self._drift_runs.close())
            self._finished = True
        rest = self._take_pending()
        if self.retain:
            records = concat_tables(self._kept_records, RecordRow)
            ctal = concat_tables(self._kept_ctal, CtalRow)
            alarms = model_table(DriftAlarmRow, self._kept_alarms)
        else:
            records, ctal, alarms = rest.records, rest.ctal, rest.alarms
        summary = rows_to_table(CtalSummaryRow, [summary_row(self.session_id, s, self._next_tick)
                                                 for s in self._sources.values()])
        return AlignResult(records=records, ctal=ctal, summary=summary, alarms=alarms, ticks=self._next_tick)

    def session_end_ns(self, final: bool = True) -> int:
        """End of the session timeline: the last point event + 1, or where a cut-short source
        should have ended (pages extend it only when no point source has events)."""
        points = [t for s in self._sources.values() if not s.is_pdf
                  for t in (s.max_t, None if s.expected_end is None else s.expected_end - 1) if t is not None]
        if points:
            return max(points) + 1
        if final or all(s.is_pdf for s in self._sources.values()):
            pages = [s.max_t for s in self._sources.values() if s.max_t is not None]
            return max(pages) + 1 if pages else 0
        return 0

    # --- internals -------------------------------------------------------------------------

    def _source(self, source_id: str) -> SourceState:
        try:
            return self._sources[source_id]
        except KeyError:
            raise InputError(f"source {source_id!r} is not registered with the aligner", stage="align") from None

    def _watermark(self, s: SourceState) -> float:
        return s.watermark(self.allowed_lateness_ns)

    def _decidable(self, final: bool) -> tuple[int, int]:
        """(end of the ticks decidable now, the timeline's tick count so far); end <= next tick: none."""
        if not self._sources or (not final and not self._expected.issubset(self._sources)):
            return self._next_tick, 0
        n_cap = self.grid.count_below(self.session_end_ns(final=final))
        if final:
            return n_cap, n_cap
        limit = min(self._watermark(s) - s.horizon_ns for s in self._sources.values())
        all_done = all(s.finished for s in self._sources.values())
        k_lim = n_cap if limit == _INF else min(self.grid.count_below(limit), n_cap)
        # Unless the session end is final, leave room for the neighbouring ticks a point
        # match looks at: they must exist in the final timeline too.
        ctx = max((s.ctx_ticks for s in self._sources.values()), default=0)
        return (k_lim if all_done else min(k_lim, n_cap - ctx)), n_cap

    def _emit(self, final: bool) -> None:
        k_end, n_cap = self._decidable(final)
        if k_end <= self._next_tick:
            return
        for s in self._sources.values():
            s.merge()
        for k0 in range(self._next_tick, k_end, CHUNK_TICKS):
            self._decide(k0, min(k_end, k0 + CHUNK_TICKS), n_cap)
        self._next_tick = k_end
        t_next = self.grid.time(k_end)
        for s in self._sources.values():
            s.evict(t_next)

    def _decide(self, k0: int, k1: int, n_cap: int) -> None:
        ticks = self.grid.times(k0, k1)
        K, srcs = k1 - k0, list(self._sources.values())
        S = len(srcs)
        ok = np.zeros((K, S), bool)
        res = np.zeros((K, S), np.int64)
        evid = np.empty((K, S), object)
        c = max(s.ctx_ticks for s in srcs)
        lo_all, hi_all = max(0, k0 - c), min(n_cap, k1 + c)
        ctx_ticks = self.grid.times(lo_all, hi_all) if c else ticks
        for j, s in enumerate(srcs):
            if s.is_pdf:
                idx, r = match_intervals(ticks, s.t, s.end, s.tol_ns)
            else:
                lo, hi = max(0, k0 - s.ctx_ticks), min(n_cap, k1 + s.ctx_ticks)
                idx = match_points(ctx_ticks[lo - lo_all:hi - lo_all], s.t, s.tol_ns)[k0 - lo:k1 - lo]
                r = s.t[np.maximum(idx, 0)] - ticks if len(s.t) else np.zeros(K, np.int64)
            m = idx >= 0
            n_m = int(np.count_nonzero(m))
            s.matched += n_m
            s.gaps += K - n_m
            if n_m == K:  # the common case: every tick matched
                ok[:, j], res[:, j], evid[:, j] = True, r, s.ids[idx]
                a = np.abs(r)
            elif n_m:
                ok[:, j] = m
                res[m, j] = r[m]
                evid[m, j] = s.ids[idx[m]]
                a = np.abs(r[m])
            if n_m:
                s.count_residuals(a)
        table = self._records.table(srcs, k0, ticks, ok, res, evid)
        self._pending_records.append(table)
        if self.retain:
            self._kept_records.append(table)
        self._push_ctal(self._ctal.gaps(srcs, k0, ticks, ok, res))
        self._drift(srcs, k0, ticks)

    def _push_ctal(self, table: pa.Table | None) -> None:
        if table is not None and table.num_rows:
            self._pending_ctal.append(table)
            if self.retain:
                self._kept_ctal.append(table)

    def _log_late(self, s: SourceState, t: np.ndarray, ids: np.ndarray) -> None:
        """CTAL rows for events of ``s`` that arrived too late, at the emitted tick nearest each."""
        k = np.array([min(self.grid.nearest(int(x)), self._next_tick - 1) for x in t.tolist()], np.int64)
        tk = np.array([self.grid.time(int(x)) for x in k.tolist()], np.int64)
        s.late += len(t)
        self._push_ctal(self._ctal.late(list(self._sources.values()), s, t, ids, k, tk, self._watermark(s),
                                        self.allowed_lateness_ns))

    # --- drift -----------------------------------------------------------------------------

    def _drift(self, srcs, k0, ticks) -> None:
        if len(srcs) < 2:
            return
        signal = drift_signal(srcs, ticks)
        if signal is None:
            self._push_alarms(self._drift_runs.close())
            return
        mat, spread = signal
        self._push_ctal(self._ctal.drift(srcs, k0, ticks, mat, spread, self.config.drift_threshold_ms))
        self._push_alarms(self._drift_runs.update(k0, ticks, spread, mat, [s.source_id for s in srcs]))

    def _push_alarms(self, rows: list[dict]) -> None:
        self._pending_alarms.extend(rows)
        if self.retain:
            self._kept_alarms.extend(rows)

    # --- results ---------------------------------------------------------------------------

    def _take_pending(self) -> AlignBatch:
        out = AlignBatch(
            records=concat_tables(self._pending_records, RecordRow),
            ctal=concat_tables(self._pending_ctal, CtalRow),
            alarms=model_table(DriftAlarmRow, self._pending_alarms),
            tick_start=self._pending_start, tick_end=self._next_tick,
        )
        self._pending_records, self._pending_ctal, self._pending_alarms = [], [], []
        self._pending_start = self._next_tick
        return out


def _int64(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
