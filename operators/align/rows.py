"""Output tables of the tick aligner: ``records``, ``ctal`` and ``ctal_summary`` rows.

``modalign.operators.align.aligner`` decides ticks in chunks and hands each chunk's match
matrix (ticks x sources: matched?, residual, event id) here; this module turns it into
Arrow tables of ``RecordRow`` / ``CtalRow`` / ``CtalSummaryRow`` (``modalign.schemas.tables``),
with the CTAL reasons that say which source, which tick and why.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from modalign.operators.align.source_state import HIST_BIN_NS, SourceState, hist_percentile
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.tables import CtalRow, LineageColumns, RecordRow

_RECORD_SCHEMA = RecordRow.schema()


class RecordChunks:
    """``records`` tables, one per decided chunk; rows in tick order, sources by id within a tick.

    The per-source constant columns (lineage, modality) are tiled once for ``capacity_ticks``
    ticks and sliced per chunk; ``reset()`` when sources or their lineage change.
    """

    def __init__(self, session_id: str, capacity_ticks: int) -> None:
        self.session_id = session_id
        self.capacity_ticks = capacity_ticks
        self._const_cols: dict[str, pa.Array] | None = None

    def reset(self) -> None:
        self._const_cols = None

    def table(self, srcs: list[SourceState], k0: int, ticks: np.ndarray, ok: np.ndarray, res: np.ndarray,
              evid: np.ndarray) -> pa.Table:
        """Ticks ``k0 .. k0 + len(ticks)``; ``ok``/``res``/``evid`` are ticks x sources."""
        K, S = ok.shape
        if self._const_cols is None:  # per-source constant columns, tiled once for a whole chunk
            which = pa.array(np.tile(np.arange(S, dtype=np.int32), self.capacity_ticks))
            self._const_cols = {}
            for name in list(LineageColumns.model_fields) + ["modality"]:
                default = self.session_id if name == "session_id" else None
                vals = [s.modality if name == "modality" else
                        s.lineage.get(name, s.source_id if name == "source_id" else default) for s in srcs]
                self._const_cols[name] = pa.array(vals, pa.string()).take(which)
            self._const_cols["_matched"] = pa.array(["matched"] * (self.capacity_ticks * S), pa.string())
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
        return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


class CtalRows:
    """CTAL tables: one row per non-clean decision (``gap``, ``late``, ``out_of_tolerance``)."""

    def __init__(self, session_id: str, trace_id: str) -> None:
        self.session_id = session_id
        self.trace_id = trace_id
        self.late_seq = 0  # numbers late-event rows across the session (part of the aligner's state)

    def table(self, srcs, ticks_idx, t_ns, offsets, decision, reasons, event_ids) -> pa.Table:
        """Rows at ticks ``ticks_idx``; ``offsets`` is (values, mask), rows x sources."""
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

    def gaps(self, srcs, k0, ticks, ok, res) -> pa.Table | None:
        """``gap`` rows: ticks of the chunk where some source had no event within its tolerance."""
        rows = np.flatnonzero(~ok.all(axis=1))
        if len(rows) == 0:
            return None
        names = np.array([s.source_id for s in srcs], object)
        reasons = ["no event within tolerance: " + ",".join(names[~ok[r]]) for r in rows.tolist()]
        ids = [f"{self.session_id}/ctal/{k0 + r}" for r in rows.tolist()]
        return self.table(srcs, k0 + rows, ticks[rows], (res[rows], ~ok[rows]), "gap", reasons, ids)

    def late(self, srcs, s: SourceState, t: np.ndarray, ids: np.ndarray, k: np.ndarray, tk: np.ndarray,
             watermark_ns: float, allowed_lateness_ns: int) -> pa.Table:
        """``late`` rows for events ``ids`` of ``s`` at ``t``, logged at the emitted ticks ``k`` (times ``tk``)."""
        j = srcs.index(s)
        n = len(t)
        off = np.zeros((n, len(srcs)), np.int64)
        mask = np.ones((n, len(srcs)), bool)
        off[:, j], mask[:, j] = t - tk, False
        lateness_ms = allowed_lateness_ns / 1e6
        reasons = [f"late event {e} of {s.source_id}: t_ns={int(x)} arrived after tick {int(kk)} was emitted "
                   f"(watermark {watermark_ns / 1e9:.3f} s, allowed lateness {lateness_ms:.0f} ms); not matched"
                   for e, x, kk in zip(ids.tolist(), t.tolist(), k.tolist())]
        eids = []
        for _ in range(n):
            eids.append(f"{self.session_id}/ctal/late/{s.source_id}/{self.late_seq}")
            self.late_seq += 1
        return self.table(srcs, k, tk, (off, mask), "late", reasons, eids)

    def drift(self, srcs, k0, ticks, mat, spread, threshold_ms: float) -> pa.Table | None:
        """``out_of_tolerance`` rows: ticks where the sources' residual offsets ``mat`` spread over the threshold."""
        over = np.flatnonzero(spread > threshold_ms * 1e6)
        if len(over) == 0:
            return None
        hi, lo = mat.argmax(axis=1), mat.argmin(axis=1)
        reasons = [f"measured clock offsets disagree by {spread[r] / 1e6:.1f} ms "
                   f"({srcs[hi[r]].source_id} vs {srcs[lo[r]].source_id}) > {threshold_ms:g} ms"
                   for r in over.tolist()]
        ids = [f"{self.session_id}/ctal/{k0 + r}/drift" for r in over.tolist()]
        vals = np.round(mat[over]).astype(np.int64)
        return self.table(srcs, k0 + over, ticks[over], (vals, np.zeros(vals.shape, bool)),
                          "out_of_tolerance", reasons, ids)


def summary_row(session_id: str, s: SourceState, ticks: int) -> dict:
    """``CtalSummaryRow`` of one source: residual percentiles (from its histogram), gaps, the clock used."""
    p50 = p95 = mx = None
    s.flush_hist()
    if s.matched:
        p50, p95 = (hist_percentile(s.hist, q) * HIST_BIN_NS / 1e6 for q in (50, 95))
        mx = s.res_max_ns / 1e6
    return dict(
        session_id=session_id, source_id=s.source_id, modality=s.modality, ticks=ticks,
        matched=s.matched, gaps=s.gaps, late=s.late, residual_p50_ms=p50, residual_p95_ms=p95, residual_max_ms=mx,
        offset_ns=s.clock.offset_ns, skew_ppm=s.clock.skew_ppm,
        offset_method="estimated" if s.clock.estimated else "manifest", offset_confidence=s.clock.confidence,
    )


_EMPTY: dict[type, pa.Table] = {}


def empty_table(model) -> pa.Table:
    """The empty table of a row model (cached)."""
    if model not in _EMPTY:
        _EMPTY[model] = model.schema().empty_table()
    return _EMPTY[model]


def concat_tables(tables: list[pa.Table], model) -> pa.Table:
    """One table of ``model``'s schema from chunk tables (empty when there are none)."""
    if not tables:
        return empty_table(model)
    return pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0]


def model_table(model, rows: list[dict]) -> pa.Table:
    """Rows (dicts) as a table of ``model``'s schema."""
    return rows_to_table(model, rows) if rows else empty_table(model)
