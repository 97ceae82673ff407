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

Matching rules (DESIGN.md "Alignment"): point events (video frames, MFCC frames) match
the nearest event within the modality's tolerance, each event at most once (the nearest
tick wins, ties to the earlier tick); outside tolerance is a gap, never a silent nearest
match. PDF pages are intervals held until the next page (residual 0 inside); a tick that
no page covers sees a page starting within the tolerance (residual = start - tick).
Events with equal ``t_ns`` are ordered by id; blocks of one page are one page event
(the smallest block id names it).

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

Drift: tolerance matching bounds residuals by the tolerance, so drift is measured from
the sources' audio: ``observe_offsets`` takes per-window observed clock offsets (from
``modalign.operators.align.offset``); per tick, a source's *residual offset* is the observed
offset (linearly interpolated between windows, held beyond them) minus the offset its
clock mapping applies there (0 for a source without observations). The drift signal is
the largest pairwise difference of these residuals. A positive residual means the
source's events belong later on the session clock than the mapping put them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from modalign.operators.align.clock import SessionClock
from modalign.operators.base import Operator
from modalign.schemas.errors import ConfigError, InputError
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import AlignConfig
from modalign.schemas.manifest import ClockMapping
from modalign.schemas.tables import CtalRow, CtalSummaryRow, DriftAlarmRow, LineageColumns, RecordRow

NS_PER_S = 1_000_000_000
DEFAULT_ALLOWED_LATENESS_MS = 2000.0
HIST_BIN_NS = 10_000  # residual histogram bin: 10 us
CHUNK_TICKS = 8192  # ticks decided per step: bounds temporary arrays
_INF = float("inf")
_RECORD_SCHEMA = RecordRow.schema()
_NEG_INF = float("-inf")


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


def match_points(ticks: np.ndarray, events: np.ndarray, tol_ns: int) -> np.ndarray:
    """Index of the event matched to each tick, or -1; each event matched at most once.

    ``events`` must be sorted. A tick takes its nearest event if within ``tol_ns``; if
    several ticks want one event, the nearest tick (earliest on a tie) keeps it.
    """
    out = np.full(len(ticks), -1, dtype=np.int64)
    if len(events) == 0 or len(ticks) == 0:
        return out
    pos = np.searchsorted(events, ticks)
    left = np.maximum(pos - 1, 0)
    right = np.minimum(pos, len(events) - 1)
    dl = np.abs(ticks - events[left])
    dr = np.abs(events[right] - ticks)
    nearest = np.where(dr < dl, right, left)
    dist = np.minimum(dl, dr)
    cand = np.flatnonzero(dist <= tol_ns)
    if len(cand) == 0:
        return out
    ev = nearest[cand]
    if len(ev) == 1 or not np.any(ev[1:] == ev[:-1]):  # sorted ticks: a shared event is adjacent
        out[cand] = ev
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


@dataclass
class _Source:
    source_id: str
    modality: str
    lineage: dict[str, Any]
    clock: ClockMapping
    tol_ns: int
    horizon_ns: int  # decisions of tick t depend on this source's events up to t + horizon
    ctx_ticks: int  # neighbouring ticks that can compete with a tick for an event
    hist_bins: int
    t: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted buffer
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pend: list = field(default_factory=list)  # (t, ids, end) chunks not yet merged
    max_t: int | None = None
    explicit_wm: float = _NEG_INF
    finished: bool = False
    timed_out: bool = False
    last_add: float = 0.0
    latency_ms: float = 0.0
    matched: int = 0
    gaps: int = 0
    late: int = 0
    res_max_ns: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hist_pend: list = field(default_factory=list)  # |residual| arrays not yet binned (bounded)
    hist_pend_n: int = 0
    obs_raw: list = field(default_factory=list)  # (t_ns, observed_offset_ns) kept windows, by time
    median_of: int = 3
    obs_cache: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def is_pdf(self) -> bool:
        return self.modality == "pdf"


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
        self.allowed_lateness_ns = int(round(lateness * 1_000_000))
        self.retain = retain
        self.idle_timeout_s = idle_timeout_s
        self.grid = TickGrid(self.config.tick_hz)
        self._sources: dict[str, _Source] = {}
        self._expected: set[str] = set(expected_sources)
        self._next_tick = 0  # first tick not yet emitted
        self._late_seq = 0
        self._pending_ctal: list[pa.Table] = []  # CTAL tables since the last poll
        self._pending_records: list[pa.Table] = []
        self._pending_alarms: list[dict] = []
        self._pending_start = 0
        self._kept_records: list[pa.Table] = []
        self._kept_ctal: list[pa.Table] = []
        self._kept_alarms: list[dict] = []
        self._run: dict | None = None  # open drift run: start, max, peak pair
        self._const_cols: dict[str, pa.Array] | None = None
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
            self._const_cols = None
            return
        if self._next_tick > 0:
            raise InputError(
                f"source {source_id!r} registered after ticks 0..{self._next_tick - 1} were emitted; "
                "declare every source first with expect_sources()", source_uri=uri, stage="align", code="late_source")
        tol = int(round(self.config.tolerance_ms[modality] * 1_000_000))
        pdf = modality == "pdf"
        self._sources[source_id] = _Source(
            source_id, modality, dict(lineage), clock, tol_ns=tol,
            horizon_ns=tol if pdf else 3 * tol,
            ctx_ticks=0 if pdf else int(np.ceil(2 * tol / self.grid.period_ns)) + 1,
            hist_bins=tol // HIST_BIN_NS + 2, hist=np.zeros(tol // HIST_BIN_NS + 2, np.int64),
            last_add=time.monotonic())
        self._sources = dict(sorted(self._sources.items()))  # output order: by source id
        self._const_cols = None

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
        s = self._source(source_id)
        kept = [(int(t), int(o)) for t, o, c in windows if c > min_confidence]
        s.obs_raw = _dedupe_times(s.obs_raw + kept)
        s.median_of = max(1, int(median_of))
        s.obs_cache = None
        return len(kept)

    # --- output ----------------------------------------------------------------------------

    def watermark(self, source_id: str) -> float:
        """Current watermark of a source (ns; +inf when finished, -inf before any event)."""
        return self._watermark(self._source(source_id))

    def buffered_events(self) -> int:
        """Events held in memory across all sources (the streaming state)."""
        return sum(len(s.t) + sum(len(p[0]) for p in s.pend) for s in self._sources.values())

    def poll(self, now: float | None = None) -> AlignBatch:
        """Decide every tick that all watermarks allow and return what was decided since the last poll."""
        if self.idle_timeout_s is not None:
            now = time.monotonic() if now is None else now
            for s in self._sources.values():
                if not s.finished and now - s.last_add > self.idle_timeout_s:
                    s.finished = s.timed_out = True
        self._emit(final=False)
        return self._take_pending()

    def finish(self) -> AlignResult:
        """Decide the remaining ticks (every source is treated as finished) and return the session."""
        if not self._finished:
            for s in self._sources.values():
                s.finished = True
            self._emit(final=True)
            self._close_run()
            self._finished = True
        rest = self._take_pending()
        if self.retain:
            records = _concat(self._kept_records, RecordRow)
            ctal = _concat(self._kept_ctal, CtalRow)
            alarms = _rows(DriftAlarmRow, self._kept_alarms)
        else:
            records, ctal, alarms = rest.records, rest.ctal, rest.alarms
        summary = rows_to_table(CtalSummaryRow, [self._summary(s) for s in self._sources.values()])
        return AlignResult(records=records, ctal=ctal, summary=summary, alarms=alarms, ticks=self._next_tick)

    def session_end_ns(self, final: bool = True) -> int:
        """End of the session timeline: the last point event + 1 (pages extend it only when
        no point source has events)."""
        points = [s.max_t for s in self._sources.values() if not s.is_pdf and s.max_t is not None]
        if points:
            return max(points) + 1
        if final or all(s.is_pdf for s in self._sources.values()):
            pages = [s.max_t for s in self._sources.values() if s.max_t is not None]
            return max(pages) + 1 if pages else 0
        return 0

    # --- internals -------------------------------------------------------------------------

    def _source(self, source_id: str) -> _Source:
        try:
            return self._sources[source_id]
        except KeyError:
            raise InputError(f"source {source_id!r} is not registered with the aligner", stage="align") from None

    def _watermark(self, s: _Source) -> float:
        if s.finished:
            return _INF
        wm = s.explicit_wm
        if s.max_t is not None:
            wm = max(wm, float(s.max_t - self.allowed_lateness_ns))
        return wm

    def _emit(self, final: bool) -> None:
        if not self._sources or (not final and not self._expected.issubset(self._sources)):
            return
        n_cap = self.grid.count_below(self.session_end_ns(final=final))
        if final:
            k_end = n_cap
        else:
            limit = min(self._watermark(s) - s.horizon_ns for s in self._sources.values())
            all_done = all(s.finished for s in self._sources.values())
            k_lim = n_cap if limit == _INF else min(self.grid.count_below(limit), n_cap)
            # Unless the session end is final, leave room for the neighbouring ticks a point
            # match looks at: they must exist in the final timeline too.
            ctx = max((s.ctx_ticks for s in self._sources.values()), default=0)
            k_end = k_lim if all_done else min(k_lim, n_cap - ctx)
        if k_end <= self._next_tick:
            return
        for s in self._sources.values():
            self._merge(s)
        for k0 in range(self._next_tick, k_end, CHUNK_TICKS):
            self._decide(k0, min(k_end, k0 + CHUNK_TICKS), n_cap)
        self._next_tick = k_end
        t_next = self.grid.time(k_end)
        for s in self._sources.values():
            self._evict(s, t_next)

    def _merge(self, s: _Source) -> None:
        if not s.pend:
            return
        t = np.concatenate([s.t] + [p[0] for p in s.pend])
        ids = np.concatenate([s.ids] + [p[1] for p in s.pend])
        end = np.concatenate([s.end] + [p[2] for p in s.pend]) if s.is_pdf else s.end
        s.pend = []
        order = np.argsort(t, kind="stable")
        ts = t[order]
        if len(ts) > 1 and np.any(ts[1:] == ts[:-1]):  # equal times: order by id, arrival-independent
            order = np.lexsort((ids, t))
            ts = t[order]
        ids = ids[order]
        if s.is_pdf:
            end = end[order]
            first = np.ones(len(ts), bool)
            first[1:] = ts[1:] != ts[:-1]  # one event per page: its smallest block id
            ts, ids, end = ts[first], ids[first], end[first]
        s.t, s.ids, s.end = ts, ids, end

    def _evict(self, s: _Source, t_next: int) -> None:
        """Drop events no undecided tick can depend on."""
        if s.is_pdf:
            i = max(int(np.searchsorted(s.t, t_next, side="right")) - 1, 0)  # the page on show stays
        else:
            i = int(np.searchsorted(s.t, t_next - s.horizon_ns, side="left"))
        if i > 0:
            s.t, s.ids = s.t[i:].copy(), s.ids[i:].copy()
            if s.is_pdf:
                s.end = s.end[i:].copy()

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
                # Summary accumulators (order-independent: counts, max and a fixed histogram).
                s.res_max_ns = max(s.res_max_ns, int(a.max()))
                s.hist_pend.append(a)
                s.hist_pend_n += n_m
                if s.hist_pend_n >= 1 << 12:
                    _flush_hist(s)
        self._records_chunk(srcs, k0, ticks, ok, res, evid)
        self._gap_rows(srcs, k0, ticks, ok, res)
        self._drift(srcs, k0, ticks)

    def _records_chunk(self, srcs, k0, ticks, ok, res, evid) -> None:
        K, S = ok.shape
        if self._const_cols is None:  # per-source constant columns, tiled once for a whole chunk
            which = pa.array(np.tile(np.arange(S, dtype=np.int32), CHUNK_TICKS))
            self._const_cols = {}
            for name in list(LineageColumns.model_fields) + ["modality"]:
                default = self.session_id if name == "session_id" else None
                vals = [s.modality if name == "modality" else
                        s.lineage.get(name, s.source_id if name == "source_id" else default) for s in srcs]
                self._const_cols[name] = pa.array(vals, pa.string()).take(which)
            self._const_cols["_matched"] = pa.array(["matched"] * (CHUNK_TICKS * S), pa.string())
        cols: dict[str, pa.Array] = {name: arr.slice(0, K * S) for name, arr in self._const_cols.items()
                                     if not name.startswith("_")}
        cols["tick_index"] = pa.array(np.repeat(np.arange(k0, k0 + K, dtype=np.int64), S))
        cols["t_ns"] = pa.array(np.repeat(ticks, S))
        flat_ok = ok.ravel()
        mask = None if flat_ok.all() else ~flat_ok
        cols["event_id"] = pa.array(evid.ravel(), pa.string())
        cols["event_t_ns"] = pa.array((res + ticks[:, None]).ravel(), pa.int64(), mask=mask)
        cols["residual_ns"] = pa.array(res.ravel(), pa.int64(), mask=mask)
        if mask is None:
            cols["decision"] = self._const_cols["_matched"].slice(0, K * S)
        else:
            cols["decision"] = pa.array(["gap", "matched"], pa.string()).take(pa.array(flat_ok.astype(np.int8)))
        schema = _RECORD_SCHEMA
        table = pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)
        self._pending_records.append(table)
        if self.retain:
            self._kept_records.append(table)

    def _ctal_table(self, srcs, ticks_idx, t_ns, offsets, decision, reasons, event_ids) -> pa.Table:
        n = len(ticks_idx)
        mods = [f"{s.modality}:{s.source_id}" for s in srcs]
        lat = [float(s.latency_ms) for s in srcs]
        schema = CtalRow.schema()
        S = len(srcs)

        def rep_list(values, typ):
            flat = pa.array(values * n, typ)
            return pa.ListArray.from_arrays(pa.array(np.arange(0, n * S + 1, S, dtype=np.int32)), flat)

        off_vals, off_mask = offsets
        cols = {
            "event_id": pa.array(event_ids, pa.string()),
            "trace_id": pa.array([self.trace_id] * n, pa.string()),
            "session_id": pa.array([self.session_id] * n, pa.string()),
            "stage": pa.array(["align"] * n, pa.string()),
            "tick_index": pa.array(np.asarray(ticks_idx, np.int64)),
            "aligned_t_ns": pa.array(np.asarray(t_ns, np.int64)),
            "modalities": rep_list(mods, pa.string()),
            "observed_offsets_ns": pa.ListArray.from_arrays(
                pa.array(np.arange(0, n * S + 1, S, dtype=np.int32)),
                pa.array(off_vals.ravel(), pa.int64(), mask=off_mask.ravel())),
            "decision": pa.array([decision] * n, pa.string()),
            "reason": pa.array(reasons, pa.string()),
            "latency_ms": rep_list(lat, pa.float64()),
        }
        return pa.Table.from_arrays([cols[f.name].cast(f.type) for f in schema], schema=schema)

    def _push_ctal(self, table: pa.Table) -> None:
        if table.num_rows:
            self._pending_ctal.append(table)
            if self.retain:
                self._kept_ctal.append(table)

    def _gap_rows(self, srcs, k0, ticks, ok, res) -> None:
        rows = np.flatnonzero(~ok.all(axis=1))
        if len(rows) == 0:
            return
        names = np.array([s.source_id for s in srcs], object)
        reasons = ["no event within tolerance: " + ",".join(names[~ok[r]]) for r in rows.tolist()]
        ids = [f"{self.session_id}/ctal/{k0 + r}" for r in rows.tolist()]
        self._push_ctal(self._ctal_table(srcs, k0 + rows, ticks[rows], (res[rows], ~ok[rows]), "gap", reasons, ids))

    def _log_late(self, s: _Source, t: np.ndarray, ids: np.ndarray) -> None:
        srcs = list(self._sources.values())
        j = srcs.index(s)
        n = len(t)
        k = np.array([min(self.grid.nearest(int(x)), self._next_tick - 1) for x in t.tolist()], np.int64)
        tk = np.array([self.grid.time(int(x)) for x in k.tolist()], np.int64)
        off = np.zeros((n, len(srcs)), np.int64)
        mask = np.ones((n, len(srcs)), bool)
        off[:, j], mask[:, j] = t - tk, False
        wm = self._watermark(s)
        lateness_ms = self.allowed_lateness_ns / 1e6
        reasons = [f"late event {e} of {s.source_id}: t_ns={int(x)} arrived after tick {int(kk)} was emitted "
                   f"(watermark {wm / 1e9:.3f} s, allowed lateness {lateness_ms:.0f} ms); not matched"
                   for e, x, kk in zip(ids.tolist(), t.tolist(), k.tolist())]
        eids = []
        for _ in range(n):
            eids.append(f"{self.session_id}/ctal/late/{s.source_id}/{self._late_seq}")
            self._late_seq += 1
        s.late += n
        self._push_ctal(self._ctal_table(srcs, k, tk, (off, mask), "late", reasons, eids))

    # --- drift -----------------------------------------------------------------------------

    def _residual_offsets(self, s: _Source, ticks: np.ndarray) -> np.ndarray | None:
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

    def _drift(self, srcs, k0, ticks) -> None:
        if len(srcs) < 2:
            return
        res = [self._residual_offsets(s, ticks) for s in srcs]
        if all(r is None for r in res):
            if self._run is not None:
                self._close_run()
            return
        mat = np.stack([r if r is not None else np.zeros(len(ticks)) for r in res], axis=1)
        spread = mat.max(axis=1) - mat.min(axis=1)
        thr = self.config.drift_threshold_ms * 1e6
        over = np.flatnonzero(spread > thr)
        if len(over):
            hi, lo = mat.argmax(axis=1), mat.argmin(axis=1)
            reasons = [f"measured clock offsets disagree by {spread[r] / 1e6:.1f} ms "
                       f"({srcs[hi[r]].source_id} vs {srcs[lo[r]].source_id}) > {self.config.drift_threshold_ms:g} ms"
                       for r in over.tolist()]
            ids = [f"{self.session_id}/ctal/{k0 + r}/drift" for r in over.tolist()]
            vals = np.round(mat[over]).astype(np.int64)
            self._push_ctal(self._ctal_table(srcs, k0 + over, ticks[over], (vals, np.zeros(vals.shape, bool)),
                                             "out_of_tolerance", reasons, ids))
        self._runs(k0, ticks, spread, mat, srcs)

    def _runs(self, k0, ticks, spread, mat, srcs) -> None:
        """Carry drift runs across decided chunks; close them into alarm rows."""
        thr = self.config.drift_threshold_ms * 1e6
        over = spread > thr
        K = len(ticks)
        i = 0
        while i < K:
            if not over[i]:
                if self._run is not None:
                    self._close_run()
                nxt = np.flatnonzero(over[i:])
                if len(nxt) == 0:
                    return
                i += int(nxt[0])
                continue
            stop = np.flatnonzero(~over[i:])
            j = K if len(stop) == 0 else i + int(stop[0])
            seg = spread[i:j]
            p = i + int(np.argmax(seg))
            pair = [srcs[int(mat[p].argmax())].source_id, srcs[int(mat[p].argmin())].source_id]
            if self._run is None:
                self._run = dict(start=k0 + i, start_t=int(ticks[i]), max=float(seg.max()), pair=pair)
            elif seg.max() > self._run["max"]:
                self._run.update(max=float(seg.max()), pair=pair)
            self._run.update(end=k0 + j - 1, end_t=int(ticks[j - 1]))
            i = j

    def _close_run(self) -> None:
        run, self._run = self._run, None
        if run is None or run["end"] - run["start"] + 1 < self.config.drift_consecutive_ticks:
            return
        row = dict(session_id=self.session_id, start_tick=run["start"], end_tick=run["end"],
                   start_t_ns=run["start_t"], end_t_ns=run["end_t"], max_residual_ms=run["max"] / 1e6,
                   sources=run["pair"])
        self._pending_alarms.append(row)
        if self.retain:
            self._kept_alarms.append(row)

    # --- results ---------------------------------------------------------------------------

    def _take_pending(self) -> AlignBatch:
        out = AlignBatch(
            records=_concat(self._pending_records, RecordRow),
            ctal=_concat(self._pending_ctal, CtalRow),
            alarms=_rows(DriftAlarmRow, self._pending_alarms),
            tick_start=self._pending_start, tick_end=self._next_tick,
        )
        self._pending_records, self._pending_ctal, self._pending_alarms = [], [], []
        self._pending_start = self._next_tick
        return out

    def _summary(self, s: _Source) -> dict:
        p50 = p95 = mx = None
        _flush_hist(s)
        if s.matched:
            p50, p95 = (_hist_percentile(s.hist, q) * HIST_BIN_NS / 1e6 for q in (50, 95))
            mx = s.res_max_ns / 1e6
        return dict(
            session_id=self.session_id, source_id=s.source_id, modality=s.modality, ticks=self._next_tick,
            matched=s.matched, gaps=s.gaps, late=s.late, residual_p50_ms=p50, residual_p95_ms=p95, residual_max_ms=mx,
            offset_ns=s.clock.offset_ns, skew_ppm=s.clock.skew_ppm,
            offset_method="estimated" if s.clock.estimated else "manifest", offset_confidence=s.clock.confidence,
        )


def _flush_hist(s: _Source) -> None:
    """Bin pending |residuals| (ns) into the source's 10 us histogram."""
    if s.hist_pend:
        a = np.concatenate(s.hist_pend)
        s.hist += np.bincount(np.minimum((a + HIST_BIN_NS // 2) // HIST_BIN_NS, s.hist_bins - 1), minlength=s.hist_bins)
        s.hist_pend, s.hist_pend_n = [], 0


def _int64(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


_EMPTY: dict[type, pa.Table] = {}


def _empty(model) -> pa.Table:
    if model not in _EMPTY:
        _EMPTY[model] = model.schema().empty_table()
    return _EMPTY[model]


def _concat(tables: list[pa.Table], model) -> pa.Table:
    if not tables:
        return _empty(model)
    return pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0]


def _rows(model, rows: list[dict]) -> pa.Table:
    return rows_to_table(model, rows) if rows else _empty(model)


def _dedupe_times(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted by time, one value per time (the later observation of a repeated time wins)."""
    out: dict[int, int] = {}
    for t, o in windows:
        out[t] = o
    return sorted(out.items())


def _hist_percentile(hist: np.ndarray, q: float) -> float:
    """``np.percentile(values, q)`` (linear) of the values a bin-count histogram describes, in bins."""
    n = int(hist.sum())
    pos = (n - 1) * q / 100.0
    lo = int(np.floor(pos))
    cum = np.cumsum(hist)
    v_lo = int(np.searchsorted(cum, lo, side="right"))
    v_hi = int(np.searchsorted(cum, min(lo + 1, n - 1), side="right"))
    return v_lo + (v_hi - v_lo) * (pos - lo)


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
