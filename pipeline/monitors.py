"""The monitors of a commit: embedding drift over every committed feature (``monitor/``).

Where it sits: called by the runner's commit (and by an erasure's, over what is left), on the
driver, beside the FAISS indexes, and like them rebuilt by every commit from the committed
features: the rows always describe exactly the features the commit holds, in the same order
for any batching, number of actors or re-run, and an erasure that removes features removes
their windows with them.

Per (model, granularity), the stream is every committed session in session-id order (a watch
over dated session ids sees them in time order), each session's vectors in time order (t_ns,
then source, then feature id), cut into windows of ``window`` to ``2 * window - 1`` vectors
that never span two sessions. The windows go through one
``operators.monitor.embedding_drift.DriftMonitor``; its reference is the stream's first
``reference_windows`` windows, or, with ``--reference OUT0``, every window of OUT0's committed
features of the same model and granularity (cut the same way).

Writes ``monitor/embedding/ATTEMPT.parquet`` (``EmbeddingWindowRow``, one per window) and
``monitor/alarms/ATTEMPT.parquet`` (``MonitorAlarmRow``, one per alarm). No vector, feature
id or event id is written: a window is counts and statistics over at least half a window of
vectors. What the alarms mean and what to do: ``runbooks/embedding-drift.md``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

import numpy as np

from modalign.operators.monitor.embedding_drift import DriftMonitor, split_windows
from modalign.pipeline.layout import OutputLayout
from modalign.schemas.arrow import rows_to_table
from modalign.schemas.config import EmbeddingMonitorConfig
from modalign.schemas.tables import EmbeddingWindowRow, MonitorAlarmRow

COLUMNS = ["model_id", "session_id", "source_id", "t_ns", "feature_id", "dim", "vector"]


def read_group(layout: OutputLayout, files: list[str], columns: list[str] = COLUMNS) -> Any:
    """The ``columns`` of one (model, granularity) group of feature files, as one Arrow table."""
    import pyarrow.dataset as ds

    with layout.faults(layout.path(files[0]).parent, "read"):
        return ds.dataset([str(layout.path(f)) for f in files], format="parquet", filesystem=layout.fs).to_table(
            columns=columns)


def session_windows(layout: OutputLayout, files: list[str], window: int) -> Iterator[dict[str, Any]]:
    """The windows of one (model, granularity) group of feature files (``table_windows``)."""
    yield from table_windows(read_group(layout, files), window)


def table_windows(t: Any, window: int) -> Iterator[dict[str, Any]]:
    """The windows of one group's features (a table with ``COLUMNS``): per session in id order,
    ``{"model_id", "session_id", "start_t_ns", "end_t_ns", "vectors": (n, dim) float32}``."""
    if t.num_rows == 0:
        return
    t = t.sort_by([("session_id", "ascending"), ("t_ns", "ascending"), ("source_id", "ascending"),
                   ("feature_id", "ascending")])
    dim = t.column("dim")[0].as_py()
    vecs = np.asarray(t.column("vector").combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, dim)
    sessions = t.column("session_id").to_numpy(zero_copy_only=False)
    t_ns = t.column("t_ns").to_numpy()
    model_id = t.column("model_id")[0].as_py()
    starts = np.flatnonzero(np.r_[True, sessions[1:] != sessions[:-1]])
    for a, b in zip(starts, [*starts[1:], len(sessions)]):
        for w in split_windows(int(b - a), window):
            lo, hi = a + w.start, a + w.stop
            yield {"model_id": model_id, "session_id": str(sessions[a]), "start_t_ns": int(t_ns[lo]),
                   "end_t_ns": int(t_ns[hi - 1]), "vectors": vecs[lo:hi]}


def monitor_reference(out0: str | None, storage: Any = None) -> tuple[OutputLayout | None, list[str]]:
    """``(layout, committed feature files)`` of the reference output ``out0``; ``(None, [])`` without one.
    ConfigError when it is no modalign output (before any work)."""
    if out0 is None:
        return None, []
    from modalign.pipeline.outputs import Output

    ref = Output(out0, storage)
    return ref.layout, sorted(f for f in ref.snapshot.files() if f.startswith("features/") and f.endswith(".parquet"))


def monitor_embeddings(layout: OutputLayout, feature_files: list[str], attempt: str,
                       config: EmbeddingMonitorConfig, reference: OutputLayout | None = None,
                       reference_files: list[str] = ()) -> dict[str, Any]:
    """Monitor every (model, granularity) of ``feature_files`` (relative to OUT); write the tables.

    ``reference``/``reference_files``: another output and its committed feature files, whose
    windows of the same group are the reference. Returns ``EmbeddingMonitors.finish``'s summary."""
    monitors = EmbeddingMonitors(layout, attempt, config, reference, reference_files)
    if config.enabled:
        for key, files in sorted(layout.feature_groups(feature_files).items()):
            monitors.observe_group(key, read_group(layout, files))
    return monitors.finish()


class EmbeddingMonitors:
    """The monitors of one commit, fed one (model, granularity) group at a time in sorted order, so
    that a caller who reads each group anyway (the FAISS index build) hands its table over instead
    of reading the vectors twice; ``finish`` writes the tables."""

    def __init__(self, layout: OutputLayout, attempt: str, config: EmbeddingMonitorConfig,
                 reference: OutputLayout | None = None, reference_files: list[str] = ()) -> None:
        self.layout, self.attempt, self.config, self.reference = layout, attempt, config, reference
        self.ref_groups = layout.feature_groups(reference_files) if reference is not None else {}
        self.rows: list[dict] = []
        self.alarms: list[dict] = []
        self.streams: list[dict] = []
        self.seconds = 0.0  # time spent monitoring (the commit's ``monitor`` stage)

    def observe_group(self, key: tuple[str, str], table: Any) -> None:
        """Monitor one group: ``key`` = (model folder, granularity), ``table`` its features with ``COLUMNS``."""
        import time

        if not self.config.enabled:
            return
        t0 = time.perf_counter()
        self._group(key, table)
        self.seconds += time.perf_counter() - t0

    def _group(self, key: tuple[str, str], table: Any) -> None:
        (folder, gran), config, reference = key, self.config, self.reference
        rows, alarms = self.rows, self.alarms
        monitor: DriftMonitor | None = None
        source = f"first {config.reference_windows} windows"
        for w in table_windows(table, config.window):
            if monitor is None:
                monitor = DriftMonitor(config, w["vectors"].shape[1])
                if (folder, gran) in self.ref_groups:
                    ref = [r["vectors"] for r in session_windows(reference, self.ref_groups[(folder, gran)],
                                                                 config.window)
                           if r["vectors"].shape[1] == monitor.dim]
                    monitor.seed_reference(ref)
                    source = f"{len(ref)} windows of {reference.uri}"
            r = monitor.observe(w["vectors"])
            row = {"model_id": w["model_id"], "granularity": gran, "session_id": w["session_id"], "window_index": r.index,
                   "start_t_ns": w["start_t_ns"], "end_t_ns": w["end_t_ns"], "vectors": r.vectors,
                   "mean_norm": r.mean_norm, "reference": r.reference, "divergence": r.divergence,
                   "threshold": r.threshold, "alpha": r.alpha, "drift_alarm": r.drift_alarm,
                   "norm_alarm": r.norm_alarm}
            rows.append(row)
            where = {k: row[k] for k in ("model_id", "granularity", "session_id", "window_index", "start_t_ns", "end_t_ns")}
            if r.drift_alarm:
                alarms.append({"kind": "embedding_drift", **where, "value": r.divergence, "threshold": r.threshold})
            if r.norm_alarm:
                alarms.append({"kind": "norm_jump", **where, "value": r.mean_norm, "threshold": monitor.reference_norm})
        if monitor is not None:
            self.streams.append({"model_id": rows[-1]["model_id"], "granularity": gran,
                                 "windows": monitor.windows, "ready": monitor.ready,
                                 "reference": source if monitor.ready else
                                 f"{monitor.reference_windows} of {config.reference_windows} windows so far"})

    def finish(self) -> dict[str, Any]:
        """Write the tables (none when disabled); returns ``{"files": [...], "windows": n,
        "alarms": {kind: n}, "streams": [per group: model_id, granularity, windows, reference]}``."""
        summary: dict[str, Any] = {"files": [], "windows": len(self.rows),
                                   "alarms": {"embedding_drift": 0, "norm_jump": 0}, "streams": self.streams}
        if not self.config.enabled:
            return summary
        for row_type, data in ((EmbeddingWindowRow, self.rows), (MonitorAlarmRow, self.alarms)):
            path = self.layout.monitor(row_type, self.attempt)
            with self.layout.faults(path):
                if self.layout.write_table(path, rows_to_table(row_type, data)) is not None:
                    summary["files"].append(self.layout.relative(path))
        summary["alarms"].update(Counter(a["kind"] for a in self.alarms))
        return summary
