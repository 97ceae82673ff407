"""Per-source streaming state of the tick aligner: buffered events, watermark, summary accumulators.

One ``SourceState`` per registered source lives inside ``modalign.operators.align.aligner``'s
``TickAligner``. It holds only what undecided ticks can still depend on: event ids and
session-clock ``t_ns`` (``end_t_ns`` for PDF pages), sorted, plus the chunks added since
the last merge. Residual percentiles come from a fixed 10 us histogram, so the summary
needs no per-event memory either; observed clock offsets (for drift) are kept per window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from modalign.schemas.manifest import ClockMapping

HIST_BIN_NS = 10_000  # residual histogram bin: 10 us
_HIST_FLUSH = 1 << 12  # pending |residual| values binned at once
_INF = float("inf")
_NEG_INF = float("-inf")


@dataclass
class SourceState:
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
    expected_end: int | None = None  # session time the recording was expected to reach (cut short)
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

    @classmethod
    def new(cls, source_id: str, modality: str, lineage: dict[str, Any], clock: ClockMapping, *, tol_ns: int,
            tick_period_ns: float, last_add: float) -> "SourceState":
        """A fresh source with its matching horizon: ``tol`` for pages, ``3 * tol`` for points."""
        pdf = modality == "pdf"
        bins = tol_ns // HIST_BIN_NS + 2
        return cls(
            source_id, modality, dict(lineage), clock, tol_ns=tol_ns,
            horizon_ns=tol_ns if pdf else 3 * tol_ns,
            ctx_ticks=0 if pdf else int(np.ceil(2 * tol_ns / tick_period_ns)) + 1,
            hist_bins=bins, hist=np.zeros(bins, np.int64), last_add=last_add)

    @property
    def is_pdf(self) -> bool:
        return self.modality == "pdf"

    def watermark(self, allowed_lateness_ns: int) -> float:
        """ns; +inf when finished, -inf before any event (or an explicit promise)."""
        if self.finished:
            return _INF
        wm = self.explicit_wm
        if self.max_t is not None:
            wm = max(wm, float(self.max_t - allowed_lateness_ns))
        return wm

    def buffered(self) -> int:
        """Events held: the sorted buffer plus chunks not yet merged."""
        return len(self.t) + sum(len(p[0]) for p in self.pend)

    def merge(self) -> None:
        """Fold pending chunks into the sorted buffer (equal times ordered by id; one event per page)."""
        if not self.pend:
            return
        t = np.concatenate([self.t] + [p[0] for p in self.pend])
        ids = np.concatenate([self.ids] + [p[1] for p in self.pend])
        end = np.concatenate([self.end] + [p[2] for p in self.pend]) if self.is_pdf else self.end
        self.pend = []
        order = np.argsort(t, kind="stable")
        ts = t[order]
        if len(ts) > 1 and np.any(ts[1:] == ts[:-1]):  # equal times: order by id, arrival-independent
            order = np.lexsort((ids, t))
            ts = t[order]
        ids = ids[order]
        if self.is_pdf:
            end = end[order]
            first = np.ones(len(ts), bool)
            first[1:] = ts[1:] != ts[:-1]  # one event per page: its smallest block id
            ts, ids, end = ts[first], ids[first], end[first]
        self.t, self.ids, self.end = ts, ids, end

    def evict(self, t_next: int) -> None:
        """Drop events no undecided tick (from ``t_next`` on) can depend on."""
        if self.is_pdf:
            i = max(int(np.searchsorted(self.t, t_next, side="right")) - 1, 0)  # the page on show stays
        else:
            i = int(np.searchsorted(self.t, t_next - self.horizon_ns, side="left"))
        if i > 0:
            self.t, self.ids = self.t[i:].copy(), self.ids[i:].copy()
            if self.is_pdf:
                self.end = self.end[i:].copy()

    def state(self) -> dict[str, Any]:
        """This source as JSON-able values (buffered ids and times, counters, the sparse histogram)."""
        self.merge()
        self.flush_hist()
        nz = np.flatnonzero(self.hist)
        return dict(
            source_id=self.source_id, modality=self.modality, lineage=self.lineage,
            clock=self.clock.model_dump(mode="json"), tol_ns=self.tol_ns, horizon_ns=self.horizon_ns,
            ctx_ticks=self.ctx_ticks, hist_bins=self.hist_bins, t=self.t.tolist(), ids=[str(x) for x in self.ids],
            end=self.end.tolist(), max_t=self.max_t, expected_end=self.expected_end,
            explicit_wm=None if self.explicit_wm == _NEG_INF else self.explicit_wm, finished=self.finished,
            timed_out=self.timed_out, latency_ms=self.latency_ms, matched=self.matched, gaps=self.gaps,
            late=self.late, res_max_ns=self.res_max_ns, hist=[nz.tolist(), self.hist[nz].tolist()],
            obs_raw=[list(w) for w in self.obs_raw], median_of=self.median_of,
        )

    @classmethod
    def from_state(cls, d: dict[str, Any], *, last_add: float) -> "SourceState":
        """The source ``state()`` described."""
        hist = np.zeros(int(d["hist_bins"]), np.int64)
        hist[np.asarray(d["hist"][0], np.int64)] = np.asarray(d["hist"][1], np.int64)
        return cls(
            d["source_id"], d["modality"], dict(d["lineage"]), ClockMapping.model_validate(d["clock"]),
            tol_ns=int(d["tol_ns"]), horizon_ns=int(d["horizon_ns"]), ctx_ticks=int(d["ctx_ticks"]),
            hist_bins=len(hist), t=np.asarray(d["t"], np.int64), ids=np.array(d["ids"], object),
            end=np.asarray(d["end"], np.int64), max_t=d["max_t"], expected_end=d["expected_end"],
            explicit_wm=_NEG_INF if d["explicit_wm"] is None else float(d["explicit_wm"]),
            finished=bool(d["finished"]), timed_out=bool(d["timed_out"]), last_add=last_add,
            latency_ms=float(d["latency_ms"]), matched=int(d["matched"]), gaps=int(d["gaps"]), late=int(d["late"]),
            res_max_ns=int(d["res_max_ns"]), hist=hist, obs_raw=[(int(t), int(o)) for t, o in d["obs_raw"]],
            median_of=int(d["median_of"]),
        )

    def count_residuals(self, abs_res: np.ndarray) -> None:
        """Add matched ticks' |residual| (ns) to the max and the histogram (order-independent)."""
        self.res_max_ns = max(self.res_max_ns, int(abs_res.max()))
        self.hist_pend.append(abs_res)
        self.hist_pend_n += len(abs_res)
        if self.hist_pend_n >= _HIST_FLUSH:
            self.flush_hist()

    def flush_hist(self) -> None:
        """Bin pending |residuals| (ns) into the source's 10 us histogram."""
        if self.hist_pend:
            a = np.concatenate(self.hist_pend)
            self.hist += np.bincount(np.minimum((a + HIST_BIN_NS // 2) // HIST_BIN_NS, self.hist_bins - 1),
                                     minlength=self.hist_bins)
            self.hist_pend, self.hist_pend_n = [], 0

    def add_offsets(self, windows: list[tuple[int, int]], median_of: int) -> None:
        """Keep observed ``(t_ns, offset_ns)`` windows: by time, a repeated time's later value wins."""
        by_time: dict[int, int] = {}
        for t, o in self.obs_raw + windows:
            by_time[t] = o
        self.obs_raw = sorted(by_time.items())
        self.median_of = max(1, int(median_of))
        self.obs_cache = None


def hist_percentile(hist: np.ndarray, q: float) -> float:
    """``np.percentile(values, q)`` (linear) of the values a bin-count histogram describes, in bins."""
    n = int(hist.sum())
    pos = (n - 1) * q / 100.0
    lo = int(np.floor(pos))
    cum = np.cumsum(hist)
    v_lo = int(np.searchsorted(cum, lo, side="right"))
    v_hi = int(np.searchsorted(cum, min(lo + 1, n - 1), side="right"))
    return v_lo + (v_hi - v_lo) * (pos - lo)
